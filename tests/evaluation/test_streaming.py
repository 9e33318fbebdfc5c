import math

import pytest
import torch
from tiny import tiny_model, token_ids

from leanlm.errors import ConfigError
from leanlm.evaluation.streaming import (
    StreamSettings,
    attention_sink_mass,
    recompute_nll,
    stream_evaluate,
    windowed_perplexity,
)

SMALL = StreamSettings(sinks=4, window=28, max_tokens=600, chunk=8, recompute_tokens=8, latency_steps=64)


@pytest.fixture(scope="module")
def tiny_with_tokenizer(smollm2_tokenizer):
    return tiny_model("llama", vocab_size=len(smollm2_tokenizer)), smollm2_tokenizer


def test_every_strategy_reports_the_contract_keys(tiny_with_tokenizer):
    model, tokenizer = tiny_with_tokenizer
    results = stream_evaluate(model, tokenizer, SMALL)["settings"]
    for strategy in ("dense", "window", "recompute", "streaming"):
        entry = results[strategy]
        assert {"perplexity", "tokens", "ms_per_token", "peak_memory_bytes"} <= set(entry)
        assert math.isfinite(entry["perplexity"]) and entry["ms_per_token"] > 0 and entry["peak_memory_bytes"] > 0
        assert math.isfinite(entry["perplexity_on_recompute_targets"])
    assert results["streaming"]["tokens"] == results["window"]["tokens"] == 599
    # The tiny model is trained to 256 positions: dense stops there and says so.
    assert results["dense"]["tokens"] == 255 and "trained context (256" in results["dense"]["stopped"]
    assert results["recompute"]["tokens"] == 8
    # Caches stay bounded: sinks + window + one chunk.
    assert results["streaming"]["cache_bytes"] == results["window"]["cache_bytes"]
    assert results["streaming"]["cache_bytes"] < results["dense"]["cache_bytes"]


def test_recompute_scores_each_target_from_its_own_window():
    model = tiny_model("llama", layers=1)
    tokens = token_ids(100)
    nll = recompute_nll(model, tokens, window=16, targets=range(40, 45), batch=2)
    with torch.inference_mode():
        logits = model(input_ids=tokens[None, 26:42]).logits[0, -1]
    assert nll[2].item() == pytest.approx(torch.nn.functional.cross_entropy(logits, tokens[42]).item(), rel=1e-5)


def test_attention_sink_mass_is_a_probability_per_layer(tiny_with_tokenizer):
    model, tokenizer = tiny_with_tokenizer
    mass = attention_sink_mass(
        model, tokenizer, ["The quick brown fox jumps over the lazy dog again and again."] * 2, length=8
    )
    assert len(mass) == model.config.num_hidden_layers and all(0 < m < 1 for m in mass)


def test_windowed_perplexity_and_bad_settings():
    assert windowed_perplexity(torch.zeros(2500), width=1024) == [1.0, 1.0, 1.0]
    with pytest.raises(ConfigError, match="sinks"):
        StreamSettings(sinks=-1)
    with pytest.raises(ConfigError, match="strategy"):
        StreamSettings(strategies=("dense", "magic"))
