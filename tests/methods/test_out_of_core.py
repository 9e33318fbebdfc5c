"""Out of core: quantizing block by block from safetensors shards gives the checkpoint the in-memory pipeline
gives, tensor for tensor, for every weight method and every family; a killed run resumes; a half-written run
is never a checkpoint."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny import FAMILIES, tiny_model, tiny_tokenizer, token_ids

from leanlm.errors import ConfigError, NeedsWholeModelError
from leanlm.methods import (
    Calibration,
    GPTQConfig,
    KbitConfig,
    LLMInt8Config,
    RTNConfig,
    SmoothQuantConfig,
    SpQRConfig,
    W8A8Config,
    load_quantized,
    quantize_,
    save_quantized,
)
from leanlm.methods.checkpoint import float_tables, weights_files
from leanlm.methods.out_of_core import load_quantizing, quantize_out_of_core
from leanlm.models import load_model

METHODS = {
    "nf4-dq": KbitConfig(double_quant=True),
    "int3-row": KbitConfig(dtype="int", bits=3, block_size=None),
    "rtn": RTNConfig(),
    "gptq": GPTQConfig(group_size=32),
    "spqr": SpQRConfig(),
    "w8a8-O2": W8A8Config(level="O2"),
    "w8a8-O3": W8A8Config(level="O3"),
    "llm-int8": LLMInt8Config(),
    "smoothquant-O3": [SmoothQuantConfig(0.5), W8A8Config(level="O3")],
    "smoothquant+gptq": [SmoothQuantConfig(0.5), GPTQConfig(group_size=32)],
}


def _calibration():
    ids = token_ids(3, 24)
    return Calibration(token_ids=ids)


def _bf16_shards(directory: Path, family: str, tokenizer=None, layers: int = 3) -> Path:
    """A tiny model as a Hugging Face directory of bf16 safetensors shards (several files and an index)."""
    model = tiny_model(family, layers=layers).to(torch.bfloat16)
    model.save_pretrained(directory, max_shard_size="40KB")
    (tokenizer or tiny_tokenizer()).save_pretrained(directory)
    return directory


def _in_memory(directory: Path, config, out: Path) -> Path:
    loaded = load_model(directory)
    record = quantize_(loaded.model, config, calibration=_calibration())
    return save_quantized(loaded, loaded.model, record, out)


def _tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in weights_files(checkpoint):
        tensors.update(load_file(str(path)))
    return tensors


def _same_checkpoint(streamed: Path, in_memory: Path) -> None:
    left, right = _tensors(streamed), _tensors(in_memory)
    # A tied embedding and output head are one tensor, which each writer may store under either name.
    only_left, only_right = sorted(set(left) - set(right)), sorted(set(right) - set(left))
    assert len(only_left) == len(only_right) <= 1
    if only_left:
        right[only_left[0]] = right.pop(only_right[0])
    for name in left:
        assert left[name].dtype == right[name].dtype and torch.equal(left[name], right[name]), name
    records = [json.loads((path / "leanlm_quant.json").read_text()) for path in (streamed, in_memory)]
    assert records[0]["modules"] == records[1]["modules"]
    assert records[0]["method"] == records[1]["method"]
    assert records[0].get("avg_bits") == pytest.approx(records[1].get("avg_bits"))


@pytest.mark.parametrize("method", list(METHODS))
def test_streamed_and_in_memory_checkpoints_are_identical_for_every_method(method, tmp_path):
    source = _bf16_shards(tmp_path / "source", "llama")
    assert len(list(source.glob("*.safetensors"))) > 2
    streamed, record = quantize_out_of_core(source, METHODS[method], tmp_path / "streamed", calibration=_calibration())
    assert record["pipeline"].startswith("out of core")
    _same_checkpoint(streamed, _in_memory(source, METHODS[method], tmp_path / "in_memory"))
    assert not list(tmp_path.glob(".*partial*"))  # nothing left beside the checkpoint
    ids = torch.randint(0, 128, (1, 12))
    with torch.inference_mode():
        logits = [load_quantized(path)[0].model(ids).logits for path in (streamed, tmp_path / "in_memory")]
    assert torch.equal(*logits)


@pytest.mark.parametrize("family", ["llama", "mistral", "gpt_neox"])  # tied; untied; a head stored under another name
def test_a_checkpoint_stores_its_embedding_and_head_in_bfloat16_on_request(family, tmp_path):
    """`table_dtype="bfloat16"` (`--table-dtype bfloat16`) stores the float tables rounded to bfloat16, both
    pipelines alike, and nothing else changes: the reloaded model computes as the float32-table checkpoint with
    its tables rounded."""
    source = tmp_path / "source"  # float32 weights: the rounding is not a no-op
    tiny_model(family).save_pretrained(source)
    tiny_tokenizer().save_pretrained(source)
    config = KbitConfig(double_quant=True)
    streamed, _ = quantize_out_of_core(source, config, tmp_path / "streamed", table_dtype="bfloat16")
    loaded = load_model(source)
    record = quantize_(loaded.model, config)
    halved = save_quantized(loaded, loaded.model, record, tmp_path / "bf16", "bfloat16")
    full = save_quantized(loaded, loaded.model, record, tmp_path / "f32")
    _same_checkpoint(streamed, halved)
    tables = float_tables(loaded.model)
    assert all(module.weight.dtype == torch.float32 for module in tables.values())  # the model keeps its own
    left, right = _tensors(halved), _tensors(full)
    assert {name for name, tensor in left.items() if tensor.dtype == torch.bfloat16} == set(tables) & set(left)
    assert all(torch.equal(left[name], right[name].to(left[name].dtype)) for name in left)
    assert json.loads((halved / "leanlm_quant.json").read_text())["table_dtype"] == "bfloat16"
    expected = load_quantized(full)[0].model
    with torch.no_grad():
        for module in float_tables(expected).values():
            module.weight.copy_(module.weight.to(torch.bfloat16))
    ids = token_ids(1, 12)
    with torch.inference_mode():
        assert torch.equal(load_quantized(halved)[0].model(ids).logits, expected(ids).logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_quantization_matches_in_memory_on_every_family(family, tmp_path):
    source = _bf16_shards(tmp_path / "source", family)
    config = [SmoothQuantConfig(0.5), W8A8Config(level="O3")] if family != "gpt2" else GPTQConfig(group_size=32)
    streamed, _ = quantize_out_of_core(source, config, tmp_path / "streamed", calibration=_calibration())
    _same_checkpoint(streamed, _in_memory(source, config, tmp_path / "in_memory"))


def test_methods_that_need_the_whole_model_say_so_before_reading_a_block(tmp_path, monkeypatch):
    from leanlm.methods.out_of_core import SafetensorsShards

    source = _bf16_shards(tmp_path / "source", "llama")
    read = []
    original = SafetensorsShards.get
    monkeypatch.setattr(SafetensorsShards, "get", lambda self, name: read.append(name) or original(self, name))
    for config in (KbitConfig(proxy_fraction=0.02), [SmoothQuantConfig("auto"), W8A8Config(level="O3")]):
        with pytest.raises(NeedsWholeModelError):
            quantize_out_of_core(source, config, tmp_path / "out", calibration=_calibration())
        assert not [name for name in read if ".layers." in name]
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


_KILLED_RUN = textwrap.dedent("""
    import os, signal, sys, torch
    from leanlm.methods import Calibration, GPTQConfig
    from leanlm.methods.out_of_core import StreamedBlocks, quantize_out_of_core
    release = StreamedBlocks.release
    def release_then_die(self, index, *args):
        release(self, index, *args)
        if index == int(sys.argv[3]):
            os.kill(os.getpid(), signal.SIGKILL)
    StreamedBlocks.release = release_then_die
    ids = torch.randint(0, 128, (3, 24), generator=torch.Generator().manual_seed(0))
    quantize_out_of_core(sys.argv[1], GPTQConfig(group_size=32), sys.argv[2], calibration=Calibration(token_ids=ids))
""")


def test_a_killed_run_is_never_a_checkpoint_and_resumes_to_the_same_one(tmp_path):
    source = _bf16_shards(tmp_path / "source", "llama", layers=4)
    out = tmp_path / "out"
    killed = subprocess.run(
        [sys.executable, "-c", _KILLED_RUN, str(source), str(out), "1"], capture_output=True, text=True
    )
    assert killed.returncode == -signal.SIGKILL
    assert not out.exists()
    staging = tmp_path / ".out.partial-resumable"
    assert sorted(path.name for path in staging.glob("block-*")) == [
        "block-00000.safetensors",
        "block-00001.safetensors",
    ]
    with pytest.raises(ConfigError, match=r"2 of 4 blocks written\): add --resume"):
        quantize_out_of_core(source, GPTQConfig(group_size=32), out, calibration=_calibration())
    with pytest.raises(ConfigError, match="other settings"):
        quantize_out_of_core(source, GPTQConfig(group_size=64), out, calibration=_calibration(), resume=True)
    resumed, _ = quantize_out_of_core(source, GPTQConfig(group_size=32), out, calibration=_calibration(), resume=True)
    assert not staging.exists()
    _same_checkpoint(resumed, _in_memory(source, GPTQConfig(group_size=32), tmp_path / "in_memory"))


@pytest.mark.slow
def test_a_model_of_hundreds_of_millions_of_parameters_quantizes_in_less_than_half_its_float_size(tmp_path):
    """The CLI's out-of-core quantization of a 550M-parameter model (2.2 GB in float32) from bf16 shards, in a
    subprocess: its peak resident memory, imports (about 390 MiB) included, stays below half of the float32
    size."""
    import transformers as hf

    from leanlm.models.synthetic import write_random_model

    config = hf.LlamaConfig(
        vocab_size=1024,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=12,
        num_attention_heads=16,
        num_key_value_heads=4,
        tie_word_embeddings=True,
    )
    # 1.0 GiB of bf16 shards and 0.3 GiB of NF4 checkpoint: on a shared disk that has not room for them (one CI
    # run found 0.4 GiB free) the test cannot say anything about memory, so it says why it did not run.
    free = shutil.disk_usage(tmp_path).free
    if free < 1.5 * 2**30:
        pytest.skip(f"needs 1.5 GiB free on the temporary directory's disk, which has {free / 2**30:.1f} GiB")
    source = write_random_model(config, tmp_path / "source", tokenizer=tiny_tokenizer(), shard_bytes=200 << 20)
    parameters = sum(json.loads((source / "model.safetensors.index.json").read_text())["metadata"].values()) // 2
    assert 500e6 < parameters < 600e6
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "leanlm",
            "quantize",
            str(source),
            "--method",
            "kbit",
            "--double-quant",
            "--out",
            str(tmp_path / "nf4"),
            "--json",
            str(tmp_path / "q.json"),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "2"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    peak = json.loads((tmp_path / "q.json").read_text())["peak_rss_bytes"]
    assert peak < 0.5 * 4 * parameters, f"peak RSS {peak / 2**20:.0f} MiB"
    stored = sum(path.stat().st_size for path in weights_files(tmp_path / "nf4"))
    assert stored < 0.2 * 4 * parameters


@pytest.mark.slow
@pytest.mark.parametrize(
    "config",
    [KbitConfig(double_quant=True), [SmoothQuantConfig(0.5, calibration_samples=2), W8A8Config(level="O3")]],
    ids=["nf4-dq", "smoothquant-O3"],
)
def test_smollm2_streamed_from_disk_equals_in_memory(config, tmp_path, default_checkpoint_dir):
    calibration = Calibration(seq_len=128)
    streamed, _ = quantize_out_of_core("smollm2-135m", config, tmp_path / "streamed", calibration=calibration)
    loaded = load_model("smollm2-135m")
    record = quantize_(loaded.model, config, calibration=Calibration(loaded.tokenizer, seq_len=128))
    _same_checkpoint(streamed, save_quantized(loaded, loaded.model, record, tmp_path / "in_memory"))


@pytest.mark.parametrize(
    "config",
    [KbitConfig(double_quant=True), GPTQConfig(group_size=32), [SmoothQuantConfig(0.5), W8A8Config(level="O3")]],
    ids=["nf4-dq", "gptq", "sq-O3"],
)
def test_a_model_loaded_quantizing_block_by_block_is_the_in_memory_quantized_model(config, tmp_path):
    """QLoRA's base (and any quantized model) can be loaded with one float block at a time in memory: the same
    model, tensor for tensor and logit for logit, as loading the float model and quantizing it."""
    source = _bf16_shards(tmp_path / "source", "llama")
    streamed, record = load_quantizing(source, config, calibration=_calibration())
    loaded = load_model(source)
    quantize_(loaded.model, config, calibration=_calibration())
    left, right = streamed.model.state_dict(), loaded.model.state_dict()
    assert sorted(left) == sorted(right)
    assert all(torch.equal(left[name], right[name]) for name in left)
    ids = torch.randint(0, 128, (1, 12))
    with torch.inference_mode():
        assert torch.equal(streamed.model(ids).logits, loaded.model(ids).logits)
