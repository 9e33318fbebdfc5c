"""Quantized checkpoints: safetensors weights + the model's config and tokenizer + `leanlm_quant.json`, which
records the method, its settings and every replaced module, so that loading rebuilds the exact structure and
then reads the tensors (no pickle anywhere). A model with a CushionCache attached also gets `cushion.safetensors`
(its per-layer keys and values), re-attached on load.

A checkpoint directory appears only when complete (`leanlm.storage.staged_directory`), and loading checks the
record against the weights file before allocating anything: every module it names must replace a module of the
same shape, and the file must hold exactly the tensors those modules have, with their shapes and types."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from accelerate import init_empty_weights
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_model as save_safetensors_from
from torch import nn

from leanlm.cache.prefix import attached_cushion, save_cushion
from leanlm.errors import ConfigError, CorruptModelError, ModelNotFoundError
from leanlm.kernels.kbit_gemm import prefill_dtype
from leanlm.memory import return_freed_memory_at_once, trim_freed_memory
from leanlm.methods.quantize import after_load, method_names
from leanlm.models.architectures import architecture_for
from leanlm.models.loading import (
    LoadedModel,
    LoadSettings,
    compute_dtype,
    dtype_name,
    load_model,
    read_model_config,
    read_tokenizer,
)
from leanlm.models.untrusted import INDEX_FILE, WEIGHTS_FILE, model_from_config, weight_files
from leanlm.nn import QUANTIZED_MODULES, KbitLinear, use_gemv_
from leanlm.nn.base import QuantizedModule
from leanlm.nn.kbit_linear import KbitEmbedding
from leanlm.storage import (
    FORMAT_VERSION,
    QUANT_FILE,
    QUANTIZED_MARKER,
    TRANSFORMERS_METHOD,
    staged_directory,
    transformers_quantization_config,
)

# What a checkpoint may store its token embedding and float output head in: bfloat16 halves what are then its
# largest float tensors (a Llama-3-8B's two are 4.2 GB in float32) for their rounding to 8 significant bits.
TABLE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def checkpoint_record(
    record: dict, source_model: str, weights_note: str | None, attn_implementation: str, modules: dict[str, dict]
) -> dict:
    """A checkpoint's `leanlm_quant.json`: the method's record, where the weights came from and every replaced
    module as {name: {"class", "args"}}."""
    return {
        **record,
        "source_model": source_model,
        "weights_note": weights_note,
        "attn_implementation": attn_implementation,
        "modules": modules,
    }


def quantized_module_records(module: nn.Module, prefix: str = "") -> dict[str, dict]:
    """{prefix + name: {"class", "args"}} of every leanlm quantized module in `module`, as the record keeps them
    for the loader to rebuild."""
    return {
        prefix + name: {"class": type(child).__name__, "args": child.constructor_args()}
        for name, child in module.named_modules()
        if type(child).__name__ in QUANTIZED_MODULES
    }


def write_checkpoint_files(config, tokenizer, quant: dict, staging: Path) -> None:
    """Everything but the weights; the record last. config.json carries the record for transformers too
    (`leanlm.integrations.transformers`)."""
    config.save_pretrained(staging)
    written = json.loads((staging / "config.json").read_text())
    written["quantization_config"] = transformers_quantization_config(quant)
    (staging / "config.json").write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")
    tokenizer.save_pretrained(staging)
    (staging / QUANT_FILE).write_text(json.dumps(quant, indent=2) + "\n")


def save_quantized(
    loaded: LoadedModel, model: nn.Module, record: dict, out_dir: str | os.PathLike, table_dtype: str = "float32"
) -> Path:
    """Write `model` (quantized from `loaded`) with `record` (method and settings) to `out_dir`, which appears
    only once every file is written; the token embedding and a float output head stored in `table_dtype` (one of
    TABLE_DTYPES; the model in memory keeps its own)."""
    quant = checkpoint_record(
        {**record, "table_dtype": check_table_dtype(table_dtype)},
        loaded.name,
        loaded.weights_note,
        model.config._attn_implementation,
        quantized_module_records(model),
    )
    with staged_directory(out_dir) as staging, tables_held_as(model, TABLE_DTYPES[table_dtype]):
        save_safetensors_from(model, str(staging / WEIGHTS_FILE), metadata={"format": "pt", QUANTIZED_MARKER: "1"})
        cushion = attached_cushion(model)
        if cushion is not None:
            save_cushion(cushion, staging)
        write_checkpoint_files(model.config, loaded.tokenizer, quant, staging)
    return Path(out_dir)


def check_table_dtype(name: str, what: str = "table dtype") -> str:
    """`name` if it is one of TABLE_DTYPES; else a ConfigError naming `what` (the CLI passes its flag)."""
    if name not in TABLE_DTYPES:
        raise ConfigError(f"{what} {name!r}: choose from {', '.join(TABLE_DTYPES)}")
    return name


def _tables(model: nn.Module) -> dict[str, nn.Module]:
    """{state-dict name of the weight: module} of the token embedding and the output head (if the model has one)."""
    names = {module: name for name, module in model.named_modules()}
    modules = [model.get_input_embeddings(), model.get_output_embeddings()]
    return {f"{names[module]}.weight": module for module in modules if module is not None}


def float_tables(model: nn.Module) -> dict[str, nn.Module]:
    """`_tables` where they are float tables (not quantized modules such as an 8-bit head)."""
    return {
        name: module
        for name, module in _tables(model).items()
        if isinstance(module, (nn.Embedding, nn.Linear))
        and type(module).__name__ not in QUANTIZED_MODULES
        and module.weight.is_floating_point()
    }


@contextmanager
def tables_held_as(model: nn.Module, dtype: torch.dtype):
    """`model`'s float tables cast to `dtype` inside the `with` statement (a tied pair stays one tensor), its own
    again after it."""
    originals = {module: module.weight for module in float_tables(model).values()}
    cast = {}
    try:
        for module, weight in originals.items():
            if weight.dtype != dtype:
                if id(weight) not in cast:
                    cast[id(weight)] = nn.Parameter(weight.detach().to(dtype), requires_grad=False)
                module.weight = cast[id(weight)]
        yield
    finally:
        for module, weight in originals.items():
            module.weight = weight


def is_quantized_checkpoint(source: str | os.PathLike) -> bool:
    return (Path(source) / QUANT_FILE).is_file()


def read_record(directory: str | os.PathLike) -> dict:
    """A checkpoint's `leanlm_quant.json`, checked (`check_record`)."""
    path = Path(directory) / QUANT_FILE
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise CorruptModelError(f"{path} cannot be read: {error}") from None
    return check_record(record, path)


def method_record(directory: str | os.PathLike) -> dict:
    """A checkpoint's record less its per-module table: the method, its settings and what quantizing it measured."""
    return {key: value for key, value in read_record(directory).items() if key != "modules"}


def check_record(record, path) -> dict:
    """`record` (read from `path`), checked: an object naming a known method (and level) and the modules to
    rebuild as {name: {"class", "args"}}."""
    if not isinstance(record, dict):
        raise CorruptModelError(f"{path} holds a JSON {type(record).__name__}; a checkpoint record is an object")
    method = record.get("method")
    if not isinstance(method, str) or not set(method.split("+")) <= set(method_names()):
        raise CorruptModelError(
            f"{path}: method {method!r} is not a leanlm method or composition of them "
            f"({', '.join(method_names())}, joined by +)"
        )
    modules = record.get("modules")
    if not isinstance(modules, dict):
        raise CorruptModelError(f"{path}: 'modules' must be an object mapping module names to their class and args")
    if record.get("table_dtype", "float32") not in TABLE_DTYPES:
        raise CorruptModelError(
            f"{path}: table_dtype {record['table_dtype']!r} is not one of {', '.join(TABLE_DTYPES)}"
        )
    for name, entry in modules.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("args"), dict):
            raise CorruptModelError(
                f"{path}: module {name} must be {{'class': ..., 'args': {{...}}}}, got {entry!r:.80}"
            )
        if entry.get("class") not in QUANTIZED_MODULES:
            raise CorruptModelError(
                f"{path}: unknown module class {entry.get('class')!r} at {name} (leanlm's are "
                f"{', '.join(QUANTIZED_MODULES)})"
            )
    return record


def rebuilt_modules(model: nn.Module, modules: dict, source: Path) -> dict[str, nn.Module]:
    """The quantized modules the record names, built empty on the meta device (no memory, whatever the args
    say), each checked to replace a module of its own shape."""
    rebuilt = {}
    for name, entry in modules.items():
        try:
            with torch.device("meta"):
                module = QUANTIZED_MODULES[entry["class"]](**entry["args"])
        except Exception as error:  # a constructor rejects bad args with TypeError, ValueError or ConfigError
            raise CorruptModelError(
                f"{source}: module {name} cannot be rebuilt from {entry['args']}: {error}"
            ) from None
        if not all(name.split(".")):
            raise CorruptModelError(f"{source}: module name {name!r} is not a module path (dotted names, none empty)")
        parent_name, _, leaf = name.rpartition(".")
        try:
            parent = model.get_submodule(parent_name)
        except AttributeError:
            raise CorruptModelError(f"{source}: the model has no module {parent_name!r} (for {name})") from None
        replaced = getattr(parent, leaf, None)
        if replaced is not None and not isinstance(replaced, nn.Module):
            raise CorruptModelError(f"{source}: {name} is a {type(replaced).__name__} of the model, not a module")
        expected = getattr(replaced, "weight", None)
        if hasattr(module, "in_features") and (
            expected is None
            or expected.shape
            not in ((module.out_features, module.in_features), (module.in_features, module.out_features))
        ):
            raise CorruptModelError(
                f"{source}: module {name} ({module.out_features} x {module.in_features}) does "
                f"not replace a linear of that shape in this model"
            )
        rebuilt[name] = module
    return rebuilt


def weights_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint: `model.safetensors`, or those its index lists (the out-of-core
    pipeline writes one per block), each inside the checkpoint."""
    if not (directory / INDEX_FILE).is_file() and not (directory / WEIGHTS_FILE).is_file():
        raise ModelNotFoundError(f"{directory} has {QUANT_FILE} but no {WEIGHTS_FILE}")
    return sorted(set(weight_files(directory).values()))


def check_weights_files(paths: list[Path], model: nn.Module, table_dtype: str | None = "float32") -> dict[str, Path]:
    """The files must hold, together, exactly the tensors of `model` (a meta-device skeleton), with their shapes
    and types (the float tables in `table_dtype`; None: any float dtype for every float tensor, as transformers
    converts them); checked on the headers, before anything is read into memory. Returns each name's file."""
    expected = model.state_dict()
    tables = float_tables(model)
    problems = []
    found: dict[str, Path] = {}
    for path in paths:
        try:
            with safe_open(str(path), "pt") as handle:
                for name in handle.keys():
                    found[name] = path
                    if name not in expected:
                        continue
                    stored = handle.get_slice(name)
                    if table_dtype is None and expected[name].is_floating_point():
                        dtypes = (torch.float32, torch.bfloat16, torch.float16)  # transformers converts them
                    elif name in tables:
                        dtypes = (TABLE_DTYPES[table_dtype],)
                    else:
                        dtypes = (expected[name].dtype,)
                    want = (list(expected[name].shape), [SAFETENSORS_DTYPES.get(dtype) for dtype in dtypes])
                    have = (stored.get_shape(), stored.get_dtype())
                    if have[0] != want[0] or have[1] not in want[1]:
                        problems.append(f"{name}: {have[1]} {have[0]}, expected {'/'.join(want[1])} {want[0]}")
        except (SafetensorError, OSError, ValueError) as error:
            raise CorruptModelError(f"{path} is not a readable safetensors file: {error}") from None
    unexpected = sorted(set(found) - set(expected))
    # Tied weights are stored once (safetensors drops the duplicate name): a name is not missing when a tensor
    # it is tied to is there.
    present = {id(tensor) for name, tensor in model.state_dict(keep_vars=True).items() if name in found}
    missing = sorted(name for name, tensor in model.state_dict(keep_vars=True).items() if id(tensor) not in present)
    if problems or unexpected or missing:
        detail = (
            problems[:2]
            + [f"unexpected {name}" for name in unexpected[:2]]
            + [f"missing {name}" for name in missing[:2]]
        )
        where = paths[0] if len(paths) == 1 else paths[0].parent
        raise CorruptModelError(f"{where} does not match its {QUANT_FILE}: {'; '.join(detail)}")
    return found


def _check_format(directory: Path, config) -> None:
    """A record config.json carries for transformers must be one this leanlm reads."""
    carried = getattr(config, "quantization_config", None)
    if isinstance(carried, dict) and carried.get("quant_method") == TRANSFORMERS_METHOD:
        version = carried.get("format_version")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise CorruptModelError(
                f"{directory}: this leanlm checkpoint is format {version!r}; this leanlm reads format "
                f"{FORMAT_VERSION} and older: upgrade leanlm"
            )


def load_quantized(
    directory: str | os.PathLike, dtype: torch.dtype = torch.float32, head: str = "float"
) -> tuple[LoadedModel, dict]:
    """(the rebuilt model, its leanlm_quant.json record). The model computes in `dtype` (`float_parts_to_`): its
    norms and float layers are held in it, the token embedding and a float output head too (`embeddings_to_`),
    and its quantized layers take and return activations in it. `head="int8"` makes the head 8-bit int blocks
    (`quantize_head_`). The tables are converted as they are read, a MiB at a time, so their stored float32 form
    is never whole in memory."""
    directory = Path(directory)
    record = read_record(directory)
    files = weights_files(directory)
    config = read_model_config(directory, quantized=True)
    _check_format(directory, config)
    table = architecture_for(config)
    # The tokenizer first: a damaged one is found before the slow part, and what building it takes beyond what it
    # keeps (hundreds of MiB for a vocabulary of 262k) is freed before the weights arrive, not on top of them.
    tokenizer = read_tokenizer(directory)
    trim_freed_memory()
    with torch.device("meta"):
        skeleton = model_from_config(config, dtype=torch.float32)
    rebuilt = rebuilt_modules(skeleton, record["modules"], directory / QUANT_FILE)
    for name, module in rebuilt.items():
        skeleton.set_submodule(name, module, strict=False)
    stored = check_weights_files(files, skeleton, record.get("table_dtype", "float32"))
    del skeleton, rebuilt
    # No float model first: parameters start on the meta device (buffers, such as RoPE's frequencies and the
    # quantized modules' codes, are real) and take the files' tensors, so resident memory is the stored bytes.
    with init_empty_weights(include_buffers=False):
        model = model_from_config(config, dtype=torch.float32)
    for name, entry in record["modules"].items():
        model.set_submodule(name, QUANTIZED_MODULES[entry["class"]](**entry["args"]), strict=False)
    tables = {name: stored[name] for name in _tables(model) if name in stored}
    unexpected = []
    for path in files:
        try:
            unexpected += model.load_state_dict(
                _read_file(path, skip=tables), strict=False, assign=True
            ).unexpected_keys
        except Exception as error:  # safetensors raises its own error types for damaged files
            raise CorruptModelError(f"the weights in {path} cannot be loaded: {error}") from None
    float_parts_to_(model, dtype)
    _load_tables(model, tables, dtype, head)
    left = [name for name, tensor in model.state_dict().items() if tensor.is_meta]
    if unexpected or left:
        raise CorruptModelError(f"the weights in {directory} do not fill the model: {(unexpected or left)[:3]}")
    after_load(model, record, directory)  # what the methods derive rather than store
    model.eval()
    use_gemv_(model)  # what stays float (the lm_head at least) decodes through leanlm's GEMV
    name = str(directory)
    return LoadedModel(model, tokenizer, name, directory, table, record.get("weights_note")), record


def _read_file(path: Path, skip: dict) -> dict[str, torch.Tensor]:
    """The tensors of one weights file but those in `skip`, copied out of it. safetensors maps the file, and a
    page read stays resident as long as any tensor viewing it (or the handle) lives: each tensor is copied
    through a handle of its own, so the pages mapped at any moment are one tensor's, however large the file (an
    in-memory checkpoint is one file of the whole model), and none outlives what the model keeps (W8A8's
    packing, for one, replaces its int8 weights)."""
    with safe_open(str(path), "pt") as handle:
        names = [name for name in handle.keys() if name not in skip]
    tensors = {}
    for name in names:
        with safe_open(str(path), "pt") as handle:
            tensors[name] = handle.get_tensor(name).clone()
    return tensors


_CHUNK_BYTES = 1 << 20  # float32 bytes of a table read (and quantized) at a time


def _rows_per_chunk(row_length: int) -> int:
    return max(1, _CHUNK_BYTES // (4 * row_length))


def _read_rows(path: Path, name: str, dtype: torch.dtype):
    """Tensor `name` of the weights file `path`, cast to `dtype` a MiB of float32 at a time: a handle per chunk,
    as the pages one handle reads stay resident until it closes (Gemma-3's float32 table, 671 MiB, would be
    resident whole beside what it is read into)."""
    with safe_open(str(path), "pt") as handle:
        shape = handle.get_slice(name).get_shape()
    rows = _rows_per_chunk(shape[-1])
    for first in range(0, shape[0], rows):
        with safe_open(str(path), "pt") as handle:
            yield handle.get_slice(name)[first : first + rows].to(dtype)


def _read_table(path: Path, name: str, dtype: torch.dtype) -> nn.Parameter:
    with safe_open(str(path), "pt") as handle:
        shape = handle.get_slice(name).get_shape()
    table, first = torch.empty(shape, dtype=dtype), 0
    for chunk in _read_rows(path, name, dtype):
        table[first : first + len(chunk)] = chunk
        first += len(chunk)
    return nn.Parameter(table, requires_grad=False)


def _load_tables(model: nn.Module, stored: dict[str, Path], dtype: torch.dtype, head: str) -> None:
    """The token embedding and output head from the files (`stored`: name -> file; a tied pair is stored once,
    under either name) in `dtype`, the head as 8-bit int blocks with head="int8"."""
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    tied = outputs is not None and bool(getattr(model.config, "tie_word_embeddings", False))
    names = dict(zip(("inputs", "outputs"), _tables(model)))

    def source(which: str) -> tuple[Path, str]:
        name = names[which] if names[which] in stored or not tied else next(iter(stored))
        return stored[name], name

    if not (head == "int8" and tied):
        inputs.weight = _read_table(*source("inputs"), dtype)
    if outputs is not None and head != "int8":
        outputs.weight = inputs.weight if tied else _read_table(*source("outputs"), dtype)
    if dtype != torch.float32 and not (head == "int8" and tied):
        embeddings_to_(model, dtype)  # the tables are in `dtype` already: what it adds is the cast back
    if head == "int8":
        quantize_head_(model, rows=_read_rows(*source("outputs"), dtype), tied=tied)


def retie_embeddings(model: nn.Module) -> None:
    """A tied output projection is stored once, under either name (safetensors keeps one of two shared
    tensors): both modules get the one that was loaded."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    if outputs is None:
        return
    if inputs.weight.is_meta:
        inputs.weight = outputs.weight
    else:
        outputs.weight = inputs.weight


def float_parts_to_(model: nn.Module, dtype: torch.dtype) -> None:
    """Hold the float parameters of a quantized model outside its quantized layers (norms, layers left in float)
    in `dtype`, so that it computes in `dtype` as a float model loaded in it does; the quantized layers take
    inputs in any float dtype and answer in it. Buffers keep theirs (RoPE's frequencies stay float32, as
    transformers makes them), and so do parameters still on the meta device (the tables, read later)."""
    if dtype == torch.float32:
        return
    quantized = {id(p) for m in model.modules() if isinstance(m, QuantizedModule) for p in m.parameters()}
    converted = {}  # id -> its new form: a tied parameter stays one tensor
    for module in model.modules():
        for name, parameter in list(module.named_parameters(recurse=False)):
            if parameter.is_floating_point() and not parameter.is_meta and id(parameter) not in quantized:
                if id(parameter) not in converted:
                    converted[id(parameter)] = nn.Parameter(parameter.detach().to(dtype), requires_grad=False)
                setattr(module, name, converted[id(parameter)])


def embeddings_to_(model: nn.Module, dtype: torch.dtype) -> None:
    """Hold a quantized model's token embedding and float output head in `dtype` (bfloat16: half the bytes of
    what are then its largest tensors, SmolLM2's tied 49152 x 576 is 108 MiB in float32). Everything else keeps
    computing in what it computes in (`_compute_dtype`): where that differs, the embedding's rows are cast to it
    as they are read, and the head's GEMV reads `dtype` weights with inputs in the other."""
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    tied = outputs is not None and outputs.weight is inputs.weight
    compute = _compute_dtype(model)
    inputs.weight = nn.Parameter(inputs.weight.detach().to(dtype), requires_grad=False)
    if compute != dtype:
        inputs.register_forward_hook(lambda module, args, output: output.to(compute))
    if tied:
        outputs.weight = inputs.weight
    elif isinstance(outputs, nn.Linear) and outputs.weight.is_floating_point():
        outputs.weight = nn.Parameter(outputs.weight.detach().to(dtype), requires_grad=False)


def _compute_dtype(model: nn.Module) -> torch.dtype:
    """What the model's layers compute in: the type of its float parameters besides the embedding and head
    (which `embeddings_to_` may hold in another)."""
    tables = {
        id(module.weight)
        for module in (model.get_input_embeddings(), model.get_output_embeddings())
        if module is not None and isinstance(getattr(module, "weight", None), torch.Tensor)
    }
    return next(
        (p.dtype for p in model.parameters() if p.is_floating_point() and not p.is_meta and id(p) not in tables),
        torch.float32,
    )


def load_any(
    source: str | os.PathLike,
    dtype: str = "float32",
    head: str = "float",
    adapter: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
    keep_freed_memory: bool = False,
) -> LoadedModel:
    """A float model (registry name, HF directory, .gguf) computing in `dtype` (see `compute_dtype`), or a leanlm
    quantized checkpoint computing in it too, its quantized layers through their kernels (`load_quantized`: the
    k-bit layers' GEMMs above decode sizes in `dtype` where the CPU multiplies it in hardware, `prefill_dtype`).
    `head="int8"`: the output head in 8-bit int blocks (`quantize_head_`). `adapter`: a LoRA adapter directory (`leanlm finetune`'s output) applied over
    the model as it was trained (its base quantized as then, the adapters beside it, in float32), or several over
    one base, each `NAME=DIR` or a directory named by its last component (`LoadedModel.adapters`; the first is
    the model's own, the others are chosen per batch row with `leanlm.nn.lora.adapter_rows`).

    Unless `keep_freed_memory`, the C library is told to give freed blocks back to the system at once, for the
    whole process (`return_freed_memory_at_once`): without it, the blocks a forward frees (activations, the
    kernels' de-quantized tiles) stay resident in glibc's heap, so resident memory exceeds what `leanlm plan`
    counts by an amount that varies from run to run (benchmarks/plan_accuracy.py)."""
    settings = LoadSettings(dtype, head, adapter, keep_freed_memory)  # checked before the slow load
    if not keep_freed_memory:  # from the start: loading leaves blocks in the heap too
        return_freed_memory_at_once()
    lora, adapters, configs = None, [], []
    if settings.adapter:
        from leanlm.methods.qlora import adapter_configs, named_adapters

        adapters = named_adapters(settings.adapter)
        configs = adapter_configs([directory for _, directory in adapters])  # damaged ones before the load
        lora = configs[0]
        dtype = "float32"
    if is_quantized_checkpoint(source):
        storage = compute_dtype(dtype)
        loaded = load_quantized(source, storage, head)[0]
        if storage != torch.float32:
            # The large-M GEMMs of k-bit / GPTQ layers take the activations' dtype where the CPU multiplies it in
            # hardware (`prefill_dtype`); decode sizes are the int8 kernels'.
            loaded.dtype = (
                f"{dtype_name(storage)}, quantized layers through their kernels (prefill GEMMs in "
                f"{dtype_name(prefill_dtype(storage))})"
            )
    else:
        loaded = load_model(source, dtype=dtype)
        if head == "int8":
            quantize_head_(loaded.model)
    if head == "int8":
        loaded.dtype += ", output head in 8-bit int blocks"
    if lora is not None:
        from leanlm.methods.qlora import add_lora_, load_adapters_, load_another_adapter_

        add_lora_(loaded.model, lora)
        load_adapters_(loaded.model, adapters[0][1])
        for (_, directory), config in zip(adapters[1:], configs[1:], strict=True):
            load_another_adapter_(loaded.model, directory, config)
        loaded.model.eval()
        loaded.adapters = tuple(name for name, _ in adapters)
        sources = ", ".join(str(directory) for _, directory in adapters)
        loaded.dtype += f", LoRA adapters from {sources} over a {lora.base} base"
    trim_freed_memory()  # what loading freed (a table converted, fbgemm's packing) leaves resident otherwise
    return loaded


def quantize_head_(model: nn.Module, rows=None, tied: bool | None = None) -> None:
    """The output head as 8-bit int blocks of 64 (a KbitLinear whose codes the int8 kernel reads as stored: 8.5
    bits a weight, as llama.cpp's Q8_0). At batch-1 decode a small model's head is its largest read (SmolLM2's
    49152 x 576: 54 MiB in bfloat16, 29 MiB so). A tied embedding then reads its rows from the head's codes
    (`KbitEmbedding`); the config says untied, so nothing ties them back to a float weight. `rows`: the head's
    weight a chunk of rows at a time (the loader's, read from the file), else the model's; `tied`: whether the
    embedding shares it (else: whether it does now)."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    in_features, out_features = head.weight.shape[1], head.weight.shape[0]
    if in_features % 64:
        raise ConfigError(f"an 8-bit head needs a hidden size that is a multiple of 64, not {in_features}")
    if tied is None:
        tied = embedding.weight.data_ptr() == head.weight.data_ptr()
    if rows is None:
        # A MiB at a time: the whole head in float32 beside its codes would be the load's peak memory (671 MiB
        # for Gemma-3's 262144 x 640), and quantizing takes several times a chunk's bytes while it runs.
        weight, step = head.weight.detach(), _rows_per_chunk(in_features)
        rows = (weight[first : first + step] for first in range(0, out_features, step))
    bias = getattr(head, "bias", None)
    quantized = KbitLinear(in_features, out_features, bias is not None, "int", 8, 64)
    codes = blocks = 0
    for chunk in rows:
        part = KbitLinear.from_float(chunk, None, "int", 8, 64)
        quantized.packed[codes : codes + part.packed.numel()] = part.packed
        quantized.absmax[blocks : blocks + part.absmax.numel()] = part.absmax
        codes, blocks = codes + part.packed.numel(), blocks + part.absmax.numel()
    if bias is not None:
        quantized.bias = bias.detach().float().clone()
    if tied:
        # The embedding reads the head's codes, so the table is held once (in 8 bits). A scaled embedding
        # (Gemma) multiplies as transformers does, in the float32 of the de-quantized rows.
        compute = _compute_dtype(model)
        scale = getattr(embedding, "embed_scale", None)
        model.set_input_embeddings(KbitEmbedding(quantized, compute, None if scale is None else float(scale)))
    model.set_output_embeddings(quantized)
    model.config.tie_word_embeddings = False
