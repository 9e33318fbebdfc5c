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
from leanlm.export.exactness import MODULE_KINDS, require_exact
from leanlm.nn import QUANTIZED_MODULES, SpQRLinear, W8A8Linear, use_gemv_

FORMATS = {W8A8Linear: "int-quantized", SpQRLinear: "pack-quantized"}


def _require_compressed_tensors() -> None:
    require_extra("compressed-tensors export", "compressed_tensors")


def compressed_tensors_problems(module: nn.Module) -> list[str]:
    """The `leanlm quantize` settings `module` would need to have an exact compressed-tensors scheme (empty:
    none)."""
    kind = type(module).__name__
    if isinstance(module, W8A8Linear):
        problems = []
        if module.outlier_threshold is not None:
            problems.append(
                "--method w8a8 or smoothquant (LLM.int8()'s outlier columns run in float; compressed-tensors has no "
                "mixed-precision decomposition)"
            )
        if module.asymmetric:
            problems.append("symmetric int8 (zero-point int8 is not exported)")
        if module.activation == "per_tensor" and not module.static:
            problems.append(
                "--level O1 or O3 (dynamic per-tensor int8 activations, W8A8 O2, have no vLLM kernel: vLLM's int8 "
                "W8A8 takes activations dynamic per token or static per tensor)"
            )
        return problems
    if isinstance(module, SpQRLinear):
        problems = []
        if module.statistic_bits is not None or module.outlier_count:
            problems.append("--method rtn or gptq (SpQR's quantized statistics and outliers have no such form)")
        if module.permutation is not None:
            problems.append("--static-groups or --no-act-order (act-order columns)")
        if module.bits not in (4, 8):
            problems.append(f"--bits 4 or 8 (int4 and int8 are written, not {module.bits}-bit codes)")
        if not module.per_row and module.in_features % module.group_size:
            problems.append(
                f"a --group-size that divides every layer's input columns (a last group of "
                f"{module.in_features % module.group_size} columns of {module.in_features} in groups of "
                f"{module.group_size}; compressed-tensors packs whole groups)"
            )
        half = 2 ** (module.bits - 1)
        if module.statistic_bits is None and not bool((module.zero == half).all()):  # quantized zeros: no grid
            problems.append(
                f"--grid symmetric (the min-max grid's fractional zeros; compressed-tensors' symmetric grid has zero "
                f"at {half})"
            )
        return problems
    if kind == "BmmQuantizer":
        return [
            "--no-bmm (attention's int8 q / k / v products have no compressed-tensors form: it quantizes the KV "
            "cache, never q)"
        ]
    return [
        f"--method w8a8, smoothquant, rtn or gptq ({MODULE_KINDS.get(kind, kind)} are not the integer grids "
        "compressed-tensors holds)"
    ]


def scheme_of(module: nn.Module) -> dict:
    """The compressed-tensors scheme ({"weights": ..., "input_activations": ...} as QuantizationArgs fields) that
    holds `module` exactly, or a ConfigError naming every setting it would need."""
    require_exact("compressed-tensors", [module], compressed_tensors_problems)
    return _scheme(module)


def _scheme(module: nn.Module) -> dict:
    """The scheme of a module that has one (`compressed_tensors_problems` found none)."""
    if isinstance(module, W8A8Linear):
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
    strategy = {"strategy": "channel"} if module.per_row else {"strategy": "group", "group_size": module.group_size}
    return {"weights": {"num_bits": module.bits, "type": "int", "symmetric": True, **strategy}}


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
    require_exact("compressed-tensors", quantized.values(), compressed_tensors_problems)  # before any work
    schemes = {name: _scheme(module) for name, module in quantized.items()}
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
