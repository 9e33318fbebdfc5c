"""What fits before anything loads: `leanlm plan MODEL [--memory 8GiB] [--context 4096]`.

From the model's config alone (config.json, or a GGUF's header) leanlm builds the model's skeleton on the meta
device (accelerate's empty weights), and for every method row of the showcase builds each quantized layer the
method would write, empty, on the meta device too: the stored bytes are those modules' buffers, the same bytes a
checkpoint holds. Around them three estimates, each the sum of named parts (`Estimate.parts`):

- stored: the quantized layers plus the tables (token embedding, norms, an untied output head) in float32;
- running: this process' own resident memory once torch and transformers are imported (what any leanlm process
  starts from), the weights and what the layers derive from them for their kernels (`runtime_bytes`), the KV
  cache at the context asked (or the sink cache's fixed size) and the working memory of one prefill chunk (the
  k-bit kernels' de-quantized tile included), or the load's own peak where that is higher (W8A8 packs its int8
  weights for fbgemm one shared-input group at a time, the group's plain and stacked copies beside its packed
  one). What a forward frees is given back to the system at once (`load_any`), so the live tensors are the
  peak;
- quantizing: `leanlm quantize`'s peak, out of core (one float block, the calibration windows' hidden states, the
  method's per-block statistics) or in memory for methods that need the whole model.

benchmarks/plan_accuracy.py measures each estimate against the process it predicts.
"""

from __future__ import annotations

import math
import os
import re
import weakref
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from leanlm.errors import ConfigError, UnsupportedArchitectureError
from leanlm.formats.ggml_inputs import int8_roundings
from leanlm.kernels.kbit_gemm import TILE_ROWS
from leanlm.settings import option

if TYPE_CHECKING:
    from leanlm.methods.bit_allocation import RecipeBudget

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
PREFILL_CHUNK = 512  # tokens per prefill forward (`leanlm serve`, `leanlm chat`)
# SpQR's outliers depend on the weights: the share its default threshold keeps on the real models
# (benchmarks/plan_accuracy.py reports the stored bytes they take)
SPQR_OUTLIER_SHARE = 0.024
# What tokenizing the calibration text leaves resident beside the windows it makes, and a loaded fast tokenizer's
# bytes per vocabulary entry (constants; benchmarks/plan_accuracy.py checks the peaks they are part of).
CALIBRATION_TEXT = 96 * 2**20
TOKENIZER_BYTES_PER_TOKEN = 900


def parse_bytes(text: str) -> int:
    """ "8GiB", "12GB", "512 MiB" or a plain number of bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in UNITS:
        raise ConfigError(f"memory {text!r}: expected a size such as 8GiB, 12GB or 512MiB")
    return int(float(match.group(1)) * UNITS[match.group(2).lower()])


def available_memory() -> int:
    """What this machine can give a new process now: MemAvailable, within a cgroup's limit if one is set."""
    available = None
    with open("/proc/meminfo") as handle:
        for line in handle:
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    limit = _cgroup_room()
    candidates = [value for value in (available, limit) if value is not None]
    if not candidates:
        raise ConfigError("cannot tell this machine's available memory: give --memory")
    return min(candidates)


def _cgroup_room() -> int | None:
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
    except (OSError, ValueError):
        return None
    return None if limit == "max" else int(limit) - used


def current_rss() -> int:
    """This process' resident memory now."""
    from leanlm.bench.harness import process_memory_bytes

    return process_memory_bytes(os.getpid(), "VmRSS")


@dataclass(frozen=True)
class PlanSettings:
    memory: str | None = option(
        None,
        "memory to plan for (8GiB, 12GB, 512MiB, ...); default: this machine's available memory",
        none_word="available",
    )
    context: int = option(4096, "tokens in the KV cache when running")
    calibration_samples: int | None = option(
        None,
        "calibration windows of the calibrated methods, as `leanlm quantize --calib-samples` (default: each "
        "method's own)",
        flag="--calib-samples",
        none_word="default",
    )

    def __post_init__(self):
        if self.memory is not None:
            parse_bytes(self.memory)
        if self.context < 1:
            raise ConfigError(f"context must be at least 1, got {self.context}")
        if self.calibration_samples is not None and self.calibration_samples < 1:
            raise ConfigError(f"calibration samples must be at least 1, got {self.calibration_samples}")

    def applied(self, configs: tuple) -> tuple:
        """`configs` with these calibration windows where a config has that setting."""
        if self.calibration_samples is None:
            return tuple(configs)
        return tuple(
            replace(c, calibration_samples=self.calibration_samples) if hasattr(c, "calibration_samples") else c
            for c in configs
        )


@dataclass
class ModelFacts:
    """What the planner needs of a model, read from its skeleton."""

    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    linears: list[tuple[str, int, int, bool]]  # (name, in_features, out_features, bias), every quantizable linear
    block_parameters: int  # numel of one decoder block (the largest)
    table_parameters: int  # numel outside the blocks (embedding, norms, untied head), tied weights once
    total_parameters: int
    tied_embeddings: bool  # the output head is the token embedding
    stored_dtype: torch.dtype = torch.float32  # of a float model's weights as loading reads them
    block_prefix: str = ""  # what a linear's name starts with before BLOCK.PATH, as tensor-type patterns name it
    # what llama.cpp's file of each type spends on the block linears (--size-of), where leanlm knows the family's
    # GGUF layout
    recipes: dict[str, RecipeBudget] = field(default_factory=dict)
    gguf_names: dict[str, str] = field(default_factory=dict)  # {BLOCK.PATH: GGUF tensor name}, where it knows them

    @property
    def recipe_bits(self) -> dict[str, float]:
        """{llama.cpp file type: the bits per weight its recipe spends on the block linears}."""
        return {recipe: budget.bits for recipe, budget in self.recipes.items()}


def model_facts(source: str) -> ModelFacts:
    """`source`'s facts from its config alone (no weight is read)."""
    from leanlm.methods.out_of_core import model_skeleton
    from leanlm.models.architectures import (
        architecture_for,
        attention_shape,
        decoder_blocks,
        iter_quantizable_linears,
    )

    config = read_config(source)
    model = model_skeleton(config)
    table = architecture_for(model)
    linears = []
    for name, module in iter_quantizable_linears(model, table):
        weight = module.weight if table.weight_layout == "out_in" else module.weight.t()
        out_features, in_features = weight.shape
        linears.append((name, in_features, out_features, getattr(module, "bias", None) is not None))
    blocks = decoder_blocks(model, table)
    block_sizes = [sum(p.numel() for p in block.parameters()) for block in blocks]
    total = sum(p.numel() for p in model.parameters())
    text, shape = config.get_text_config(), attention_shape(config)
    recipes, gguf_names = _recipes(model)
    return ModelFacts(
        name=str(source),
        layers=len(blocks),
        hidden=text.hidden_size,
        intermediate=getattr(text, "intermediate_size", 4 * text.hidden_size),
        heads=shape.heads,
        kv_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        vocab=text.vocab_size,
        linears=linears,
        block_parameters=max(block_sizes),
        table_parameters=total - sum(block_sizes),
        total_parameters=total,
        tied_embeddings=bool(getattr(text, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False))),
        stored_dtype=stored_float_dtype(source),
        block_prefix=f"{table.blocks}.",
        recipes=recipes,
        gguf_names=gguf_names,
    )


def _recipes(model) -> tuple[dict[str, RecipeBudget], dict[str, str]]:
    """({llama.cpp file type: what its recipe spends on `model`'s block linears}, {BLOCK.PATH: GGUF tensor name} of
    those linears); both empty for a family whose GGUF layout leanlm does not know."""
    from leanlm.formats.llama_cpp_recipes import RECIPES
    from leanlm.methods.bit_allocation import budget_of, linear_gguf_names, recipe_rows

    try:
        read, names = recipe_rows(model), linear_gguf_names(model)
    except (ConfigError, UnsupportedArchitectureError):
        return {}, {}
    return {recipe: budget_of(recipe, *read) for recipe in RECIPES}, names


def stored_float_dtype(source: str) -> torch.dtype:
    """The float dtype holding most of a model directory's weights, from its safetensors headers (no tensor is
    read); float32 for a GGUF or registry model, which leanlm converts to float32 shards."""
    from leanlm.methods.checkpoint import SAFETENSORS_DTYPES
    from leanlm.models.untrusted import FLOAT_DTYPES, INDEX_FILE, WEIGHTS_FILE, stored_tensors, weight_files

    path = Path(source).expanduser()
    if not (path / WEIGHTS_FILE).is_file() and not (path / INDEX_FILE).is_file():
        return torch.float32
    numels: dict[str, int] = {}
    for file in set(weight_files(path).values()):
        for dtype, shape in stored_tensors(file).values():
            if dtype in FLOAT_DTYPES:
                numels[dtype] = numels.get(dtype, 0) + math.prod(shape)
    dtypes = {code: dtype for dtype, code in SAFETENSORS_DTYPES.items()}
    return dtypes.get(max(numels, key=numels.get), torch.float32) if numels else torch.float32


def read_config(source: str):
    """The config of a registry name, model directory, leanlm checkpoint or .gguf file, converting nothing."""
    from leanlm.methods.checkpoint import is_quantized_checkpoint
    from leanlm.models.gguf_conversion import gguf_config
    from leanlm.models.loading import cached_float_directory, read_model_config
    from leanlm.models.registry import REGISTRY, gguf_path_of
    from leanlm.storage import cache_root

    if source in REGISTRY:
        registered = REGISTRY[source]
        gguf = gguf_path_of(registered, cache_root() / "gguf")
        directory = cached_float_directory(gguf, registered.sha256)
        return read_model_config(directory) if (directory / "config.json").is_file() else gguf_config(gguf)
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return gguf_config(path)
    if path.is_dir():
        return read_model_config(path, quantized=is_quantized_checkpoint(path))
    from leanlm.models.loading import resolve_float_directory

    resolve_float_directory(source)  # its one line naming what `source` is not
    raise AssertionError("unreachable")


class _LiveTensors(TorchDispatchMode):
    """Counts the bytes of every storage an operation makes, from when it is made until the last tensor using it is
    freed, and keeps the peak. A view's output uses its input's storage (under fake tensors it has one of its own);
    the storages made before (the parameters and buffers) are not counted. Storages are known by their addresses,
    each pinned by a weak reference while it is known, so that no other storage is given its address (a tensor can
    let go of its storage while it lives, as a lifted constant does under fake tensors)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.before = {t.untyped_storage()._cdata for t in (*model.parameters(), *model.buffers())}
        self.uses: dict[int, int] = {}  # a tensor's own storage -> the storage it uses, while a tensor has it
        self.holders: dict[int, int] = {}  # an own storage in `uses` -> the tensors alive that have it
        self.users: dict[int, int] = {}  # a storage counted -> the tensors alive that use it
        self.sizes: dict[int, int] = {}
        self.pins: dict[int, StorageWeakRef] = {}  # every address in `uses` or `users` -> its storage, weakly
        self.live = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        viewed = args[0] if func.is_view and args and isinstance(args[0], torch.Tensor) else None
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor):
                continue
            source = viewed if viewed is not None else tensor
            used = self._storage(source)
            if used in self.before:
                continue
            own = tensor.untyped_storage()._cdata
            for pinned in (source, tensor):
                storage = pinned.untyped_storage()
                if storage._cdata not in self.pins:
                    self.pins[storage._cdata] = StorageWeakRef(storage)
            self.uses[own] = used
            self.holders[own] = self.holders.get(own, 0) + 1
            if used not in self.users:
                self.users[used], self.sizes[used] = 0, tensor.untyped_storage().nbytes()
                self.live += self.sizes[used]
                self.peak = max(self.peak, self.live)
            self.users[used] += 1
            weakref.finalize(tensor, self._released, own, used)
        return out

    def _storage(self, tensor: torch.Tensor) -> int:
        own = tensor.untyped_storage()._cdata
        return self.uses.get(own, own)

    def _released(self, own: int, used: int) -> None:
        self.holders[own] -= 1
        if not self.holders[own]:  # no tensor has this storage now
            del self.holders[own], self.uses[own]
        self.users[used] -= 1
        if not self.users[used]:
            del self.users[used]
            self.live -= self.sizes.pop(used)
        for address in {own, used}:
            if address not in self.uses and address not in self.users:
                self.pins.pop(address, None)


def gradient_pass_bytes(config, tokens: int) -> int:
    """The peak of the tensors alive while one window of `tokens` goes forward and back through the float32 model
    for the next-token loss, its parameters frozen, as each window of the Fisher allocation does
    (`collect_sensitivity`): transformers' own forward and backward run on fake tensors, which take no memory and do
    no arithmetic, and every tensor they make is counted until it is freed. The fake forward keeps a KV cache: without
    one, transformers cannot tell fake positions from a packed batch's and builds a causal mask that the real run
    leaves to the attention kernel (changing the kernel, and what it keeps), so the count can exceed the real one
    by at most the cache's bytes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from leanlm.methods.calibration import activation_gradients
    from leanlm.models.untrusted import model_from_config

    with FakeTensorMode():
        model = model_from_config(config, dtype=torch.float32).eval()
        ids = torch.zeros((1, tokens), dtype=torch.long)
        with activation_gradients(model), _LiveTensors(model) as live:
            model(input_ids=ids, labels=ids, use_cache=True).loss.backward()
    return live.peak


def empty_linear(config, in_features: int, out_features: int, bias: bool, block_type: str | None = None) -> nn.Module:
    """The module `config`'s method writes for a linear of this shape (in GGUF blocks of `block_type`, if given),
    empty, on the meta device."""
    from leanlm.formats.packing import preferred_layout
    from leanlm.methods.gptq import GPTQConfig, RTNConfig, SpQRConfig
    from leanlm.methods.kbit import KbitConfig
    from leanlm.methods.w8a8 import LEVELS, LLMInt8Config, W8A8Config
    from leanlm.nn.gguf_linear import GGUFLinear
    from leanlm.nn.kbit_linear import KbitLinear
    from leanlm.nn.spqr_linear import SpQRLinear
    from leanlm.nn.w8a8_linear import W8A8Linear

    with torch.device("meta"):
        if block_type is not None:
            return GGUFLinear(in_features, out_features, bias, block_type)
        if isinstance(config, LLMInt8Config):
            config = config.w8a8()
        if isinstance(config, W8A8Config):
            activation, static = LEVELS[config.level]
            return W8A8Linear(
                in_features, out_features, bias, activation, static, None, config.outlier_threshold, config.asymmetric
            )
        if isinstance(config, KbitConfig):
            proxy = round(config.proxy_fraction * in_features)
            return KbitLinear(
                in_features,
                out_features,
                bias,
                config.dtype,
                config.bits,
                config.block_size,
                config.double_quant,
                config.exponent_bits,
                proxy_dims=proxy,
            )
        if isinstance(config, (RTNConfig, GPTQConfig, SpQRConfig)):
            settings = config.solver()
            outliers = round(SPQR_OUTLIER_SHARE * in_features * out_features) if isinstance(config, SpQRConfig) else 0
            return SpQRLinear(
                in_features,
                out_features,
                bias,
                settings.bits,
                settings.group_size,
                settings.statistic_bits,
                settings.statistic_group_size,
                outliers,
                settings.act_order,
                preferred_layout(settings.bits),
            )
    raise ConfigError(f"the planner does not know the layers of {type(config).__name__}")


def module_bytes(module: nn.Module) -> int:
    """The bytes of a module's tensors, on the meta device too (`weight_bytes` tells storages apart by their address,
    which meta tensors do not have)."""
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


@dataclass
class Estimate:
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.parts.values())


@dataclass
class RowPlan:
    row: str
    description: str
    stored: Estimate
    running: Estimate
    quantizing: Estimate | None  # None: nothing to quantize
    quantizing_path: str | None  # "out of core" or "in memory"
    quantizing_phase: str | None = None  # the phase of quantizing that peaks (`quantizing_phases`)

    def as_dict(self, memory: int) -> dict:
        peak = max(self.running.total, self.quantizing.total if self.quantizing else 0)
        return {
            "row": self.row,
            "description": self.description,
            "stored_bytes": self.stored.total,
            "running_bytes": self.running.total,
            "quantizing_bytes": self.quantizing.total if self.quantizing else None,
            "quantizing_path": self.quantizing_path,
            "quantizing_phase": self.quantizing_phase,
            "fits": peak <= memory,
            "parts": {
                "stored": self.stored.parts,
                "running": self.running.parts,
                "quantizing": self.quantizing.parts if self.quantizing else None,
            },
        }


def kv_cache_bytes(facts: ModelFacts, tokens: int, dtype_bytes: int = 4) -> int:
    return facts.layers * 2 * facts.kv_heads * facts.head_dim * tokens * dtype_bytes


def prefill_workspace(facts: ModelFacts, context: int, dtype_bytes: int = 4) -> int:
    """One prefill chunk's activations: its hidden states and MLP intermediates, and the attention scores of the
    chunk over the whole context."""
    chunk = min(PREFILL_CHUNK, context)
    scores = 3 * facts.heads * chunk * context * 4  # the scores, their softmax and the masked copy, in float32
    return token_activations(facts, chunk, dtype_bytes) + scores


def token_activations(facts: ModelFacts, tokens: int, dtype_bytes: int = 4) -> int:
    """What a forward of `tokens` tokens holds at once besides attention scores: hidden states and MLP
    intermediates."""
    return tokens * (6 * facts.hidden + 3 * facts.intermediate) * dtype_bytes


def stored_estimate(facts: ModelFacts, configs: tuple, table_bytes: int = 4) -> tuple[Estimate, dict[str, int], int]:
    """(stored bytes, stored bytes per quantized module type, what the quantized linears derive from their
    buffers to run: their `runtime_bytes`)."""
    quantizer = _weight_quantizer(configs)
    parts: dict[str, int] = {"tables": facts.table_parameters * table_bytes}
    by_type: dict[str, int] = {}
    if quantizer is None:
        parts["linears"] = sum(i * o + (o if b else 0) for _, i, o, b in facts.linears) * table_bytes
        return Estimate(parts), by_type, 0
    runtime = 0.0
    for (in_features, out_features, bias, block_type), count in _planned_linears(facts, quantizer).items():
        module = empty_linear(quantizer, in_features, out_features, bias, block_type)
        kind = type(module).__name__
        by_type[kind] = by_type.get(kind, 0) + round(count * module_bytes(module))
        runtime += count * module.runtime_bytes()
    parts["linears"] = sum(by_type.values())
    return Estimate(parts), by_type, round(runtime)


def _planned_linears(facts: ModelFacts, quantizer) -> dict[tuple[int, int, bool, str | None], float]:
    """{(in_features, out_features, bias, GGUF block type or None: the method's own layout): how many linears}.
    A linear takes the user's pattern's type, else a budget's, else --gguf-type's. llama.cpp's recipe
    (--allocation recipe) gives its own types, planned as they are. The types any other budget gives are chosen
    from the data, after the plan: it is planned as the two candidate types whose bits per weight enclose the
    budget, in the shares that spend it exactly."""
    from leanlm.formats.gguf_blocks import BLOCK_TYPES
    from leanlm.methods import bit_allocation
    from leanlm.methods.gptq import chooses_types

    names = [name.removeprefix(facts.block_prefix) for name, *_ in facts.linears]  # BLOCK.PATH, as patterns see them
    patterns = bit_allocation.parse_tensor_types(getattr(quantizer, "tensor_types", ()))
    fixed = bit_allocation.fixed_types(names, patterns)
    target = _budget_bits(facts, quantizer)
    if target is not None and not chooses_types(quantizer):  # the recipe gives every type; the user's patterns win
        fixed = {**facts.recipes[quantizer.size_of].linear_types(facts.gguf_names), **fixed}
        target = None
    planned: dict[tuple[int, int, bool, str | None], float] = {}
    for name, (_, in_features, out_features, bias) in zip(names, facts.linears, strict=True):
        types = [(fixed.get(name, getattr(quantizer, "gguf_type", None)), 1.0)]
        if target is not None and name not in fixed:
            bits = {t: BLOCK_TYPES[t].bits_per_weight for t in bit_allocation.candidates_for(in_features)}
            below = max((t for t in bits if bits[t] <= target), key=bits.get, default=None)
            above = min((t for t in bits if bits[t] >= target), key=bits.get, default=None)
            types = [(below or above, 1.0)]
            if below is not None and above is not None and bits[above] != bits[below]:
                share = (target - bits[below]) / (bits[above] - bits[below])
                types = [(below, 1 - share), (above, share)]
        for block_type, share in types:
            key = (in_features, out_features, bias, block_type)
            planned[key] = planned.get(key, 0) + share
    return planned


def _budget_bits(facts: ModelFacts, config) -> float | None:
    """The bits per weight `config` spends over the block linears (--target-bits, or llama.cpp's recipe's for
    --size-of), or None."""
    if getattr(config, "size_of", None) is not None:
        return facts.recipe_bits.get(config.size_of)
    return getattr(config, "target_bits", None)


def _dequantized_per_call(facts: ModelFacts, configs: tuple) -> int:
    """The float32 bytes of the largest linear planned in GGUF blocks that no kernel reads (it de-quantizes its
    whole weight at each forward), or 0."""
    quantizer = _weight_quantizer(configs)
    return max(
        (
            in_features * out_features * 4
            for in_features, out_features, bias, block_type in _planned_linears(facts, quantizer)
            if block_type is not None
            and not empty_linear(quantizer, in_features, out_features, bias, block_type).runtime_bytes()
        ),
        default=0,
    )


def _weight_quantizer(configs: tuple):
    from leanlm.methods.quantize import method_spec

    quantizers = [c for c in configs if method_spec(c).role == "quantizer"]
    return quantizers[-1] if quantizers else None


def _calibration(configs: tuple) -> tuple[int, int]:
    """(windows, tokens per window) the configs calibrate on (0 windows: none)."""
    from leanlm.methods.quantize import Calibration, method_spec

    windows = 0
    for config in configs:
        spec = method_spec(config)
        if spec.needs_calibration(config):
            windows = max(windows, getattr(config, "calibration_samples", 0) or 0)
    return windows, Calibration().seq_len


def _needs_whole_model(configs: tuple) -> bool:
    from leanlm.methods.quantize import method_spec

    return any(method_spec(config).whole_model_reason(config) for config in configs)


def plan_row(
    facts: ModelFacts, name: str, description: str, configs: tuple, settings: PlanSettings, baseline: int
) -> RowPlan:
    configs = settings.applied(configs)
    compute_bytes = 2 if name == "bf16" else 4
    stored_bytes = facts.stored_dtype.itemsize
    stored, by_type, kernel_forms = stored_estimate(facts, configs)
    kv = kv_cache_bytes(facts, settings.context, compute_bytes)
    prefill = prefill_workspace(facts, settings.context, compute_bytes)
    extra = {"kv_cache": kv, "prefill": prefill}  # what running adds to the weights
    if not configs:
        weights = facts.total_parameters * compute_bytes
        in_place = facts.stored_dtype == (torch.bfloat16 if name == "bf16" else torch.float32)
        if in_place and not facts.tied_embeddings:
            # weights in the compute dtype are used in place from the memory-mapped file, and only the embedding
            # rows of the tokens read are ever paged in (a head tied to it is read whole)
            weights -= facts.vocab * facts.hidden * compute_bytes
        # Otherwise loading converts the stored tensors, read through a memory map, into the compute dtype: both
        # are resident until the load ends.
        loading = 0 if in_place else facts.total_parameters * stored_bytes
    else:
        weights = stored.total  # the tables are copied in from their file a MiB at a time
        if by_type.keys() - {"W8A8Linear"}:  # the k-bit kernels' prefill GEMM de-quantizes a tile of rows at a time
            tile = TILE_ROWS * max(i for _, i, _, _ in facts.linears) * 4
            whole = _dequantized_per_call(facts, configs)
            extra.update({"de-quantized weight": whole} if whole > tile else {"kernel tile": tile})
            loading = 0
        else:  # packing a shared-input group of two of the largest linears: its plain, stacked and packed copies
            loading = 3 * 2 * max(i * o for _, i, o, _ in facts.linears)
    running = Estimate({"process": baseline, "weights": weights})
    if kernel_forms:
        running.parts["kernel forms"] = kernel_forms
    if loading > sum(extra.values()):  # the load's peak is the higher one
        running.parts["loading"] = loading
    else:
        running.parts.update(extra)
    if not configs:
        return RowPlan(name, description, stored, running, None, None)
    phases = quantizing_phases(facts, configs, stored, baseline)
    phase = max(phases, key=lambda each: phases[each].total)
    return RowPlan(
        name,
        description,
        stored,
        running,
        phases[phase],
        "in memory" if _needs_whole_model(configs) else "out of core",
        phase,
    )


def _first_block(facts: ModelFacts) -> list[tuple[str, int, int, bool]]:
    """The quantizable linears of one decoder block, in the order they are quantized."""
    return facts.linears[: len(facts.linears) // facts.layers]


def _block_hessians(facts: ModelFacts) -> int:
    """GPTQ's and SpQR's statistics of one block: a float32 Hessian per linear."""
    return sum(i * i * 4 for _, i, _, _ in _first_block(facts))


def solver_peak(facts: ModelFacts) -> int:
    """The most GPTQ's and SpQR's solves of one block hold beyond the block's float and quantized weights. The
    linears are solved in order, each taking its Hessian from those still held, and each solved linear's float
    weight is let go (its quantized form replaces it). A solve has two steps: its Hessian's inverse factor (two more
    of the Hessian's size beside it, and a float32 copy of the weight), then the column loop (the factor beside the
    Hessian; the weight's copy, its codes and outlier mask, its residuals, the feedback into the later columns or the
    copy put back in input order, and four buffers of a lazy batch of columns)."""
    from leanlm.formats.gptq import SolverSettings

    lazy_columns = SolverSettings().block_size
    held = _block_hessians(facts)
    freed = 0
    peak = 0
    for _, in_features, out_features, _ in _first_block(facts):
        factor = 2 * in_features * in_features + in_features * out_features
        columns = in_features * in_features + 7 * in_features * out_features // 2 + 4 * lazy_columns * out_features
        peak = max(peak, held + max(factor, columns) * 4 - freed)
        held -= in_features * in_features * 4
        freed += in_features * out_features * 4
    return peak


def quantizing_phases(facts: ModelFacts, configs: tuple, stored: Estimate, baseline: int) -> dict[str, Estimate]:
    """What each phase of `leanlm quantize` holds at its peak; the largest is the job's. The phases come one after
    the other, each holding the process, the tokenizer and (calibrated methods) what tokenizing the calibration
    text left:
    - out of core, "tables": the largest table (token embedding or output head) as read (its stored tensor) and
      as copied to float32, and the calibration windows' hidden states it makes (before the blocks; after them the
      tables are read again, one at a time, to be written);
    - out of core, "blocks": one float32 block (its largest tensor also as read), its quantized form, the windows'
      hidden states entering and leaving it, and the larger of one window's activations (with GPTQ's and SpQR's
      Hessians) and the quantizing that follows (their solves; the other quantizers' float32 copy of a weight);
    - in memory, the whole float32 model and then, as the blocks are quantized, the whole quantized model, with
      the "blocks" parts above; before them a CushionCache search (one forward of a batch of candidates, and the
      quantization error it measures on each linear's input) or a bit budget ranked by the loss's gradients (one
      window's forward and backward through the float model, counted on fake tensors)."""
    from leanlm.methods.cushion import CushionConfig
    from leanlm.methods.gptq import GPTQConfig, SpQRConfig, ranks_by_gradients

    windows, seq_len = _calibration(configs)
    quantizer = _weight_quantizer(configs)
    solves = isinstance(quantizer, (GPTQConfig, SpQRConfig))
    common = {"process": baseline, "tokenizer": facts.vocab * TOKENIZER_BYTES_PER_TOKEN}
    if windows:
        common["calibration text"] = CALIBRATION_TEXT
    inputs = windows * seq_len * facts.hidden * 4  # the windows' hidden states entering (or leaving) a block
    largest = max(i * o for _, i, o, _ in facts.linears)
    # A block first runs the windows (one window's activations at a time, GPTQ's and SpQR's Hessians growing), then
    # is quantized (their solves; the other quantizers work on a float32 copy of a weight): the larger is its peak.
    observing = {"one window": prefill_workspace(facts, seq_len) if windows else 0}
    if solves and windows:
        observing["Hessians"] = _block_hessians(facts)
        quantizing = {"solves": solver_peak(facts)}
    else:
        quantizing = {"working copy": largest * 4}
    blocks = {"hidden states": 2 * inputs, **max(observing, quantizing, key=lambda parts: sum(parts.values()))}
    phases: dict[str, dict[str, int]] = {}
    if _needs_whole_model(configs):
        common["float model"] = facts.total_parameters * 4
        phases["blocks"] = {**common, "quantized model": stored.parts["linears"], **blocks}
        cushion = next((c for c in configs if isinstance(c, CushionConfig)), None)
        if cushion is not None:
            tokens = cushion.batch_size * (cushion.sample_tokens + cushion.max_length)
            probe = 3 * tokens * max(i for _, i, _, _ in facts.linears) * 4  # the input's round trip and its error
            phases["cushion search"] = {**common, "search forward": token_activations(facts, tokens) + probe}
        if ranks_by_gradients(quantizer):
            phases["gradient pass"] = {**common, "gradient pass": gradient_pass_bytes(read_config(facts.name), seq_len)}
            if getattr(
                quantizer, "llama_cpp_inputs", False
            ):  # each rounding's output change, bfloat16, to the backward
                phases["gradient pass"]["llama.cpp input roundings"] = sum(
                    2 * seq_len * o * len(int8_roundings(i)) for _, i, o, _ in facts.linears
                )
    else:
        stored_bytes = facts.stored_dtype.itemsize
        phases["tables"] = {**common, "largest table": facts.vocab * facts.hidden * (4 + stored_bytes)}
        if windows:
            phases["tables"]["hidden states"] = inputs
        phases["blocks"] = {
            **common,
            "float block": facts.block_parameters * 4 + largest * stored_bytes,
            "quantized block": stored.parts["linears"] // facts.layers,
            **blocks,
        }
    return {name: Estimate({key: value for key, value in parts.items() if value}) for name, parts in phases.items()}


def method_rows() -> list[tuple[str, str, tuple]]:
    """(name, description, configs) of every quantizing row the planner predicts: the showcase's, then the settings
    it does not run that change what quantizing holds."""
    from leanlm.methods.gptq import GPTQConfig
    from leanlm.showcase import ROWS

    mix = GPTQConfig(target_bits=4.5, hessian_shrinkage=0.5)
    return [(row.name, row.description, row.steps) for row in ROWS if row.steps] + [
        (
            "gptq-mix",
            "GPTQ with a GGUF block type per linear, 4.5 bits per weight spent where the loss's gradients say "
            "(--target-bits 4.5)",
            (mix,),
        )
    ]


def plan_model(source: str, settings: PlanSettings) -> dict:
    facts = model_facts(source)
    baseline = current_rss()
    memory = parse_bytes(settings.memory) if settings.memory is not None else available_memory()
    rows = [
        plan_row(facts, "fp32", "float32 weights and activations", (), settings, baseline),
        plan_row(facts, "bf16", "bfloat16 weights and activations", (), settings, baseline),
    ]
    for name, description, configs in method_rows():
        rows.append(plan_row(facts, name, description, configs, settings, baseline))
    streaming = rows[0]
    sink = Estimate(dict(streaming.running.parts))
    sink.parts["kv_cache"] = kv_cache_bytes(facts, 256)
    sink.parts["prefill"] = prefill_workspace(facts, 256)
    rows.append(
        RowPlan(
            "streaming", "float32 through a sink cache of 256 tokens, any length", streaming.stored, sink, None, None
        )
    )
    return {
        "model": source,
        "parameters": facts.total_parameters,
        "layers": facts.layers,
        "context": settings.context,
        "memory_bytes": memory,
        "memory_from": "--memory" if settings.memory is not None else "available",
        "rows": [row.as_dict(memory) for row in rows],
    }


def plan_table(payload: dict) -> str:
    from leanlm.report import format_table

    def gib(value):
        return "-" if value is None else f"{value / 2**30:.2f}"

    rows = [
        [
            r["row"],
            gib(r["stored_bytes"]),
            gib(r["running_bytes"]),
            gib(r["quantizing_bytes"]),
            r["quantizing_path"] or "-",
            "yes" if r["fits"] else "no",
        ]
        for r in payload["rows"]
    ]
    return format_table(
        ["method", "stored GiB", f"running GiB (context {payload['context']})", "quantizing GiB", "quantized", "fits"],
        rows,
    )


def check_quantizing(source: str, configs: tuple) -> str | None:
    """What `leanlm quantize` checks from `source`'s config before it reads a weight: raises ConfigError for a
    request the model rules out; returns a warning line when the predicted peak exceeds this machine's available
    memory, else None."""
    from leanlm.methods import bit_allocation

    facts = model_facts(source)
    shapes = {  # {BLOCK.PATH, as patterns see them: (out, in)}
        name.removeprefix(facts.block_prefix): (out_features, in_features)
        for name, in_features, out_features, _ in facts.linears
    }
    for config in configs:
        size_of = getattr(config, "size_of", None)
        if size_of is not None and not facts.recipes:
            raise ConfigError(
                f"--size-of {size_of}: leanlm does not know the GGUF layout of {source}'s family, so it cannot "
                "read llama.cpp's recipe for it (give --target-bits instead)"
            )
        fixed = bit_allocation.checked_types(shapes, config, _budget_bits(facts, config))
        if getattr(config, "decode_costs", None) is not None:
            bit_allocation.decode_budget(config.decode_costs, facts.recipes[size_of], fixed)
    row = plan_row(facts, "quantize", "", tuple(configs), PlanSettings(), current_rss())
    peak, available = row.quantizing.total, available_memory()
    if peak <= available:
        return None
    return (
        f"warning: quantizing {source} this way ({row.quantizing_path}) is predicted to peak at "
        f"{peak / 2**30:.1f} GiB resident, more than the {available / 2**30:.1f} GiB available now "
        f"(`leanlm plan {source}` compares every method)"
    )
