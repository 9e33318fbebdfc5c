"""Model-level methods: each transforms a loaded model with a config (one verb per method), plus the
quantized-checkpoint format they all save to."""

from leanlm.methods.calibration import collect_input_absmax
from leanlm.methods.checkpoint import QUANT_FILE, is_quantized_checkpoint, load_any, load_quantized, save_quantized
from leanlm.methods.kbit import KbitConfig, quantize_kbit_
from leanlm.methods.qlora import LORA_BASES, LoRAConfig, add_lora_, load_adapters_, merge_lora_, save_adapters
from leanlm.methods.smoothquant import SmoothQuantConfig, smooth_
from leanlm.methods.w8a8 import (
    LEVELS,
    ZEROQUANT,
    CalibrationSettings,
    CalibrationStats,
    W8A8Config,
    calibrate,
    llm_int8_config,
    quantize_loaded_w8a8_,
    quantize_w8a8_,
    search_alpha,
    share_input_gemms_,
)

__all__ = [
    "collect_input_absmax",
    "QUANT_FILE",
    "is_quantized_checkpoint",
    "load_any",
    "load_quantized",
    "save_quantized",
    "KbitConfig",
    "quantize_kbit_",
    "LORA_BASES",
    "LoRAConfig",
    "add_lora_",
    "load_adapters_",
    "merge_lora_",
    "save_adapters",
    "SmoothQuantConfig",
    "smooth_",
    "LEVELS",
    "ZEROQUANT",
    "CalibrationSettings",
    "CalibrationStats",
    "W8A8Config",
    "calibrate",
    "llm_int8_config",
    "quantize_loaded_w8a8_",
    "quantize_w8a8_",
    "search_alpha",
    "share_input_gemms_",
]
