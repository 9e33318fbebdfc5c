"""A GGUF becomes a Hugging Face directory one tensor at a time: the same tensors, config and tokenizer as
transformers' whole-model loader gives, in the memory of one tensor and one shard; a damaged file is named."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, LlamaConfig

from leanlm.errors import CorruptModelError, UnsupportedArchitectureError
from leanlm.export import export_gguf
from leanlm.models.gguf_conversion import INDEX_FILE, convert_gguf, tensor_processor
from leanlm.models.synthetic import write_random_model


def _tensors(directory) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as handle:
            tensors.update({name: handle.get_tensor(name) for name in handle.keys()})
    return tensors


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, smollm2_tokenizer):
    """(a tiny random Llama's directory, its F32 GGUF), written once for the module."""
    from tiny import save_tiny_llama

    directory = save_tiny_llama(tmp_path_factory.mktemp("tiny"), smollm2_tokenizer)
    return directory, Path(export_gguf(directory, directory.parent / "tiny.gguf", "f32")["path"])


def test_a_converted_gguf_is_the_model_it_was_written_from(tiny_gguf, tmp_path):
    tiny_llama_dir, gguf = tiny_gguf
    out = tmp_path / "converted"
    out.mkdir()
    convert_gguf(gguf, out, shard_bytes=1 << 16)  # many shards, an index
    converted, original = _tensors(out), _tensors(tiny_llama_dir)
    assert len(list(out.glob("*.safetensors"))) > 1 and (out / INDEX_FILE).is_file()
    assert set(converted) == set(original) - {"lm_head.weight"}  # tied: the embedding serves
    for name, tensor in original.items():
        if name in converted:
            assert torch.equal(converted[name], tensor), name
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"]
    assert (
        AutoConfig.from_pretrained(out).num_hidden_layers
        == AutoConfig.from_pretrained(tiny_llama_dir).num_hidden_layers
    )


def test_a_conversion_parses_the_files_metadata_once(tiny_gguf, tmp_path, monkeypatch):
    """Parsing a GGUF's fields (a vocabulary of 10^5 strings and its merges) costs more than de-quantizing a small
    model: transformers' one parse gives the config, the tokenizer's model type and the tensors, and the
    conversion is the same file for file (the test above)."""
    import gguf

    parses, build = [], gguf.GGUFReader._build_fields
    monkeypatch.setattr(
        gguf.GGUFReader, "_build_fields", lambda reader, *args: parses.append(reader) or build(reader, *args)
    )
    out = tmp_path / "converted"
    out.mkdir()
    convert_gguf(tiny_gguf[1], out)
    assert len(parses) == 1 and (out / "tokenizer.json").is_file()


def test_the_tensor_processor_is_the_files_architectures_not_the_model_types():
    """A Gemma-3 GGUF's model type is gemma3_text; its processor (norm weights stored as 1 + w) is
    gemma3's."""
    processor = tensor_processor("gemma3", {"config": {"model_type": "gemma3_text"}})
    assert type(processor).__name__ == "Gemma2TensorProcessor"  # transformers shares Gemma 2's


def test_a_truncated_gguf_is_named_before_any_tensor_is_read(tiny_gguf, tmp_path):
    gguf = tiny_gguf[1]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf.read_bytes()[: gguf.stat().st_size // 2])
    out = tmp_path / "converted"
    out.mkdir()
    with pytest.raises(CorruptModelError, match="cut.gguf"):
        convert_gguf(cut, out)
    assert not list(out.iterdir())


def _patched(gguf: Path, key: str, old: int, new: int, out: Path) -> Path:
    """`gguf` with the uint32 metadata value `key` changed from `old` to `new` (its bytes follow the key's name
    and its type)."""
    data = bytearray(gguf.read_bytes())
    at = data.index(key.encode()) + len(key) + 4
    assert int.from_bytes(data[at : at + 4], "little") == old
    data[at : at + 4] = new.to_bytes(4, "little")
    out.write_bytes(bytes(data))
    return out


def _refused(gguf: Path, tmp_path: Path, error, message: str) -> None:
    out = tmp_path / "converted"
    out.mkdir(exist_ok=True)
    with pytest.raises(error, match=message) as raised:
        convert_gguf(gguf, out)
    assert "\n" not in str(raised.value) and not list(out.iterdir())


def test_tensors_that_disagree_with_the_metadata_are_named_before_any_is_read(tiny_gguf, tmp_path):
    gguf = tiny_gguf[1]
    narrower = _patched(gguf, "llama.feed_forward_length", 128, 96, tmp_path / "narrower.gguf")
    _refused(narrower, tmp_path, CorruptModelError, r"blk.0.ffn_\w+.weight is \d+ x \d+, but the file's metadata makes")


@pytest.fixture(scope="module")
def tiny_metadata(tiny_gguf):
    """The tiny GGUF's parsed metadata, read once (parsing a vocabulary's metadata takes seconds)."""
    from leanlm.models import gguf_conversion

    config, parsed, _, architecture = gguf_conversion._read_metadata(tiny_gguf[1])
    return config, parsed, architecture


@pytest.mark.parametrize(
    "layers, message",
    [(1, "metadata says 1 layers, but it holds more"), (3, r"lacks 9 of the model's tensors \(model.layers.2")],
)
def test_a_layer_count_that_disagrees_with_the_blocks_is_named(tiny_gguf, tiny_metadata, layers, message):
    """The check on the file's tensors against the model a metadata of `layers` blocks describes."""
    import copy

    from gguf import GGUFReader

    from leanlm.models import gguf_conversion

    config, parsed, architecture = copy.deepcopy(tiny_metadata[0]), tiny_metadata[1], tiny_metadata[2]
    config.num_hidden_layers = layers
    name_map, _, needed = gguf_conversion._name_map(config, parsed, architecture)
    with pytest.raises(CorruptModelError, match=message):
        gguf_conversion._check_tensors(tiny_gguf[1], GGUFReader(tiny_gguf[1]), config, name_map, needed)


def test_a_gguf_of_an_architecture_transformers_cannot_build_is_one_line(tmp_path):
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(tmp_path / "rwkv.gguf"), "rwkv6")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _refused(tmp_path / "rwkv.gguf", tmp_path, UnsupportedArchitectureError, "architecture rwkv6 is not supported")


def test_a_conversion_killed_half_way_leaves_no_cache_entry_that_loads(tiny_gguf, tmp_path, monkeypatch):
    from leanlm.models import gguf_conversion, load_model

    monkeypatch.setenv("LEANLM_CACHE", str(tmp_path / "cache"))
    gguf = tiny_gguf[1]
    written = []

    def killed_after_one_shard(tensors, path, metadata=None):
        save_file(tensors, path, metadata=metadata)
        written.append(path)
        raise KeyboardInterrupt  # after the shard, before the index, config and tokenizer

    monkeypatch.setattr(gguf_conversion, "save_file", killed_after_one_shard)
    with pytest.raises(KeyboardInterrupt):
        load_model(gguf)
    assert len(written) == 1
    assert not list((tmp_path / "cache").rglob("*.safetensors"))  # the staged shard went with the kill
    monkeypatch.setattr(gguf_conversion, "save_file", save_file)
    loaded = load_model(gguf)  # the next run converts from the start
    assert loaded.model.config.num_hidden_layers == 2


def test_processes_loading_one_gguf_at_once_convert_it_once(tiny_gguf, tmp_path):
    """Two processes ask for the same uncached GGUF at the same moment (after their imports): one converts, the
    other waits for its cache entry, and both load it."""
    probe = textwrap.dedent(
        f"""
        import os, time
        from pathlib import Path
        from leanlm.models.loading import _cached_float_checkpoint
        ready = Path({str(tmp_path / "ready")!r})
        (ready / str(os.getpid())).touch()
        while len(list(ready.iterdir())) < 2:
            time.sleep(0.01)
        print(_cached_float_checkpoint(Path({str(tiny_gguf[1])!r}), None))
        """
    )
    environment = {**os.environ, "LEANLM_CACHE": str(tmp_path / "cache")}
    (tmp_path / "ready").mkdir()
    processes = [
        subprocess.Popen([sys.executable, "-c", probe], env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(2)
    ]
    outputs = [process.communicate(timeout=120) for process in processes]
    assert [process.returncode for process in processes] == [0, 0], [err[-2000:] for _, err in outputs]
    assert len({out.decode().split()[-1] for out, _ in outputs}) == 1
    assert sum(b"converting" in err for _, err in outputs) == 1


# The synthetic model: 12 layers of hidden 1024 / MLP 2816, a vocabulary of 49,152: about 190M values, 0.37 GB
# as an F16 GGUF; its largest tensor, the embedding, is 192 MiB in float32.
SHARD_BYTES = 128 << 20
LARGEST_BYTES = 49152 * 1024 * 4


@pytest.mark.slow
def test_converting_a_large_gguf_holds_one_tensor_and_one_shard(smollm2_tokenizer, tmp_path):
    config = LlamaConfig(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=12,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=len(smollm2_tokenizer),
        tie_word_embeddings=True,
    )
    source = write_random_model(config, tmp_path / "source", tokenizer=smollm2_tokenizer)
    gguf = Path(export_gguf(source, tmp_path / "large.gguf", "f16")["path"])
    assert gguf.stat().st_size > 350e6
    probe = textwrap.dedent(
        f"""
        from pathlib import Path
        from leanlm.bench.harness import process_memory_bytes
        from leanlm.models.gguf_conversion import convert_gguf
        import leanlm.models.loading  # every import the conversion makes, before the baseline
        before = process_memory_bytes("self", "VmRSS")
        out = Path({str(tmp_path / "out")!r}); out.mkdir()
        convert_gguf(Path({str(gguf)!r}), out, shard_bytes={SHARD_BYTES})
        print(before, process_memory_bytes("self"))
        """
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    before, peak = map(int, done.stdout.split()[-2:])
    # One shard or one tensor (a shard is written before the next tensor is de-quantized), the de-quantizer's
    # chunks and the metadata (its parse, the tokenizer): far below the model's 0.75 GB in float32.
    assert peak - before < max(SHARD_BYTES, LARGEST_BYTES) + (300 << 20), (peak - before) / 2**20
