"""GGUF export: the default model written as F32 holds exactly the tensors (names, shapes, values) of the GGUF it
came from, de-quantized, with its metadata; Q8_0 is llama.cpp's own rounding of those values."""

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize, quantize

from leanlm.cli.main import main
from leanlm.export import export_gguf
from leanlm.export.to_gguf import source_gguf


@pytest.mark.slow
def test_the_default_model_exports_to_its_own_gguf_layout_bit_for_bit(tmp_path):
    source = gguf.GGUFReader(source_gguf("smollm2-135m"))
    result = export_gguf("smollm2-135m", tmp_path / "f32.gguf", "f32")
    exported = gguf.GGUFReader(result["path"])
    assert result["tensors"] == len(source.tensors) == 272
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.chat_template", "llama.rope.freq_base"):
        assert exported.fields[key].contents() == source.fields[key].contents()
    by_name = {tensor.name: tensor for tensor in exported.tensors}
    for tensor in source.tensors:  # q and k back in llama.cpp's rotary order, every value as the source stored it
        ours = by_name[tensor.name]
        assert ours.shape.tolist() == tensor.shape.tolist()
        assert np.array_equal(dequantize(ours.data, ours.tensor_type), dequantize(tensor.data, tensor.tensor_type))

    q8 = gguf.GGUFReader(export_gguf("smollm2-135m", tmp_path / "q8.gguf", "q8_0")["path"])
    floats = {tensor.name: dequantize(tensor.data, tensor.tensor_type) for tensor in exported.tensors}
    for tensor in q8.tensors:
        expected = floats[tensor.name] if tensor.tensor_type == gguf.GGMLQuantizationType.F32 else dequantize(
            quantize(floats[tensor.name], gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0)
        assert np.array_equal(dequantize(tensor.data, tensor.tensor_type), expected)
    assert q8.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q8_0


def test_export_refuses_a_model_without_its_gguf(tiny_llama_dir, tmp_path, capsys):
    assert main(["export", str(tiny_llama_dir), "--format", "gguf", "--out", str(tmp_path / "m.gguf")]) == 2
    assert "needs the GGUF the model came from" in capsys.readouterr().err
    assert not (tmp_path / "m.gguf").exists()
