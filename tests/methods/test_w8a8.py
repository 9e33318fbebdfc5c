import copy

import pytest
import torch
from tiny import FAMILIES, tiny_model, token_ids

from leanlm.errors import ConfigError
from leanlm.methods import (
    LEVELS,
    ZEROQUANT,
    Calibration,
    LLMInt8Config,
    SmoothQuantConfig,
    W8A8Config,
    calibrate,
    quantize_,
    share_input_gemms_,
)
from leanlm.models import architecture_for
from leanlm.nn import ATTENTION_NAME, BmmQuantizer, W8A8Linear


def _batches(n=3, length=24):
    return token_ids(n, length)


def _relative_error(model, quantized):
    ids = token_ids(1, 20, seed=1)
    with torch.inference_mode():
        expected, actual = model(ids).logits, quantized(ids).logits
    return ((actual - expected).norm() / expected.norm()).item()


@pytest.mark.parametrize("model_type", FAMILIES)
@pytest.mark.parametrize("level", list(LEVELS))
def test_every_linear_becomes_int8_and_outputs_stay_close(model_type, level):
    model = tiny_model(model_type)
    stats = calibrate(model, _batches())
    quantized = copy.deepcopy(model)
    record = quantize_(
        quantized, [SmoothQuantConfig(), W8A8Config(level=level)], calibration=Calibration(int8_stats=stats)
    )
    activation, static = LEVELS[level]
    linears = [m for m in quantized.modules() if isinstance(m, W8A8Linear)]
    assert len(linears) == 2 * len(architecture_for(model).quantizable_linears)
    assert all(m.activation == activation and m.static == static for m in linears)
    assert sum(isinstance(m, BmmQuantizer) for m in quantized.modules()) == 2
    assert quantized.config._attn_implementation == ATTENTION_NAME
    assert record["method"] == "smoothquant" and record["level"] == level
    assert _relative_error(model, quantized) < 0.1  # random weights have no outliers for smoothing to tame
    # The linears reading one norm (the table's norm_feeds with more than one linear: q/k/v, gate/up) share a GEMM,
    # and sharing changes no logit.
    feeds = [f.linears for f in architecture_for(quantized).norm_feeds if len(f.linears) > 1]
    assert sum(m.shared_input is not None for m in linears) == 2 * sum(map(len, feeds))  # two blocks
    ids = token_ids(2, 20, seed=1)
    with torch.inference_mode():
        shared = quantized(ids).logits
        assert share_input_gemms_(quantized, share=False) == 0
        separate = quantized(ids).logits
        assert share_input_gemms_(quantized) == 2 * len(feeds)
    assert torch.allclose(shared, separate, rtol=1e-5, atol=1e-5)


def test_static_scales_are_the_calibrated_maxima():
    model = tiny_model("llama")
    stats = calibrate(model, _batches())
    quantize_(model, W8A8Config(level="O3", quantize_bmm=False), calibration=Calibration(int8_stats=stats))
    q_proj = model.model.layers[1].self_attn.q_proj
    assert torch.isclose(q_proj.input_scale, stats.input_absmax["model.layers.1.self_attn.q_proj"].max() / 127)
    assert model.config._attn_implementation == "sdpa"


def test_zeroquant_is_per_token_with_grouped_weights():
    model = tiny_model("llama")
    quantize_(model, ZEROQUANT)  # dynamic and unsmoothed: needs no calibration
    down = model.model.layers[0].mlp.down_proj
    assert down.activation == "per_token" and not down.static
    assert down.weight_scale.unique().numel() == 1  # 64 outputs: one group of 128


def test_levels_that_need_calibration_say_so():
    with pytest.raises(ConfigError, match="W8A8Config needs calibration text"):
        quantize_(tiny_model("llama"), W8A8Config(level="O3"))
    with pytest.raises(ConfigError, match="SmoothQuantConfig needs calibration text"):
        quantize_(tiny_model("llama"), [SmoothQuantConfig(), W8A8Config(level="O1")])
    with pytest.raises(ConfigError, match="level must be one of"):
        W8A8Config(level="O4")


def test_alpha_search_keeps_the_grid_minimum_on_held_out_windows(smollm2_tokenizer):
    model = tiny_model("llama", vocab_size=len(smollm2_tokenizer))
    calibration = Calibration(smollm2_tokenizer, samples=3, seq_len=24)
    grid = (0.3, 0.6, 0.9)
    record = quantize_(
        model,
        [SmoothQuantConfig("auto", alpha_grid=grid, search_windows=2), W8A8Config(level="O3")],
        calibration=calibration,
    )
    searched = {float(alpha): ppl for alpha, ppl in record["alpha_search"].items()}
    assert set(searched) == set(grid) and searched[record["smoothquant"]["alpha"]] == min(searched.values())
    # The candidates were copies: the model itself was smoothed and quantized once, with the chosen alpha.
    assert sum(isinstance(m, W8A8Linear) for m in model.modules()) == 14
    again = tiny_model("llama", vocab_size=len(smollm2_tokenizer))
    quantize_(
        again, [SmoothQuantConfig(record["smoothquant"]["alpha"]), W8A8Config(level="O3")], calibration=calibration
    )
    ids = torch.randint(0, 1000, (1, 12))
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, again(ids).logits)


def test_llm_int8_and_zeropoint_configs_reach_every_linear():
    model = tiny_model("llama")
    record = quantize_(model, LLMInt8Config(6.0))
    linears = [m for m in model.modules() if isinstance(m, W8A8Linear)]
    assert record["method"] == "llm-int8" and all(m.outlier_threshold == 6.0 for m in linears)
    assert model.config._attn_implementation == "sdpa"  # the paper keeps attention's matmuls in 16-bit
    zeropoint = tiny_model("llama")
    quantize_(zeropoint, W8A8Config(level="O2", asymmetric=True, quantize_bmm=False))
    assert all(m.asymmetric for m in zeropoint.modules() if isinstance(m, W8A8Linear))
    with pytest.raises(ConfigError, match="dynamic activation scales"):
        W8A8Config(level="O3", outlier_threshold=6.0)
