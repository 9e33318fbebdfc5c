"""A quantized module type declared in one place: a new subclass of QuantizedModule is saved and loaded by the
checkpoint code, refused by name by both exporters and the fused decode step, with no edit anywhere else; and
the kernels' enums come from the extension."""

from __future__ import annotations

import typing

import pytest
import torch
from tiny import tiny_model, tiny_tokenizer
from torch import nn

from leanlm.decoding import fused
from leanlm.decoding.fused import fused_decoder_problem
from leanlm.export.to_compressed_tensors import compressed_tensors_problems
from leanlm.export.to_gguf import gguf_problems
from leanlm.kernels.float_gemv import GemvIsa
from leanlm.kernels.kbit_gemm import INT8_ISAS, KernelIsa, compiled_kernels
from leanlm.methods.checkpoint import load_quantized, save_quantized
from leanlm.models.loading import LoadedModel
from leanlm.nn import QUANTIZED_MODULES
from leanlm.nn.base import QuantizedModule


class HalfLinear(QuantizedModule):
    """A float16 linear: the smallest quantized module there is."""

    kind = "float16 weights"

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.float16))
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)

    @classmethod
    def from_float(cls, linear: nn.Linear) -> HalfLinear:
        module = cls(linear.in_features, linear.out_features, linear.bias is not None)
        module.weight = linear.weight.detach().half()
        module.keep_bias(linear.bias)
        return module

    def constructor_args(self) -> dict:
        return self.linear_args()

    def dequantized_weight(self) -> torch.Tensor:
        return self.weight.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.dequantized_weight(), self.bias)


def _halved(model: nn.Module) -> nn.Module:
    for name, module in list(model.model.layers.named_modules()):
        if isinstance(module, nn.Linear):
            model.model.layers.set_submodule(name, HalfLinear.from_float(module))
    return model


def test_a_new_module_type_is_saved_loaded_and_refused_by_name_without_editing_anything_else(tmp_path):
    assert QUANTIZED_MODULES["HalfLinear"] is HalfLinear
    model = _halved(tiny_model("llama"))
    module = model.model.layers[0].mlp.down_proj
    assert module.bits_per_weight() == 16
    loaded = LoadedModel(model, tiny_tokenizer(), "tiny", tmp_path, None)
    out = save_quantized(loaded, model, {"method": "rtn"}, tmp_path / "half")  # the module type is what is new
    again = load_quantized(out)[0].model
    assert isinstance(again.model.layers[1].self_attn.q_proj, HalfLinear)
    ids = torch.randint(0, 128, (1, 9))
    with torch.inference_mode():
        torch.testing.assert_close(again(ids).logits, model(ids).logits, rtol=0, atol=0)
    assert "float16 weights" in " ".join(gguf_problems(module))
    assert "float16 weights" in " ".join(compressed_tensors_problems(module))
    assert "float16 weights, which the fused step does not run" in fused_decoder_problem(model)


def test_the_kernels_enums_come_from_the_extension():
    extension = compiled_kernels()
    if extension is None:
        pytest.skip("leanlm's CPU kernels are not built on this machine")
    names = set(typing.get_args(KernelIsa)) - set(INT8_ISAS) | set(INT8_ISAS.values()) | set(typing.get_args(GemvIsa))
    assert names <= set(extension.ISAS)
    assert set(fused._FLOAT_KINDS.values()) <= set(extension.LINEAR_KINDS)
    assert {f"kbit{bits}" for bits in (3, 4, 8)} <= set(extension.LINEAR_KINDS)
    assert set(fused._ACTIVATIONS) == set(extension.ACTIVATIONS)
    assert {"per_tensor", "per_token", "static"} <= set(extension.BMM_MODES)
    assert len(set(extension.LINEAR_KINDS.values())) == len(extension.LINEAR_KINDS)
