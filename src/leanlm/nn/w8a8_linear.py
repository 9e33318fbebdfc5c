"""W8A8Linear: a linear layer that stores int8 weights and multiplies int8 activations by them in an integer
GEMM (SmoothQuant eq. 3.2): Y = diag(delta_X) (X_int8 W_int8^T) diag(delta_W) + b.

Weights: int8 with a per-tensor, per-output-channel or per-group scale (all along the GEMM's outer dimension,
so they apply after the integer product). Activations: quantized on the fly per token or per tensor (dynamic),
or with a per-tensor scale fixed at calibration (static).

With `outlier_threshold` it is LLM.int8() (Dettmers' thesis eq. 2.2): at every forward, the input feature dimensions
where any |x| >= threshold go through a float matmul with the matching weight columns, and the rest through
the int8 GEMM, the per-token scales computed after the outlier columns are removed. As in bitsandbytes, the
outlier weight columns are de-quantized from the int8 weight (no float copy is kept).

With `asymmetric` both operands use per-tensor zero points (LLM.int8()'s "zeropoint" baseline, Table 2.1).

`SharedInputGemm` runs linears that read the same input (q/k/v, gate/up) as one GEMM.
"""

from __future__ import annotations

import torch

from leanlm.errors import ConfigError
from leanlm.formats.int8 import (
    QMAX,
    ActivationGranularity,
    WeightGranularity,
    activation_scale,
    quantize_weight,
    zeropoint_params,
)
from leanlm.kernels.int8_gemm import Backend, PackedInt8Weight, default_backend, int8_linear, pack_weight
from leanlm.nn.base import QuantizedModule


def shaped_like_input(out_rows: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A GEMM's (tokens, out_features) result in the shape and dtype of the input x it was computed from."""
    return out_rows.reshape(*x.shape[:-1], out_rows.shape[-1]).to(x.dtype)


class W8A8Linear(QuantizedModule):
    kind = "int8 weights and activations (W8A8, SmoothQuant, LLM.int8())"

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
        self._packed = None  # fbgemm's packed weight: made at the first forward, then the only copy kept
        self.shared_input: SharedInputGemm | None = None  # set by SharedInputGemm; derived, never saved
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
    ) -> W8A8Linear:
        out_features, in_features = weight.shape
        module = cls(
            in_features,
            out_features,
            bias is not None,
            activation,
            input_scale is not None,
            backend,
            outlier_threshold,
            asymmetric,
        )
        if asymmetric:
            scale, zero_point = zeropoint_params(weight)
            module.weight = (
                (torch.round(weight.detach().float() / scale) + zero_point).clamp(-QMAX, QMAX).to(torch.int8)
            )
            module.weight_scale = scale.expand(out_features).clone()
            module.weight_zero_point = torch.tensor(zero_point)
        else:
            module.weight, module.weight_scale = quantize_weight(
                weight.detach().float(), weight_granularity, group_size
            )
        module.keep_bias(bias)
        if input_scale is not None:
            module.input_scale = input_scale.detach().float().reshape(()).clone()
        return module

    def constructor_args(self) -> dict:
        """The arguments that rebuild this module (empty) before a checkpoint's state dict is loaded into it."""
        return {
            **self.linear_args(),
            "activation": self.activation,
            "static": self.static,
            "outlier_threshold": self.outlier_threshold,
            "asymmetric": self.asymmetric,
        }

    @property
    def weight(self) -> torch.Tensor:
        """The int8 weight (out, in). On fbgemm the packed copy made at the first forward is the only one kept
        (resident memory is the stored bytes): then this unpacks it, a new tensor, exactly as stored."""
        buffers = self.__dict__.get("_buffers", {})
        if "weight" not in buffers:
            raise AttributeError("weight")  # not registered yet (nn.Module's own checks ask before it is)
        if buffers["weight"] is not None:
            return buffers["weight"]
        if self.shared_input is not None and self.shared_input.packed is not None:
            return self.shared_input.member_weight(self)
        return self._packed.unpacked()

    def use_reference_(self) -> None:
        """Compute from now on with the plain-PyTorch int8 reference (the oracle the kernels are tested against:
        x rounded by division, integer products summed exactly), unpacking fbgemm's copy if it is the only one."""
        self._buffers["weight"] = self.weight
        self.backend = "reference"

    def release_int8_weight(self) -> None:
        """Drop the plain int8 tensor once a packed copy holds the same values."""
        self._buffers["weight"] = None

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        if self._buffers["weight"] is not None:
            return super()._save_to_state_dict(destination, prefix, keep_vars)
        self._buffers["weight"] = self.weight  # unpacked for the moment of saving, in its usual place
        try:
            super()._save_to_state_dict(destination, prefix, keep_vars)
        finally:
            self._buffers["weight"] = None

    def _load_from_state_dict(self, *args, **kwargs):
        if self.shared_input is not None:
            self.shared_input.forget_weights()  # gives every member its plain int8 weight back
        if self._buffers["weight"] is None:
            self._buffers["weight"] = self.weight
        self._packed = None
        super()._load_from_state_dict(*args, **kwargs)

    def input_scale_for(self, rows: torch.Tensor) -> torch.Tensor:
        """The activation scale of a plain (symmetric, no outlier decomposition) forward: static or dynamic."""
        return self.input_scale if self.static else activation_scale(rows, self.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"W8A8Linear expects {self.in_features} input features, got shape {tuple(x.shape)}")
        if self.shared_input is not None and self.backend == "fbgemm":
            return self.shared_input.output(self, x)
        return self._forward_alone(x)

    def _forward_alone(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        outlier_inputs = outlier_weight = None
        rows_are_ours = False  # whether `rows` is a private copy the kernel may scale in place
        if self.outlier_threshold is not None:
            columns = (torch.linalg.vector_norm(rows, float("inf"), dim=0) >= self.outlier_threshold).nonzero()[:, 0]
            self.decomposition_counts["dims"] += self.in_features
            self.decomposition_counts["outlier_dims"] += columns.numel()
            if columns.numel():
                outlier_weight = self._dequantized_columns(columns)
                outlier_inputs = rows[:, columns]
                rows, rows_are_ours = rows.index_fill(1, columns, 0.0), True
        zero_points = {}
        if self.asymmetric:
            scale, x_zero_point = zeropoint_params(rows)
            zero_points = {"x_zero_point": x_zero_point, "weight_zero_point": int(self.weight_zero_point)}
        else:
            scale = self.input_scale_for(rows)
        if self.backend == "fbgemm":
            out = int8_linear(
                rows,
                scale,
                None,
                None,
                self.bias,
                self.backend,
                self._packed_weight(),
                overwrite_input=rows_are_ours,
                **zero_points,
            )
        else:
            out = int8_linear(
                rows,
                scale,
                self.weight,
                self.weight_scale,
                self.bias,
                self.backend,
                overwrite_input=rows_are_ours,
                **zero_points,
            )
        if outlier_inputs is not None:
            out = out.addmm_(outlier_inputs, outlier_weight.T)
        return shaped_like_input(out, x)

    def pack_(self) -> None:
        """Make the packed copy now (else the first forward does) and release the plain int8 tensor."""
        if self.backend != "fbgemm":
            return
        if self.shared_input is not None:
            self.shared_input.packed_weight()
        else:
            self._packed_weight()

    def _packed_weight(self) -> PackedInt8Weight:
        if self._packed is None:
            zero_point = int(self.weight_zero_point) if self.asymmetric else 0
            self._packed = pack_weight(self.weight, self.weight_scale, zero_point)
            self.release_int8_weight()
        return self._packed

    def _dequantized_columns(self, columns: torch.Tensor) -> torch.Tensor:
        """(out, len(columns)) float32: the weight columns LLM.int8() multiplies in float, de-quantized from the
        int8 weight (bitsandbytes keeps no float copy either): on fbgemm read through the packed copy."""
        if self.backend == "fbgemm":
            return self._packed_weight().dequantized_columns(columns, self.in_features).T.contiguous()
        zero_point = self.weight_zero_point if self.asymmetric else 0
        return (self.weight[:, columns].float() - zero_point) * self.weight_scale[:, None]

    def fused_problem(self) -> str | None:
        if self.asymmetric:
            return "zero-point (asymmetric) int8, a baseline the fused step does not run"
        if int(self.weight.min()) == -128:  # absmax quantization never writes it
            return "an int8 weight of -128, which the AVX2 kernel's sign trick cannot negate"
        return None

    def add_to_fused(self, decoder, compact_constants: bool) -> int:
        """A plain int8 copy of the weight goes to the step, beside fbgemm's packed one that prefill runs."""
        return decoder.add_w8a8_linear(
            self.weight.contiguous(),
            self.weight_scale,
            None if self.bias is None else self.bias.detach(),
            float(self.input_scale) if self.static else 0.0,
            self.outlier_threshold or 0.0,
        )

    def compressed_tensors_problems(self) -> list[str]:
        problems = []
        if self.outlier_threshold is not None:
            problems.append(
                "--method w8a8 or smoothquant (LLM.int8()'s outlier columns run in float; compressed-tensors has no "
                "mixed-precision decomposition)"
            )
        if self.asymmetric:
            problems.append("symmetric int8 (zero-point int8 is not exported)")
        if self.activation == "per_tensor" and not self.static:
            problems.append(
                "--level O1 or O3 (dynamic per-tensor int8 activations, W8A8 O2, have no vLLM kernel: vLLM's int8 "
                "W8A8 takes activations dynamic per token or static per tensor)"
            )
        return problems

    def compressed_tensors_scheme(self) -> tuple[dict, str]:
        per_tensor = bool((self.weight_scale == self.weight_scale[0]).all())
        weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor" if per_tensor else "channel"}
        activations = {
            "num_bits": 8,
            "type": "int",
            "symmetric": True,
            "strategy": "token" if self.activation == "per_token" else "tensor",
            "dynamic": not self.static,
        }
        return {"weights": weights, "input_activations": activations}, "int-quantized"

    def compressed_tensors_tensors(self) -> dict[str, torch.Tensor]:
        scale = self.weight_scale[:, None]
        tensors = {"weight": self.weight.float() * scale, "weight_scale": scale.clone()}
        if self.static:
            tensors["input_scale"] = self.input_scale.float().clone()
        return tensors

    def extra_repr(self) -> str:
        mode = "static" if self.static else "dynamic"
        outliers = f", outlier_threshold={self.outlier_threshold}" if self.outlier_threshold is not None else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"activation={self.activation} {mode}{outliers}, backend={self.backend}"
        )


class SharedInputGemm:
    """Linears that read the same input (q/k/v after the attention norm, gate/up after the MLP norm) run as one
    int8 GEMM: the input is quantized once, and the stacked weights make one wide GEMM, which fbgemm runs much
    better than several narrow ones (SmolLM2's k and v projections are 192 x 576 and alone run slower than
    FP32 at 512 tokens). The outputs are exactly those of the separate layers: the same input scale (one per
    token, or one per tensor, computed from the shared input or calibrated equal) and each layer's own weight
    scales, per output channel.

    The first member called computes every member's output and keeps the others' until they are asked for with
    the very same tensor, unmodified (`is` plus its version counter, and the kept input stays referenced, so no
    other tensor can take its identity); a member called with another input starts a new round. On the
    reference backend (the test oracle) every member computes alone. Derived state: built from the members,
    never saved."""

    def __init__(self, members: list[W8A8Linear]):
        problem = self.problem(members)
        if problem:
            raise ConfigError(f"these linears cannot share one GEMM: {problem}")
        self.members = list(members)
        self._packed = None  # fbgemm's packed stacked weight, built at the first call
        self._bias: torch.Tensor | None = None  # the stacked bias (zeros for members without one), if any has one
        self._input: torch.Tensor | None = None
        self._input_version: int | None = None
        self._pending: dict[int, torch.Tensor] = {}  # id(member) -> its output, not yet asked for
        for member in self.members:
            if member._buffers["weight"] is None:  # packed alone before: the stacked copy replaces that one
                member._buffers["weight"] = member.weight
            member._packed = None
            member.shared_input = self

    @staticmethod
    def problem(members: list[W8A8Linear]) -> str | None:
        """Why `members` cannot share a GEMM, or None."""
        if len(members) < 2:
            return "a group needs at least two linears"
        first = members[0]
        if any(not isinstance(m, W8A8Linear) for m in members):
            return "all must be W8A8Linear"
        if any(m.outlier_threshold is not None or m.asymmetric for m in members):
            return "outlier decomposition and zero points quantize each layer's input differently"
        if len({(m.in_features, m.activation, m.static, m.backend) for m in members}) > 1:
            return "inputs, activation granularity, static/dynamic and backend must agree"
        if first.static and any(not torch.equal(m.input_scale, first.input_scale) for m in members):
            return "their static input scales differ"
        return None

    @property
    def packed(self) -> PackedInt8Weight | None:
        return self._packed

    def member_weight(self, member: W8A8Linear) -> torch.Tensor:
        """A member's int8 weight, unpacked from the stacked copy (a new tensor)."""
        start = sum(m.out_features for m in self.members[: self.members.index(member)])
        return self._packed.unpacked()[start : start + member.out_features].clone()

    def forget_weights(self) -> None:
        """Drop the stacked packed copy, first giving each member its plain int8 weight back."""
        if self._packed is None:
            return
        stacked = self._packed.unpacked()
        for member, rows in zip(self.members, stacked.split([m.out_features for m in self.members])):
            member._buffers["weight"] = rows.clone()
        self._packed = None

    def packed_weight(self) -> PackedInt8Weight:
        if self._packed is None:  # the int8 rows are copied into fbgemm's layout, then only that copy is kept
            members = self.members
            self._bias = None
            if any(m.bias is not None for m in members):
                self._bias = torch.cat([m.bias if m.bias is not None else torch.zeros(m.out_features) for m in members])
            self._packed = pack_weight(
                torch.cat([m.weight for m in members]), torch.cat([m.weight_scale for m in members])
            )
            for member in members:
                member.release_int8_weight()
        return self._packed

    @staticmethod
    def _version(x: torch.Tensor) -> int | None:
        """x's version counter; None for an inference-mode tensor, which has none (there the identity alone
        decides: no model this serves changes a norm's output in place between the projections that read it)."""
        return None if x.is_inference() else x._version

    def output(self, member: W8A8Linear, x: torch.Tensor) -> torch.Tensor:
        if x is self._input and self._version(x) == self._input_version and id(member) in self._pending:
            out = self._pending.pop(id(member))
            if not self._pending:
                self._input = None
            return out
        rows = x.reshape(-1, member.in_features).float()
        packed = self.packed_weight()
        out = int8_linear(rows, member.input_scale_for(rows), None, None, self._bias, "fbgemm", packed)
        # contiguous: callers .view() the outputs, and split columns are strided
        outputs = [
            shaped_like_input(part, x).contiguous()
            for part in out.split([m.out_features for m in self.members], dim=-1)
        ]
        self._pending = {id(m): o for m, o in zip(self.members, outputs) if m is not member}
        self._input, self._input_version = x, self._version(x)
        return outputs[self.members.index(member)]
