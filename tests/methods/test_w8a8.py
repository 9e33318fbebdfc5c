import copy

import pytest
import torch

from leanlm.errors import ConfigError
from leanlm.methods import (
    LEVELS,
    ZEROQUANT,
    SmoothQuantConfig,
    W8A8Config,
    calibrate,
    quantize_w8a8_,
    search_alpha,
    share_input_gemms_,
)
from leanlm.nn import ATTENTION_NAME, BmmQuantizer, W8A8Linear
from leanlm.models import architecture_for
from tiny import FAMILIES, tiny_model


def _batches(n=3, length=24):
    return torch.randint(0, 128, (n, length), generator=torch.Generator().manual_seed(0))


def _relative_error(model, quantized):
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected, actual = model(ids).logits, quantized(ids).logits
    return ((actual - expected).norm() / expected.norm()).item()


@pytest.mark.parametrize("model_type", FAMILIES)
@pytest.mark.parametrize("level", list(LEVELS))
def test_every_linear_becomes_int8_and_outputs_stay_close(model_type, level):
    model = tiny_model(model_type)
    stats = calibrate(model, _batches())
    quantized = copy.deepcopy(model)
    record = quantize_w8a8_(quantized, W8A8Config(level=level, smoothquant=SmoothQuantConfig()), stats)
    activation, static = LEVELS[level]
    linears = [m for m in quantized.modules() if isinstance(m, W8A8Linear)]
    assert len(linears) == 2 * (4 if model_type in ("gpt2", "gpt_neox") else 7 if model_type != "opt" else 6)
    assert all(m.activation == activation and m.static == static for m in linears)
    assert sum(isinstance(m, BmmQuantizer) for m in quantized.modules()) == 2
    assert quantized.config._attn_implementation == ATTENTION_NAME
    assert record["method"] == "smoothquant" and record["level"] == level
    assert _relative_error(model, quantized) < 0.08
    # The linears reading one norm (the table's norm_feeds with more than one linear: q/k/v, gate/up) share a GEMM,
    # and sharing changes no logit.
    feeds = [f.linears for f in architecture_for(quantized).norm_feeds if len(f.linears) > 1]
    assert sum(m.shared_input is not None for m in linears) == 2 * sum(map(len, feeds))  # two blocks
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        shared = quantized(ids).logits
        assert share_input_gemms_(quantized, share=False) == 0
        separate = quantized(ids).logits
        assert share_input_gemms_(quantized) == 2 * len(feeds)
    assert torch.allclose(shared, separate, rtol=1e-5, atol=1e-5)


def test_static_scales_are_the_calibrated_maxima():
    model = tiny_model("llama")
    stats = calibrate(model, _batches())
    quantize_w8a8_(model, W8A8Config(level="O3", quantize_bmm=False), stats)
    q_proj = model.model.layers[1].self_attn.q_proj
    assert torch.isclose(q_proj.input_scale, stats.input_absmax["model.layers.1.self_attn.q_proj"].max() / 127)
    assert model.config._attn_implementation == "sdpa"


def test_zeroquant_is_per_token_with_grouped_weights():
    model = tiny_model("llama")
    quantize_w8a8_(model, ZEROQUANT)  # dynamic and unsmoothed: needs no calibration
    down = model.model.layers[0].mlp.down_proj
    assert down.activation == "per_token" and not down.static
    assert down.weight_scale.unique().numel() == 1  # 64 outputs: one group of 128


def test_levels_that_need_calibration_say_so():
    with pytest.raises(ConfigError, match="needs calibration"):
        quantize_w8a8_(tiny_model("llama"), W8A8Config(level="O3"))
    with pytest.raises(ConfigError, match="level must be one of"):
        W8A8Config(level="O4")


def test_alpha_search_returns_the_grid_minimum():
    model = tiny_model("llama")
    stats = calibrate(model, _batches())
    best, perplexities = search_alpha(
        model, W8A8Config(level="O3", smoothquant=SmoothQuantConfig()), stats, _batches(2, 16), grid=(0.3, 0.6, 0.9)
    )
    assert set(perplexities) == {0.3, 0.6, 0.9} and perplexities[best] == min(perplexities.values())
    assert not any(isinstance(m, W8A8Linear) for m in model.modules()), "the float model must stay untouched"


def test_llm_int8_and_zeropoint_configs_reach_every_linear():
    from leanlm.methods import llm_int8_config

    model = tiny_model("llama")
    record = quantize_w8a8_(model, llm_int8_config(6.0))
    linears = [m for m in model.modules() if isinstance(m, W8A8Linear)]
    assert record["method"] == "llm-int8" and all(m.outlier_threshold == 6.0 for m in linears)
    assert model.config._attn_implementation == "sdpa"  # the paper keeps attention's matmuls in 16-bit
    zeropoint = tiny_model("llama")
    quantize_w8a8_(zeropoint, W8A8Config(level="O2", asymmetric=True, quantize_bmm=False))
    assert all(m.asymmetric for m in zeropoint.modules() if isinstance(m, W8A8Linear))
    with pytest.raises(ConfigError, match="dynamic activation scales"):
        W8A8Config(level="O3", outlier_threshold=6.0)

