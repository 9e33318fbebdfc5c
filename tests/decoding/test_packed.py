"""Prompt pieces read packed into one forward give each piece, bit for bit, what a pack of it alone gives, and
what transformers' own forward computes; models that cannot be read so say why."""

import copy

import pytest
import torch
from tiny import tiny_model, token_ids

from leanlm.decoding import packed
from leanlm.decoding.packed import attention_oracle, packing_problem, piece_attention, read_pieces
from leanlm.kernels.kbit_gemm import avx2_available
from leanlm.methods import Calibration, GPTQConfig, KbitConfig, SmoothQuantConfig, W8A8Config, quantize_
from leanlm.methods.streaming import StreamingConfig, sink_cache
from leanlm.nn import use_gemv_

pytestmark = pytest.mark.skipif(not avx2_available(), reason="leanlm's kernels cannot be built here")

FORMATS = {
    "float": None,
    "nf4-dq": KbitConfig(double_quant=True),
    "int8-codes": KbitConfig(dtype="int", bits=8),
    "gptq": GPTQConfig(group_size=32),
}
STREAMING = StreamingConfig(sinks=2, window=40)
# Pieces that take every path alone: one token, the int8 kernel's rows (up to 16), the de-quantized tiles' (17 up);
# the second round continues each cache, the 50-token piece past the window (the sink cache evicts).
FIRST = [[5, 6, 7], list(range(20, 60)), [9], list(range(60, 76)), list(range(3, 20))]
SECOND = [list(range(30, 80)), [11], list(range(90, 107)), [4, 5], list(range(40, 56))]
ECHO = [False, True, False, False, True]  # every position's logits for these


def _model(family: str, form: str, dtype: torch.dtype):
    model = tiny_model(family, seed=3).to(dtype)
    if FORMATS[form] is not None:
        quantize_(model, FORMATS[form], calibration=Calibration(token_ids=token_ids(4, 24)))
    use_gemv_(model)  # as leanlm's loaders leave the float linears (the head here)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("form", list(FORMATS))
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "qwen3"])
def test_packed_pieces_give_what_each_gives_read_alone(family, form, dtype):
    model = _model(family, form, dtype)
    assert packing_problem(model, STREAMING.cache_size + 64) is None
    caches = [sink_cache(model, STREAMING) for _ in FIRST]
    alone = copy.deepcopy(caches)
    packed = [read_pieces(model, caches, FIRST, ECHO), read_pieces(model, caches, SECOND, ECHO)]
    for index, cache in enumerate(alone):
        for round_index, pieces in enumerate((FIRST, SECOND)):
            logits = read_pieces(model, [cache], [pieces[index]], [ECHO[index]])[0]
            assert torch.equal(logits, packed[round_index][index]), (index, round_index)
        for mine, theirs in zip(caches[index].layers, cache.layers):
            assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_packed_read_computes_what_transformers_forward_does(family):
    """Float32, float weights: each piece's logits equal transformers' forward of it (sdpa) to float rounding."""
    model = _model(family, "float", torch.float32)
    caches = [sink_cache(model, STREAMING) for _ in FIRST]
    theirs = copy.deepcopy(caches)
    for pieces in (FIRST, SECOND):
        packed = read_pieces(model, caches, pieces, ECHO)
        with torch.inference_mode():
            for index, (cache, piece) in enumerate(zip(theirs, pieces)):
                out = model(input_ids=torch.tensor([piece]), past_key_values=cache, use_cache=True).logits[0]
                expected = out.float() if ECHO[index] else out[-1].float()
                torch.testing.assert_close(packed[index], expected, rtol=1e-4, atol=1e-5)


def test_models_that_cannot_be_read_packed_say_why():
    plain = tiny_model("llama")  # transformers' nn.Linear: not leanlm's, whose rows it could not keep apart
    assert "Linear" in packing_problem(plain, 100)
    w8a8 = tiny_model("llama")
    quantize_(
        w8a8, [SmoothQuantConfig(), W8A8Config(quantize_bmm=False)], calibration=Calibration(token_ids=token_ids(2, 8))
    )
    use_gemv_(w8a8)
    assert "W8A8Linear" in packing_problem(w8a8, 100)
    gemma = tiny_model("gemma3_text")
    use_gemv_(gemma)
    assert "sliding window" in packing_problem(gemma, 100)
    mistral = tiny_model("mistral")
    use_gemv_(mistral)
    mistral.config.sliding_window = 64
    assert "sliding window of 64" in packing_problem(mistral, 100)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_smollm2_pieces_read_packed_give_what_each_gives_alone(default_checkpoint_dir, dtype):
    """SmolLM2's shapes, NF4 + DQ with an 8-bit head as `leanlm serve` runs it: a chat prompt's 44 tokens, a short
    piece and a long one, packed or alone, bit for bit."""
    from leanlm.methods import load_any

    model = load_any(str(default_checkpoint_dir), dtype, "int8").model
    quantize_(model, KbitConfig(double_quant=True))
    assert packing_problem(model, 1100) is None
    pieces = [list(range(1000, 1044)), [17, 18, 19], list(range(2000, 2200))]
    streaming = StreamingConfig(sinks=4, window=1000)
    caches = [sink_cache(model, streaming) for _ in pieces]
    alone = copy.deepcopy(caches)
    packed = read_pieces(model, caches, pieces)
    for index, cache in enumerate(alone):
        assert torch.equal(read_pieces(model, [cache], [pieces[index]])[0], packed[index]), index


def test_a_read_that_fails_leaves_every_cache_as_it_was():
    model = _model("llama", "nf4-dq", torch.float32)
    caches = [sink_cache(model, STREAMING) for _ in FIRST]
    read_pieces(model, caches, FIRST)
    before = copy.deepcopy(caches)
    last = model.model.layers[-1]
    last.register_forward_pre_hook(lambda module, args: (_ for _ in ()).throw(RuntimeError("out of memory")))
    with pytest.raises(RuntimeError, match="out of memory"):
        read_pieces(model, caches, SECOND)
    for cache, kept in zip(caches, before):
        assert cache.get_seq_length() == kept.get_seq_length()
        for mine, theirs in zip(cache.layers, kept.layers):
            assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)


@pytest.mark.parametrize("block", [128, 16, None], ids=["blocks-128", "blocks-16", "masked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"), [(4, 4, 32), (9, 3, 64), (12, 2, 128)], ids=["mha", "smollm2", "qwen2.5-1.5b"]
)
@pytest.mark.parametrize(("earlier", "new"), [(0, 1), (0, 77), (5, 1), (300, 40), (64, 200)])
def test_a_pieces_attention_is_the_oracles(block, dtype, heads, kv_heads, dim, earlier, new):
    """Both ways of attending (blocks of queries against the earlier keys and their own apart, merged; or one
    masked attention) give the float64 oracle's values to the dtype's rounding."""
    generator = torch.Generator().manual_seed(earlier * 1000 + new)
    length = earlier + new
    query = torch.randn(1, heads, new, dim, generator=generator).to(dtype)
    key, value = (torch.randn(1, kv_heads, length, dim, generator=generator).to(dtype) for _ in range(2))
    mask = torch.ones(new, length, dtype=torch.bool).tril(earlier)
    with torch.inference_mode():
        out = piece_attention(query, key, value, mask, dim**-0.5, block)
    expected = attention_oracle(query, key, value, mask, dim**-0.5)
    assert out.shape == expected.shape and out.dtype == dtype
    tolerance = 2e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected.float(), rtol=0, atol=tolerance)


def test_this_pytorch_has_the_flash_attention_the_blocks_need():
    """The pinned PyTorch has the kernel; without it reads fall back to one masked attention (tested above)."""
    assert packed._FLASH is not None
