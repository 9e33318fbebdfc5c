"""A leanlm checkpoint as a compressed-tensors directory (llm-compressor's format, which transformers and vLLM
load): `export_compressed_tensors(source, out)`.

The weights are written by the `compressed-tensors` package itself (`apply_quantization_config`, then its
`ModelCompressor`), from a float model holding exactly leanlm's de-quantized weights and leanlm's own scales, so
its rounding gives back leanlm's integer codes (w = scale * q, and round(w / scale) = q).

What maps, exactly:
- W8A8 (naive or SmoothQuant, its smoothing already folded into the norms and weights): int8 weights with a
  scale per tensor or per output channel (leanlm's per-group-of-channels scales are written per channel, each
  channel its group's scale), activations dynamic per token (O1) or static per tensor (O3, with leanlm's
  calibrated `input_scale`): the two int8 activation schemes vLLM runs.
- RTN / GPTQ on the symmetric grid (`--grid symmetric`), in natural column order: int4 or int8 weights in groups
  along the input (`pack-quantized`), value = scale * (code - 2^(b-1)).

What is refused, with the reason: dynamic per-tensor activations (O2: no vLLM kernel), attention's int8 products
(BmmQuantizer: compressed-tensors quantizes the KV cache, never q), LLM.int8()'s float outlier columns, zero
points, k-bit codebooks (NF4 / FP4), SpQR's quantized statistics and outliers, GPTQ's fractional min-max zeros and
act-order columns, and CushionCache's prefix.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from leanlm.errors import ConfigError, require_extra
from leanlm.nn import QUANTIZED_MODULES, SpQRLinear, W8A8Linear, use_gemv_

FORMATS = {W8A8Linear: "int-quantized", SpQRLinear: "pack-quantized"}


def _require_compressed_tensors() -> None:
    require_extra("compressed-tensors export", "compressed_tensors")


def scheme_of(module: nn.Module) -> dict:
    """The compressed-tensors scheme ({"weights": ..., "input_activations": ...} as QuantizationArgs fields) that
    holds `module` exactly, or a ConfigError naming why none does."""
    kind = type(module).__name__
    if isinstance(module, W8A8Linear):
        if module.outlier_threshold is not None:
            raise ConfigError(
                "LLM.int8()'s outlier columns run in float; compressed-tensors has no mixed-precision decomposition"
            )
        if module.asymmetric:
            raise ConfigError("zero-point int8 (LLM.int8()'s zeropoint baseline) is not exported")
        if module.activation == "per_tensor" and not module.static:
            raise ConfigError(
                "dynamic per-tensor int8 activations (W8A8 O2) have no vLLM kernel: vLLM's int8 W8A8 "
                "takes activations dynamic per token or static per tensor; quantize with --level O1 "
                "or O3"
            )
        per_tensor = bool((module.weight_scale == module.weight_scale[0]).all())
        weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor" if per_tensor else "channel"}
        activations = {
            "num_bits": 8,
            "type": "int",
            "symmetric": True,
            "strategy": "token" if module.activation == "per_token" else "tensor",
            "dynamic": not module.static,
        }
        return {"weights": weights, "input_activations": activations}
    if isinstance(module, SpQRLinear):
        problems = []
        if module.statistic_bits is not None or module.outlier_count:
            problems.append("SpQR's quantized statistics and outliers")
        if module.permutation is not None:
            problems.append("act-order columns without static groups (--static-groups or --no-act-order)")
        half = 2 ** (module.bits - 1)
        if module.bits not in (4, 8):
            problems.append(f"{module.bits}-bit codes (int4 and int8 are written)")
        if not module.per_row and module.in_features % module.group_size:
            problems.append(
                f"a last group of {module.in_features % module.group_size} columns ({module.in_features} "
                f"input columns in groups of {module.group_size}; compressed-tensors packs whole groups: "
                "a --group-size that divides every layer's input columns)"
            )
        if not problems and not bool((module.zero == half).all()):
            problems.append(
                f"the min-max grid's fractional zeros (compressed-tensors' symmetric grid has zero at "
                f"{half}: --grid symmetric)"
            )
        if problems:
            raise ConfigError(f"this SpQRLinear has no exact compressed-tensors form: {'; '.join(problems)}")
        strategy = {"strategy": "channel"} if module.per_row else {"strategy": "group", "group_size": module.group_size}
        return {"weights": {"num_bits": module.bits, "type": "int", "symmetric": True, **strategy}}
    if kind == "BmmQuantizer":
        raise ConfigError(
            "attention's int8 q / k / v products (BmmQuantizer) have no compressed-tensors form (it "
            "quantizes the KV cache, never q): quantize with --no-bmm"
        )
    raise ConfigError(f"{kind} has no compressed-tensors form (k-bit codebooks such as NF4 are not integer grids)")


def _weight_and_scale(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The (out, in) float weight leanlm computes with and the scale that re-creates its codes."""
    if isinstance(module, W8A8Linear):
        return module.weight.float() * module.weight_scale[:, None], module.weight_scale[:, None].clone()
    return module.dequantized_weight(), module.scale.float()


def export_compressed_tensors(source: str | os.PathLike, out: str | os.PathLike) -> dict:
    """Write the leanlm checkpoint `source` to the directory `out` (appearing only when complete) in the
    compressed-tensors format. Returns {"path", "format", "modules", "scheme", "bytes"}."""
    from leanlm.cache.prefix import attached_cushion
    from leanlm.methods.checkpoint import is_quantized_checkpoint, load_quantized
    from leanlm.storage import check_output_directory

    _require_compressed_tensors()
    if not is_quantized_checkpoint(source):
        raise ConfigError(
            f"{source}: compressed-tensors export takes a leanlm quantized checkpoint (leanlm quantize ... --out DIR)"
        )
    check_output_directory(out)
    loaded, _ = load_quantized(source)
    model = loaded.model
    if attached_cushion(model) is not None:
        raise ConfigError(
            "this checkpoint carries a CushionCache prefix; compressed-tensors has no place for a "
            "prefix KV cache, and without it the int8 activations it protects break"
        )
    quantized = {name: module for name, module in model.named_modules() if type(module).__name__ in QUANTIZED_MODULES}
    schemes = {name: scheme_of(module) for name, module in quantized.items()}  # every refusal before any work
    distinct = {repr(scheme) for scheme in schemes.values()}
    if len(distinct) != 1:
        raise ConfigError(f"the checkpoint's quantized linears use {len(distinct)} different schemes; one is exported")
    scheme = next(iter(schemes.values()))
    form = {FORMATS[type(module)] for module in quantized.values()}.pop()
    return _write(loaded, quantized, scheme, form, Path(out))


def _write(loaded, quantized: dict, scheme: dict, form: str, out: Path) -> dict:
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )

    from leanlm.storage import staged_directory

    model = loaded.model
    for name, module in quantized.items():  # float linears holding exactly the quantized values
        weight, _ = _weight_and_scale(module)
        linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
        linear.weight = nn.Parameter(weight, requires_grad=False)
        if module.bias is not None:
            linear.bias = nn.Parameter(module.bias.float().clone(), requires_grad=False)
        model.set_submodule(name, linear)
    group = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(**scheme["weights"]),
        input_activations=QuantizationArgs(**scheme["input_activations"]) if "input_activations" in scheme else None,
    )
    use_gemv_(model, use=False)  # compressed-tensors targets modules by class name ("Linear")
    left_float = [
        name
        for name, module in model.named_modules()  # lm_head and anything else leanlm kept float
        if isinstance(module, nn.Linear) and name not in quantized
    ]
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": group}, ignore=left_float))
    for name, module in quantized.items():
        linear = model.get_submodule(name)
        _, scale = _weight_and_scale(module)
        if scheme["weights"]["strategy"] == "tensor":
            scale = scale[:1, :1].reshape(linear.weight_scale.shape)
        linear.weight_scale.data = scale.to(linear.weight_scale.dtype).reshape(linear.weight_scale.shape)
        if isinstance(module, W8A8Linear) and module.static:
            linear.input_scale.data = module.input_scale.float().reshape(linear.input_scale.shape).clone()
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=form)
    compressor.compress_model(model)
    with staged_directory(out) as staging:
        model.save_pretrained(staging)
        compressor.update_config(str(staging))
        loaded.tokenizer.save_pretrained(staging)
    size = sum(path.stat().st_size for path in out.glob("*.safetensors"))
    return {"path": str(out), "format": form, "modules": len(quantized), "scheme": scheme, "bytes": size}
