"""Weight-only k-bit quantization (Dettmers' thesis ch. 3; NF4 + double quantization of QLoRA): every linear of the
decoder blocks becomes a KbitLinear. `quantize_(model, KbitConfig(...))`."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from leanlm.errors import ConfigError
from leanlm.formats.blockwise import bits_per_parameter
from leanlm.formats.codebooks import DTYPES
from leanlm.methods.quantize import BlockPlan, QuantRun, register_method
from leanlm.models.architectures import (
    architecture_for,
    linear_weight_out_in,
    proxy_source_weights,
)
from leanlm.nn import KbitLinear
from leanlm.settings import option

BLOCK_SIZES = tuple(2**power for power in range(4, 13))  # 16 .. 4096, bitsandbytes' range


@dataclass(frozen=True)
class KbitConfig:
    dtype: str = option("nf", "data type of the codes (int is symmetric, int_asym two's complement)", choices=DTYPES)
    bits: int = option(4, "k, bits per weight code (3-8)")
    block_size: int | None = option(
        64, "values per absmax constant (a power of two, 16-4096), or one block per output row", none_word="row"
    )
    double_quant: bool = option(False, "8-bit block constants in second-level blocks of 256 (QLoRA)")
    exponent_bits: int | None = option(None, "fp: exponent bits e of e/m (default about half)")
    proxy_fraction: float = option(
        0.0,
        "p of proxy quantization: share of input dimensions kept in 16-bit, chosen "
        "by the previous layer's weight std (Dettmers' thesis uses 0.02)",
    )

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ConfigError(f"unknown data type {self.dtype!r}; choose from {', '.join(DTYPES)}")
        if not 3 <= self.bits <= 8:
            raise ConfigError(f"bits must be between 3 and 8, got {self.bits}")
        if self.block_size is not None and self.block_size not in BLOCK_SIZES:
            # Each block stores a 32-bit absmax: a block of 7 would cost 4.6 bits per weight on top of the codes.
            raise ConfigError(
                f"block_size must be a power of two from {BLOCK_SIZES[0]} to {BLOCK_SIZES[-1]} "
                f"(or None: one block per row), got {self.block_size}"
            )
        if not 0.0 <= self.proxy_fraction < 1.0:
            raise ConfigError(f"proxy fraction must be in [0, 1), got {self.proxy_fraction}")

    def nominal_bits(self) -> float | None:
        """The account for fixed-size blocks (per-row blocks depend on the layer width)."""
        if self.block_size is None:
            return None
        return bits_per_parameter(self.bits, self.block_size, self.double_quant, self.proxy_fraction)


@register_method(
    KbitConfig,
    "kbit",
    "quantizer",
    needs_calibration=lambda config: False,
    blockwise=True,
    needs_whole_model=lambda config: (
        (
            "proxy quantization chooses each linear's columns from the previous block's weights; "
            "it needs the model in memory, not read block by block"
        )
        if config.proxy_fraction
        else None
    ),
)
def _kbit_plan(model: nn.Module, config: KbitConfig, run: QuantRun) -> BlockPlan:
    """Every block linear becomes a KbitLinear; the record has the measured average bits per weight of the
    quantized linears ("avg_bits")."""
    table = architecture_for(model)
    # Chosen from the float weights before any layer is replaced.
    proxy = (
        {
            name: proxy_columns(source, config.proxy_fraction)
            for name, source in proxy_source_weights(model, table).items()
        }
        if config.proxy_fraction
        else {}
    )

    def quantize_block(index: int, block: nn.Module) -> dict:
        counts = {"weights": 0, "stored_bits": 0.0}
        for path in table.quantizable_linears:
            module = block.get_submodule(path)
            quantized = KbitLinear.from_float(
                linear_weight_out_in(module, table),
                getattr(module, "bias", None),
                config.dtype,
                config.bits,
                config.block_size,
                config.double_quant,
                config.exponent_bits,
                proxy.get(f"{table.blocks}.{index}.{path}"),
            )
            block.set_submodule(path, quantized)
            count = quantized.in_features * quantized.out_features
            counts["weights"] += count
            counts["stored_bits"] += quantized.bits_per_weight() * count
        return counts

    def finish(model: nn.Module, counts: dict) -> dict:
        return {
            **asdict(config),
            "avg_bits": counts["stored_bits"] / counts["weights"],
            "nominal_bits": config.nominal_bits(),
        }

    return BlockPlan(quantize_block, finish)


def proxy_columns(source_weight: torch.Tensor, fraction: float) -> torch.Tensor | None:
    """Thesis eq. 3.2: the `fraction` of output units of the previous layer whose weights have the largest
    standard deviation; their dimensions are the next layer's outlier inputs."""
    count = round(fraction * source_weight.shape[0])
    if count == 0:
        return None
    return source_weight.detach().float().std(dim=1).topk(count).indices
