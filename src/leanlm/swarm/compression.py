"""What travels between pipeline stages: tensors as hivemind protobufs, activations and gradients optionally
compressed to 8 bits block-wise (Dettmers et al.'s dynamic 8-bit map, one float32 absmax per block of 256 values;
SWARM section 6.3.2), with leanlm's own quantizer."""

from __future__ import annotations

import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2

from leanlm.formats.blockwise import BlockwiseQuantized, quantize_blockwise
from leanlm.formats.codebooks import DYNAMIC8

BLOCK = 256


def encode(tensors: list[torch.Tensor], compress: bool) -> list[runtime_pb2.Tensor]:
    """Each tensor as [shape, payload...]: float tensors compressed when asked, others (ids) as they are."""
    out = []
    for tensor in tensors:
        shape = torch.tensor(tensor.shape, dtype=torch.int64)
        if compress and tensor.is_floating_point():
            quantized = quantize_blockwise(tensor.detach().float().reshape(-1), DYNAMIC8, BLOCK)
            parts = [torch.tensor([1]), shape, quantized.codes, quantized.absmax]
        else:
            parts = [torch.tensor([0]), shape, tensor.detach()]
        out += [serialize_torch_tensor(part) for part in parts]
    return out


def decode(messages: list[runtime_pb2.Tensor]) -> list[torch.Tensor]:
    parts = [deserialize_torch_tensor(message) for message in messages]
    tensors, position = [], 0
    while position < len(parts):
        compressed, shape = bool(parts[position].item()), torch.Size(parts[position + 1].tolist())
        if compressed:
            codes, absmax = parts[position + 2], parts[position + 3]
            tensors.append(BlockwiseQuantized(codes, absmax, shape, BLOCK, DYNAMIC8).dequantize())
            position += 4
        else:
            tensors.append(parts[position + 2].reshape(shape))
            position += 3
    return tensors
