"""KbitLinear: weight-only k-bit linear (Dettmers' thesis ch. 3, QLoRA's NF4): packed k-bit codes of any data type,
block-wise absmax constants (optionally double-quantized), activations float32 (at decode sizes, up to SMALL_M
rows without gradients, quantized per chunk of 64 to int8 for the int8 kernel, as llama.cpp does).

Storage is really k bits per weight (`packed` holds the bit stream, or for 3 bits the planes layout the 3-bit
kernel reads: `leanlm.formats.packing`); `bits_per_weight` is the exact account. The forward pass runs leanlm's
kernels where the layout allows (4-bit codes in blocks tiling each row; 8-bit int codes and 3-bit codes in
blocks the int8 kernel reads, which serves their decode sizes; a longer input multiplies by tiles of rows the
kernel de-quantizes, 512 at a time), else the plain-PyTorch reference (de-quantize, then matmul), which is also
the kernels' test oracle.
"""

from __future__ import annotations

import torch
from torch import nn

from leanlm.formats.blockwise import SECOND_LEVEL_BLOCK, BlockwiseQuantized, quantize_blockwise
from leanlm.formats.codebooks import DYNAMIC8, Codebook, codebook
from leanlm.formats.packing import CodeLayout, pack, packed_bytes, preferred_layout, unpack
from leanlm.kernels.kbit_gemm import (
    INT8_CODE_BIAS,
    SMALL_M,
    BlockConstants,
    KbitBackend,
    KernelIsa,
    code_table,
    compiled_kernels,
    default_backend,
    dequantize_weight,
    int8_kernel_table,
    is_int8_code_book,
    kbit_linear,
    per_group,
    prefill_dtype,
    supports_fast_path,
    supports_int8_activations,
)
from leanlm.nn.base import QuantizedModule
from leanlm.nn.rows import by_path, groups_of, linear_by_group


class KbitLinear(QuantizedModule):
    kind = "k-bit codebooks (NF4, FP4, dynamic, and int with a float32 absmax)"

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: str = "nf",
        bits: int = 4,
        block_size: int | None = 64,  # None: one block per output row
        double_quant: bool = False,
        exponent_bits: int | None = None,  # float types only
        backend: KbitBackend | None = None,  # None: the fast kernel where it applies, chosen at the first forward
        proxy_dims: int = 0,  # input dimensions kept in 16-bit (proxy quantization, Dettmers' thesis section 3.3)
        code_layout: CodeLayout = "stream",  # how `packed` holds the codes; checkpoints from before "planes" lack it
    ):
        super().__init__()
        self.backend = backend
        self.kernel_isa: KernelIsa = "auto"  # which small-M kernel (benchmarks name one; "auto" = the best here)
        self._kernel_inputs = None  # (float absmax, code table), until `forget_runtime_forms`
        self.in_features, self.out_features = in_features, out_features
        self.dtype, self.bits, self.double_quant, self.exponent_bits = dtype, bits, double_quant, exponent_bits
        self.code_layout = code_layout
        self.block_size = block_size or in_features
        self.per_row = block_size is None
        count = in_features * out_features
        blocks = -(-count // self.block_size)
        self.register_buffer("packed", torch.zeros(packed_bytes(count, bits, code_layout), dtype=torch.uint8))
        if double_quant:
            self.register_buffer("absmax", torch.zeros(blocks, dtype=torch.uint8))
            self.register_buffer("absmax_scale", torch.zeros(-(-blocks // SECOND_LEVEL_BLOCK)))
            self.register_buffer("absmax_offset", torch.zeros(()))
        else:
            self.register_buffer("absmax", torch.zeros(blocks))
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)
        # Proxy quantization: these input columns are stored in float16 beside the k-bit weight (whose codes
        # for them encode zeros, so the columns neither count twice nor inflate their blocks' absmax).
        self.register_buffer("proxy_columns", torch.zeros(proxy_dims, dtype=torch.int32) if proxy_dims else None)
        self.register_buffer(
            "proxy_weight", torch.zeros(out_features, proxy_dims, dtype=torch.float16) if proxy_dims else None
        )

    @property
    def codebook(self) -> Codebook:
        return codebook(self.dtype, self.bits, self.exponent_bits)

    @classmethod
    def from_float(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: str = "nf",
        bits: int = 4,
        block_size: int | None = 64,
        double_quant: bool = False,
        exponent_bits: int | None = None,
        proxy_columns: torch.Tensor | None = None,
    ) -> KbitLinear:
        out_features, in_features = weight.shape
        proxy_dims = 0 if proxy_columns is None else proxy_columns.numel()
        module = cls(
            in_features,
            out_features,
            bias is not None,
            dtype,
            bits,
            block_size,
            double_quant,
            exponent_bits,
            proxy_dims=proxy_dims,
            code_layout=preferred_layout(bits),
        )
        weight = weight.detach().float()
        if proxy_dims:
            columns = proxy_columns.long().sort().values
            module.proxy_columns = columns.to(torch.int32)
            module.proxy_weight = weight[:, columns].half()
            weight = weight.index_fill(1, columns, 0.0)
        quantized = quantize_blockwise(weight, module.codebook, block_size, double_quant)
        module.packed = pack(quantized.codes, bits, module.code_layout)
        module.absmax = quantized.absmax
        if double_quant:
            module.absmax_scale, module.absmax_offset = quantized.absmax_scale, quantized.absmax_offset
        module.keep_bias(bias)
        return module

    def constructor_args(self) -> dict:
        return {
            **self.linear_args(),
            "dtype": self.dtype,
            "bits": self.bits,
            "block_size": None if self.per_row else self.block_size,
            "double_quant": self.double_quant,
            "exponent_bits": self.exponent_bits,
            "proxy_dims": 0 if self.proxy_columns is None else self.proxy_columns.numel(),
            "code_layout": self.code_layout,
        }

    def quantized(self) -> BlockwiseQuantized:
        count = self.in_features * self.out_features
        return BlockwiseQuantized(
            unpack(self.packed, self.bits, count, self.code_layout),
            self.absmax,
            (self.out_features, self.in_features),
            self.block_size,
            self.codebook,
            self.absmax_scale if self.double_quant else None,
            self.absmax_offset if self.double_quant else None,
        )

    def dequantized_weight(self) -> torch.Tensor:
        """The weight this layer computes with, proxy columns included."""
        if self._resolve_backend() == "reference" or self.bits != 4:
            weight = self.quantized().dequantize()
        else:
            weight = dequantize_weight(
                self.packed, *self._kernel_state(), self.out_features, self.in_features, self.block_size
            )
        if self.proxy_columns is not None:
            weight[:, self.proxy_columns.long()] = self.proxy_weight.float()
        return weight

    def bits_per_weight(self) -> float:
        """Measured: bits of every stored tensor of this module (bias excluded) per weight."""
        stored = [self.packed, self.absmax] + ([self.absmax_scale, self.absmax_offset] if self.double_quant else [])
        stored += [self.proxy_columns, self.proxy_weight] if self.proxy_columns is not None else []
        return sum(t.numel() * t.element_size() * 8 for t in stored) / (self.in_features * self.out_features)

    def forget_runtime_forms(self) -> None:
        self._kernel_inputs = None

    def _kernel_state(self) -> tuple[BlockConstants, torch.Tensor | None]:
        """(the block constants as stored - double-quantized ones stay 8-bit, the kernel decodes them row by row -,
        the code book as float32: 16 entries for 3 or 4 bits, 256 for 8), derived once from the buffers."""
        if self._kernel_inputs is None:
            constants = (
                BlockConstants(
                    self.absmax, self.absmax_scale, DYNAMIC8.values, self.absmax_offset.item(), SECOND_LEVEL_BLOCK
                )
                if self.double_quant
                else BlockConstants(self.absmax.float().contiguous())
            )
            table = code_table(self.codebook.values) if self.bits in (3, 4) else self.codebook.values.float()
            if self.bits == 8 and self._runs_int8_kernel_only():
                # Older checkpoints may hold the unused code 255 (= 0.0, as is 127); mended 16M codes at a time,
                # as the mask takes a byte per code
                for part in self.packed.split(1 << 24):
                    part.masked_fill_(part == 255, INT8_CODE_BIAS)
            self._kernel_inputs = (constants, table)
        return self._kernel_inputs

    def fused_problem(self) -> str | None:
        runs = (
            self.bits == 4
            and supports_int8_activations(self.block_size, self.in_features)
            and self.proxy_columns is None
        ) or self._runs_int8_kernel_only()
        if not runs or self.backend == "reference":
            return (
                f"{self.extra_repr()} (the fused step runs 4-bit codes and 8-bit int codes in blocks of a multiple "
                "of 64 and 3-bit codes in blocks of 16, 32 or a multiple of 64, without proxy columns)"
            )
        return None

    def add_to_fused(self, decoder, compact_constants: bool) -> int:
        constants, table = self._kernel_state()
        values, inverse = int8_kernel_table(table, self.bits)
        if not compact_constants:
            constants = constants.decoded_once()
        return decoder.add_linear(
            compiled_kernels().LINEAR_KINDS[f"kbit{self.bits}"],
            self.packed,
            self.in_features,
            self.out_features,
            None if self.bias is None else self.bias.detach(),
            constants.absmax,
            values,
            inverse,
            self.block_size,
            **constants.kernel_arguments(),
        )

    def _runs_int8_kernel_only(self) -> bool:
        """Codes without a float-activation GEMV: the int8 kernel at decode sizes, tiles beyond: 8-bit codes of
        the symmetric int book (llama.cpp's Q8_0 in all but the block), read as stored, and 3-bit codes in the
        planes layout."""
        readable = (
            self.bits == 8
            and is_int8_code_book(self.codebook.values)
            or self.bits == 3
            and self.code_layout == "planes"
        )
        return (
            readable
            and supports_int8_activations(self.block_size, self.in_features, self.bits)
            and self.proxy_columns is None
        )

    def _resolve_backend(self) -> KbitBackend:
        if self.backend is None:
            fits = supports_fast_path(self.bits, self.block_size, self.in_features) or self._runs_int8_kernel_only()
            self.backend = default_backend() if fits else "reference"
        return self.backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"KbitLinear expects {self.in_features} input features, got shape {tuple(x.shape)}")
        if torch.is_grad_enabled() and x.requires_grad:
            return _FrozenKbitMatmul.apply(x, self)
        return self._forward_frozen(x)

    def _forward_frozen(self, x: torch.Tensor, int8_activations: bool = True) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        groups = groups_of(rows.shape[0]) if int8_activations else None  # packed sequences (nn/rows.py)
        if self._resolve_backend() == "reference":
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return linear_by_group(x, self.dequantized_weight().to(x.dtype), bias, groups)
        # Under autograd (int8_activations False) the forward stays the function the backward differentiates.
        compute_dtype = prefill_dtype(x.dtype)
        absmax, table = self._kernel_state()

        def compute(part: torch.Tensor, part_groups: tuple[int, ...] | None) -> torch.Tensor:
            out = kbit_linear(
                part,
                self.packed,
                absmax,
                table,
                self.out_features,
                self.block_size,
                self.bias,
                self.backend,
                self.kernel_isa,
                int8_activations,
                self.bits,
                compute_dtype,
                groups=part_groups,
            )
            if self.proxy_columns is not None:
                proxy = self.proxy_weight.to(out.dtype).T
                columns = self.proxy_columns.long()
                per_group(part_groups, part, out, lambda rows, into: into.addmm_(rows[:, columns].to(out.dtype), proxy))
            return out.to(x.dtype)

        out = compute(rows, None) if groups is None else by_path(rows, groups, lambda rows: rows <= SMALL_M, compute)
        return out.reshape(*x.shape[:-1], self.out_features)

    def weight_rows(self, index: slice | torch.Tensor) -> torch.Tensor:
        """Output rows `index` of a layer the int8 kernel reads, de-quantized (float32, (rows, in_features)): a
        row's codes are whole bytes (8 bits: one byte each; 3-bit planes: 24 bytes per 64), so rows are read
        without unpacking the whole weight."""
        constants = self._kernel_state()[0].rows(index, self.in_features // self.block_size)
        codes = self.packed.reshape(self.out_features, -1)[index]
        if self.bits != 8:
            codes = unpack(codes.reshape(-1), self.bits, codes.shape[0] * self.in_features, self.code_layout)
        codes = codes.reshape(constants.shape[0], -1, self.block_size)
        return (self.codebook.values[codes.long()] * constants[:, :, None]).reshape(-1, self.in_features)

    def extra_repr(self) -> str:
        blocks = "per-row" if self.per_row else f"block {self.block_size}"
        proxy = f", {self.proxy_columns.numel()} proxy dims in fp16" if self.proxy_columns is not None else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, {self.codebook.name}, {blocks}"
            f"{', double-quant' if self.double_quant else ''}{proxy}"
        )


class _FrozenKbitMatmul(torch.autograd.Function):
    """Gradients through a frozen k-bit weight (QLoRA): the backward pass needs only dX = dY W, so it de-quantizes
    the weight again instead of autograd keeping a float copy of it alive for every layer until backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: KbitLinear) -> torch.Tensor:
        ctx.layer = layer
        # Float activations: the backward pass multiplies by the float weight, and the forward must be the
        # function it differentiates (int8 activations are for inference at decode sizes).
        return layer._forward_frozen(x, int8_activations=False)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        weight = ctx.layer.dequantized_weight().to(grad_output.dtype)
        return grad_output @ weight, None


class KbitEmbedding(nn.Module):
    """The token embedding of a tied model whose head became a KbitLinear (`--head int8`): the rows looked up are
    read from the head's codes and de-quantized, so the table is held once, in 8 bits, as llama.cpp's Q8_0
    `token_embd` serves both too. `scale`: a scaled embedding's factor (Gemma: sqrt(hidden)); `dtype`: what the
    model computes in."""

    def __init__(self, head: KbitLinear, dtype: torch.dtype, scale: float | None = None):
        super().__init__()
        self._head = (head,)  # a reference, not a submodule: the codes are the head's buffers, stored once
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        self.dtype, self.scale = dtype, scale

    @property
    def head(self) -> KbitLinear:
        return self._head[0]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The de-quantized float32 rows of `ids` (any shape), before the scale."""
        return self.head.weight_rows(ids.reshape(-1)).reshape(*ids.shape, self.embedding_dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.rows(ids)
        return (out * self.scale if self.scale is not None else out).to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, read from the output head's 8-bit codes"
