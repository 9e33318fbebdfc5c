"""llama.cpp's quantization recipes: the GGUF block type `llama-quantize` gives each tensor of a dense model for a
file type such as Q4_K_M, read from the tensor's name, its layer and its row length, so that leanlm can spend the
bits of llama.cpp's file of that name on the same model (`--size-of`).

A recipe starts from its base type and raises some tensors: the output head to Q6_K (Q8_0 where its rows are no
whole number of the base type's blocks), the value projections and `ffn_down` of chosen layers (`_more_bits`:
the first and last eighth and every third layer between), the first layers' `ffn_down`. A type whose blocks do
not divide a row takes llama.cpp's fallback (`gguf_blocks.type_for_row`). Mixture-of-experts models and the
rules llama.cpp keeps for 70B models and for Falcon are not modelled."""

from __future__ import annotations

import re
from collections.abc import Mapping

from leanlm.errors import ConfigError
from leanlm.formats import gguf_blocks

# file type -> the block type every tensor without a rule of its own takes
RECIPES = {
    "q3_k_s": "q3_k",
    "q3_k_m": "q3_k",
    "q3_k_l": "q3_k",
    "iq4_xs": "iq4_xs",
    "iq4_nl": "iq4_nl",
    "q4_0": "q4_0",
    "q4_k_s": "q4_k",
    "q4_k_m": "q4_k",
    "q5_k_s": "q5_k",
    "q5_k_m": "q5_k",
    "q6_k": "q6_k",
    "q8_0": "q8_0",
}

_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


def _more_bits(layer: int, layers: int) -> bool:
    """The layers llama.cpp's _M recipes give more bits: the first and last eighth, and every third between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _block_type(recipe: str, role: str, layer: int, layers: int, values: int, gqa: float, importance: bool) -> str:
    """The type a block tensor of `role` (attn_v, ffn_down, ...) in `layer` takes before any fallback; `values`:
    how many value (or fused qkv) projections the model has, `gqa`: query heads per key-value head."""
    base = RECIPES[recipe]
    if role == "attn_v":
        if recipe == "q3_k_m":
            return "q5_k" if layer < 2 else "q4_k"
        if recipe == "q3_k_l":
            return "q5_k"
        if recipe in ("iq4_nl", "iq4_xs") and gqa >= 4:
            return "q5_k"
        if recipe in ("q4_k_m", "q5_k_m") and _more_bits(layer, values):
            return "q6_k"
        if recipe == "q4_k_s" and layer < 4:
            return "q5_k"
    elif role == "attn_qkv":
        return {"q3_k_m": "q4_k", "q3_k_l": "q4_k", "q4_k_m": "q5_k", "q5_k_m": "q6_k"}.get(recipe, base)
    elif role == "attn_output":
        return {"q3_k_m": "q4_k", "q3_k_l": "q5_k"}.get(recipe, base)
    elif role == "ffn_down":
        if recipe == "q3_k_m":
            return "q5_k" if layer < layers // 16 else "q4_k"
        if recipe == "q3_k_l":
            return "q5_k"
        if recipe in ("q4_k_m", "q5_k_m") and _more_bits(layer, layers):
            return "q6_k"
        if recipe in ("iq4_nl", "iq4_xs") and layer < layers // 8 and not importance:
            return "q5_k"
        if recipe == "q4_k_s" and layer < layers // 8:
            return "q5_k"
        if recipe == "q4_0" and importance and layer < layers // 8:
            return "q4_1"
    return base


def recipe_types(recipe: str, rows: Mapping[str, int], gqa: float, importance: bool = False) -> dict[str, str]:
    """{GGUF tensor name: block type} of llama.cpp's `recipe` file (with an importance matrix if `importance`)
    for the tensors `rows` names, each with its row length: the block linears (`blk.N.attn_q` ...), the token
    embedding (`token_embd`) and, for a model whose head is not tied to it, the output head (`output`). `gqa`:
    the model's query heads per key-value head."""
    if recipe not in RECIPES:
        raise ConfigError(f"llama.cpp file type {recipe!r}: choose from {', '.join(RECIPES)}")
    base = RECIPES[recipe]
    blocks = {name: _BLOCK.match(name) for name in rows}
    layers = 1 + max((int(match[1]) for match in blocks.values() if match), default=-1)
    values = sum(1 for match in blocks.values() if match and match[2] in ("attn_v", "attn_qkv"))
    head = "output" if "output" in rows else "token_embd"  # a tied head is quantized as the output
    types = {}
    for name, columns in rows.items():
        match = blocks[name]
        if match:
            kind = _block_type(recipe, match[2], int(match[1]), layers, values, gqa, importance)
        elif name == head:
            fits = columns % gguf_blocks.block_type(base).block == 0
            kind = base if base == "q8_0" else "q6_k" if fits else "q8_0"
        elif name == "token_embd":
            kind = base
        else:
            raise ConfigError(f"{name}: not a tensor llama.cpp's recipes give a type to")
        types[name] = gguf_blocks.type_for_row(kind, columns).name
    return types
