"""Model-level methods: one config dataclass per method, all applied by one verb, `quantize_(model, config)`
(`leanlm.methods.quantize`), plus the quantized-checkpoint format they all save to and QLoRA's adapters.

Importing this package registers every method (each module registers its own config with the verb)."""

from leanlm.methods.calibration import collect_input_absmax
from leanlm.methods.checkpoint import QUANT_FILE, is_quantized_checkpoint, load_any, load_quantized, save_quantized
from leanlm.methods.cushion import CushionConfig
from leanlm.methods.gptq import GPTQConfig, RTNConfig, SpQRConfig
from leanlm.methods.kbit import KbitConfig
from leanlm.methods.qlora import LORA_BASES, LoRAConfig, add_lora_, load_adapters_, merge_lora_, save_adapters
from leanlm.methods.quantize import Calibration, QuantRecord, check_composition, quantize_
from leanlm.methods.smoothquant import SmoothQuantConfig, smooth_
from leanlm.methods.w8a8 import (
    LEVELS,
    ZEROQUANT,
    CalibrationStats,
    LLMInt8Config,
    W8A8Config,
    calibrate,
    share_input_gemms_,
)

__all__ = [
    "collect_input_absmax",
    "QUANT_FILE",
    "is_quantized_checkpoint",
    "load_any",
    "load_quantized",
    "save_quantized",
    "CushionConfig",
    "GPTQConfig",
    "RTNConfig",
    "SpQRConfig",
    "KbitConfig",
    "LORA_BASES",
    "LoRAConfig",
    "add_lora_",
    "load_adapters_",
    "merge_lora_",
    "save_adapters",
    "Calibration",
    "QuantRecord",
    "check_composition",
    "quantize_",
    "SmoothQuantConfig",
    "smooth_",
    "LEVELS",
    "ZEROQUANT",
    "CalibrationStats",
    "LLMInt8Config",
    "W8A8Config",
    "calibrate",
    "share_input_gemms_",
]
