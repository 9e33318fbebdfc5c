import copy

import pytest
import torch
from tiny import FAMILIES, tiny_model, token_ids

from leanlm.errors import ConfigError
from leanlm.methods import SmoothQuantConfig, calibrate, collect_input_absmax, smooth_
from leanlm.methods.smoothquant import consumer_to_producer_channels, smoothing_factors


def test_the_worked_example():
    """X (2x4), W (4x3) from the digest: s = sqrt(max|X_j| / max|W_j|) = [1, 4, 1, 3] and XW is unchanged."""
    x = torch.tensor([[1.0, -16, 2, 6], [-2, 8, -1, -9]])
    w = torch.tensor([[2.0, 1, -2], [1, -1, 1], [2, -1, -2], [-1, -1, 1]])  # (C_i, C_o) as in the paper
    s = smoothing_factors(x.abs().amax(0), w.abs().amax(1), alpha=0.5)
    assert torch.allclose(s, torch.tensor([1.0, 4, 1, 3]))
    assert torch.allclose((x / s) @ (s[:, None] * w), x @ w)
    assert torch.allclose(smoothing_factors(x.abs().amax(0), w.abs().amax(1), 1.0), torch.tensor([2.0, 16, 2, 9]))


def _batches(n=3, length=24):
    return token_ids(n, length)


@pytest.mark.parametrize("model_type", FAMILIES)
@pytest.mark.parametrize("extension", [False, True])
def test_smoothing_leaves_the_function_unchanged(model_type, extension):
    model = tiny_model(model_type)
    stats = collect_input_absmax(model, _batches())
    smoothed = copy.deepcopy(model)
    smooth_(smoothed, stats, SmoothQuantConfig(alpha=0.5, smooth_value_output=extension, smooth_mlp_output=extension))
    ids = torch.randint(0, 128, (2, 19))
    with torch.inference_mode():
        expected, actual = model(ids).logits, smoothed(ids).logits
    assert torch.allclose(actual, expected, atol=1e-4, rtol=1e-4)
    changed = [n for n, p in smoothed.named_parameters() if not torch.equal(p, dict(model.named_parameters())[n])]
    assert changed, "smoothing should have rescaled something"


@pytest.mark.parametrize("model_type", ["llama", "opt", "gemma3_text"])
def test_derived_ranges_equal_a_fresh_calibration_of_the_smoothed_model(model_type):
    model = tiny_model(model_type)
    batches = _batches()
    stats = collect_input_absmax(model, batches)
    result = smooth_(model, stats, SmoothQuantConfig(alpha=0.6))
    fresh = collect_input_absmax(model, batches)
    for name, derived in result.input_absmax.items():
        assert torch.allclose(derived, fresh[name], rtol=1e-4, atol=1e-6), name


def test_smoothing_flattens_an_outlier_channel():
    model = tiny_model("llama")
    model.model.layers[0].input_layernorm.weight.data[5] = 50.0  # a massive input channel for q/k/v
    stats = collect_input_absmax(model, _batches())
    q_proj = "model.layers.0.self_attn.q_proj"
    before = stats[q_proj].max() / stats[q_proj].median()
    after = smooth_(model, stats, SmoothQuantConfig(alpha=0.8)).input_absmax[q_proj]
    assert after.max() / after.median() < before / 10


def test_grouped_query_value_channels_map_to_their_kv_head():
    class Config:
        head_dim, hidden_size, num_attention_heads = 2, 8, 4

    # 4 query heads share 2 kv heads: query heads 0,1 -> kv head 0; 2,3 -> kv head 1
    assert consumer_to_producer_channels(Config, 4, 8).tolist() == [0, 1, 0, 1, 2, 3, 2, 3]


def test_alpha_out_of_range_is_refused():
    with pytest.raises(ConfigError, match="alpha"):
        SmoothQuantConfig(alpha=1.5)


def test_calibrate_leaves_the_model_as_it_was():
    model = tiny_model("llama")
    stats = calibrate(model, _batches())
    assert model.config._attn_implementation == "sdpa"
    assert not any(hasattr(layer.self_attn, "bmm_quantizer") for layer in model.model.layers)
    assert set(stats.attention) == {"model.layers.0.self_attn", "model.layers.1.self_attn"}
