"""Quantized modules: drop-in replacements for nn.Linear (and attention's matmuls), knowing nothing of
calibration or of which model they sit in."""

from leanlm.nn.attention import ATTENTION_NAME, BmmQuantizer, use_int8_bmm_attention
from leanlm.nn.base import REGISTRY, QuantizedModule
from leanlm.nn.float_linear import GemvLinear, use_gemv_
from leanlm.nn.gguf_linear import GGUFLinear
from leanlm.nn.kbit_linear import KbitLinear
from leanlm.nn.lora import LoRALinear
from leanlm.nn.spqr_linear import SpQRLinear
from leanlm.nn.w8a8_linear import SharedInputGemm, W8A8Linear

# Class name -> class: how a saved checkpoint's module records are turned back into modules.
QUANTIZED_MODULES = REGISTRY

__all__ = [
    "GemvLinear",
    "use_gemv_",
    "ATTENTION_NAME",
    "BmmQuantizer",
    "use_int8_bmm_attention",
    "W8A8Linear",
    "SharedInputGemm",
    "KbitLinear",
    "LoRALinear",
    "SpQRLinear",
    "GGUFLinear",
    "QuantizedModule",
    "QUANTIZED_MODULES",
]
