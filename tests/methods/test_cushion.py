import pytest
import torch

from leanlm.errors import UnsupportedArchitectureError
from leanlm.methods import W8A8Config, load_quantized, save_quantized
from leanlm.methods.cushion import (
    CUSHION_FILE,
    Cushion,
    CushionConfig,
    _prefix_keys_values,
    attach_cushion,
    detach_cushion,
    quantization_error_probe,
    quantize_with_cushion_,
    search_cushion,
    tune_cushion,
)
from leanlm.methods.w8a8 import CalibrationSettings
from leanlm.models import load_model
from tiny import tiny_model

SMALL_SEARCH = CushionConfig(candidates=12, max_length=2, min_improvement=0.0, sample_tokens=16, search_samples=1,
                             batch_size=6)


def _cushion(model, tokens):
    return Cushion(tokens, *_prefix_keys_values(model, tokens))


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
    assert torch.equal(generated, ids[:, len(prefix):])


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
    tuned = tune_cushion(model, smollm2_tokenizer, cushion, CushionConfig(tune_steps=2, tune_batch_size=2,
                                                                          tune_seq_len=16), progress=False)
    assert len(tuned.record["tuning"]["curve"]) == 2
    assert not torch.equal(tuned.keys[0], cushion.keys[0]) and tuned.tokens == cushion.tokens
    assert all(p.requires_grad for p in model.parameters())  # the model is unfrozen again


def test_w8a8_with_a_cushion_round_trips_through_a_checkpoint(tiny_llama_dir, tmp_path):
    loaded = load_model(tiny_llama_dir)
    record, cushion = quantize_with_cushion_(loaded.model, loaded.tokenizer, W8A8Config(level="O3"), SMALL_SEARCH,
                                             CalibrationSettings(n_samples=2, seq_len=32), progress=False)
    assert record["cushion"]["length"] == cushion.length >= 1
    out = save_quantized(loaded, loaded.model, record, tmp_path / "q")
    assert (out / CUSHION_FILE).is_file()
    reloaded, saved = load_quantized(out)
    ids = torch.randint(0, 1000, (1, 12))
    with torch.inference_mode():
        assert torch.equal(reloaded.model(input_ids=ids).logits, loaded.model(input_ids=ids).logits)
    assert saved["cushion"]["tokens"] == cushion.tokens


def test_sliding_window_models_are_refused():
    with pytest.raises(UnsupportedArchitectureError, match="sliding-window"):
        attach_cushion(tiny_model("gemma3_text"), Cushion([], [], []))
