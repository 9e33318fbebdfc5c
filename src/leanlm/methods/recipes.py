"""The methods `leanlm quantize --method NAME` offers, each a list of method configs (the contract's names), with
the defaults a recipe sets on top of its configs' own. The command line's options are generated from these."""

from __future__ import annotations

from dataclasses import dataclass, field

from leanlm.methods.cushion import CushionConfig
from leanlm.methods.gptq import GPTQConfig, RTNConfig, SpQRConfig
from leanlm.methods.kbit import KbitConfig
from leanlm.methods.smoothquant import SmoothQuantConfig
from leanlm.methods.w8a8 import LLMInt8Config, W8A8Config


@dataclass(frozen=True)
class Recipe:
    help: str
    steps: tuple[type, ...]  # method configs, applied in order
    defaults: dict = field(default_factory=dict)  # field name -> this recipe's default, over the configs' own
    # Alternative middle steps chosen by `--base` (CushionCache over naive W8A8 or SmoothQuant); the first is the default.
    bases: dict[str, tuple[type, ...]] = field(default_factory=dict)

    def step_types(self, base: str | None = None) -> tuple[type, ...]:
        if not self.bases:
            return self.steps
        chosen = self.bases[base or next(iter(self.bases))]
        return (*self.steps, *chosen)


# GPTQ as GGUF's Q4_0 blocks (symmetric groups of 32, act-order kept by fitting the groups first), which
# compressed-tensors holds too; its scale search and halved Hessian off-diagonal are the best measured recipe
# (benchmarks/gguf_llama_cpp.py).
GPTQ_EXPORTABLE = {
    "grid": "symmetric",
    "group_size": 32,
    "static_groups": True,
    "scale_search": True,
    "hessian_shrinkage": 0.5,
}

RECIPES: dict[str, Recipe] = {
    "w8a8": Recipe("naive int8 weights and activations", (W8A8Config,)),
    # The defaults of `--method NAME` are its best measured recipe on the real models (the showcase's rows), where
    # it differs from the paper's defaults that the configs keep.
    "smoothquant": Recipe(
        "SmoothQuant: migrate activation outliers into the weights, then W8A8",
        (SmoothQuantConfig, W8A8Config),
        {"level": "O3", "alpha": 0.7, "weight_granularity": "per_channel"},
    ),
    "llm-int8": Recipe("vector-wise int8 with the outlier dimensions in float", (LLMInt8Config,)),
    "kbit": Recipe(
        "weight-only k-bit blocks (NF4, FP4, int, dynamic), QLoRA's double quantization",
        (KbitConfig,),
        {"double_quant": True},
    ),
    "rtn": Recipe("weight-only min-max groups, rounded to nearest", (RTNConfig,)),
    "gptq": Recipe(
        "weight-only integer groups with Hessian error feedback",
        (GPTQConfig,),
        GPTQ_EXPORTABLE,
    ),
    "spqr": Recipe("GPTQ with 3-bit group statistics and fp16 outliers", (SpQRConfig,)),
    "cushion": Recipe(
        "a searched (and tuned) prefix KV cache, then int8 (--base w8a8 or smoothquant)",
        (CushionConfig,),
        {"level": "O3"},
        {"w8a8": (W8A8Config,), "smoothquant": (SmoothQuantConfig, W8A8Config)},
    ),
}
