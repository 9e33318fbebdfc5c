"""The peers leanlm is measured against, built the same way in every benchmark (imported lazily: they are
benchmark dependencies, not leanlm's)."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn


def bitsandbytes_int8_linear(linear: nn.Linear, threshold: float) -> nn.Module:
    """bitsandbytes' Linear8bitLt with `linear`'s weights, in eval mode: in training mode its CPU path
    de-quantizes the weight and skips activation quantization, which is not the int8 method."""
    import bitsandbytes as bnb

    module = bnb.nn.Linear8bitLt(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        has_fp16_weights=False,
        threshold=threshold,
    )
    module.load_state_dict(linear.state_dict())
    return module.to("cpu").eval()


def torchao_int8_dynamic_(model: nn.Module, include: Callable[[str], bool] = lambda name: True) -> nn.Module:
    """torchao's int8 dynamic-activation, int8-weight quantization of the linears whose names pass `include`."""
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    quantize_(
        model,
        Int8DynamicActivationInt8WeightConfig(),
        filter_fn=lambda module, name: isinstance(module, nn.Linear) and include(name),
    )
    return model
