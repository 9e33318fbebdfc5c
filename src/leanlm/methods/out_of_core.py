"""Quantize a model larger than memory: the block pipeline reading one decoder block at a time from the
safetensors shards and writing each quantized block to disk as soon as it is done.

    quantize_out_of_core("path/to/hf-model", KbitConfig(double_quant=True), "out/")

The model is a skeleton whose parameters live on the meta device (accelerate's `init_empty_weights`: no
memory). For each block `StreamedBlocks` reads that block's tensors (safetensors' `safe_open`, one tensor at a
time, as float32), the method plans of `quantize_` observe and quantize it exactly as they do in memory, and the
quantized block is written as one safetensors file (its module record and counts in the file's metadata) and
put back on the meta device. So resident memory holds one float block, the calibration windows' hidden states
(windows x seq_len x hidden x 4 bytes) and, for calibrated methods, the token embedding.

Every file goes into a staging directory beside the output (`.OUT.partial-resumable`), renamed into place only
when the whole checkpoint is written. A killed run leaves that directory; `resume=True` continues after the
last block written whole (each block file appears by rename), with the hidden states that enter it, saved
before the block's file. The checkpoint it makes is the one `load_quantized` reads: the same tensors as the
in-memory path (`quantize_` then `save_quantized`) writes, in one file per block plus one for the rest.
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, is_dataclass, replace
from pathlib import Path

import torch
from accelerate import init_empty_weights
from accelerate.utils import set_module_tensor_to_device
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from leanlm.errors import ConfigError, CorruptModelError
from leanlm.memory import return_freed_memory_at_once, trim_freed_memory
from leanlm.methods.blocks import ResidentBlocks
from leanlm.methods.checkpoint import (
    INDEX_FILE,
    TABLE_DTYPES,
    check_table_dtype,
    checkpoint_record,
    float_tables,
    quantized_module_records,
    retie_embeddings,
    write_checkpoint_files,
)
from leanlm.methods.quantize import Calibration, QuantRecord, quantize_
from leanlm.models.architectures import architecture_for, decoder_blocks
from leanlm.models.loading import LoadedModel, read_model_config, read_tokenizer, resolve_float_directory
from leanlm.models.untrusted import model_from_config, stored_names, weight_files
from leanlm.nn import use_gemv_
from leanlm.storage import (
    QUANTIZED_MARKER,
    check_output_directory,
    partial_path,
    resumable_staging,
    write_text_atomically,
)

_JOB_FILE, _OWNER_FILE = ".job.json", ".owner.pid"  # the run a staging directory belongs to


def block_file(index: int) -> str:
    return f"block-{index:05d}.safetensors"


def _hidden_file(index: int) -> str:  # the calibration windows' hidden states entering block `index`
    return f"hidden-{index:05d}.safetensors"


class SafetensorsShards:
    """The tensors of a Hugging Face model directory (`model.safetensors`, or the shards its
    `model.safetensors.index.json` lists), each read on its own as float32, under the names `model` (a
    skeleton) gives them: transformers renames some stored names on load (GPT-NeoX's `embed_out` is `lm_head`),
    and its own renaming rules are applied here."""

    def __init__(self, directory: Path, model: nn.Module):
        self.directory = directory
        self.files = weight_files(directory)
        self.stored_names = stored_names(model, list(self.files))
        self.files = {name: self.files[stored] for name, stored in self.stored_names.items()}

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str) -> torch.Tensor:
        """A fresh float32 copy (the file's memory map is closed at once, so its pages leave resident memory)."""
        try:
            with safe_open(str(self.files[name]), "pt") as handle:
                return handle.get_tensor(self.stored_names[name]).to(torch.float32, copy=True)
        except (SafetensorError, OSError) as error:
            raise CorruptModelError(f"{self.files[name]}: tensor {name} cannot be read: {error}") from None

    def fill(self, module: nn.Module, prefix: str = "", skip: tuple[str, ...] = ()) -> list[str]:
        """Give `module`'s tensors still on the meta device their stored values (`prefix` + name), except
        those whose names start with one of `skip`; returns the names filled."""
        tensors = module.state_dict(keep_vars=True)
        stored = {id(tensor) for name, tensor in tensors.items() if prefix + name in self}
        # A tied tensor (an output head sharing the embedding) is read under the name it is stored by.
        wanted = [
            name
            for name, tensor in tensors.items()
            if tensor.is_meta and not name.startswith(skip) and (prefix + name in self or id(tensor) not in stored)
        ]
        absent = [prefix + name for name in wanted if prefix + name not in self]
        if absent:
            raise CorruptModelError(
                f"the weights in {self.directory} lack {len(absent)} of the model's tensors ({', '.join(absent[:3])})"
            )
        module.load_state_dict({name: self.get(prefix + name) for name in wanted}, strict=False, assign=True)
        return wanted


def model_skeleton(config) -> nn.Module:
    """The float32 model of `config` with every parameter on the meta device (buffers such as RoPE's
    frequencies are real and small)."""
    with init_empty_weights(include_buffers=False):
        model = model_from_config(config, dtype=torch.float32)
    retie_embeddings(model)  # a tied output head is the embedding's parameter, stored once
    return model.eval()


class ShardBlocks(ResidentBlocks):
    """Blocks read from `shards` when the pipeline reaches them and kept, quantized, in memory: a model loaded
    quantized with no more than one block ever in float (`load_quantizing`)."""

    def __init__(self, model: nn.Module, shards: SafetensorsShards):
        self.model, self.shards = model, shards
        self.table = architecture_for(model)
        super().__init__(decoder_blocks(model, self.table))

    def _outside_blocks(self) -> list[str]:
        """Read what lies outside the blocks but the output head (token and position embeddings, norms)."""
        head = _module_prefix(self.model, self.model.get_output_embeddings())
        filled = self.shards.fill(self.model, skip=(f"{self.table.blocks}.", head))
        retie_embeddings(self.model)
        return filled

    def inputs(self):
        self._outside_blocks()
        return nullcontext()

    def _block_prefix(self, index: int) -> str:
        return f"{self.table.blocks}.{index}."

    def load(self, index: int) -> nn.Module:
        block = self.blocks[index]
        # Ordinary tensors, though the pipeline runs in inference mode: what the block keeps in float (its norms)
        # may be trained through later (QLoRA over this base).
        with torch.inference_mode(False):
            self.shards.fill(block, self._block_prefix(index))
        return block

    def release(self, index: int, block: nn.Module, hidden, result) -> None:
        trim_freed_memory()  # the float weights just replaced


class StreamedBlocks(ShardBlocks):
    """The block source of an out-of-core run: each block read from `shards` when the pipeline needs it, and
    written to the staging directory of `out` (then emptied) when it is done."""

    def __init__(self, model: nn.Module, shards: SafetensorsShards, out: Path, job: dict, resume: bool):
        super().__init__(model, shards)
        self.out = out
        self.job = json.loads(json.dumps(job, default=str))  # as it reads back from job.json
        self.staging = resumable_staging(out)
        self.modules: dict[str, dict] = {}
        if self.staging.exists():
            self._check_resumable(resume)

    def _check_resumable(self, resume: bool) -> None:
        owner = (self.staging / _OWNER_FILE).read_text().strip() if (self.staging / _OWNER_FILE).is_file() else ""
        if owner.isdigit() and int(owner) != os.getpid() and Path(f"/proc/{owner}").exists():
            raise ConfigError(f"{self.staging} is being written by another leanlm process (pid {owner})")
        done = len(list(self.staging.glob("block-*.safetensors")))
        if not done:  # killed before its first block was written: nothing worth keeping
            shutil.rmtree(self.staging)
            return
        if not resume:
            raise ConfigError(
                f"an interrupted run left {self.staging} ({done} of {len(self)} blocks written): add "
                "--resume to finish it, or remove that directory to start again"
            )
        try:
            started = json.loads((self.staging / _JOB_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            started = None
        if started != self.job:
            changed = sorted(
                key for key in self.job if not isinstance(started, dict) or started.get(key) != self.job[key]
            )
            raise ConfigError(
                f"{self.staging} was started with other settings ({', '.join(changed) or 'unreadable'}); "
                "repeat them to resume, or remove that directory to start again"
            )

    @contextmanager
    def inputs(self):
        """What the calibration windows pass through before the blocks, read for as long as they do: an 8B
        model's embedding is 0.8 GB in float32. (An untied output head is read only when the checkpoint is
        published.)"""
        filled = self._outside_blocks()
        try:
            yield
        finally:
            for name in filled:
                set_module_tensor_to_device(self.model, name, "meta")
            if getattr(self.model.config, "tie_word_embeddings", False):  # the head held the embedding too
                self.model.get_output_embeddings().weight = self.model.get_input_embeddings().weight

    def resume(self, hidden):
        self.staging.mkdir(parents=True, exist_ok=True)
        for partial in self.staging.glob(".*.partial-*"):  # a file a killed run was writing
            partial.unlink()
        write_text_atomically(self.staging / _JOB_FILE, json.dumps(self.job, indent=2) + "\n")
        write_text_atomically(self.staging / _OWNER_FILE, f"{os.getpid()}\n")
        results = []
        while (self.staging / block_file(len(results))).is_file() and len(results) < len(self):
            path = self.staging / block_file(len(results))
            try:
                with safe_open(str(path), "pt") as handle:
                    metadata = handle.metadata() or {}
                self.modules.update(json.loads(metadata["leanlm_modules"]))
                results.append(json.loads(metadata["leanlm_counts"]))
            except (SafetensorError, OSError, ValueError, KeyError) as error:
                raise CorruptModelError(f"{path} cannot be resumed from: {error}; remove {self.staging}") from None
        if results and hidden is not None and len(results) < len(self):
            path = self.staging / _hidden_file(len(results))
            try:
                saved = load_file(str(path))
            except (SafetensorError, OSError) as error:
                raise CorruptModelError(f"{path} cannot be resumed from: {error}; remove {self.staging}") from None
            if len(saved) != len(hidden):
                raise ConfigError(f"{path} holds {len(saved)} calibration windows, this run has {len(hidden)}")
            hidden = [saved[str(window)] for window in range(len(hidden))]
        if results:
            print(f"resuming {self.staging.name}: {len(results)} of {len(self)} blocks already written", flush=True)
        return results, hidden

    def release(self, index: int, block: nn.Module, hidden, result) -> None:
        prefix = self._block_prefix(index)
        modules = quantized_module_records(block, prefix)
        if hidden is not None:  # the next block's inputs first: a block file on disk always has them beside it
            _write_atomically(
                self.staging / _hidden_file(index + 1),
                {str(window): state.contiguous() for window, state in enumerate(hidden)},
                {},
            )
        _write_atomically(
            self.staging / block_file(index),
            {prefix + name: tensor.contiguous() for name, tensor in block.state_dict().items()},
            {QUANTIZED_MARKER: "1", "leanlm_modules": json.dumps(modules), "leanlm_counts": json.dumps(result)},
        )
        (self.staging / _hidden_file(index)).unlink(missing_ok=True)
        self.modules.update(modules)
        block.to("meta")
        trim_freed_memory()

    def discard_if_empty(self) -> None:
        if self.staging.is_dir() and not any(self.staging.glob("block-*.safetensors")):
            shutil.rmtree(self.staging, ignore_errors=True)

    def publish(
        self, record: dict, tokenizer, name: str, weights_note: str | None, table_dtype: str = "float32"
    ) -> Path:
        """Write what is outside the blocks (the float tables in `table_dtype`), the index, config, tokenizer
        and record; then the staging directory becomes `out` in one rename."""
        weight_map, seen = {}, set()
        tables = float_tables(self.model)
        for key, tensor in self.model.state_dict(keep_vars=True).items():
            if key.startswith(f"{self.table.blocks}.") or id(tensor) in seen:
                continue  # a tied output head is stored once, as the in-memory checkpoint does
            seen.add(id(tensor))
            if tensor.is_meta and key not in self.shards:
                raise CorruptModelError(f"the weights in {self.shards.directory} lack {key}")
            # One file each: an 8B model's embedding and output head are 0.8 GB apiece in float32.
            file = f"outside-blocks-{len(seen):02d}.safetensors"
            value = self.shards.get(key) if tensor.is_meta else tensor.detach()
            if key in tables:
                value = value.to(TABLE_DTYPES[table_dtype])
            _write_atomically(self.staging / file, {key: value}, {QUANTIZED_MARKER: "1"})
            weight_map[key] = file
        for index in range(len(self)):
            with safe_open(str(self.staging / block_file(index)), "pt") as handle:
                weight_map.update({key: block_file(index) for key in handle.keys()})
        (self.staging / INDEX_FILE).write_text(
            json.dumps({"metadata": {"format": "pt"}, "weight_map": weight_map}, indent=2) + "\n"
        )
        quant = checkpoint_record(
            {**record, "table_dtype": table_dtype},
            name,
            weights_note,
            self.model.config._attn_implementation,
            self.modules,
        )
        write_checkpoint_files(self.model.config, tokenizer, quant, self.staging)
        check_output_directory(self.out)
        if self.out.is_dir():
            self.out.rmdir()  # empty (checked): rename(2) replaces only an empty directory
        self.staging.replace(self.out)
        for leftover in (_JOB_FILE, _OWNER_FILE):  # kept to the end, so that a kill at any point can resume
            (self.out / leftover).unlink(missing_ok=True)
        return self.out


def _write_atomically(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    partial = partial_path(path)
    save_file(tensors, str(partial), metadata={"format": "pt", **metadata})
    os.replace(partial, path)


def _job(directory: Path, configs: tuple, calibration: Calibration | None) -> dict:
    """What a run makes, for `resume` to check it continues the same run."""
    described = [
        {"method": type(config).__name__, **(asdict(config) if is_dataclass(config) else {})} for config in configs
    ]
    windows = (
        None
        if calibration is None
        else {key: getattr(calibration, key) for key in ("samples", "seq_len", "seed", "source")}
    )
    return {"source": str(directory.resolve()), "steps": described, "calibration": windows}


def quantize_out_of_core(
    source: str | os.PathLike,
    config,
    out: str | os.PathLike,
    *,
    calibration: Calibration | None = None,
    resume: bool = False,
    table_dtype: str = "float32",
) -> tuple[Path, QuantRecord]:
    """Quantize the float model `source` (registry name, HF directory of safetensors, .gguf) with `config` (as
    `quantize_` takes it) block by block from disk into the checkpoint `out`, its token embedding and float
    output head stored in `table_dtype`; (out, the record). A method that needs the whole model raises
    `NeedsWholeModelError` before any block is read."""
    check_table_dtype(table_dtype)
    out = check_output_directory(out)
    directory, weights_note = resolve_float_directory(source)
    model_config = read_model_config(directory)
    tokenizer = read_tokenizer(directory)
    model = model_skeleton(model_config)
    shards = SafetensorsShards(directory, model)
    configs = tuple(config) if isinstance(config, (list, tuple)) else (config,)
    if calibration is not None:
        calibration = replace(calibration, tokenizer=tokenizer)
    blocks = StreamedBlocks(model, shards, out, _job(directory, configs, calibration), resume)
    try:
        record = quantize_(model, configs, calibration=calibration, source=blocks)
        record["pipeline"] = "out of core: one block at a time from disk"
        return blocks.publish(record, tokenizer, str(source), weights_note, table_dtype), record
    except BaseException:
        blocks.discard_if_empty()  # stopped before any block was written: nothing worth resuming
        raise


def quantize_checkpoint(
    source: str | os.PathLike,
    configs: tuple,
    out: str | os.PathLike,
    *,
    calibration: Calibration | None = None,
    resume: bool = False,
    table_dtype: str = "float32",
    say=print,
) -> tuple[Path, QuantRecord]:
    """What `leanlm quantize` does: out of core, or in memory (saying why) for a method that needs the whole model.
    Either way freed memory goes back to the system at once (`return_freed_memory_at_once`), so that the peak is
    the live tensors' (`leanlm plan`): the solvers' many temporaries otherwise stay resident in glibc's heap."""
    from leanlm.errors import NeedsWholeModelError
    from leanlm.methods.checkpoint import save_quantized
    from leanlm.models import load_model

    return_freed_memory_at_once()
    try:  # block by block from disk: resident memory holds one float block, whatever the model's size
        return quantize_out_of_core(
            source, configs, out, calibration=calibration, resume=resume, table_dtype=table_dtype
        )
    except NeedsWholeModelError as reason:
        say(f"quantizing in memory: {reason}")
        loaded = load_model(source)
        calibration = replace(calibration or Calibration(), tokenizer=loaded.tokenizer)
        record = quantize_(loaded.model, configs, calibration=calibration)
        return save_quantized(loaded, loaded.model, record, out, table_dtype), record


def _module_prefix(model: nn.Module, module: nn.Module) -> str:
    return next(f"{name}." for name, candidate in model.named_modules() if candidate is module)


def load_quantizing(
    source: str | os.PathLike, config, *, calibration: Calibration | None = None
) -> tuple[LoadedModel, QuantRecord]:
    """The float model `source` loaded quantized by `config` (as `quantize_` takes it), block by block: each
    block is read, quantized and kept, so no more than one block is ever in float (QLoRA's base is loaded so).
    Returns (the model, the record)."""
    directory, weights_note = resolve_float_directory(source)
    model_config = read_model_config(directory)
    tokenizer = read_tokenizer(directory)
    model = model_skeleton(model_config)
    shards = SafetensorsShards(directory, model)
    if calibration is not None:
        calibration = replace(calibration, tokenizer=tokenizer)
    record = quantize_(model, config, calibration=calibration, source=ShardBlocks(model, shards))
    shards.fill(model)  # the rest: the output head, and the embeddings if no calibration read them
    retie_embeddings(model)
    use_gemv_(model)
    return LoadedModel(model, tokenizer, str(source), directory, architecture_for(model), weights_note), record
