import pytest
import torch
from tiny import tiny_model, token_ids
from transformers import DynamicCache

from leanlm.bench import peak_memory
from leanlm.cache import SinkCache
from leanlm.errors import ConfigError, UnsupportedArchitectureError
from leanlm.methods import W8A8Config, quantize_
from leanlm.methods.streaming import StreamingConfig, sink_cache


def stream(model, tokens: torch.Tensor, cache, chunk: int = 1) -> torch.Tensor:
    """Logits of every position, feeding `tokens` (batch, length) `chunk` tokens at a time."""
    logits = []
    with torch.inference_mode():
        for start in range(0, tokens.shape[1], chunk):
            out = model(input_ids=tokens[:, start : start + chunk], past_key_values=cache, use_cache=True)
            logits.append(out.logits)
    return torch.cat(logits, dim=1)


def kept_positions(length: int, sinks: int, window: int) -> list[int]:
    """Text positions a stream of `length` tokens leaves in the cache (after the pending eviction)."""
    return list(range(length)) if length <= sinks + window else [*range(sinks), *range(length - window, length)]


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt_neox"])
def test_equals_dense_attention_until_the_cache_is_full(family):
    model = tiny_model(family)
    tokens = token_ids(2, 24)
    dense = stream(model, tokens, DynamicCache(config=model.config))
    streamed = stream(model, tokens, sink_cache(model, StreamingConfig(sinks=4, window=20)))
    assert torch.equal(dense, streamed)


@pytest.mark.parametrize("family", ["llama", "llama3", "mistral", "qwen3", "phi3", "gpt_neox"])
@pytest.mark.parametrize("sinks", [0, 4])
def test_after_eviction_each_token_sees_the_kept_tokens_at_cache_positions(family, sinks):
    # With one layer a token's key and value depend only on the token and its position, so the streamed logits
    # of token t must equal a dense forward over exactly the tokens the cache kept, renumbered 0..n-1.
    model = tiny_model(family, layers=1)
    window, length = 6, 40
    tokens = token_ids(1, length, seed=1)
    streamed = stream(model, tokens, sink_cache(model, StreamingConfig(sinks=sinks, window=window)))
    with torch.inference_mode():
        for t in range(length):
            context = kept_positions(t, sinks, window) + [t]
            expected = model(input_ids=tokens[:, context]).logits[0, -1]
            torch.testing.assert_close(streamed[0, t], expected, rtol=1e-5, atol=1e-5)


def test_cache_holds_sinks_plus_window_with_the_first_tokens_kept():
    model = tiny_model("llama", layers=1)
    config = StreamingConfig(sinks=3, window=5)
    cache = sink_cache(model, config)
    tokens = token_ids(1, 30, seed=2)
    stream(model, tokens, cache)
    assert cache.get_seq_length() == config.cache_size
    assert cache.evicted == 30 - config.cache_size - 1  # the last token's eviction is still pending
    # Layer 0's values do not depend on position: the kept ones are those of text positions 0,1,2 and 25..29.
    with torch.inference_mode():
        dense = DynamicCache(config=model.config)
        model(input_ids=tokens, past_key_values=dense, use_cache=True)
    layer = cache.layers[0]
    layer._evict_overflow()
    torch.testing.assert_close(layer.values, dense.layers[0].values[..., kept_positions(30, 3, 5), :])


def test_generate_streams_past_the_cache_and_matches_a_manual_loop():
    model = tiny_model("llama")
    model.generation_config.pad_token_id = 0
    prompt = token_ids(2, 5, seed=3)
    config = StreamingConfig(sinks=2, window=10)
    cache = sink_cache(model, config)
    generated = model.generate(
        prompt, attention_mask=torch.ones_like(prompt), past_key_values=cache, max_new_tokens=40, do_sample=False
    )
    assert generated.shape == (2, 45)
    assert cache.get_seq_length() == config.cache_size and cache.evicted > 0

    manual_cache, tokens = sink_cache(model, config), prompt
    with torch.inference_mode():
        logits = model(input_ids=prompt, past_key_values=manual_cache, use_cache=True).logits
        for _ in range(40):
            next_token = logits[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, next_token], dim=1)
            logits = model(input_ids=next_token, past_key_values=manual_cache, use_cache=True).logits
    assert torch.equal(generated, tokens)


def test_works_with_a_w8a8_quantized_model():
    model = tiny_model("llama")
    quantize_(model, W8A8Config(level="O1"))
    tokens = token_ids(1, 30, seed=4)
    dense = stream(model, tokens[:, :12], DynamicCache(config=model.config))
    streamed = stream(model, tokens, sink_cache(model, StreamingConfig(sinks=4, window=8)))
    assert torch.equal(dense, streamed[:, :12])
    assert torch.isfinite(streamed).all()


def test_a_million_tokens_stream_with_flat_memory():
    model = tiny_model("llama", layers=1)
    config = StreamingConfig(sinks=4, window=60)
    cache = sink_cache(model, config)
    chunk = token_ids(1, 250, seed=5)
    with torch.inference_mode():

        def run(chunks):
            for _ in range(chunks):
                model(input_ids=chunk, past_key_values=cache, use_cache=True)
                assert cache.get_seq_length() == config.cache_size

        with peak_memory() as warm:
            run(200)  # 50K tokens
        with peak_memory() as rest:
            run(3800)  # to 1M tokens
    assert cache.evicted + cache.layers[0].keys.shape[-2] == 1_000_000
    assert cache.layers[0].keys.shape[-2] == config.cache_size + 250
    assert rest.peak_bytes <= warm.peak_bytes + 16 * 2**20, (warm.peak_bytes, rest.peak_bytes)


@pytest.mark.parametrize("family", ["gpt2", "opt"])
def test_learned_positions_are_refused_with_a_reason(family):
    with pytest.raises(UnsupportedArchitectureError, match="absolute position"):
        sink_cache(tiny_model(family))


def test_sliding_window_models_are_refused():
    with pytest.raises(UnsupportedArchitectureError, match="sliding-window"):
        sink_cache(tiny_model("gemma3_text"))


def test_bad_sizes_and_padding_are_refused():
    model = tiny_model("llama")
    with pytest.raises(ConfigError, match="window"):
        StreamingConfig(window=0)
    with pytest.raises(ConfigError, match="trained context"):
        sink_cache(model, StreamingConfig(sinks=4, window=252))  # the tiny model is trained to 256
    cache = sink_cache(model, StreamingConfig(sinks=2, window=8))
    with pytest.raises(ConfigError, match="padding"):
        model(
            input_ids=torch.ones(2, 3, dtype=torch.long),
            attention_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]),
            past_key_values=cache,
        )
    stream(model, torch.ones(1, 3, dtype=torch.long), cache)
    with pytest.raises(ConfigError, match="cropped"):
        cache.crop(-1)
    with pytest.raises(ConfigError, match="sinks >= 0"):
        SinkCache(sinks=-1)
