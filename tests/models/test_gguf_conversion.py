"""A GGUF becomes a Hugging Face directory one tensor at a time: the same tensors, config and tokenizer as
transformers' whole-model loader gives, in the memory of one tensor and one shard; a damaged file is named."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, LlamaConfig

from leanlm.errors import CorruptModelError
from leanlm.export import export_gguf
from leanlm.models.gguf_conversion import INDEX_FILE, convert_gguf
from leanlm.models.synthetic import write_random_model


def _tensors(directory) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as handle:
            tensors.update({name: handle.get_tensor(name) for name in handle.keys()})
    return tensors


def test_a_converted_gguf_is_the_model_it_was_written_from(tiny_llama_dir, tmp_path):
    gguf = export_gguf(tiny_llama_dir, tmp_path / "tiny.gguf", "f32")["path"]
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


def test_a_truncated_gguf_is_named_before_any_tensor_is_read(tiny_llama_dir, tmp_path):
    gguf = Path(export_gguf(tiny_llama_dir, tmp_path / "tiny.gguf", "f32")["path"])
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf.read_bytes()[: gguf.stat().st_size // 2])
    out = tmp_path / "converted"
    out.mkdir()
    with pytest.raises(CorruptModelError, match="cut.gguf"):
        convert_gguf(cut, out)
    assert not list(out.iterdir())


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
