"""The fused decode step against transformers' eager forward: the same logits step by step (up to summation
order), hence the same greedy tokens, for every family it implements and every linear kind it runs."""

import copy

import pytest
import torch
from tiny import tiny_config, tiny_model, token_ids
from transformers import AutoModelForCausalLM, DynamicCache

from leanlm.cache.prefix import Cushion, attach_cushion
from leanlm.decoding import FusedDecoder, fused_decoder_problem, greedy_tokens, new_cache, read_in_chunks
from leanlm.errors import ConfigError
from leanlm.kernels.kbit_gemm import avx2_available
from leanlm.methods import GPTQConfig, KbitConfig, LLMInt8Config, SmoothQuantConfig, SpQRConfig, W8A8Config, quantize_
from leanlm.methods.checkpoint import embeddings_to_, quantize_head_
from leanlm.methods.quantize import Calibration
from leanlm.methods.streaming import StreamingConfig
from leanlm.nn import KbitLinear
from leanlm.nn.float_linear import use_gemv_

needs_kernels = pytest.mark.skipif(not avx2_available(), reason="leanlm's kernels cannot be built here")
FUSED_FAMILIES = ("llama", "mistral", "qwen2", "gemma3_text")
# Llama 3's rope scaling and Qwen3's per-head q / k norms, through the float and one weight path of each kind.
NEWER_FAMILIES = ("llama3", "qwen3")
WEIGHTS = (
    "float32",
    "nf4",
    "nf4-dq+bf16-head",
    "fp4",
    "nf4-dq+int8-head",
    "w8a8-O1",
    "w8a8-O2",
    "smoothquant-O3",
    "llm-int8",
    "gptq",
    "spqr",
    "nf3-dq",
    "gptq-3bit",
    "spqr-3bit",
)
# Methods that calibrate. W8A8 quantizes attention's matmul inputs too (by default): O1 per token, O2 per tensor, O3
# static scales. GPTQ: act-order permutation, offsets; SpQR: 4-bit codes, 3-bit statistics and sparse outliers.
# 3 bits: the planes layout through the 3-bit kernel, SpQR's default recipe in blocks of 16.
CALIBRATED = {
    "gptq": GPTQConfig(group_size=64),
    "gptq-3bit": GPTQConfig(bits=3, group_size=32),
    "spqr": SpQRConfig(bits=4, beta1=64),
    "spqr-3bit": SpQRConfig(),
    "w8a8-O1": W8A8Config(level="O1", weight_granularity="per_channel"),
    "w8a8-O2": W8A8Config(level="O2", quantize_probs=True),
    "smoothquant-O3": [SmoothQuantConfig(0.5), W8A8Config(level="O3")],
    "llm-int8": LLMInt8Config(threshold=1.5),
}  # low enough for the tiny model to have outliers


def _tiny(family: str):
    """A tiny model whose attention windows the decoded tokens pass: Mistral's on every layer, Gemma 3's on its
    local layers (one global layer between them, with its own rotary frequencies)."""
    config = tiny_config(family, vocab_size=256, layers=3)
    if family == "mistral":
        config.sliding_window = 12
    if family == "gemma3_text":
        config.sliding_window = 6
        config.layer_types = ["sliding_attention", "full_attention", "sliding_attention"]
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _model(family: str, weights: str):
    model = _tiny(family)
    with torch.no_grad():
        for module in model.modules():  # non-zero biases (Qwen2's q / k / v), and decisive logits
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.normal_(0, 0.5)
        model.get_input_embeddings().weight.mul_(20)
    if weights.startswith("nf"):
        quantize_(model, KbitConfig(bits=int(weights[2]), double_quant="dq" in weights))
    elif weights == "fp4":
        quantize_(model, KbitConfig(dtype="fp"))
    elif weights in CALIBRATED:
        calibration = token_ids(3, 16, vocab_size=256)
        quantize_(model, CALIBRATED[weights], calibration=Calibration(token_ids=calibration))
    if weights.endswith("bf16-head"):  # as load_any holds a quantized checkpoint's with --dtype auto
        use_gemv_(model)
        embeddings_to_(model, torch.bfloat16)
    if weights.endswith("int8-head"):  # --head int8
        quantize_head_(model)
    return model


def _eager_logits(model, prompt, tokens):
    return _eager_greedy(model, prompt, tokens)[1]


def _eager_greedy(model, prompt, tokens):
    """transformers' forward with a cache: the prompt, then each of `tokens` (an int: that many greedy tokens, each
    the argmax of the logits before it). The tokens fed, and the logits after each."""
    cache, steps = DynamicCache(), []
    greedy = isinstance(tokens, int)
    fed = [] if greedy else list(tokens)
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True).logits[0, -1]
        for i in range(tokens if greedy else len(fed)):
            if greedy:
                fed.append(int(logits.argmax()))
            logits = model(input_ids=torch.tensor([[fed[i]]]), past_key_values=cache, use_cache=True).logits[0, -1]
            steps.append(logits)
    return fed, torch.stack(steps).float()


@needs_kernels
@pytest.mark.parametrize(
    "family, weights",
    [(family, weights) for family in FUSED_FAMILIES for weights in WEIGHTS]
    + [
        (family, weights)
        for family in NEWER_FAMILIES
        for weights in ("float32", "nf4-dq+int8-head", "smoothquant-O3", "gptq")
    ],
)
def test_fused_step_gives_the_eager_logits_and_tokens(family, weights):
    model = _model(family, weights)
    assert fused_decoder_problem(model) is None
    prompt = [3, 17, 99, 5, 250, 42, 7]
    tokens = greedy_tokens(model, prompt, 24, fused=False)
    assert greedy_tokens(model, prompt, 24, fused=True) == tokens
    decoder = FusedDecoder(model, capacity=64)
    decoder.prefill(prompt)
    fused = torch.stack([decoder.step(token) for token in tokens])
    eager = _eager_logits(model, prompt, tokens)
    # float32 summation order only; int8 activations may round one value of a chunk the other way
    tolerance = 1e-4 if weights == "float32" else 2e-2
    torch.testing.assert_close(fused, eager, rtol=0, atol=tolerance * eager.abs().max().item())


@needs_kernels
@pytest.mark.parametrize("weights", ["nf4-dq+int8-head", "nf3-dq"])
def test_double_quantized_constants_decoded_once_give_the_same_logits_bit_for_bit(weights):
    """The step decodes double-quantized constants to float32 once (the default, for speed) or per row as stored
    (`compact_constants`); both are the kernel's own decode, so every logit is identical."""
    model = _model("llama", weights)
    prompt, tokens = [3, 17, 99, 5, 250, 42, 7], [11, 200, 5, 64, 9]
    logits = []
    for compact in (False, True):
        decoder = FusedDecoder(model, capacity=32, compact_constants=compact)
        logits.append(torch.stack([decoder.prefill(prompt)] + [decoder.step(token) for token in tokens]))
    assert torch.equal(logits[0], logits[1])


@needs_kernels
def test_families_and_layers_it_does_not_run_are_named():
    assert "gpt2" in fused_decoder_problem(tiny_model("gpt2"))
    zero_points = tiny_model("llama")
    quantize_(zero_points, W8A8Config(level="O2", asymmetric=True))
    assert "asymmetric" in fused_decoder_problem(zero_points)
    five_bit = tiny_model("llama")
    quantize_(five_bit, KbitConfig(bits=5))
    assert "nf5" in fused_decoder_problem(five_bit)
    assert FusedDecoder.build(five_bit) is None
    with pytest.raises(ConfigError, match="cannot use the fused decode step"):
        FusedDecoder(five_bit)


@needs_kernels
def test_the_cache_bounds_are_checked():
    decoder = FusedDecoder(tiny_model("llama"), capacity=8)
    with pytest.raises(ConfigError, match="does not fit"):
        decoder.prefill(list(range(8)))
    decoder.prefill(list(range(7)))
    decoder.step(1)
    with pytest.raises(ConfigError, match="full"):
        decoder.step(2)


def _perturbed_eager_logits(model, prompt, tokens, relative_noise=1e-7, seed=0):
    """The eager logits with the embedding's output perturbed by `relative_noise` (noise drawn from `seed`): how far
    float rounding alone moves a decode whose activations are quantized to int8 (a rounding that lands on the
    other side of a quantization step changes the value by a whole step)."""
    torch.manual_seed(seed)
    hook = model.get_input_embeddings().register_forward_hook(
        lambda module, args, out: out * (1 + relative_noise * torch.randn_like(out))
    )
    try:
        return _eager_logits(model, prompt, tokens)
    finally:
        hook.remove()


@pytest.mark.slow
@needs_kernels
def test_smollm2_decodes_the_eager_tokens_fused(default_checkpoint_dir):
    """Float weights: the same 64 greedy tokens. 4-bit weights (int8 activations): the fused logits lie within twice
    what a 1e-7 relative perturbation moves the eager logits (float rounding alone), and the greedy token is the
    eager one wherever the eager top two are further apart than that."""
    from leanlm.models import load_model

    model = load_model(default_checkpoint_dir).model
    prompt = list(range(100, 132))
    assert greedy_tokens(model, prompt, 64, fused=True) == greedy_tokens(model, prompt, 64, fused=False)
    quantize_(model, KbitConfig(double_quant=True))
    embeddings_to_(model, torch.bfloat16)
    _assert_fused_within_float_rounding(model, prompt, "bfloat16 head")
    quantize_head_(model)  # and the table read from the 8-bit head's codes
    _assert_fused_within_float_rounding(model, prompt, "int8 head")


@pytest.mark.slow
@needs_kernels
def test_smollm2_in_3_bits_decodes_fused_as_its_eager_path(default_checkpoint_dir):
    """NF3 + DQ through the 3-bit kernel, in both paths at M = 1: the same bounds as the 4-bit test above. NF3's
    SmolLM2 (perplexity ~67) is less sure of its tokens, so it continues real text (WikiText-2's first 32 tokens),
    where its greedy steps are decisive often enough whatever the thread count; after arbitrary token ids its
    greedy path depends on the summation order and may have no decisive step at all."""
    from leanlm.data import datasets
    from leanlm.evaluation.tokens import encode
    from leanlm.models import load_model

    loaded = load_model(default_checkpoint_dir)
    model = loaded.model
    prompt = encode(loaded.tokenizer, datasets.wikitext2_test_text()[:1000])[:32]
    quantize_(model, KbitConfig(bits=3, double_quant=True))
    layers = [module for module in model.modules() if isinstance(module, KbitLinear)]
    for layer in layers:  # resolves each layer's backend: the kernel, not the de-quantizing reference
        layer(torch.zeros(1, layer.in_features))
    assert {layer.backend for layer in layers} == {"avx2"}
    _assert_fused_within_float_rounding(model, prompt, "nf3", least_decisive=12)


def _assert_fused_within_float_rounding(model, prompt, label, least_decisive=32, draws=4):
    """The fused logits lie within twice what a 1e-7 relative perturbation moves the eager logits (the widest of
    `draws` perturbations), and at every step where the eager top two are further apart than twice what the
    perturbations move that step's logits, the greedy token is the eager one. How far rounding moves a step differs
    between steps and between CPUs (int8 activations turn a rounding tie into a whole quantization step), so the
    decisive steps are judged step by step."""
    tokens, eager = _eager_greedy(model, prompt, 64)
    moved = torch.stack(
        [(_perturbed_eager_logits(model, prompt, tokens, seed=seed) - eager).abs().amax(1) for seed in range(draws)]
    ).amax(0)
    decoder = FusedDecoder(model, capacity=128)
    decoder.prefill(prompt)
    fused = torch.stack([decoder.step(token) for token in tokens])
    assert (fused - eager).abs().max() <= 2 * moved.max(), label
    top2 = eager.topk(2).values
    decisive = top2[:, 0] - top2[:, 1] > 2 * moved
    assert decisive.sum() > least_decisive and torch.equal(fused.argmax(1)[decisive], eager.argmax(1)[decisive]), label


@pytest.mark.slow
@needs_kernels
@pytest.mark.parametrize(
    "config", [W8A8Config(level="O1", weight_granularity="per_channel"), LLMInt8Config()], ids=["w8a8-O1", "llm-int8"]
)
def test_smollm2_w8a8_decodes_fused_within_the_eager_paths_own_rounding_noise(default_checkpoint_dir, config):
    """int8 activations (and int8 attention inputs) make a 30-layer decode chaotic: a value near a rounding tie flips
    a whole step, and the change grows downstream. Measured on WikiText-2 text read token by token (teacher forced),
    the fused step departs from the eager path no further than the eager path departs from itself when its embedding
    output is perturbed by 1e-6 relative: largest logit change, next-token loss, greedy-token agreement, each
    against the widest of four perturbations (on an AMD EPYC four draws moved the loss by 0.001 to 0.023: one
    draw is too few a sample of this noise)."""
    from leanlm.data import datasets
    from leanlm.evaluation.tokens import encode
    from leanlm.models import load_model

    loaded = load_model(default_checkpoint_dir)
    ids = encode(loaded.tokenizer, datasets.wikitext2_test_text()[:5000])[:160]
    prompt, tokens = ids[:32], ids[32:]
    model = loaded.model
    quantize_(model, config)
    eager = _eager_logits(model, prompt, tokens)[:-1]
    perturbed = [
        _perturbed_eager_logits(model, prompt, tokens, relative_noise=1e-6, seed=seed)[:-1] for seed in range(4)
    ]
    decoder = FusedDecoder(model, capacity=256)
    decoder.prefill(prompt)
    fused = torch.stack([decoder.step(token) for token in tokens])[:-1]
    target = torch.tensor(tokens[1:])

    def loss(logits):
        return torch.nn.functional.cross_entropy(logits, target).item()

    def agreement(logits):
        return (logits.argmax(1) == eager.argmax(1)).float().mean().item()

    assert (fused - eager).abs().max() <= 2 * max((other - eager).abs().max() for other in perturbed)
    assert abs(loss(fused) - loss(eager)) <= max(2 * max(abs(loss(other) - loss(eager)) for other in perturbed), 0.01)
    assert agreement(fused) >= min(agreement(other) for other in perturbed) - 0.05


def _eager_stream_logits(model, prompt, tokens, streaming):
    """transformers' forward with `new_cache(model, streaming)`: the prompt in chunks of the window, then one token
    at a time (what `leanlm chat` runs)."""
    cache, steps = new_cache(model, streaming), []
    read_in_chunks(model, cache, prompt, streaming.window if streaming is not None else len(prompt))
    with torch.inference_mode():
        for token in tokens:
            steps.append(model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits[0, -1])
    return torch.stack(steps).float()


def _with_cushion(model, length=3):
    """`model` with a CushionCache prefix of random keys and values (what a searched cushion stores), attached."""
    torch.manual_seed(1)
    config = model.config
    shape = (1, config.num_key_value_heads, length, config.hidden_size // config.num_attention_heads)
    dtype = model.get_input_embeddings().weight.dtype
    cushion = Cushion(
        list(range(length)),
        [torch.randn(shape).to(dtype) for _ in range(config.num_hidden_layers)],
        [torch.randn(shape).to(dtype) for _ in range(config.num_hidden_layers)],
    )
    attach_cushion(model, cushion)
    return model


@needs_kernels
@pytest.mark.parametrize("weights", ["float32", "nf4", "llm-int8"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("prompt_length", [5, 21])  # inside the window; longer than the cache (evicted at prefill)
def test_fused_step_with_a_sink_cache_gives_the_eager_sink_caches_logits(family, weights, prompt_length):
    """StreamingLLM's cache (2 sinks + a window of 8) through 40 decode steps: the fused ring, which never moves a
    key, against transformers' forward with leanlm's SinkCache, which re-rotates the recent keys at every eviction."""
    model = _model(family, weights)
    streaming = StreamingConfig(sinks=2, window=8)
    assert fused_decoder_problem(model, streaming) is None
    prompt = [(7 * i + 3) % 256 for i in range(prompt_length)]
    tokens = greedy_tokens(model, prompt, 40, fused=False, streaming=streaming)
    assert greedy_tokens(model, prompt, 40, fused=True, streaming=streaming) == tokens
    decoder = FusedDecoder(model, streaming=streaming)
    decoder.prefill(prompt)
    assert decoder.cache.keys.shape[2] == 2 + 8 + 1  # bounded, however long the stream
    fused = torch.stack([decoder.step(token) for token in tokens])
    eager = _eager_stream_logits(model, prompt, tokens, streaming)
    tolerance = 1e-4 if weights == "float32" else 2e-2
    torch.testing.assert_close(fused, eager, rtol=0, atol=tolerance * eager.abs().max().item())


@needs_kernels
@pytest.mark.parametrize("streaming", [None, StreamingConfig(sinks=2, window=8)], ids=["dense", "sink-cache"])
def test_a_cushioncache_prefix_is_read_before_the_prompt(streaming):
    model = _with_cushion(_model("llama", "float32"))
    prompt = [3, 17, 99, 5, 250, 42, 7]
    tokens = greedy_tokens(model, prompt, 24, fused=False, streaming=streaming)
    assert greedy_tokens(model, prompt, 24, fused=True, streaming=streaming) == tokens
    decoder = FusedDecoder(model, capacity=64, streaming=streaming)
    decoder.prefill(prompt)
    assert decoder.cache.position == 3 + len(prompt)
    fused = torch.stack([decoder.step(token) for token in tokens])
    eager = _eager_stream_logits(model, prompt, tokens, streaming)
    torch.testing.assert_close(fused, eager, rtol=0, atol=1e-4 * eager.abs().max().item())


@needs_kernels
@pytest.mark.parametrize(
    "window, room, dtype",
    [(8, None, torch.float32), (8, None, torch.bfloat16), (80, 30, torch.float32), (8, 30, torch.float32)],
    ids=["ring", "ring-bf16", "kept-dense", "room-past-the-window"],
)
@pytest.mark.parametrize("cushion", [False, True], ids=["", "cushion"])
def test_a_cache_goes_into_the_fused_layout_and_back(window, room, dtype, cushion):
    """What `leanlm serve` does with each conversation: a prompt read by transformers' forward into a sink cache,
    tokens through the fused step (a ring that goes round, or a dense cache where they cannot overflow it), the
    cache given back (`release`) and read on by the forward: the same cache and logits as transformers' all along."""
    model = _model("llama", "float32").to(dtype)
    if cushion:
        model = _with_cushion(model)
    streaming = StreamingConfig(sinks=2, window=window)
    decoder = FusedDecoder(model, streaming=streaming)
    prompt, tokens, more = [3, 17, 99, 5, 250], [(11 * i + 4) % 256 for i in range(20)], [8, 13, 21, 34, 55, 89]
    eager = new_cache(model, streaming)
    read_in_chunks(model, eager, prompt, window)
    reference = _eager_stream_logits(model, prompt, tokens, streaming)
    fused_cache = decoder.adopt(eager, room)
    assert (fused_cache.window, fused_cache.capacity) == (
        (0, len(prompt) + 3 * cushion + room) if window == 80 else (window, 2 + 3 * cushion + window + 1)
    )
    fused = torch.stack([decoder.step(token, fused_cache) for token in tokens])
    scale = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(fused, reference, rtol=0, atol=scale * reference.abs().max().item())
    given_back, alone = decoder.release(fused_cache), new_cache(model, streaming)
    read_in_chunks(model, alone, prompt + tokens, 1)  # one token per forward, as the step read them
    for cache in (given_back, alone):
        cache.settle()
    for back, single in zip(given_back.layers, alone.layers):
        assert back.keys.dtype == single.keys.dtype == dtype
        for a, b in ((back.keys, single.keys), (back.values, single.values)):
            torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=scale * b.abs().max().item())
    after_back, after_alone = (read_in_chunks(model, cache, more, window) for cache in (given_back, alone))
    torch.testing.assert_close(
        after_back.float(), after_alone.float(), rtol=0, atol=scale * after_alone.abs().max().item()
    )


@needs_kernels
@pytest.mark.parametrize(
    "weights", ["float32", "nf4-dq+int8-head", "w8a8-O2", "smoothquant-O3", "llm-int8", "gptq", "spqr"]
)
@pytest.mark.parametrize("family", FUSED_FAMILIES)
def test_a_batched_step_gives_each_sequence_what_stepping_it_alone_gives(family, weights):
    """Eleven sequences at different positions stepped together (every weight read once for all eleven rows: 8 + 2
    + 1 in AVX512-VNNI's int8 kernel, 4 + 4 + 2 + 1 in AVX2's) over three steps: each row's logits and cache are
    those of stepping that sequence alone (its own int8 activation scales and int8 attention, not shared with the
    others)."""
    model = _model(family, weights)
    decoder = FusedDecoder(model, capacity=48)
    caches = []
    for length in (3, 9, 17, 4, 30, 12, 7, 22, 2, 15, 26):
        decoder.prefill([(5 * i + length) % 256 for i in range(length)])
        caches.append(decoder.cache)
    alone = copy.deepcopy(caches)
    tokens = [11, 200, 37, 5, 94, 63, 150, 8, 240, 71, 19]
    for _ in range(3):
        batched = decoder.step_batch(tokens, caches)
        single = torch.stack([decoder.step(token, cache) for token, cache in zip(tokens, alone)])
        torch.testing.assert_close(batched, single, rtol=0, atol=1e-6 * single.abs().max().item())
        tokens = [int(row.argmax()) for row in single]
    for together, by_itself in zip(caches, alone):
        assert together.position == by_itself.position
        torch.testing.assert_close(together.keys[:, :, : together.position], by_itself.keys[:, :, : by_itself.position])


@needs_kernels
@pytest.mark.parametrize("weights", ["float32", "nf4"])
def test_a_batch_mixes_rings_that_went_round_and_dense_caches(weights):
    """A server's batch: sink caches at several points of their ring and a dense one (a request that cannot
    overflow its window), stepped together over 5 steps as each alone, and refused when two rows share a cache."""
    model = _model("llama", weights)
    decoder = FusedDecoder(model, streaming=StreamingConfig(sinks=2, window=8))
    caches = []
    for length, room in ((3, None), (11, None), (25, None), (4, 5)):
        eager = new_cache(model, decoder.streaming)
        read_in_chunks(model, eager, [(3 * i + length) % 256 for i in range(length)], 8)
        caches.append(decoder.adopt(eager, room))
    assert [cache.window for cache in caches] == [8, 8, 8, 0]
    alone = copy.deepcopy(caches)
    tokens = [1, 2, 3, 4]
    for _ in range(5):
        batched = decoder.step_batch(tokens, caches)
        single = torch.stack([decoder.step(token, cache) for token, cache in zip(tokens, alone)])
        torch.testing.assert_close(batched, single, rtol=0, atol=1e-6 * single.abs().max().item())
        tokens = [int(row.argmax()) for row in single]
    with pytest.raises(ConfigError, match="each cache once"):
        decoder.step_batch([1, 2], [caches[0], caches[0]])


@needs_kernels
def test_a_sink_cache_is_refused_where_the_eager_one_is_or_the_step_cannot_run_it():
    streaming = StreamingConfig(sinks=2, window=8)
    assert "sliding" in fused_decoder_problem(_model("gemma3_text", "float32"), streaming)
    assert "sliding" in fused_decoder_problem(_model("mistral", "float32"), streaming)  # its window of 12
    assert "int8 attention" in fused_decoder_problem(_model("llama", "w8a8-O2"), streaming)
    assert "trained context" in fused_decoder_problem(_model("llama", "float32"), StreamingConfig(4, 4000))


@needs_kernels
def test_a_chat_through_the_fused_step_answers_as_through_transformers(smollm2_tokenizer):
    """`leanlm chat`'s conversation (a sink cache of 4 + 24, outlived by the third turn) replies the same words
    through the fused step (first prompt prefilled, later turns read a token per call) as through transformers:
    the same tokens, sampled from the same seed."""
    from tiny import tiny_model

    from leanlm.chat import ChatSettings, StreamingChat

    model = tiny_model("llama", vocab_size=len(smollm2_tokenizer))
    replies = {}
    for fused in (True, False):
        # sampled (a tiny random model's greedy answer is one token over and over), from the same seed
        settings = ChatSettings(
            streaming=StreamingConfig(sinks=4, window=24), max_new_tokens=8, temperature=1.0, fused=fused
        )
        chat = StreamingChat(model, smollm2_tokenizer, settings)
        assert (chat.fused is not None) == fused
        replies[fused] = [chat.reply(text) for text in ("Hello there", "What is two plus two?", "And three?")]
    assert replies[True] == replies[False]
    assert len(set("".join(replies[True]))) > 8  # words, not one token over and over
    rendered = smollm2_tokenizer.apply_chat_template(chat.messages, tokenize=False)
    assert len(smollm2_tokenizer(rendered)["input_ids"]) > chat.settings.streaming.cache_size  # outgrew the cache


@needs_kernels
def test_indices_read_from_a_checkpoint_are_bounds_checked_before_the_step_reads_them():
    """A GPTQ / SpQR layer's permutation and outlier columns come from the file; the C++ step reads them without
    bounds checks per token, so one pointing outside the layer is refused when the decoder is built."""
    from leanlm.nn.spqr_linear import SpQRLinear

    model = _model("llama", "spqr")
    layer = next(module for module in model.modules() if isinstance(module, SpQRLinear) and module.outlier_count)
    columns, permutation = layer.outlier_columns.clone(), layer.permutation.clone()  # the loaded, corrupted
    layer.outlier_columns = columns.index_fill(0, torch.tensor([0]), layer.in_features)
    with pytest.raises(RuntimeError, match="outside the layer"):
        FusedDecoder(model)
    layer.outlier_columns, layer.permutation = columns, permutation.index_fill(0, torch.tensor([0]), -1)
    with pytest.raises(RuntimeError, match="each an input column"):
        FusedDecoder(model)
