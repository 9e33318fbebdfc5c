"""W8A8Linear: a linear layer that stores int8 weights and multiplies int8 activations by them in an integer
GEMM (SmoothQuant eq. 3.2): Y = diag(delta_X) (X_int8 W_int8^T) diag(delta_W) + b.

Weights: int8 with a per-tensor, per-output-channel or per-group scale (all along the GEMM's outer dimension,
so they apply after the integer product). Activations: quantized on the fly per token or per tensor (dynamic),
or with a per-tensor scale fixed at calibration (static).

With `outlier_threshold` it is LLM.int8() (thesis eq. 2.2): at every forward, the input feature dimensions
where any |x| >= threshold go through a float matmul with the matching weight columns, and the rest through
the int8 GEMM, the per-token scales computed after the outlier columns are removed. As in bitsandbytes, the
outlier weight columns are de-quantized from the int8 weight (no float copy is kept).

With `asymmetric` both operands use per-tensor zero points (LLM.int8()'s "zeropoint" baseline, Table 2.1).
"""

from __future__ import annotations


import torch
from torch import nn

from leanlm.errors import ConfigError
from leanlm.formats.int8 import (
    QMAX,
    ActivationGranularity,
    WeightGranularity,
    activation_scale,
    quantize_weight,
    zeropoint_params,
)
from leanlm.kernels.int8_gemm import Backend, default_backend, int8_linear, pack_weight


class W8A8Linear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        activation: ActivationGranularity = "per_tensor",
        static: bool = False,
        backend: Backend | None = None,
        outlier_threshold: float | None = None,
        asymmetric: bool = False,
    ):
        super().__init__()
        if asymmetric and (static or activation != "per_tensor"):
            raise ConfigError("asymmetric (zeropoint) quantization is per tensor and dynamic here")
        if static and activation != "per_tensor":
            raise ConfigError("static activation scales are per tensor; per-token scales are always dynamic")
        if outlier_threshold is not None and (static or outlier_threshold <= 0):
            raise ConfigError(f"outlier_threshold must be positive and needs dynamic scales, got {outlier_threshold}")
        self.in_features, self.out_features = in_features, out_features
        self.activation, self.static, self.outlier_threshold = activation, static, outlier_threshold
        self.asymmetric = asymmetric
        self.backend: Backend = backend or default_backend()
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.ones(out_features))
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)
        self.register_buffer("input_scale", torch.ones(()) if static else None)
        self.register_buffer("weight_zero_point", torch.zeros((), dtype=torch.long) if asymmetric else None)
        self._packed = None  # fbgemm's packed weight, rebuilt lazily whenever the int8 weight changes
        # Input dimensions seen, and how many of them went through the float path (LLM.int8() only).
        self.decomposition_counts = {"dims": 0, "outlier_dims": 0}

    @classmethod
    def from_float(
        cls,
        weight: torch.Tensor,  # (out, in)
        bias: torch.Tensor | None,
        weight_granularity: WeightGranularity = "per_tensor",
        group_size: int = 128,
        activation: ActivationGranularity = "per_tensor",
        input_scale: torch.Tensor | None = None,
        backend: Backend | None = None,
        outlier_threshold: float | None = None,
        asymmetric: bool = False,
    ) -> "W8A8Linear":
        out_features, in_features = weight.shape
        module = cls(in_features, out_features, bias is not None, activation, input_scale is not None, backend,
                     outlier_threshold, asymmetric)
        if asymmetric:
            scale, zero_point = zeropoint_params(weight)
            module.weight = (torch.round(weight.detach().float() / scale) + zero_point).clamp(-QMAX, QMAX).to(torch.int8)
            module.weight_scale = scale.expand(out_features).clone()
            module.weight_zero_point = torch.tensor(zero_point)
        else:
            module.weight, module.weight_scale = quantize_weight(weight.detach().float(), weight_granularity, group_size)
        if bias is not None:
            module.bias = bias.detach().float().clone()
        if input_scale is not None:
            module.input_scale = input_scale.detach().float().reshape(()).clone()
        return module

    def constructor_args(self) -> dict:
        """The arguments that rebuild this module (empty) before a checkpoint's state dict is loaded into it."""
        return {"in_features": self.in_features, "out_features": self.out_features, "bias": self.bias is not None,
                "activation": self.activation, "static": self.static, "outlier_threshold": self.outlier_threshold,
                "asymmetric": self.asymmetric}

    def _load_from_state_dict(self, *args, **kwargs):
        self._packed = None
        super()._load_from_state_dict(*args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"W8A8Linear expects {self.in_features} input features, got shape {tuple(x.shape)}")
        rows = x.reshape(-1, self.in_features).float()
        outlier_inputs = outlier_weight = None
        rows_are_ours = False  # whether `rows` is a private copy the kernel may scale in place
        if self.outlier_threshold is not None:
            columns = (torch.linalg.vector_norm(rows, float("inf"), dim=0) >= self.outlier_threshold).nonzero()[:, 0]
            self.decomposition_counts["dims"] += self.in_features
            self.decomposition_counts["outlier_dims"] += columns.numel()
            if columns.numel():
                outlier_weight = self.weight[:, columns].float() * self.weight_scale[:, None]
                outlier_inputs = rows[:, columns]
                rows, rows_are_ours = rows.index_fill(1, columns, 0.0), True
        zero_points = {}
        if self.asymmetric:
            scale, x_zero_point = zeropoint_params(rows)
            zero_points = {"x_zero_point": x_zero_point, "weight_zero_point": int(self.weight_zero_point)}
        else:
            scale = self.input_scale if self.static else activation_scale(rows, self.activation)
        if self.backend == "fbgemm" and self._packed is None:
            self._packed = pack_weight(self.weight, self.weight_scale, self.bias, zero_points.get("weight_zero_point", 0))
        out = int8_linear(rows, scale, self.weight, self.weight_scale, self.bias, self.backend, self._packed,
                          overwrite_input=rows_are_ours, **zero_points)
        if outlier_inputs is not None:
            out = out.addmm_(outlier_inputs, outlier_weight.T)
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        mode = "static" if self.static else "dynamic"
        outliers = f", outlier_threshold={self.outlier_threshold}" if self.outlier_threshold is not None else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"activation={self.activation} {mode}{outliers}, backend={self.backend}")
