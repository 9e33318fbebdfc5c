"""Weight-only k-bit quantization (thesis ch. 3; NF4 + double quantization of QLoRA): every linear of the
decoder blocks becomes a KbitLinear. One verb: `quantize_kbit_(model, KbitConfig(...))`."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from torch import nn
from tqdm.auto import tqdm

from leanlm.errors import ConfigError
from leanlm.formats.blockwise import bits_per_parameter
from leanlm.formats.codebooks import DTYPES
from leanlm.models.architectures import architecture_for, iter_quantizable_linears, linear_weight_out_in
from leanlm.nn import KbitLinear


@dataclass(frozen=True)
class KbitConfig:
    dtype: str = "nf"  # int, int_asym, fp, nf, dynamic
    bits: int = 4  # k, 3..8
    block_size: int | None = 64  # None: one block per output row
    double_quant: bool = False  # 8-bit constants in second-level blocks of 256 (QLoRA)
    exponent_bits: int | None = None  # float types: the e of e/m

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ConfigError(f"unknown data type {self.dtype!r}; choose from {', '.join(DTYPES)}")
        if not 3 <= self.bits <= 8:
            raise ConfigError(f"bits must be between 3 and 8, got {self.bits}")
        if self.block_size is not None and self.block_size < 2:
            raise ConfigError(f"block size must be at least 2, got {self.block_size}")

    def nominal_bits(self) -> float | None:
        """The account for fixed-size blocks (per-row blocks depend on the layer width)."""
        return None if self.block_size is None else bits_per_parameter(self.bits, self.block_size, self.double_quant)


def quantize_kbit_(model: nn.Module, config: KbitConfig) -> dict:
    """Quantize the block linears of `model` in place; returns the record, with the measured average bits per
    weight of the quantized linears ("avg_bits")."""
    table = architecture_for(model)
    weights = stored_bits = 0
    for name, module in tqdm(list(iter_quantizable_linears(model, table)), desc="quantizing", unit="linear", leave=False):
        quantized = KbitLinear.from_float(linear_weight_out_in(module, table), getattr(module, "bias", None),
                                          config.dtype, config.bits, config.block_size, config.double_quant,
                                          config.exponent_bits)
        model.set_submodule(name, quantized)
        count = quantized.in_features * quantized.out_features
        weights += count
        stored_bits += quantized.bits_per_weight() * count
    return {"method": "kbit", **asdict(config), "avg_bits": stored_bits / weights,
            "nominal_bits": config.nominal_bits()}
