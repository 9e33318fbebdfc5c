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

from torch import nn

from leanlm.errors import ConfigError, require_extra
from leanlm.export.exactness import require_exact
from leanlm.nn import QUANTIZED_MODULES, use_gemv_


def _require_compressed_tensors() -> None:
    require_extra("compressed-tensors export", "compressed_tensors")


def compressed_tensors_problems(module: nn.Module) -> list[str]:
    """The `leanlm quantize` settings `module` would need to have an exact compressed-tensors scheme (empty:
    none)."""
    return module.compressed_tensors_problems()


def scheme_of(module: nn.Module) -> dict:
    """The compressed-tensors scheme ({"weights": ..., "input_activations": ...} as QuantizationArgs fields) that
    holds `module` exactly, or a ConfigError naming every setting it would need."""
    require_exact("compressed-tensors", [module], compressed_tensors_problems)
    return module.compressed_tensors_scheme()[0]


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
    schemes = {repr(scheme): scheme for scheme in (m.compressed_tensors_scheme() for m in quantized.values())}
    if len(schemes) != 1:
        raise ConfigError(f"the checkpoint's quantized linears use {len(schemes)} different schemes; one is exported")
    scheme, form = next(iter(schemes.values()))
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
    tensors = {}
    for name, module in quantized.items():  # float linears holding exactly the quantized values
        tensors[name] = module.compressed_tensors_tensors()
        linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
        linear.weight = nn.Parameter(tensors[name]["weight"], requires_grad=False)
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
    for name in quantized:
        linear = model.get_submodule(name)
        scale = tensors[name]["weight_scale"]
        if scheme["weights"]["strategy"] == "tensor":
            scale = scale[:1, :1].reshape(linear.weight_scale.shape)
        linear.weight_scale.data = scale.to(linear.weight_scale.dtype).reshape(linear.weight_scale.shape)
        if "input_scale" in tensors[name]:
            linear.input_scale.data = tensors[name]["input_scale"].reshape(linear.input_scale.shape)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=form)
    compressor.compress_model(model)
    with staged_directory(out) as staging:
        model.save_pretrained(staging)
        compressor.update_config(str(staging))
        loaded.tokenizer.save_pretrained(staging)
    size = sum(path.stat().st_size for path in out.glob("*.safetensors"))
    return {"path": str(out), "format": form, "modules": len(quantized), "scheme": scheme, "bytes": size}
