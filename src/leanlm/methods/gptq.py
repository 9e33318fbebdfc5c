"""RTN, GPTQ and SpQR on a whole model (Dettmers' thesis ch. 4): `quantize_(model, GPTQConfig(...), calibration=...)`.

Sequential through the block pipeline (`leanlm.methods.blocks`): the calibration samples' inputs to block i
are the outputs of blocks 0..i-1 *already quantized*; each linear's input Hessian accumulates while block i
runs in float, its linears are solved (`leanlm.formats.gptq.solve`) and replaced by SpQRLinear, and the
quantized block produces block i+1's inputs. Within a block every linear sees float inputs.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch import nn

from leanlm.errors import ConfigError
from leanlm.formats import llama_cpp_recipes
from leanlm.formats.gguf_blocks import BLOCK_TYPES
from leanlm.formats.gptq import SolverSettings, solve
from leanlm.formats.minmax import GRIDS
from leanlm.methods import bit_allocation
from leanlm.methods.blocks import observe_inputs, walk_blocks
from leanlm.methods.quantize import BlockPlan, QuantRun, register_method
from leanlm.models.architectures import architecture_for, decoder_blocks, linear_weight_out_in
from leanlm.nn.gguf_linear import GGUFLinear
from leanlm.nn.spqr_linear import SpQRLinear
from leanlm.settings import option

SENSITIVITY_WINDOWS = 32  # calibration windows the loss's gradients are measured on (a backward pass each)
DIVERGENCE_WINDOWS = 1  # calibration windows (after those) a linear's rounding is measured on, for "measured"
# Part of the key of every kept table of type errors: a change to what `type_error_table` computes must change it.
TYPE_ERRORS_FORMAT = 2


class _SolverChecks:
    """Every setting of a solver config is checked when the config is made, before any model is loaded."""

    def __post_init__(self):
        self.solver()
        if getattr(self, "calibration_samples", 1) < 1:
            raise ConfigError(f"calibration_samples must be at least 1, got {self.calibration_samples}")
        bit_allocation.parse_tensor_types(getattr(self, "tensor_types", ()))
        target = getattr(self, "target_bits", None)
        if target is not None and not 2 <= target <= 9:
            raise ConfigError(f"target bits must be between 2 and 9 bits per weight, got {target}")
        size_of = getattr(self, "size_of", None)
        if target is not None and size_of is not None:
            raise ConfigError("give --target-bits or --size-of (the bits of llama.cpp's file of that type), not both")
        if size_of is not None and size_of not in llama_cpp_recipes.RECIPES:
            raise ConfigError(f"size_of must be one of {', '.join(llama_cpp_recipes.RECIPES)}, got {size_of!r}")
        allocation = getattr(self, "allocation", bit_allocation.ALLOCATIONS[0])
        if allocation not in bit_allocation.ALLOCATIONS:
            raise ConfigError(f"allocation must be one of {', '.join(bit_allocation.ALLOCATIONS)}, got {allocation!r}")
        if allocation == "recipe" and size_of is None:
            raise ConfigError("--allocation recipe gives each linear the type of llama.cpp's file: give --size-of")
        costs = getattr(self, "decode_costs", None)
        if costs is not None:
            if size_of is None:
                raise ConfigError(
                    "--decode-costs keeps the decode time of llama.cpp's file of one type: give --size-of with it"
                )
            if allocation not in RANKED_BY_GRADIENTS:
                raise ConfigError("--decode-costs needs --allocation fisher or measured (one budget for the model)")
            bit_allocation.read_decode_costs(costs)


def _scale_search_option():
    """RTN's and GPTQ's `scale_search` field (one text for both)."""
    return option(
        False,
        "symmetric grid: choose each group's scale among 19 candidates by its squared error "
        "(GPTQ: weighted by the Hessian's diagonal), as llama.cpp's importance-matrix quantizer does",
    )


def _gguf_type_option():
    """RTN's and GPTQ's `gguf_type` field (one text for both)."""
    return option(
        None,
        "store the weights as this GGUF block type (its own bits, sub-blocks and statistics, fitted as the format "
        "stores them; rows that are no whole number of K-quant super-blocks take llama.cpp's fallback type)",
        none_word="none",
        choices=tuple(BLOCK_TYPES),
    )


def _target_bits_option():
    """RTN's and GPTQ's `target_bits` field (one text for both)."""
    among = ", ".join(name.upper() for name in bit_allocation.CANDIDATES)
    return option(
        None,
        f"choose a GGUF block type per linear (among {among}) to spend at most this many bits per weight where "
        "the loss falls most (see --allocation)",
        none_word="none",
    )


def _size_of_option():
    """RTN's and GPTQ's `size_of` field (one text for both)."""
    return option(
        None,
        "spend what llama.cpp's file of this type spends on this model (llama-quantize's recipe for it, the "
        "smaller of its plain and importance-matrix files) as --target-bits in the block linears, and give the "
        "token embedding and output head its types when exported",
        none_word="none",
        choices=tuple(llama_cpp_recipes.RECIPES),
    )


def _allocation_option():
    """RTN's and GPTQ's `allocation` field (one text for both)."""
    return option(
        "fisher",
        "how --target-bits ranks the types: fisher (each linear's Hessian-weighted error scaled by the loss's "
        "squared gradient at its outputs, one budget for the whole model, quantized in memory), measured (fisher, "
        "each linear's errors rescaled to the output divergence measured with it alone rounded: a forward pass per "
        "linear), block (the Hessian-weighted error alone, bits moved within each transformer block, out of core) "
        "or recipe (with --size-of: the types llama.cpp's file gives each linear, leanlm's rounding in them)",
        choices=bit_allocation.ALLOCATIONS,
    )


def _llama_cpp_inputs_option():
    """RTN's and GPTQ's `llama_cpp_inputs` field (one text for both)."""
    return option(
        True,
        "--allocation fisher / measured: add to each type's error the loss llama.cpp's CPU backend adds by rounding "
        "the linear's input for it (int8 per 32 values for the blocks of 32, per 256 for the K-quants and IQ4_XS), "
        "measured on the calibration text",
        off="rank the types by the weights' rounding alone (for files run elsewhere than llama.cpp's CPU backend)",
    )


def _decode_costs_option():
    """RTN's and GPTQ's `decode_costs` field (one text for both)."""
    return option(
        None,
        "with --size-of: a JSON file of each block type's llama.cpp decode time per weight on the CPU the file is "
        "for ({type: time}, or benchmarks/gguf_llama_cpp.py's results); only those types are chosen, and the mix's "
        "summed time stays at most that of llama.cpp's file",
        none_word="none",
    )


def _tensor_types_option():
    """RTN's and GPTQ's `tensor_types` field (one text for both)."""
    return option(
        (),
        "PATTERN=TYPE: the GGUF block type of the linears whose BLOCK.PATH (e.g. 3.mlp.down_proj) the regular "
        "expression finds; repeat it, or give the map a quantize record saved",
        flag="--tensor-type",
    )


def _grid_option():
    """RTN's and GPTQ's `grid` field (one text for both)."""
    return option(
        "minmax",
        "group grid: minmax (fractional zero) or symmetric (zero 2^(bits-1): with --group-size "
        "32, GGUF's Q4_0 / Q8_0 blocks; exportable when groups are consecutive columns)",
        choices=tuple(GRIDS),
    )


@dataclass(frozen=True)
class RTNConfig(_SolverChecks):
    """Round to nearest: min-max groups, no calibration (the baseline of GPTQ and SpQR); `imatrix` weighs the
    symmetric grid's scale search by calibration inputs, as llama.cpp's importance-matrix quantization does."""

    bits: int = option(4, "bits per weight code (2-8)")
    group_size: int | None = option(128, "input columns per scale and zero, or the whole row", none_word="0")
    grid: str = _grid_option()
    scale_search: bool = _scale_search_option()
    imatrix: bool = option(
        False,
        "weigh the scale search by each input column's mean squared activation on "
        "calibration text (llama.cpp's importance matrix; with --scale-search)",
    )
    calibration_samples: int = option(
        128, "calibration windows the importance matrix is read from (--imatrix)", flag="--calib-samples"
    )
    imatrix_file: str | None = option(
        None,
        "an importance matrix file (llama-imatrix's GGUF, or leanlm imatrix's) to weigh the scale search by, "
        "instead of --imatrix's calibration pass",
        none_word="none",
    )
    gguf_type: str | None = _gguf_type_option()
    target_bits: float | None = _target_bits_option()
    size_of: str | None = _size_of_option()
    allocation: str = _allocation_option()
    llama_cpp_inputs: bool = _llama_cpp_inputs_option()
    decode_costs: str | None = _decode_costs_option()
    tensor_types: tuple[str, ...] = _tensor_types_option()

    def __post_init__(self):
        super().__post_init__()
        if self.imatrix and self.imatrix_file:
            raise ConfigError("give --imatrix (computed while quantizing) or --imatrix-file, not both")
        if self.imatrix_file is not None and not Path(self.imatrix_file).expanduser().is_file():
            raise ConfigError(f"--imatrix-file {self.imatrix_file}: no such file")
        if (self.imatrix or self.imatrix_file) and not (self.scale_search or self.gguf_type or has_budget(self)):
            raise ConfigError(
                "imatrix weighs the search of each group's scale, which needs --scale-search or GGUF block types "
                "(--gguf-type, --target-bits or --size-of)"
            )

    def solver(self) -> SolverSettings:
        return SolverSettings(
            bits=self.bits,
            group_size=self.group_size,
            act_order=False,
            error_feedback=False,
            grid=self.grid,
            scale_search=self.scale_search,
            block_type=self.gguf_type,
        )


@dataclass(frozen=True)
class GPTQConfig(_SolverChecks):
    """GPTQ (Frantar et al. 2022; Dettmers' thesis ch. 4): min-max groups with Hessian error feedback, one block at a time."""

    bits: int = option(4, "bits per weight code (2-8)")
    group_size: int | None = option(128, "input columns per scale and zero, or the whole row", none_word="0")
    act_order: bool = option(
        True,
        "quantize columns by decreasing Hessian diagonal (else in their natural order)",
        off="quantize columns in their natural order",
    )
    damping: float = option(0.01, "lambda: Hessian damping as a fraction of its mean diagonal")
    calibration_samples: int = option(128, "calibration windows (GPTQ: 128 random segments)", flag="--calib-samples")
    grid: str = _grid_option()
    static_groups: bool = option(
        False,
        "fit every group before solving, on consecutive columns, so act-order keeps "
        "groups contiguous (for GGUF / compressed-tensors export with act-order)",
    )
    scale_search: bool = _scale_search_option()
    hessian_shrinkage: float = option(
        0.0, "pull the Hessian's off-diagonal terms toward zero by this fraction (0: GPTQ, 1: importance-weighted RTN)"
    )
    gguf_type: str | None = _gguf_type_option()
    target_bits: float | None = _target_bits_option()
    size_of: str | None = _size_of_option()
    allocation: str = _allocation_option()
    llama_cpp_inputs: bool = _llama_cpp_inputs_option()
    decode_costs: str | None = _decode_costs_option()
    tensor_types: tuple[str, ...] = _tensor_types_option()

    def solver(self) -> SolverSettings:
        return SolverSettings(
            bits=self.bits,
            group_size=self.group_size,
            act_order=self.act_order,
            damping=self.damping,
            grid=self.grid,
            static_groups=self.static_groups,
            scale_search=self.scale_search,
            hessian_shrinkage=self.hessian_shrinkage,
            block_type=self.gguf_type,
        )


@dataclass(frozen=True)
class SpQRConfig(_SolverChecks):
    """SpQR (Dettmers et al. 2023; Dettmers' thesis ch. 4): GPTQ with small groups whose statistics are themselves quantized,
    and unstructured outliers kept in 16 bits. Defaults: the chapter's ~4-bit recipe shape (3-bit base and
    statistics, beta1 = beta2 = 16, tau = 0.2, damping 1.0 as the reference near-lossless recipe)."""

    bits: int = option(3, "bits per weight code (2-8)")
    beta1: int = option(16, "input columns per first-level group")
    beta2: int = option(16, "rows per second-level group of the quantized statistics")
    outlier_threshold: float | None = option(
        0.2, "tau, relative to the layer's mean sensitivity (none: no outliers)", none_word="none"
    )
    statistic_bits: int = option(3, "bits of the group scales and zeros")
    damping: float = option(1.0, "lambda: Hessian damping as a fraction of its mean diagonal")
    act_order: bool = option(
        True,
        "quantize columns by decreasing Hessian diagonal (else in their natural order)",
        off="quantize columns in their natural order",
    )
    calibration_samples: int = option(128, "calibration windows", flag="--calib-samples")

    def solver(self) -> SolverSettings:
        return SolverSettings(
            bits=self.bits,
            group_size=self.beta1,
            statistic_bits=self.statistic_bits,
            statistic_group_size=self.beta2,
            outlier_threshold=self.outlier_threshold,
            act_order=self.act_order,
            damping=self.damping,
        )


SolverConfig = RTNConfig | GPTQConfig | SpQRConfig


RANKED_BY_GRADIENTS = ("fisher", "measured")  # the allocations that spend one budget over the whole model


def has_budget(config) -> bool:
    """Whether `config` spends a budget of bits per weight (--target-bits, or --size-of's)."""
    return getattr(config, "target_bits", None) is not None or getattr(config, "size_of", None) is not None


def _budget(model: nn.Module, config) -> tuple[float | None, bit_allocation.RecipeBudget | None]:
    """(the bits per weight `config` spends over `model`'s block linears or None, the llama.cpp recipe's budget
    behind it or None)."""
    if getattr(config, "size_of", None) is None:
        return getattr(config, "target_bits", None), None
    recipe = bit_allocation.recipe_budget(model, config.size_of)
    return recipe.bits, recipe


def chooses_types(config) -> bool:
    """Whether `config` has a budget whose types are chosen from the model's weights (and, but for RTN's plain
    rounding, text): any budget but llama.cpp's recipe, which gives every type."""
    return has_budget(config) and config.allocation != "recipe"


def ranks_by_gradients(config) -> bool:
    """Whether `config` spends a bit budget over the whole model, its types ranked by the loss's gradients: a
    forward and backward pass of the float model for each of SENSITIVITY_WINDOWS windows (`collect_sensitivity`),
    unless leanlm's cache keeps them for this model and text (`kept_sensitivity`)."""
    return has_budget(config) and config.allocation in RANKED_BY_GRADIENTS


def _whole_model_for_budget(config) -> str | None:
    """Why a budget spent over the whole model needs the model in memory (None for any other config)."""
    if not ranks_by_gradients(config):
        return None
    return (
        f"--allocation {config.allocation} measures the loss's gradients through the whole model, which a model "
        "read block by block from disk cannot give (--allocation block ranks the types block by block)"
    )


@register_method(
    RTNConfig,
    "rtn",
    "quantizer",
    needs_calibration=lambda config: config.imatrix or chooses_types(config),
    blockwise=True,
    needs_whole_model=_whole_model_for_budget,
)
@register_method(GPTQConfig, "gptq", "quantizer", blockwise=True, needs_whole_model=_whole_model_for_budget)
@register_method(SpQRConfig, "spqr", "quantizer", blockwise=True)
def _solver_plan(model: nn.Module, config: SolverConfig, run: QuantRun) -> BlockPlan:
    """Replace the block linears by SpQRLinear (GGUFLinear for a GGUF block type), block by block (each block's Hessians come from the outputs of
    the blocks before it, already quantized); the record has the measured average bits per weight
    ("avg_bits"), the outlier rate and the wall time."""
    settings = config.solver()
    samples = getattr(config, "calibration_samples", None)
    table = architecture_for(model)
    started = time.perf_counter()
    importance_only = getattr(config, "imatrix", False)  # RTN's scale search weighted by the Hessian's diagonal
    target, recipe = _budget(model, config)
    shapes = _linear_shapes(model, table)
    fixed = bit_allocation.checked_types(shapes, config, target)
    allocation = getattr(config, "allocation", "block")  # SpQR spends no budget
    spend = target if chooses_types(config) else None  # the bits left to allocate
    if target is not None and spend is None:  # llama.cpp's recipe gives every type; the user's patterns win
        fixed = {**bit_allocation.recipe_linear_types(model, recipe), **fixed}
    speed = None  # (each type's decode cost, the most the linears may cost: llama.cpp's recipe's)
    if getattr(config, "decode_costs", None) is not None:
        speed = bit_allocation.decode_budget(config.decode_costs, recipe, fixed)
    given = _importance_from_file(model, table, shapes, getattr(config, "imatrix_file", None))
    hessians = _HessianObserver(table, diagonal_only=not settings.error_feedback)
    whole_model = ranks_by_gradients(config)
    # RTN reads no data, but for its importance matrix or a budget
    reads_text = settings.error_feedback or importance_only or spend is not None
    data = run.data(config).batches(samples) if reads_text else None
    budget = (
        _fisher_types(
            model,
            table,
            fixed,
            target,
            data,
            measured=allocation == "measured",
            inputs=getattr(config, "llama_cpp_inputs", False),
            speed=speed,
        )
        if whole_model
        else {}
    )

    def block_types(index: int, block: nn.Module) -> dict[str, str | None]:
        """Each linear's block type: the user's, llama.cpp's recipe's, the whole model's budget, the block's budget
        (bits moved between the block's linears), or --gguf-type's."""
        names = {path: f"{index}.{path}" for path in table.quantizable_linears}
        if whole_model:
            return {path: budget[name] for path, name in names.items()}
        if spend is None:
            return {path: fixed.get(name, settings.block_type) for path, name in names.items()}
        weights = {name: linear_weight_out_in(block.get_submodule(path), table) for path, name in names.items()}
        types = bit_allocation.budget_types(
            weights, fixed, spend, lambda name: hessians.diagonal(name.partition(".")[2], weights[name].shape[1])
        )
        return {path: types[name] for path, name in names.items()}

    def quantize_block(index: int, block: nn.Module) -> dict:
        counts = {"weights": 0, "stored_bits": 0.0, "outliers": 0}
        types = block_types(index, block)
        for path in table.quantizable_linears:
            linear = block.get_submodule(path)
            weight = linear_weight_out_in(linear, table)
            solver = replace(settings, block_type=types[path])
            if not settings.error_feedback:
                importance = hessians.take(path) if importance_only else given.get(f"{index}.{path}")
                solved = solve(weight, None, solver, importance=importance)
            else:
                solved = solve(weight, hessians.take(path), solver, overwrite_hessian=True)
            bias = getattr(linear, "bias", None)
            if solved.blocks is not None:
                kind, statistics = solved.blocks
                quantized = GGUFLinear.from_codes(kind, solved.codes, statistics, bias)
                counts[f"^{re.escape(f'{index}.{path}')}$={kind.name}"] = 1  # the map the record keeps
                if speed is not None:
                    counts["decode_cost"] = counts.get("decode_cost", 0.0) + speed[0][kind.name] * weight.numel()
            else:
                quantized = SpQRLinear.from_solved(solved, settings, bias)
            block.set_submodule(path, quantized)
            counts["weights"] += weight.numel()
            counts["stored_bits"] += quantized.bits_per_weight() * weight.numel()
            counts["outliers"] += int(solved.outlier_mask.sum())
            del linear, weight, solved  # the float weight and the solver's result, before the next linear's solve
        hessians.clear()
        return counts

    # the blocks read the calibration windows where the Hessians they observe are used
    windows = data if settings.error_feedback or importance_only or (spend is not None and not whole_model) else None

    def finish(model: nn.Module, counts: dict) -> dict:
        mapped = {key.rpartition("=")[0]: key.rpartition("=")[2] for key in counts if "=" in key}
        return {
            **asdict(settings),
            "target_bits": target,
            "size_of": None if recipe is None else recipe.recipe,
            "gguf_table_types": None if recipe is None else recipe.tables,
            "allocation": allocation if target is not None else None,
            "llama_cpp_inputs": getattr(config, "llama_cpp_inputs", False) if whole_model else None,
            "decode_costs": None if speed is None else speed[0],
            # the block linears' summed decode cost as a fraction of llama.cpp's recipe's, by the costs given
            "decode_cost": None if speed is None else counts.get("decode_cost", 0.0) / speed[1],
            "tensor_types": mapped or None,
            "imatrix": importance_only,
            "imatrix_file": getattr(config, "imatrix_file", None),
            "calibration_samples": None if data is None else len(data),
            "calibration_seq_len": run.calibration.seq_len if run.calibration is not None else None,
            "avg_bits": counts["stored_bits"] / counts["weights"],
            "outlier_rate": counts["outliers"] / counts["weights"],
            "seconds": time.perf_counter() - started,
        }

    return BlockPlan(
        quantize_block,
        finish,
        observe=hessians.observe if windows is not None else None,
        windows=windows,
        feed_quantized=True,
    )


def _fisher_types(
    model: nn.Module,
    table,
    fixed: dict[str, str],
    target: float,
    windows,
    measured: bool = False,
    inputs: bool = False,
    speed: tuple[dict[str, float], float] | None = None,
) -> dict[str, str]:
    """{BLOCK.PATH: type} spending `target` bits per weight over the whole float model, each type ranked by its
    Fisher-weighted error (`bit_allocation`), rescaled per linear by a measured output divergence if `measured`,
    plus (`inputs`) the estimated loss of llama.cpp's rounding of the linear's input for that type, within
    `speed`'s decode cost if given; `fixed` entries keep the user's type."""
    from leanlm.methods.calibration import kept_sensitivity, kept_type_errors, output_divergence, tensors_digest

    digest = tensors_digest(model)
    sensitivity = kept_sensitivity(model, windows[:SENSITIVITY_WINDOWS], table, digest)
    weights = {
        f"{index}.{path}": linear_weight_out_in(block.get_submodule(path), table)
        for index, block in enumerate(decoder_blocks(model, table))
        for path in table.quantizable_linears
    }
    used = windows[:SENSITIVITY_WINDOWS]  # the windows the errors depend on
    measure = None
    if measured:  # windows the gradients were not measured on, where there are enough
        rest = windows[SENSITIVITY_WINDOWS:] if len(windows) > SENSITIVITY_WINDOWS else windows
        held_out = rest[:DIVERGENCE_WINDOWS]
        used = torch.cat([used, held_out])
        divergences = []  # the float model's outputs, measured at the first linear the cache does not hold

        def measure(name: str, rounded: torch.Tensor) -> float:
            if not divergences:
                divergences.append(output_divergence(model, held_out))
            weight = weights[name]
            with torch.no_grad():
                kept = weight.detach().clone()
                weight.copy_(rounded.to(weight.dtype))
                try:
                    return divergences[0]()
                finally:
                    weight.copy_(kept)

    key = hashlib.blake2b(digest_size=16)
    key.update(
        f"{TYPE_ERRORS_FORMAT} {torch.__version__} {table.blocks} {table.quantizable_linears} measured={measured} "
        f"{bit_allocation.CANDIDATES} {bit_allocation.SAMPLE_ROWS} {digest}".encode()
    )
    key.update(memoryview(used.to(torch.int64).contiguous().numpy()))
    return bit_allocation.budget_types(
        weights,
        fixed,
        target,
        lambda name: sensitivity[name].h,
        lambda name: sensitivity[name].g,
        measure,
        keep=lambda names, measure_names: kept_type_errors(key.hexdigest(), names, measure_names),
        input_errors=(lambda name: sensitivity[name].inputs) if inputs else (lambda name: {}),
        speed=speed,
    )


def _linear_shapes(model: nn.Module, table) -> dict[str, tuple[int, int]]:
    """{BLOCK.PATH: (out, in)} of every block linear, read from the (possibly still empty) model's modules."""
    return {
        f"{index}.{path}": tuple(linear_weight_out_in(block.get_submodule(path), table).shape)
        for index, block in enumerate(decoder_blocks(model, table))
        for path in table.quantizable_linears
    }


def _importance_from_file(model: nn.Module, table, shapes: dict, path: str | None) -> dict[str, torch.Tensor]:
    """{BLOCK.PATH: importance per input column} of every block linear, from an importance-matrix file; a
    ConfigError before any work if the file is not this model's."""
    if path is None:
        return {}
    from leanlm.formats.imatrix import read_imatrix
    from leanlm.models.architectures import gguf_tensor_names

    matrix = read_imatrix(path)
    names = gguf_tensor_names(model)
    found = {}
    for linear, (_, columns) in shapes.items():
        name = f"{names.get_name(f'{table.blocks}.{linear}')}.weight"
        if name not in matrix.sums:
            raise ConfigError(f"{path} is not this model's importance matrix: it has no entry for {name}")
        if matrix.sums[name].shape[0] != columns:
            raise ConfigError(
                f"{path} is not this model's importance matrix: {name} has {matrix.sums[name].shape[0]} "
                f"columns there, {columns} here"
            )
        found[linear] = torch.from_numpy(matrix.mean_squares(name))
    return found


GRAM_PANEL = 512  # rows of x^T x computed per product: only the panels' parts on and above the diagonal


def _add_upper_gram(total: torch.Tensor, x: torch.Tensor) -> None:
    """Adds x^T x to `total`'s upper triangle, a panel of GRAM_PANEL rows at a time from its diagonal on: half the
    products of the whole x^T x for a wide x (a diagonal tile's lower half comes along)."""
    columns = x.shape[1]
    for start in range(0, columns, GRAM_PANEL):
        rows = slice(start, min(start + GRAM_PANEL, columns))
        total[rows, start:].addmm_(x[:, rows].T, x[:, start:])


def _mirror_upper(total: torch.Tensor) -> None:
    """Makes `total` exactly symmetric from the upper triangle `_add_upper_gram` summed, in place: the part below
    its panels and the lower half of each diagonal tile (which a matrix product need not have rounded as its
    mirror image)."""
    columns = total.shape[0]
    for start in range(0, columns, GRAM_PANEL):
        end = min(start + GRAM_PANEL, columns)
        total[end:, start:end].copy_(total[start:end, end:].T)
        tile = total[start:end, start:end]
        upper = torch.triu(tile, diagonal=1)
        tile.copy_(upper + upper.T + torch.diag(tile.diagonal()))


class _HessianObserver:
    """H = 2/N sum_x x x^T over every calibration token entering each linear of the current (float) block. The
    linears one norm feeds (q/k/v, gate/up) read the same input, so they share one H; each H is dropped once the
    last linear reading it has taken it (an 8B model's down_proj alone has a 14336^2 float32 H, 0.8 GB).
    `diagonal_only`: H's diagonal 2/N sum_x x^2 alone (the importance matrix), a vector per input."""

    def __init__(self, table, diagonal_only: bool = False):
        self.table = table
        self.diagonal_only = diagonal_only
        self.source = {member: feeds.linears[0] for feeds in table.norm_feeds for member in feeds.linears}
        self.sums: dict[str, torch.Tensor] = {}  # x^T x: its upper panels, the rest filled in when taken
        self.tokens: dict[str, int] = {}
        self.readers: dict[str, int] = {}

    def observe(self, index: int, block: nn.Module):
        self.clear()
        for path in self.table.quantizable_linears:
            key = self.source.get(path, path)
            self.readers[key] = self.readers.get(key, 0) + 1
        return observe_inputs(((key, block.get_submodule(key)) for key in self.readers), self._add)

    def _add(self, key: str, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()
        if self.diagonal_only:
            self.sums[key] = self.sums[key].add_(x.square().sum(dim=0)) if key in self.sums else x.square().sum(dim=0)
        else:
            if key not in self.sums:
                self.sums[key] = torch.zeros(x.shape[1], x.shape[1])
            _add_upper_gram(self.sums[key], x)
        self.tokens[key] = self.tokens.get(key, 0) + x.shape[0]

    def clear(self) -> None:
        self.sums, self.tokens, self.readers = {}, {}, {}

    def diagonal(self, path: str, columns: int) -> torch.Tensor:
        """The diagonal of `path`'s input Hessian, without taking it (ones if it saw no input)."""
        key = self.source.get(path, path)
        if key not in self.sums:
            return torch.ones(columns)
        total = self.sums[key] if self.diagonal_only else self.sums[key].diagonal()
        return 2.0 * total / self.tokens[key]

    def take(self, path: str) -> torch.Tensor | None:
        """The Hessian of `path`'s input (None if it saw none), forgotten after its last reader."""
        key = self.source.get(path, path)
        if key not in self.sums:
            return None
        whole = self.sums[key]
        if not self.diagonal_only:
            _mirror_upper(whole)  # the upper panels stay as they are, so a second reader's mirror changes nothing
        self.readers[key] -= 1
        if self.readers[key]:
            return 2.0 * whole / self.tokens[key]
        del self.sums[key]
        return whole.mul_(2.0).div_(self.tokens[key])  # the same numbers, without a second copy


def input_hessians(model: nn.Module, batches: torch.Tensor, blocks: Iterable[int]) -> dict[str, torch.Tensor]:
    """{BLOCK.PATH: H} for every quantizable linear of the decoder blocks numbered `blocks`: the Hessian GPTQ solves
    with, 2/N sum_x x x^T over the tokens of `batches` (windows, seq_len), observed on the float model (every
    block reads the float blocks' outputs, not quantized ones)."""
    table = architecture_for(model)
    wanted = set(blocks)
    observer = _HessianObserver(table)
    found: dict[str, torch.Tensor] = {}

    def observe(index: int, block: nn.Module):
        return observer.observe(index, block) if index in wanted else nullcontext()

    def take(index: int, block: nn.Module) -> None:
        if index in wanted:
            found.update({f"{table.blocks}.{index}.{path}": observer.take(path) for path in table.quantizable_linears})

    walk_blocks(model, batches, observe=observe, quantize_block=take, feed_quantized=False, desc="hessians")
    return found
