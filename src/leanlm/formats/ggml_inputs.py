"""The rounding llama.cpp's CPU backend gives a matmul's input: ggml-cpu pairs every stored weight type with a
`vec_dot_type` and rounds each row of the input to it before the dot products (ggml-cpu's type traits, read in the
bindings' vendored tree):

- Q8_0 (and Q8_1, the same values plus a block sum) for the blocks of 32: int8 codes per 32 values, a float16 scale;
- Q8_K for the K-quants and IQ4_XS: int8 codes per 256 values, a float32 scale set by the block's largest value;
- float16 / bfloat16 inputs for float16 / bfloat16 weights; float32 weights take float32 inputs.

A model run in PyTorch with these roundings applied (`leanlm.bench.llama_cpp.llama_cpp_inputs`) computes what
llama.cpp computes up to the order of its sums, and the loss a rounding adds can be measured on calibration text
(`leanlm.methods.calibration.collect_sensitivity`), so a bit budget can weigh it when it chooses block types.
"""

from __future__ import annotations

import torch


def round_trip_q8_0(x: torch.Tensor) -> torch.Tensor:
    """x as llama.cpp's quantize_row_q8_0 (and q8_1) leaves it: blocks of 32 along the last dimension, d = absmax /
    127, q = round(x / d) (with the float32 d), values q * float16(d)."""
    blocks = x.float().reshape(*x.shape[:-1], -1, 32)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    q = torch.round(torch.where(d > 0, blocks / d, 0.0))
    return (q * d.half().float()).reshape(x.shape).to(x.dtype)


def round_trip_q8_k(x: torch.Tensor) -> torch.Tensor:
    """x as llama.cpp's quantize_row_q8_K leaves it: blocks of 256 along the last dimension, m the value of largest
    magnitude (its sign kept), scale = -127 / m, q = min(127, round(scale * x)), values q / scale in float32."""
    blocks = x.float().reshape(*x.shape[:-1], -1, 256)
    largest = torch.gather(blocks, -1, blocks.abs().argmax(dim=-1, keepdim=True))
    scale = torch.where(largest != 0, -127.0 / largest, 0.0)
    q = torch.clamp(torch.round(scale * blocks), max=127)
    return torch.where(scale != 0, q / scale, 0.0).reshape(x.shape).to(x.dtype)


ROUNDINGS = {
    "q8_0": round_trip_q8_0,
    "q8_k": round_trip_q8_k,
    "f16": lambda x: x.half().to(x.dtype),
    "bf16": lambda x: x.bfloat16().to(x.dtype),
}

# The rounding of a matmul's input, by the stored weight's GGUF type (None: the input stays float32).
INPUT_ROUNDING = {
    "f32": None,
    "f16": "f16",
    "bf16": "bf16",
    **{name: "q8_0" for name in ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "iq4_nl")},
    **{name: "q8_k" for name in ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs")},
}

# The int8 roundings and the input length (a whole number of their blocks) each needs.
INT8_BLOCKS = {"q8_0": 32, "q8_k": 256}


def int8_roundings(columns: int) -> list[str]:
    """The int8 input roundings llama.cpp can apply to a row of `columns` inputs."""
    return [name for name, block in INT8_BLOCKS.items() if columns % block == 0]
