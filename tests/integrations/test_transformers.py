"""transformers' `from_pretrained` loads leanlm checkpoints of every weight method with the logits leanlm's own
loader gives; `generate` runs; `save_pretrained` writes a directory that loads back the same in both; a checkpoint
written before config.json carried the record (the committed fixture) still loads in leanlm; a record of another
format version or method is one line in both."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from tiny import byte_tokenizer, save_tiny_llama
from transformers import AutoModelForCausalLM

import leanlm.methods as m
from leanlm.errors import LeanLMError
from leanlm.methods import load_any

FIXTURE = Path(__file__).parent / "fixtures" / "kbit-before-quantization-config"
METHODS = {
    "nf4-dq": m.KbitConfig(),
    "rtn": m.RTNConfig(),
    "gptq": m.GPTQConfig(),
    "spqr": m.SpQRConfig(),
    "llm-int8": m.LLMInt8Config(),
    "w8a8-O2": m.W8A8Config("O2"),
    "smoothquant-O3": [m.SmoothQuantConfig(), m.W8A8Config("O3")],
}
IDS = torch.tensor([[5, 60, 7, 100, 9, 33, 2, 250]])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tokenizer = byte_tokenizer()
    return save_tiny_llama(tmp_path_factory.mktemp("tiny"), tokenizer), tokenizer


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


@pytest.mark.parametrize("method", METHODS)
def test_from_pretrained_loads_every_method_as_leanlm_does(tiny, tmp_path, method):
    directory, tokenizer = tiny
    loaded = load_any(directory)
    calibration = m.Calibration(tokenizer=tokenizer, samples=4, seq_len=32)
    record = m.quantize_(loaded.model, METHODS[method], calibration=calibration)
    checkpoint = m.save_quantized(loaded, loaded.model, record, tmp_path / "q")
    ours = load_any(checkpoint).model
    theirs = AutoModelForCausalLM.from_pretrained(checkpoint)
    assert type(theirs.model.layers[0].mlp.down_proj) is type(ours.model.layers[0].mlp.down_proj)
    torch.testing.assert_close(_logits(theirs), _logits(ours), rtol=0, atol=0)
    assert theirs.generate(IDS, max_new_tokens=3, do_sample=False).shape == (1, IDS.shape[1] + 3)
    theirs.save_pretrained(tmp_path / "saved")
    tokenizer.save_pretrained(tmp_path / "saved")
    torch.testing.assert_close(_logits(AutoModelForCausalLM.from_pretrained(tmp_path / "saved")), _logits(ours))
    torch.testing.assert_close(_logits(load_any(tmp_path / "saved").model), _logits(ours))


def test_a_checkpoint_from_before_still_loads_in_leanlm():
    config = json.loads((FIXTURE / "config.json").read_text())
    assert "quantization_config" not in config
    model = load_any(FIXTURE).model
    assert torch.isfinite(_logits(model)).all()


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda q: q.update(format_version=99), "format 99"),
        (lambda q: q["record"].update(method="awq"), "'awq' is not a leanlm method"),
    ],
)
def test_a_record_leanlm_cannot_read_is_one_line_in_both(tmp_path, change, message):
    checkpoint = Path(shutil.copytree(FIXTURE, tmp_path / "q"))
    config = json.loads((checkpoint / "config.json").read_text())
    from leanlm.storage import transformers_quantization_config as quantization_config

    config["quantization_config"] = quantization_config(json.loads((checkpoint / "leanlm_quant.json").read_text()))
    change(config["quantization_config"])
    (checkpoint / "config.json").write_text(json.dumps(config))
    if "method" in message:
        (checkpoint / "leanlm_quant.json").write_text(json.dumps(config["quantization_config"]["record"]))
    with pytest.raises(Exception, match=message) as raised:
        AutoModelForCausalLM.from_pretrained(checkpoint)
    assert "\n" not in str(raised.value).strip()
    with pytest.raises(LeanLMError, match=message):
        load_any(checkpoint)


def test_tensors_that_disagree_with_the_record_are_one_line_in_both(tiny, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    directory, tokenizer = tiny
    loaded = load_any(directory)
    checkpoint = m.save_quantized(loaded, loaded.model, m.quantize_(loaded.model, m.KbitConfig()), tmp_path / "q")
    (weights,) = checkpoint.glob("*.safetensors")
    with safe_open(str(weights), "pt") as handle:
        metadata = handle.metadata()
    tensors = load_file(weights)
    tensors["model.layers.0.mlp.down_proj.packed"] = tensors["model.layers.0.mlp.down_proj.packed"][:-5]
    save_file(tensors, weights, metadata=metadata)
    message = r"model.layers.0.mlp.down_proj.packed: U8 \[\d+\], expected U8"
    with pytest.raises(LeanLMError, match=message) as raised:
        AutoModelForCausalLM.from_pretrained(checkpoint)
    assert "\n" not in str(raised.value).strip()
    with pytest.raises(LeanLMError, match=message):
        load_any(checkpoint)


def test_import_leanlm_registers_with_transformers_whichever_comes_first():
    import subprocess
    import sys

    for program in (
        "import sys, leanlm; assert 'torch' not in sys.modules and 'transformers' not in sys.modules; import transformers",
        "import transformers, leanlm",
    ):
        check = "; from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING as M; assert 'leanlm' in M"
        subprocess.run([sys.executable, "-c", program + check], check=True, timeout=120)
