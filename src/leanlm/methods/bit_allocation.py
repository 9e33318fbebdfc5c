"""Which GGUF block type each linear takes: a user's map (`PATTERN=TYPE`, llama.cpp's `--tensor-type` form), or
a budget of bits per weight spent where it lowers the loss most.

The measure of a type on a linear is its weighted squared error, sum_ij g_i h_j (W_ij - Q(W)_ij)^2 (round to
nearest on the type's fitted statistics, on a sample of rows and scaled to all), with h the mean squared input of
each column (llama.cpp's importance matrix) and g:
- allocation "fisher": the mean squared gradient of the next-token loss with respect to each output, measured on
  the float model (`collect_sensitivity`). The sum is then the Fisher estimate of the loss the rounding adds, one
  scale for every linear of the model, and the budget is spent over the whole model at once.
- allocation "measured": as "fisher", then each linear's errors rescaled so that its cheapest type's error is the
  KL divergence of the model's next-token distribution from the float model's, measured on calibration windows with
  that linear alone rounded to that type (`output_divergence`; one forward pass per linear and window). The Fisher
  estimate ranks the types of one linear well but linears against each other poorly; the measurement fixes each
  linear's scale.
- allocation "block": 1, the increase of the layer's own output error. Errors of different blocks are on
  different scales, so bits move only between the linears of one transformer block (attention against MLP, V
  against Q and K, down against gate and up); it needs no backward pass and runs on streamed (out-of-core) models.
- allocation "recipe": no ranking; each linear takes the type llama.cpp's recipe of --size-of gives it, so the file
  has llama.cpp's types (its size and its decode kernels) and differs from llama.cpp's only in the rounding.
For a budget B, every linear takes the type that minimises error + lambda * bits, with lambda the smallest at
which the stored bits fit B (the Lagrangian of the knapsack; a type is a candidate only where a row is a whole
number of its blocks). Given decode costs (each type's decode time per weight in llama.cpp on one CPU, measured by
benchmarks/gguf_llama_cpp.py's type-speed part), the choice also keeps the summed cost of the linears at most a
limit (the cost of llama.cpp's recipe at that size): error + lambda * bits + mu * cost, mu the smallest that keeps
the limit, only the types with a cost as candidates.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from leanlm.errors import ConfigError
from leanlm.formats import llama_cpp_recipes
from leanlm.formats.ggml_inputs import INPUT_ROUNDING
from leanlm.formats.gguf_blocks import BLOCK_TYPES, block_type, codes_for, decode, fit_statistics

# What --target-bits chooses among by default: the K-quants and IQ4_XS and, for rows they cannot tile, the blocks
# of 32 (IQ4_NL among them, and Q4_1 / Q5_1, whose minimum fits weights that lie on an asymmetric grid).
CANDIDATES = ("q3_k", "iq4_xs", "q4_k", "q5_k", "q6_k", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1", "q8_0")
SCALE = "scale"  # the key of `type_error_table`'s entries that is no type: the scale of the Fisher estimate
SAMPLE_ROWS = 256  # rows of a weight the error is measured on (spread evenly), scaled to the whole weight
ALLOCATIONS = ("fisher", "measured", "block", "recipe")


def _entries(spec: str) -> list[str]:
    """`spec` itself, or the PATTERN=TYPE entries of the JSON file it names: a {pattern: type} object, or a
    quantize record's `tensor_types` (its map: one anchored pattern per linear)."""
    path = Path(spec).expanduser()
    if "=" in spec or not path.is_file():
        return [spec]
    try:
        mapping = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"tensor types {spec}: not a JSON file ({error})") from None
    if isinstance(mapping, dict) and isinstance(mapping.get("tensor_types"), dict):
        mapping = mapping["tensor_types"]
    if not isinstance(mapping, dict) or not all(isinstance(v, str) for v in mapping.values()):
        raise ConfigError(f"tensor types {spec}: expected a JSON object of pattern: type")
    return [f"{pattern}={name}" for pattern, name in mapping.items()]


def read_decode_costs(spec: str) -> dict[str, float]:
    """{block type: decode time per weight, in any one unit} from the JSON file `spec`: an object of type: number,
    or the results of benchmarks/gguf_llama_cpp.py (its type-speed part's relative times); a ConfigError naming
    what is wrong."""
    path = Path(spec).expanduser()
    try:
        costs = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"decode costs {spec}: not a readable JSON file ({error})") from None
    if isinstance(costs, dict) and isinstance(costs.get("type_speed"), dict):
        costs = {kind: value.get("relative_time") for kind, value in costs["type_speed"].items()}
    if not isinstance(costs, dict) or not costs:
        raise ConfigError(f"decode costs {spec}: expected a JSON object of block type: decode time per weight")
    for kind, cost in costs.items():
        block_type(kind.lower())
        if isinstance(cost, bool) or not isinstance(cost, (int, float)) or not cost > 0:
            raise ConfigError(f"decode costs {spec}: the cost of {kind} must be a positive number, got {cost!r}")
    return {kind.lower(): float(cost) for kind, cost in costs.items()}


def parse_tensor_types(specs: tuple[str, ...]) -> list[tuple[re.Pattern, str]]:
    """`PATTERN=TYPE` strings (or JSON files of them) as (compiled pattern, block type), or a ConfigError naming
    the bad one."""
    parsed = []
    for spec in (entry for given in specs for entry in _entries(given)):
        pattern, sep, name = spec.rpartition("=")
        if not sep or not pattern:
            raise ConfigError(f"tensor type {spec!r}: write PATTERN=TYPE (for example mlp.down_proj=q6_k)")
        try:
            compiled = re.compile(pattern)
        except re.error as error:
            raise ConfigError(f"tensor type {spec!r}: {pattern!r} is not a regular expression ({error})") from None
        parsed.append((compiled, block_type(name.lower()).name))
    return parsed


def fixed_types(names: list[str], patterns: list[tuple[re.Pattern, str]]) -> dict[str, str]:
    """{name: type} for the names a pattern finds (the last pattern that matches wins, as in llama.cpp)."""
    chosen = {}
    for pattern, name in patterns:
        for tensor in names:
            if pattern.search(tensor):
                chosen[tensor] = name
    return chosen


def unmatched(names: list[str], patterns: list[tuple[re.Pattern, str]]) -> list[str]:
    """The patterns that find none of `names`."""
    return [pattern.pattern for pattern, _ in patterns if not any(pattern.search(name) for name in names)]


def checked_types(shapes: dict[str, tuple[int, int]], config, target: float | None) -> dict[str, str]:
    """{BLOCK.PATH: type} the user's patterns give, checked before any slow work: every pattern must find a
    linear, and a budget (`target` bits per weight) must be one the linears' block types can spend."""
    patterns = parse_tensor_types(getattr(config, "tensor_types", ()))
    if not patterns and target is None:
        return {}
    missing = unmatched(list(shapes), patterns)
    if missing:
        example = next(iter(shapes))
        raise ConfigError(f"tensor type pattern {missing[0]!r} finds no linear (they are named like {example!r})")
    fixed = fixed_types(list(shapes), patterns)
    untyped = [name for name in shapes if name not in fixed]
    if untyped and target is None and getattr(config, "gguf_type", None) is None:
        raise ConfigError(
            f"--tensor-type gives {untyped[0]} (and {len(untyped) - 1} more) no type: add --gguf-type or "
            "--target-bits for the rest"
        )
    if target is not None:
        low, high = reachable_bits(shapes, fixed)
        size_of = getattr(config, "size_of", None)
        asked = f"--target-bits {target}" if size_of is None else f"--size-of {size_of} ({target:.3f} bits)"
        if not low <= target:
            raise ConfigError(f"{asked}: this model's linears take at least {low:.3f} bits per weight")
        if target > high:
            raise ConfigError(f"{asked}: this model's linears take at most {high:.3f} bits per weight")
    return fixed


def candidates_for(columns: int, names: tuple[str, ...] = CANDIDATES) -> list[str]:
    return [name for name in names if columns % BLOCK_TYPES[name].block == 0]


def reachable_bits(shapes: dict[str, tuple[int, int]], fixed: dict[str, str]) -> tuple[float, float]:
    """The least and most bits per weight a budget over `shapes` can spend (fixed tensors keep their type)."""
    low = high = 0.0
    total = 0
    for name, (rows, columns) in shapes.items():
        options = [fixed[name]] if name in fixed else candidates_for(columns)
        if not options:
            raise ConfigError(f"{name}: a row of {columns} weights is a whole number of no GGUF block type")
        bits = [BLOCK_TYPES[option].bits_per_weight for option in options]
        low, high, total = low + min(bits) * rows * columns, high + max(bits) * rows * columns, total + rows * columns
    return low / total, high / total


def type_errors(
    weight: torch.Tensor, importance: torch.Tensor, names: list[str], output_weights: torch.Tensor | None = None
) -> dict[str, float]:
    """{type: sum_ij g_i h_j (W - Q(W))_ij^2 of rounding `weight` to it}, h the `importance` of each input column
    and g the `output_weights` of each row (ones if None), measured on SAMPLE_ROWS rows and scaled to all."""
    rows = weight.shape[0]
    picked = torch.linspace(0, rows - 1, min(rows, SAMPLE_ROWS)).long()
    sample = weight[picked].detach().float()  # the weight may be a parameter: no autograd graph here
    if output_weights is None:
        row_weights = torch.full((len(picked),), rows / len(picked))
    else:  # the sampled rows stand for all: their weights scaled to the whole weight's total
        row_weights = output_weights[picked].float()
        row_weights = row_weights * (
            output_weights.sum() / row_weights.sum().clamp_min(torch.finfo(torch.float32).tiny)
        )
    errors = {}
    for name in names:
        restored = rounded(sample, name, importance)
        errors[name] = float((((restored - sample).square() * importance).sum(dim=1) * row_weights).sum())
    return errors


def rounded(weight: torch.Tensor, name: str, importance: torch.Tensor) -> torch.Tensor:
    """`weight` (out, in) rounded to the nearest values of block type `name`, its statistics fitted with each input
    column weighted by `importance`."""
    kind = BLOCK_TYPES[name]
    statistics = fit_statistics(kind, weight, importance)
    return decode(kind, codes_for(kind, weight, statistics), statistics)


def budget_types(
    weights: dict[str, torch.Tensor],
    fixed: dict[str, str],
    target_bits: float,
    importance: Callable[[str], torch.Tensor],
    output_weights: Callable[[str], torch.Tensor | None] = lambda name: None,
    measure: Callable[[str, torch.Tensor], float] | None = None,
    keep: Callable[[list[str], Callable[[list[str]], dict]], dict] | None = None,
    input_errors: Callable[[str], dict[str, float]] = lambda name: {},
    speed: tuple[dict[str, float], float] | None = None,
) -> dict[str, str]:
    """{name: type} spending at most `target_bits` per weight over `weights` ({name: (out, in) weight}): the
    `fixed` names keep their type, the others' candidates are ranked by `type_error_table`. `keep(names,
    measure_names)`: the errors of `names`, those a cache holds read back and the rest measured by
    `measure_names(missing)`; None measures them all. `speed`: (decode cost per weight of each type, the most
    the linears may cost in all), as `allocate` takes them."""
    free = [name for name in weights if name not in fixed]

    def measure_names(names: list[str]) -> dict[str, dict[str, float]]:
        return type_error_table({name: weights[name] for name in names}, importance, output_weights, measure)

    errors = keep(free, measure_names) if keep is not None else measure_names(free)
    errors = {name: with_input_errors(errors[name], input_errors(name)) for name in free}
    errors.update({name: {fixed[name]: 0.0} for name in weights if name in fixed})
    return allocate(errors, {name: weight.numel() for name, weight in weights.items()}, target_bits, *(speed or ()))


def with_input_errors(errors: dict[str, float], inputs: dict[str, float]) -> dict[str, float]:
    """Each type's error (`type_error_table`'s entry of one linear) plus what llama.cpp's rounding of the linear's
    input for that type adds (`inputs`: {int8 rounding: its Fisher estimate}, taken to the errors' scale; nothing
    where a rounding is not given)."""
    scale = errors.get(SCALE, 1.0)
    return {
        kind: error + scale * inputs.get(INPUT_ROUNDING[kind], 0.0) for kind, error in errors.items() if kind != SCALE
    }


def type_error_table(
    weights: dict[str, torch.Tensor],
    importance: Callable[[str], torch.Tensor],
    output_weights: Callable[[str], torch.Tensor | None] = lambda name: None,
    measure: Callable[[str, torch.Tensor], float] | None = None,
) -> dict[str, dict[str, float]]:
    """{name: {type: error}} of every candidate type of each weight: `type_errors` with `importance(name)` and
    `output_weights(name)`. With `measure` (name, the whole weight rounded: the loss that rounding adds), each
    linear's errors are scaled so that its cheapest type's error is what `measure` gives for it; the scale from the
    Fisher estimate to the errors is kept under the key SCALE."""
    errors = {}
    for name, weight in tqdm(weights.items(), desc="bit allocation", unit="linear", leave=False):
        candidates = candidates_for(weight.shape[1])
        errors[name] = type_errors(weight, importance(name), candidates, output_weights(name))
        cheapest = min(candidates, key=lambda t: BLOCK_TYPES[t].bits_per_weight)
        scale = 1.0
        if measure is not None and errors[name][cheapest] > 0:
            whole = rounded(weight.detach().float(), cheapest, importance(name))
            scale = max(measure(name, whole), 0.0) / errors[name][cheapest]
        errors[name] = {**{t: error * scale for t, error in errors[name].items()}, SCALE: scale}
    return errors


def allocate(
    errors: dict[str, dict[str, float]],
    sizes: dict[str, int],
    target_bits: float,
    costs: dict[str, float] | None = None,
    cost_limit: float | None = None,
) -> dict[str, str]:
    """{tensor: type} minimising the summed error with at most `target_bits` per weight over `sizes` (weights per
    tensor); `errors`: each tensor's candidates and their errors. With `costs` ({type: decode cost per weight}),
    only the types they name are candidates and the summed cost stays at most `cost_limit` where a choice can keep
    it. Bisection on lambda (and on mu, the price of cost, outside it; then, tensor by tensor in order of error
    saved per cost, the types of the highest price that breaks the limit wherever both limits still hold); the result
    never exceeds the budget (the cheapest choice is taken where nothing fits)."""
    total = sum(sizes.values())
    if costs is not None:
        errors = {
            tensor: {t: e for t, e in options.items() if t in costs} or options for tensor, options in errors.items()
        }

    def choice(penalty: float, price: float = 0.0) -> dict[str, str]:
        return {
            tensor: min(
                options,
                key=lambda t: (
                    options[t]
                    + penalty * BLOCK_TYPES[t].bits_per_weight * sizes[tensor]
                    + (price * costs.get(t, 0.0) * sizes[tensor] if price else 0.0)
                ),
            )
            for tensor, options in errors.items()
        }

    def bits(chosen: dict[str, str]) -> float:
        return sum(BLOCK_TYPES[t].bits_per_weight * sizes[tensor] for tensor, t in chosen.items()) / total

    def cost(chosen: dict[str, str]) -> float:
        return sum(costs.get(t, 0.0) * sizes[tensor] for tensor, t in chosen.items())

    def within_bits(price: float) -> dict[str, str]:
        low, high = 0.0, 1.0
        while bits(choice(high, price)) > target_bits and high < 1e30:
            high *= 10
        if bits(choice(0.0, price)) <= target_bits:
            return choice(0.0, price)
        for _ in range(60):
            middle = (low + high) / 2
            low, high = (middle, high) if bits(choice(middle, price)) > target_bits else (low, middle)
        return choice(high, price)

    chosen = within_bits(0.0)
    if costs is None or cost_limit is None or cost(chosen) <= cost_limit:
        return chosen
    low, high = 0.0, 1.0
    while cost(within_bits(high)) > cost_limit and high < 1e30:
        high *= 10
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (middle, high) if cost(within_bits(middle)) > cost_limit else (low, middle)
    chosen, wanted = within_bits(high), within_bits(low)
    # tensors alike switch at one price together: take the cheaper price's types one by one where both limits allow
    gains = {
        tensor: (errors[tensor][chosen[tensor]] - errors[tensor][kind])
        / max(costs.get(kind, 0.0) - costs.get(chosen[tensor], 0.0), 1e-12)
        for tensor, kind in wanted.items()
        if kind != chosen[tensor]
    }
    for tensor in sorted(gains, key=gains.get, reverse=True):
        trial = {**chosen, tensor: wanted[tensor]}
        if bits(trial) <= target_bits and cost(trial) <= cost_limit:
            chosen = trial
    return chosen


@dataclass(frozen=True)
class RecipeBudget:
    """What llama.cpp's file of one type (`--size-of`) spends on a model: `bits` per weight in the block linears
    (the smaller of its plain and importance-matrix recipes) and the types it gives the token embedding and the
    output head (`tables`: {"token_embd": type, "output": type}, no "output" for a tied head); `linears`: {GGUF
    name: (type, weights)} of its block linears."""

    recipe: str
    bits: float
    tables: dict[str, str]
    linears: dict[str, tuple[str, int]]

    def decode_cost(self, costs: dict[str, float]) -> float:
        """The summed decode cost of the recipe's block linears (`costs`: {type: cost per weight}); a ConfigError
        naming a type of the recipe that `costs` lacks."""
        missing = sorted({kind for kind, _ in self.linears.values() if kind not in costs})
        if missing:
            raise ConfigError(
                f"the decode costs give no cost for {', '.join(missing)}, which llama.cpp's {self.recipe.upper()} "
                "file gives this model's linears"
            )
        return sum(costs[kind] * size for kind, size in self.linears.values())

    def linear_types(self, gguf_names: dict[str, str]) -> dict[str, str]:
        """{BLOCK.PATH: type} the recipe gives each block linear (`gguf_names`: {BLOCK.PATH: GGUF tensor name}, as
        `linear_gguf_names` reads them)."""
        return {linear: self.linears[name][0] for linear, name in gguf_names.items()}


def decode_budget(spec: str, recipe: RecipeBudget, fixed: dict[str, str]) -> tuple[dict[str, float], float]:
    """(each block type's decode cost from the file `spec`, the most a mix's block linears may cost: `recipe`'s);
    a ConfigError naming a type of the recipe, or of the user's map `fixed` ({linear: type}), that `spec` does not
    cost."""
    costs = read_decode_costs(spec)
    limit = recipe.decode_cost(costs)
    uncosted = sorted({kind for kind in fixed.values() if kind not in costs})
    if uncosted:
        raise ConfigError(f"--tensor-type gives {uncosted[0]}, for which --decode-costs gives no decode time")
    return costs, limit


def linear_gguf_names(model: nn.Module) -> dict[str, str]:
    """{BLOCK.PATH: GGUF tensor name} of every block linear of `model`, in llama.cpp's layout."""
    from leanlm.models.architectures import architecture_for, decoder_blocks, gguf_tensor_names

    table = architecture_for(model)
    names = gguf_tensor_names(model)
    found = {}
    for index in range(len(decoder_blocks(model, table))):
        for path in table.quantizable_linears:
            name = names.get_name(f"{table.blocks}.{index}.{path}")
            if name is None:
                raise ConfigError(f"{table.blocks}.{index}.{path}: no GGUF name for this linear in llama.cpp's layout")
            found[f"{index}.{path}"] = name
    return found


def recipe_rows(model: nn.Module) -> tuple[dict[str, int], dict[str, int], float]:
    """What llama.cpp's recipes read of `model` (an empty model on the meta device will do): ({GGUF tensor name:
    row length} of the block linears, the token embedding and an untied output head, {block linear's GGUF name:
    weights}, query heads per key-value head)."""
    from leanlm.models.architectures import architecture_for, decoder_blocks, linear_weight_out_in

    table = architecture_for(model)
    blocks = decoder_blocks(model, table)
    sizes, rows = {}, {}
    for linear, name in linear_gguf_names(model).items():
        index, _, path = linear.partition(".")
        out_features, rows[name] = linear_weight_out_in(blocks[int(index)].get_submodule(path), table).shape
        sizes[name] = out_features * rows[name]
    rows["token_embd"] = model.get_input_embeddings().weight.shape[1]
    if not getattr(model.config, "tie_word_embeddings", False) and model.get_output_embeddings() is not None:
        rows["output"] = model.get_output_embeddings().weight.shape[1]
    heads = getattr(model.config, "num_attention_heads", 1)
    return rows, sizes, heads / (getattr(model.config, "num_key_value_heads", None) or heads)


def recipe_linear_types(model: nn.Module, recipe: RecipeBudget) -> dict[str, str]:
    """{BLOCK.PATH: type} llama.cpp's `recipe` gives each block linear of `model` (allocation "recipe")."""
    return recipe.linear_types(linear_gguf_names(model))


def recipe_budget(model: nn.Module, recipe: str) -> RecipeBudget:
    """The budget of llama.cpp's `recipe` file (`llama_cpp_recipes`) for `model`."""
    return budget_of(recipe, *recipe_rows(model))


def budget_of(recipe: str, rows: dict[str, int], sizes: dict[str, int], gqa: float) -> RecipeBudget:
    """The budget of llama.cpp's `recipe` file for the model `recipe_rows` read (`rows`, `sizes`, `gqa`)."""

    def bits(types: dict[str, str]) -> float:
        return sum(BLOCK_TYPES[types[name]].bits_per_weight * size for name, size in sizes.items()) / sum(
            sizes.values()
        )

    both = [llama_cpp_recipes.recipe_types(recipe, rows, gqa, importance) for importance in (False, True)]
    types = min(both, key=bits)
    tables = {name: types[name] for name in ("token_embd", "output") if name in types}
    return RecipeBudget(recipe, bits(types), tables, {name: (types[name], size) for name, size in sizes.items()})
