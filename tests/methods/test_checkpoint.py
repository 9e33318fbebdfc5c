import json

import pytest
import torch

from leanlm.errors import CorruptModelError
from leanlm.methods import (
    QUANT_FILE,
    SmoothQuantConfig,
    W8A8Config,
    calibrate,
    load_any,
    load_quantized,
    quantize_w8a8_,
    save_quantized,
)
from leanlm.models import load_model


@pytest.fixture
def quantized_dir(tiny_llama_dir, tmp_path):
    loaded = load_model(tiny_llama_dir)
    stats = calibrate(loaded.model, torch.randint(0, 1000, (2, 16)))
    record = quantize_w8a8_(loaded.model, W8A8Config(level="O3", smoothquant=SmoothQuantConfig(0.5)), stats)
    out = save_quantized(loaded, loaded.model, record, tmp_path / "q")
    return out, loaded.model


def test_round_trip_gives_identical_outputs(quantized_dir):
    out, model = quantized_dir
    loaded, record = load_quantized(out)
    ids = torch.randint(0, 1000, (1, 12))
    with torch.inference_mode():
        assert torch.equal(loaded.model(ids).logits, model(ids).logits)
    assert record["method"] == "smoothquant" and record["smoothquant"]["alpha"] == 0.5
    assert load_any(out).model.config._attn_implementation == model.config._attn_implementation


def test_checkpoint_is_safetensors_and_json_only(quantized_dir):
    out, _ = quantized_dir
    suffixes = {p.suffix for p in out.iterdir()}
    assert suffixes <= {".safetensors", ".json", ".jinja"}


def test_damaged_record_is_named(quantized_dir):
    out, _ = quantized_dir
    record = json.loads((out / QUANT_FILE).read_text())
    first = next(iter(record["modules"]))
    record["modules"][first]["class"] = "Int3Linear"
    (out / QUANT_FILE).write_text(json.dumps(record))
    with pytest.raises(CorruptModelError, match="unknown module class 'Int3Linear'"):
        load_quantized(out)
