import pytest
import torch
from tiny import tiny_model

from leanlm.cache.prefix import (
    CUSHION_FILE,
    Cushion,
    attach_cushion,
    attached_cushion,
    cushion_keys_values,
    detach_cushion,
)
from leanlm.errors import ConfigError, UnsupportedArchitectureError
from leanlm.methods import (
    Calibration,
    SmoothQuantConfig,
    W8A8Config,
    collect_input_absmax,
    load_quantized,
    quantize_,
    save_quantized,
    smooth_,
)
from leanlm.methods.cushion import (
    CushionConfig,
    cushioned_copy,
    quantization_error_probe,
    search_cushion,
    tune_cushion,
)
from leanlm.models import load_model
from leanlm.nn import W8A8Linear

SMALL_SEARCH = CushionConfig(
    candidates=12, max_length=2, min_improvement=0.0, sample_tokens=16, search_samples=1, batch_size=6
)


def _cushion(model, tokens):
    return Cushion(tokens, *cushion_keys_values(model, tokens))


def test_an_attached_cushion_equals_running_its_tokens_first():
    model = tiny_model("llama")
    prefix, text = [5, 17, 3], torch.randint(0, 128, (2, 10))
    with torch.inference_mode():
        dense = model(input_ids=torch.cat([torch.tensor(prefix).expand(2, -1), text], dim=1)).logits[:, 3:]
        attach_cushion(model, _cushion(model, prefix))
        cushioned = model(input_ids=text).logits
        detach_cushion(model)
        plain = model(input_ids=text).logits
    torch.testing.assert_close(cushioned, dense, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(plain, dense, atol=1e-3)


def test_generation_continues_after_the_cushion():
    model = tiny_model("llama")
    prefix, prompt = [9, 2], torch.randint(0, 128, (1, 5))
    attach_cushion(model, _cushion(model, prefix))
    generated = model.generate(prompt, max_new_tokens=6, do_sample=False)
    detach_cushion(model)
    ids = torch.cat([torch.tensor([prefix]), prompt], dim=1)
    with torch.inference_mode():
        for _ in range(6):
            ids = torch.cat([ids, model(input_ids=ids).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(generated, ids[:, len(prefix) :])


def test_smoothing_v_proj_divides_an_attached_cushions_values_alike():
    model = tiny_model("llama")
    cushion = _cushion(model, [5, 17])
    original_values = cushion.values[0].clone()
    attach_cushion(model, cushion)
    ids = torch.randint(0, 128, (2, 12))
    with torch.inference_mode():
        expected = model(input_ids=ids).logits
    smooth_(model, collect_input_absmax(model, torch.randint(0, 128, (3, 24))), SmoothQuantConfig(0.5))
    followed_values = attached_cushion(model).values[0]
    with torch.inference_mode():
        followed = model(input_ids=ids).logits
        attach_cushion(model, cushion)  # the values as they were before smoothing
        stale = model(input_ids=ids).logits
    assert not torch.allclose(stale, expected, atol=1e-3)  # the cushion's old values no longer fit o_proj
    torch.testing.assert_close(followed, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(cushion.values[0], original_values)  # a new cushion is attached; the given one is shared
    assert not torch.equal(followed_values, original_values)


def test_a_cushioned_copy_leaves_the_float_model_alone(smollm2_tokenizer):
    model = tiny_model("llama", vocab_size=len(smollm2_tokenizer))
    cushion = _cushion(model, [5, 17])
    float_copy, record = cushioned_copy(model, cushion)
    assert attached_cushion(float_copy) is cushion and record == {} and attached_cushion(model) is None
    calibration = Calibration(smollm2_tokenizer, samples=2, seq_len=16)
    quantized, record = cushioned_copy(model, cushion, [W8A8Config(level="O3")], calibration)
    assert record["method"] == "w8a8" and attached_cushion(quantized) is cushion
    plain, record = cushioned_copy(model, None, [W8A8Config(level="O3")], calibration)
    assert attached_cushion(plain) is None and "cushion" not in record
    assert not any(isinstance(m, W8A8Linear) for m in model.modules())  # the original stays float
    assert any(isinstance(m, W8A8Linear) for m in quantized.modules())


def test_the_error_probe_ignores_the_skipped_positions():
    model = tiny_model("llama")
    ids = torch.randint(0, 128, (1, 12))
    with quantization_error_probe(model, skip=0) as with_first, torch.inference_mode():
        model(input_ids=ids)
    with quantization_error_probe(model, skip=1) as without_first, torch.inference_mode():
        model(input_ids=ids)
    assert len(with_first) == 2 * 7 and with_first[0].shape == (1,)
    assert not torch.allclose(torch.stack(with_first), torch.stack(without_first))


def test_search_and_tuning_record_what_they_did(smollm2_tokenizer):
    model = tiny_model("llama", vocab_size=len(smollm2_tokenizer))
    cushion = search_cushion(model, smollm2_tokenizer, SMALL_SEARCH, progress=False)
    assert 1 <= cushion.length <= 2 and cushion.record["search_seconds"] > 0
    history = cushion.record["history"]
    assert history[0]["error_after"] <= history[0]["error_before"]
    assert len(cushion.keys) == 2 and cushion.keys[0].shape == (1, 2, cushion.length, 16)
    tuned = tune_cushion(
        model,
        smollm2_tokenizer,
        cushion,
        CushionConfig(tune_steps=2, tune_batch_size=2, tune_seq_len=16),
        progress=False,
    )
    assert len(tuned.record["tuning"]["curve"]) == 2
    assert not torch.equal(tuned.keys[0], cushion.keys[0]) and tuned.tokens == cushion.tokens
    assert all(p.requires_grad for p in model.parameters())  # the model is unfrozen again


def test_a_negative_threshold_forces_the_search_to_its_maximum_length(smollm2_tokenizer):
    model = tiny_model("llama", vocab_size=len(smollm2_tokenizer))
    forced = CushionConfig(
        candidates=6, max_length=3, min_improvement=float("-inf"), sample_tokens=8, search_samples=1, batch_size=6
    )
    cushion = search_cushion(model, smollm2_tokenizer, forced, progress=False)
    assert cushion.length == 3 and len(cushion.record["history"]) == 3
    with pytest.raises(ConfigError, match="min improvement must be below 1"):
        CushionConfig(min_improvement=1.0)


def test_w8a8_with_a_cushion_round_trips_through_a_checkpoint(tiny_llama_dir, tmp_path):
    loaded = load_model(tiny_llama_dir)
    record = quantize_(
        loaded.model,
        [SMALL_SEARCH, W8A8Config(level="O3")],
        calibration=Calibration(loaded.tokenizer, samples=2, seq_len=32),
    )
    cushion = attached_cushion(loaded.model)
    assert record["method"] == "cushion+w8a8" and record["cushion"]["length"] == cushion.length >= 1
    out = save_quantized(loaded, loaded.model, record, tmp_path / "q")
    assert (out / CUSHION_FILE).is_file()
    reloaded, saved = load_quantized(out)
    ids = torch.randint(0, 1000, (1, 12))
    with torch.inference_mode():
        assert torch.equal(reloaded.model(input_ids=ids).logits, loaded.model(input_ids=ids).logits)
    assert saved["cushion"]["tokens"] == cushion.tokens
    in_bf16, _ = load_quantized(out, dtype=torch.bfloat16)  # the stored cushion is float32
    with torch.inference_mode():
        logits = in_bf16.model(input_ids=ids).logits.float()
        generated = in_bf16.model.generate(ids, max_new_tokens=4, do_sample=False)
    torch.testing.assert_close(logits, loaded.model(input_ids=ids).logits, rtol=0.05, atol=0.05)
    assert generated.shape == (1, 16)


def test_sliding_window_models_are_refused():
    with pytest.raises(UnsupportedArchitectureError, match="sliding-window"):
        attach_cushion(tiny_model("gemma3_text"), Cushion([], [], []))
