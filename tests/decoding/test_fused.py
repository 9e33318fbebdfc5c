"""The fused decode step against transformers' eager forward: the same logits step by step (up to summation
order), hence the same greedy tokens, for every family it implements and every linear kind it runs."""

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from leanlm.decoding import FusedDecoder, fused_decoder_problem, greedy_tokens
from leanlm.errors import ConfigError
from leanlm.kernels.kbit_gemm import avx2_available
from leanlm.methods import KbitConfig, W8A8Config, quantize_
from leanlm.methods.checkpoint import embeddings_to_, quantize_head_
from leanlm.nn.float_linear import use_gemv_
from tiny import tiny_config, tiny_model

needs_kernels = pytest.mark.skipif(not avx2_available(), reason="leanlm's kernels cannot be built here")
FUSED_FAMILIES = ("llama", "mistral", "qwen2", "gemma3_text")
WEIGHTS = ("float32", "nf4", "nf4-dq+bf16-head", "fp4", "nf4-dq+int8-head")


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
    if weights.startswith("nf4"):
        quantize_(model, KbitConfig(double_quant="dq" in weights))
    elif weights == "fp4":
        quantize_(model, KbitConfig(dtype="fp"))
    if weights.endswith("bf16-head"):  # as load_any holds a quantized checkpoint's with --dtype auto
        use_gemv_(model)
        embeddings_to_(model, torch.bfloat16)
    if weights.endswith("int8-head"):  # --head int8
        quantize_head_(model)
    return model


def _eager_logits(model, prompt, tokens):
    cache, steps = DynamicCache(), []
    with torch.inference_mode():
        model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True)
        for token in tokens:
            steps.append(model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits[0, -1])
    return torch.stack(steps).float()


@needs_kernels
@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("family", FUSED_FAMILIES)
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
def test_families_and_layers_it_does_not_run_are_named():
    assert "gpt2" in fused_decoder_problem(tiny_model("gpt2"))
    w8a8 = tiny_model("llama")
    quantize_(w8a8, W8A8Config(level="O1"))
    assert "W8A8" in fused_decoder_problem(w8a8) or "Int8" in fused_decoder_problem(w8a8)
    three_bit = tiny_model("llama")
    quantize_(three_bit, KbitConfig(bits=3))
    assert "nf3" in fused_decoder_problem(three_bit)
    assert FusedDecoder.build(three_bit) is None
    with pytest.raises(ConfigError, match="cannot use the fused decode step"):
        FusedDecoder(three_bit)


@needs_kernels
def test_the_cache_bounds_are_checked():
    decoder = FusedDecoder(tiny_model("llama"), capacity=8)
    with pytest.raises(ConfigError, match="does not fit"):
        decoder.prefill(list(range(8)))
    decoder.prefill(list(range(7)))
    decoder.step(1)
    with pytest.raises(ConfigError, match="full"):
        decoder.step(2)


def _perturbed_eager_logits(model, prompt, tokens, relative_noise=1e-7):
    """The eager logits with the embedding's output perturbed by `relative_noise`: how far float rounding alone
    moves a decode whose activations are quantized to int8 (a rounding that lands on the other side of a
    quantization step changes the value by a whole step)."""
    torch.manual_seed(0)
    hook = model.get_input_embeddings().register_forward_hook(
        lambda module, args, out: out * (1 + relative_noise * torch.randn_like(out)))
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
    for head in ("bfloat16", "int8"):
        if head == "int8":
            quantize_head_(model)  # and the table read from the 8-bit head's codes
        tokens = greedy_tokens(model, prompt, 64, fused=False)
        eager = _eager_logits(model, prompt, tokens)
        sensitivity = (_perturbed_eager_logits(model, prompt, tokens) - eager).abs().max()
        decoder = FusedDecoder(model, capacity=128)
        decoder.prefill(prompt)
        fused = torch.stack([decoder.step(token) for token in tokens])
        assert (fused - eager).abs().max() <= 2 * sensitivity, head
        top2 = eager.topk(2).values
        decisive = top2[:, 0] - top2[:, 1] > 2 * sensitivity
        assert decisive.sum() > 32 and torch.equal(fused.argmax(1)[decisive], eager.argmax(1)[decisive]), head
