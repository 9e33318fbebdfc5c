"""leanlm's GGUF exports measured inside llama.cpp, beside llama.cpp's own quantizer: WikiText-2
perplexity computed by llama.cpp on exactly the windows `leanlm eval` scores (leanlm's token ids, one fresh
context per window), each file's size and tensor types, and for every leanlm row leanlm's own perplexity of the
same checkpoint and the wall time leanlm took to quantize it; for the leanlm rows and the shipped file, leanlm's
perplexity again with each linear's input rounded as llama.cpp rounds it for the type the file stores
(`leanlm.bench.llama_cpp.llama_cpp_inputs`), which splits llama.cpp's difference from leanlm into the weights'
part and its arithmetic's. (llama.cpp's scoring speed is saved too but not reported: files of the same tensor
types run the same llama.cpp kernels, and decode speed is measured on a quiet machine by its own benchmark.)
Writes benchmarks/results/gguf_llama_cpp_<model>.json + .png.

    pip install llama-cpp-python==0.3.36     # optional extra `llama`: compiles llama.cpp, 15-35 min on 2 cores
    python benchmarks/gguf_llama_cpp.py                    # first 8 windows of 512 tokens
    python benchmarks/gguf_llama_cpp.py --windows 0        # the full test set (about 10 min a row in each engine)
    python benchmarks/gguf_llama_cpp.py --windows 0 --no-q8-inputs --only F32 imatrix "scale search"
    python benchmarks/gguf_llama_cpp.py --windows 0 --no-q8-inputs --resume --only shrunk   # one more row
    python benchmarks/gguf_llama_cpp.py --report

Rows: the float model as F32; the GGUF file the model ships as (its weights, de-quantized, are the float
model's); llama.cpp's own Q8_0 and Q4_0 of that F32 file (`llama_model_quantize`), and its
Q4_0 weighted by an importance matrix (each block linear's mean squared input per column over the same
calibration windows GPTQ uses: what llama.cpp's `llama-imatrix` accumulates, computed here by leanlm on the float
model and handed to the quantizer through the bindings); leanlm RTN and GPTQ on the symmetric grid in groups of
32 (`--grid symmetric --group-size 32`, in column order or act-order with `--static-groups`), exported as their
exact Q4_0 blocks, and leanlm RTN with llama.cpp's importance-matrix scale search (`--scale-search --imatrix`:
each block's scale chosen by its squared error weighted by the same mean squared inputs, the importance matrix
leanlm collects while quantizing, from the outputs of the blocks before, already quantized), and GPTQ with
that search whose Hessian's off-diagonal terms are halved first (`--hessian-shrinkage 0.5`: its error feedback
trusts the calibration text's input correlations half as much; 1 would be the importance-matrix RTN). K-quant rows: llama.cpp's own Q3_K_M, Q4_K_M, Q5_K_M and Q6_K (its fixed per-tensor
recipes), each with and without the importance matrix; leanlm RTN with the importance matrix and GPTQ with the
Hessian shrunk by half on each of Q3_K-Q6_K (`--gguf-type`); and leanlm GPTQ with its types chosen to the budget of
llama.cpp's Q3_K_M, IQ4_XS, Q4_K_M and Q5_K_M files (`--size-of`: the bits per weight of the block linears of the
smaller of llama.cpp's two files of that type, checked against the files themselves), so that leanlm's file is
never larger: the token embedding and output head of a mix take the types they have in that llama.cpp file
(rounded to nearest at export), and leanlm scores the mix with them rounded so. The speed-kept mixes also keep
llama.cpp's decode time to its file's (`--decode-costs`), by the costs the type-speed part measures on this CPU:
llama.cpp's decode speed on files that store every block linear as one type, each beside the all-Q4_K file
(`--only type_speed`, before the speed-kept rows). The rows "in llama.cpp's types" give every linear the type
llama.cpp's file of that size gives it (`--allocation recipe`): the same size and decode kernels as llama.cpp's file,
only GPTQ's rounding differs. In the other leanlm rows the tensors that are not block linears take
the type llama.cpp's Q4_0 gives them on SmolLM2 and Gemma (token_embd Q8_0, norms F32), so files of one block
type have the same size there. SmolLM2's weights are de-quantized Q4_1 (asymmetric groups of 32): Q4_0's symmetric
grid does not contain them, so every Q4_0 row re-rounds.
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import time
from collections import Counter
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import gguf  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from leanlm.bench import Study, measured_on, print_report, results_name, study_arguments, titled  # noqa: E402
from leanlm.bench.harness import peak_memory, time_interleaved  # noqa: E402
from leanlm.bench.llama_cpp import (  # noqa: E402
    LlamaCpp,
    input_types,
    llama_cpp_inputs,
    llama_cpp_version,
    paired_difference,
    quantize_gguf,
)
from leanlm.data import datasets  # noqa: E402
from leanlm.evaluation.perplexity import perplexity_windows, windows_perplexity  # noqa: E402
from leanlm.export import export_gguf  # noqa: E402
from leanlm.export.to_gguf import source_gguf, table_blocks  # noqa: E402
from leanlm.formats.ggml_inputs import INPUT_ROUNDING  # noqa: E402
from leanlm.formats.gguf_blocks import dequantize as blocks_dequantized  # noqa: E402
from leanlm.methods import Calibration, GPTQConfig, RTNConfig, quantize_, save_quantized  # noqa: E402
from leanlm.methods.bit_allocation import CANDIDATES, candidates_for, recipe_budget, recipe_rows  # noqa: E402
from leanlm.methods.calibration import collect_importance  # noqa: E402
from leanlm.report import format_table, save_figure  # noqa: E402

# What llama.cpp's Q4_0 gives the tensors that are not block linears (token_embd, as the tied output: Q6_K, which
# falls back to Q8_0 where a row is not a multiple of 256, as on both models here); each row records its own.
FLOAT_TYPE_OF_Q4_0 = "q8_0"


def rows(calibration_samples: int) -> dict:
    """Row name -> what makes its file: ("llama.cpp", type, imatrix?), a leanlm config, None (the F32 export) or
    "shipped" (the GGUF the model is loaded from, as its makers published it; none for a model that is not one)."""
    grid = dict(group_size=32, grid="symmetric")
    return {
        "F32": None,
        "shipped GGUF": "shipped",
        "llama.cpp Q8_0": ("llama.cpp", "q8_0", False),
        "llama.cpp Q4_0": ("llama.cpp", "q4_0", False),
        "llama.cpp Q4_0 + imatrix": ("llama.cpp", "q4_0", True),
        "leanlm RTN Q4_0": RTNConfig(bits=4, **grid),
        "leanlm RTN Q4_0, imatrix": RTNConfig(
            bits=4, scale_search=True, imatrix=True, calibration_samples=calibration_samples, **grid
        ),
        "leanlm GPTQ Q4_0": GPTQConfig(bits=4, act_order=False, calibration_samples=calibration_samples, **grid),
        "leanlm GPTQ Q4_0, act-order": GPTQConfig(
            bits=4, static_groups=True, calibration_samples=calibration_samples, **grid
        ),
        "leanlm GPTQ Q4_0, act-order, scale search": GPTQConfig(
            bits=4, static_groups=True, scale_search=True, calibration_samples=calibration_samples, **grid
        ),
        "leanlm GPTQ Q4_0, shrunk Hessian": GPTQConfig(
            bits=4,
            static_groups=True,
            scale_search=True,
            hessian_shrinkage=0.5,
            calibration_samples=calibration_samples,
            **grid,
        ),
        **{
            f"llama.cpp {kind.upper()}{' + imatrix' if weighted else ''}": ("llama.cpp", kind, weighted)
            for kind in ("q3_k_m", "iq4_xs", "q4_k_m", "q5_k_m", "q6_k")
            for weighted in (False, True)
        },
        **{
            f"leanlm {name} {kind.upper()}, {variant}": config(gguf_type=kind, **extra)
            for kind in ("q3_k", "q4_k", "q5_k", "q6_k")
            for name, variant, config, extra in (
                ("RTN", "imatrix", RTNConfig, {"imatrix": True, "calibration_samples": calibration_samples}),
                (
                    "GPTQ",
                    "shrunk Hessian",
                    GPTQConfig,
                    {"calibration_samples": calibration_samples, "hessian_shrinkage": 0.5},
                ),
            )
        },
        **{
            f"leanlm GPTQ {'measured ' if allocation == 'measured' else ''}mix, size of {kind.upper()}": (
                "mix",
                kind,
                allocation,
            )
            for allocation in ("fisher", "measured")
            for kind in ("q3_k_m", "iq4_xs", "q4_k_m", "q5_k_m")
        },
        **{
            f"leanlm GPTQ speed-kept mix, size of {kind.upper()}": ("mix", kind, "fisher", "speed")
            for kind in ("q3_k_m", "iq4_xs", "q4_k_m", "q5_k_m")
        },
        **{
            f"leanlm GPTQ in llama.cpp's types, size of {kind.upper()}": ("mix", kind, "recipe")
            for kind in ("q3_k_m", "iq4_xs", "q4_k_m", "q5_k_m", "q6_k")
        },
    }


def importance_matrix(model, batches: torch.Tensor) -> dict[str, torch.Tensor]:
    """{GGUF tensor name: mean over calibration tokens of each input column's square} for every block linear of
    the float model, the statistic llama.cpp's imatrix tool collects."""
    matrix = collect_importance(model, batches)
    return {name: matrix.mean_squares(name) for name in matrix.sums}


def row_file(work: Path, row: str) -> Path:
    """Where a row's GGUF file is written (a leanlm row's checkpoint is the same path without `.gguf`)."""
    return work / f"{row.replace(' ', '_')}.gguf"


def _export(loaded, model, record, checkpoint_dir: Path, tables: dict[str, str]) -> Path:
    """The quantized model saved as a checkpoint and exported, its tables as `tables` gives (`table_types`; a
    previous run's files are made anew)."""
    path = checkpoint_dir.with_name(f"{checkpoint_dir.name}.gguf")
    shutil.rmtree(checkpoint_dir, ignore_errors=True)
    path.unlink(missing_ok=True)
    checkpoint = save_quantized(loaded, model, record, checkpoint_dir)
    types = {"token_embedding_type": tables.get("token_embd"), "output_tensor_type": tables.get("output")}
    return Path(export_gguf(checkpoint, path, FLOAT_TYPE_OF_Q4_0, **types)["path"])


def table_types(path: Path, tied: bool) -> dict[str, str]:
    """{GGUF name: block type} of the token embedding and (untied) output head in llama.cpp's file at `path`."""
    types = {tensor.name: tensor.tensor_type.name.lower() for tensor in gguf.GGUFReader(path).tensors}
    names = ("token_embd",) if tied else ("token_embd", "output")
    return {name: types[f"{name}.weight"] for name in names if f"{name}.weight" in types}


def round_tables_(model, tables: dict[str, str]) -> None:
    """`model`'s token embedding and output head replaced by what the export writes for `tables`
    (`table_blocks`), so that leanlm scores the weights the file holds."""
    modules = {"token_embd": model.get_input_embeddings(), "output": model.get_output_embeddings()}
    for name, kind in tables.items():
        weight = modules[name].weight
        blocks, written = table_blocks(weight, kind)
        rounded = blocks_dequantized(written, torch.from_numpy(blocks), weight.shape[1])
        modules[name].weight = torch.nn.Parameter(rounded.to(weight.dtype), requires_grad=False)
    if getattr(model.config, "tie_word_embeddings", False):
        model.get_output_embeddings().weight = model.get_input_embeddings().weight


def check_recipe(budget, paths: list[Path], tied: bool) -> None:
    """Stop unless the smaller of llama.cpp's files at `paths` (plain and importance-matrix) spends `budget.bits`
    in its block linears (leanlm's reading of llama.cpp's recipe) and gives the tables `budget.tables`' types."""
    bits = {path: block_linear_bits(path) for path in paths}
    smaller = min(paths, key=bits.get)
    tables = table_types(smaller, tied)
    if abs(bits[smaller] - budget.bits) > 1e-9 or tables != budget.tables:
        raise SystemExit(
            f"{smaller.name}: llama.cpp's file spends {bits[smaller]:.4f} bits per weight with tables {tables}; "
            f"leanlm's {budget.recipe} recipe plans {budget.bits:.4f} with {budget.tables}: this llama.cpp's "
            "recipe differs"
        )


def block_linear_bits(path: Path) -> float:
    """Bits per weight of a GGUF file's block linears (its blk.* matrices)."""
    matrices = [t for t in gguf.GGUFReader(path).tensors if t.name.startswith("blk.") and len(t.shape) == 2]
    return 8 * sum(int(t.n_bytes) for t in matrices) / sum(int(t.n_elements) for t in matrices)


def describe_file(path: Path) -> dict:
    reader = gguf.GGUFReader(path)
    types = {tensor.name: tensor.tensor_type.name for tensor in reader.tensors}
    return {
        "file_bytes": path.stat().st_size,
        "block_linear_bits": block_linear_bits(path),
        "tensor_types": dict(Counter(types.values())),
        "token_embd_type": types["token_embd.weight"],
    }


GOAL_BITS = (3.5, 6.6)  # the llama.cpp files the goal covers: bits per weight of their block linears


def _shown_bits(row: dict) -> str:
    return f"{row['block_linear_bits']:.2f}" if "block_linear_bits" in row else ""


def pareto(table: dict) -> tuple[list[str], list[list[str]]]:
    """For every llama.cpp file of GOAL_BITS, the leanlm file of lowest perplexity in llama.cpp among those no
    larger, and whether it is lower than llama.cpp's (the goal: every row "yes"); nothing before a leanlm file is
    measured."""
    float_bytes = table.get("F32", {}).get("file_bytes")
    ours = {name: row for name, row in table.items() if name.startswith("leanlm")}
    if not float_bytes or not ours:
        return [], []
    lines = []
    for name, row in table.items():
        bits = row.get("block_linear_bits")  # rows saved before it was recorded are left out
        if not name.startswith("llama.cpp") or bits is None or not GOAL_BITS[0] <= bits <= GOAL_BITS[1]:
            continue
        theirs = row["llama_cpp"]["perplexity"]
        smaller = {n: r for n, r in ours.items() if r["file_bytes"] <= row["file_bytes"]}
        best = min(smaller, key=lambda n: smaller[n]["llama_cpp"]["perplexity"], default=None)
        mine = smaller[best]["llama_cpp"]["perplexity"] if best else None
        lines.append(
            [
                name,
                f"{row['file_bytes'] / 2**20:.1f}",
                _shown_bits(row),
                f"{theirs:.3f}",
                best or "none",
                f"{smaller[best]['file_bytes'] / 2**20:.1f}" if best else "",
                _shown_bits(smaller[best]) if best else "",
                f"{mine:.3f}" if best else "",
                f"{100 * (mine / theirs - 1):+.1f}%" if best else "",
                "yes" if best and mine < theirs else "no",
                _noise(smaller[best]["llama_cpp"], row["llama_cpp"]) if best else "",
            ]
        )
    head = ["llama.cpp file", "MiB", "block linears", "ppl"]
    return [*head, "best leanlm file no larger", *head[1:], "vs", "lower", "2 SE"], lines


def _noise(ours: dict, theirs: dict) -> str:
    """Two standard errors of the difference of two rows' perplexities, in percent, from their windows' NLLs
    (`paired_difference`): a "vs" smaller than this is within what the windows drawn move it by. Blank for rows
    saved without their windows' NLLs."""
    paired = paired_difference(ours, theirs)
    return "" if paired is None else f"{200 * paired[1]:.1f}%"


def _emulated(row: dict) -> float | None:
    """leanlm's perplexity of a row's weights with llama.cpp's input rounding. A value saved under the rule of one
    Q8_0 rounding for every linear ("with_q8_0_activations") is the same measurement where every tensor type of
    the file takes Q8_0 inputs (or is a float vector), and is shown only there."""
    ours = row.get("leanlm") or {}
    if "with_llama_cpp_inputs" in ours:
        return ours["with_llama_cpp_inputs"]
    same_rule = all(INPUT_ROUNDING.get(kind.lower()) in (None, "q8_0") for kind in row["tensor_types"])
    return ours.get("with_q8_0_activations") if same_rule else None


def report(payload: dict) -> str:
    table = payload.get("rows", {})
    settings = payload["settings"]
    float_ppl = table.get("F32", {}).get("llama_cpp", {}).get("perplexity")
    float_bytes = table.get("F32", {}).get("file_bytes")
    lines = []
    for name, row in table.items():
        engine = row["llama_cpp"]
        ours = row.get("leanlm")
        emulated = _emulated(row)
        lines.append(
            [
                name,
                f"{engine['perplexity']:.3f}",
                f"{100 * (engine['perplexity'] / float_ppl - 1):+.1f}%" if float_ppl else "",
                f"{ours['perplexity']:.3f}" if ours else "",
                f"{emulated:.3f}" if emulated else "",
                f"{100 * (engine['perplexity'] / ours['perplexity'] - 1):+.2f}%" if ours else "",
                f"{row['file_bytes'] / 2**20:.1f}",
                f"{32 * row['file_bytes'] / float_bytes:.2f}" if float_bytes else "",
                f"{row['block_linear_bits']:.2f}" if "block_linear_bits" in row else "",
                ", ".join(f"{k} {v}" for k, v in sorted(row["tensor_types"].items())),
            ]
        )
    windows = settings["windows"] or "all"
    head = (
        f"WikiText-2 test, {windows} windows of {settings['seq_len']} tokens, scored by llama.cpp "
        f"{payload.get('llama_cpp_version', '')} ({settings['threads']} threads)"
    )
    return (
        head
        + "\n\n"
        + format_table(
            [
                "file",
                "llama.cpp ppl",
                "vs F32",
                "leanlm ppl",
                "leanlm, llama.cpp's inputs",
                "llama.cpp vs leanlm",
                "MiB",
                "bits/weight",
                "block linears",
                "tensor types",
            ],
            lines,
            markdown=True,
        )
        + _pareto_text(table)
        + _shipped_text(payload)
        + _decode_text(payload)
        + _type_speed_text(payload)
    )


def _type_speed_text(payload: dict) -> str:
    rows = payload.get("type_speed", {})
    if not rows:
        return ""
    lines = [
        [
            kind.upper(),
            f"{value['tokens_per_second']:.1f}",
            f"{value['reference_tokens_per_second']:.1f}",
            f"{value['relative_time']:.3f}",
            " / ".join(f"{load:.1f}" for load in value["load_average"]),
            measured_on(payload, f"type_speed/{kind}") or "not recorded",
        ]
        for kind, value in rows.items()
    ]
    return (
        f"\n\nllama.cpp's decode speed with every block linear of one type (llama.cpp's own rounding; token "
        f"embedding and output head Q8_0), each beside the all-{SPEED_REFERENCE.upper()} file: the decode costs "
        "of the speed-kept mixes (`--decode-costs`)\n\n"
        + format_table(
            [
                "block type",
                "tokens/s",
                f"{SPEED_REFERENCE.upper()} tokens/s",
                f"time / {SPEED_REFERENCE.upper()}'s",
                "load (1/5/15 min)",
                "CPU",
            ],
            lines,
            markdown=True,
        )
    )


def _decode_text(payload: dict) -> str:
    rows = payload.get("decode", {})
    if not rows:
        return ""
    lines = []
    for row, value in rows.items():
        ours, theirs = decode_pairs(payload["rows"])[row]
        lines.append(
            [
                row,
                f"{value[ours]['tokens_per_second']:.1f}",
                theirs,
                f"{value[theirs]['tokens_per_second']:.1f}",
                f"{value['ratio']:.3f}",
                " / ".join(f"{load:.1f}" for load in value["load_average"]),
                measured_on(payload, f"decode/{row}") or "not recorded",
            ]
        )
    return (
        f"\n\nllama.cpp's decode speed ({DECODE_STEPS} one-token steps after {DECODE_PROMPT} prompt tokens, median of "
        "interleaved rounds, tokens/s)\n\n"
        + format_table(
            ["leanlm file", "tokens/s", "llama.cpp file", "tokens/s", "ratio", "load (1/5/15 min)", "CPU"],
            lines,
            markdown=True,
        )
    )


def _pareto_text(table: dict) -> str:
    head, lines = pareto(table)
    if not lines:
        return ""
    return (
        f"\n\nEvery llama.cpp file of {GOAL_BITS[0]} to {GOAL_BITS[1]} bits per weight in its block linears against "
        "leanlm's best file no larger (perplexity in llama.cpp; 2 SE: two standard errors of the difference, window "
        "by window, where both rows kept their windows' NLLs)\n\n" + format_table(head, lines, markdown=True)
    )


def _system(name: str) -> str:
    """Which line of the plot a row is on: llama.cpp with or without its importance matrix, or leanlm's recipe."""
    if name.startswith("llama.cpp"):
        return "llama.cpp + imatrix" if "imatrix" in name else "llama.cpp"
    if name.startswith("leanlm"):
        if "llama.cpp's types" in name:
            return "leanlm GPTQ, llama.cpp's types"
        if "speed-kept" in name:
            return "leanlm GPTQ, budget and decode time"
        if "mix" in name:
            return "leanlm GPTQ, measured budget" if "measured" in name else "leanlm GPTQ, budget"
        return f"leanlm {name.split()[1]}{name.partition(',')[2]}"
    return name


def plot_rows(payload: dict, path: Path) -> None:
    """Perplexity in llama.cpp against the file's bits per weight, one line per system (F32 left out)."""
    table = {name: row for name, row in payload.get("rows", {}).items() if name != "F32"}
    float_bytes = payload.get("rows", {}).get("F32", {}).get("file_bytes")
    if not table or not float_bytes:
        return
    lines: dict[str, list[tuple[float, float]]] = {}
    for name, row in table.items():
        lines.setdefault(_system(name), []).append(
            (32 * row["file_bytes"] / float_bytes, row["llama_cpp"]["perplexity"])
        )
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for system, points in sorted(lines.items()):
        bits, perplexity = zip(*sorted(points))
        style = "--" if system.startswith("llama.cpp") else "-"
        ax.plot(bits, perplexity, style, marker="o", label=system)
    ax.axhline(payload["rows"]["F32"]["llama_cpp"]["perplexity"], color="black", linewidth=0.8, label="F32")
    ax.set_xlabel("file size, bits per weight")
    ax.set_ylabel("WikiText-2 perplexity, computed by llama.cpp")
    ax.legend(fontsize=8)
    save_figure(fig, path, titled(payload, "GGUF files in llama.cpp"))


def main() -> None:
    parser = study_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    parser.add_argument("--windows", type=int, default=8, help="first N windows of the test set (0: all)")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--calib-samples", type=int, default=128)
    parser.add_argument("--calib-seq-len", type=int, default=512)
    parser.add_argument("--decode-rounds", type=int, default=7, help="interleaved rounds of the decode-speed part")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--no-q8-inputs",
        action="store_true",
        help="skip the 'leanlm, llama.cpp's inputs' column (a second leanlm evaluation of every quantized "
        "row: a full-test-set run is about 16 min shorter without it)",
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        default=Path(os.environ.get("TMPDIR", "/tmp")) / "leanlm-gguf",
        help="where the GGUF files and checkpoints are written (not kept in results)",
    )
    args = parser.parse_args()
    name = results_name("gguf_llama_cpp", args.model) + ("" if args.windows == 8 else f"_windows{args.windows}")
    if args.report:
        return print_report(name, report)

    settings = {
        "windows": args.windows,
        "seq_len": args.seq_len,
        "calibration_samples": args.calib_samples,
        "calibration_seq_len": args.calib_seq_len,
        "threads": args.threads,
    }
    if args.no_q8_inputs:  # recorded only when set, so that the runs before the flag keep their settings
        settings["q8_inputs"] = False
    study = Study(name, settings, args, plot=plot_rows)
    study.payload["llama_cpp_version"] = llama_cpp_version()
    loaded = study.load_model(args.model)
    windows = perplexity_windows(loaded.tokenizer, datasets.wikitext2_test_text(), seq_len=args.seq_len)
    windows = windows[: args.windows or None]
    work = args.workdir / Path(args.model).name  # a model directory's own name, not its whole path
    work.mkdir(parents=True, exist_ok=True)
    calibration = Calibration(loaded.tokenizer, samples=args.calib_samples, seq_len=args.calib_seq_len)
    float_file = work / "f32.gguf"
    if not float_file.exists():
        export_gguf(args.model, float_file, "f32")

    def leanlm_perplexity(model, path: Path | None = None, *, embedding_q8_0: bool = False) -> dict:
        """leanlm's perplexity of the model, and (given the GGUF file at `path` that holds its weights) of the same
        model with every linear's input rounded as llama.cpp rounds it for the file's tensor types, and with
        `embedding_q8_0` the token embedding rounded to the Q8_0 the file stores: what llama.cpp's arithmetic adds
        to the weights'."""
        result = {"perplexity": windows_perplexity(model, windows).perplexity}
        if path is not None and not args.no_q8_inputs:
            with llama_cpp_inputs(model, input_types(model, path), embedding_q8_0=embedding_q8_0) as emulated:
                result["with_llama_cpp_inputs"] = windows_perplexity(emulated, windows).perplexity
        return result

    recipes = rows(args.calib_samples)
    importance = {}  # the float model's importance matrix, computed once, for every llama.cpp row that takes it

    def llama_cpp_file(path: Path, kind: str, weighted: bool) -> Path:
        """llama.cpp's own quantizer's `kind` file of the F32 export at `path`, with the importance matrix if
        `weighted`."""
        if weighted and not importance:
            importance.update(importance_matrix(loaded.model, calibration.batches()))
        return quantize_gguf(float_file, path, kind, threads=args.threads, importance=importance if weighted else None)

    measure_type_speed(study, work, float_file, loaded.model, windows[0], args)
    measured = set()  # the rows whose files this run made
    for row in study.todo("rows", recipes):
        recipe = recipes[row]
        measured.add(row)
        tables = {}  # the tables' types, where they are not the float type of every leanlm row (FLOAT_TYPE_OF_Q4_0)
        if recipe == "shipped" and source_gguf(args.model) is None:
            continue
        if isinstance(recipe, tuple) and recipe[0] == "mix":  # GPTQ spending what llama.cpp's file of a type spends
            budget = recipe_budget(loaded.model, recipe[1])
            references = []
            for weighted in (False, True):  # llama.cpp's files, made here if not yet made, must spend what leanlm plans
                reference = row_file(work, f"llama.cpp {recipe[1].upper()}{' + imatrix' if weighted else ''}")
                references.append(reference if reference.exists() else llama_cpp_file(reference, recipe[1], weighted))
            check_recipe(budget, references, getattr(loaded.model.config, "tie_word_embeddings", False))
            tables = budget.tables
            speed_kept = recipe[3:] == ("speed",)  # the type-speed part's decode times, which the mix's must not exceed
            if speed_kept and not study.payload.get("type_speed"):
                raise SystemExit(f"{row}: measure the type_speed part first (--only type_speed)")
            recipe = GPTQConfig(
                size_of=recipe[1],
                allocation=recipe[2],
                hessian_shrinkage=0.5,
                calibration_samples=args.calib_samples,
                decode_costs=str(study.path) if speed_kept else None,  # the results file, as saved so far
            )
        with peak_memory() as memory:
            ours = None
            if recipe is None:
                path = float_file
                ours = leanlm_perplexity(loaded.model)
            elif recipe == "shipped":  # the float model's weights are the shipped file's, de-quantized
                path = source_gguf(args.model)
                ours = leanlm_perplexity(loaded.model, path)
            elif isinstance(recipe, tuple):
                _, kind, weighted = recipe
                path = llama_cpp_file(row_file(work, row), kind, weighted)
            else:
                model = copy.deepcopy(loaded.model)
                started = time.perf_counter()
                record = quantize_(model, recipe, calibration=calibration)
                seconds = time.perf_counter() - started
                path = _export(loaded, model, record, row_file(work, row).with_suffix(""), tables)
                round_tables_(model, tables)
                ours = {"quantize_seconds": seconds, **leanlm_perplexity(model, path, embedding_q8_0=not tables)}
                if record.get("decode_cost") is not None:  # the mix's decode time over its recipe's, by the costs
                    ours["decode_cost"] = record["decode_cost"]
                del model
        engine = LlamaCpp(path, context=args.seq_len, threads=args.threads)
        scored = engine.perplexity(windows)
        del engine
        value = {**describe_file(path), "llama_cpp": scored, "peak_rss_bytes": memory.peak_bytes}
        if ours is not None:
            value["leanlm"] = ours
        study.record(
            "rows",
            row,
            value,
            summary=lambda v: (
                f"llama.cpp {v['llama_cpp']['perplexity']:.3f}"
                + (f", leanlm {v['leanlm']['perplexity']:.3f}" if "leanlm" in v else "")
                + (
                    f" (quantized in {v['leanlm']['quantize_seconds'] / 60:.1f} min)"
                    if "quantize_seconds" in v.get("leanlm", {})
                    else ""
                )
                + f", {v['file_bytes']:,} bytes"
            ),
        )
    compare_with_shipped(study, work, measured)
    measure_decode(study, work, windows[0], args)
    print(report(study.payload))
    print(f"wrote {study.path}")


def compare_with_shipped(study: Study, work: Path, measured: set[str]) -> None:
    """For every row's file in `work` not compared yet or made again by this run (`measured`), how many of its
    quantized tensors are byte for byte those of the GGUF the model ships as (the same type and blocks): a
    quantizer that finds the shipped blocks again from their de-quantized weights recovers the shipped file."""
    shipped = source_gguf(study.payload["model"]) if "model" in study.payload else None
    compared = dict(study.payload.get("as_shipped", {}))
    todo = [
        row
        for row in study.payload.get("rows", {})
        if row not in ("F32", "shipped GGUF")
        and row_file(work, row).exists()
        and (row not in compared or row in measured)
    ]
    if shipped is None or not todo:
        return
    theirs = {t.name: t for t in gguf.GGUFReader(shipped).tensors if t.tensor_type.name != "F32"}
    for row in todo:
        ours = {t.name: t for t in gguf.GGUFReader(row_file(work, row)).tensors if t.tensor_type.name != "F32"}
        same = sum(
            name in theirs
            and theirs[name].tensor_type == tensor.tensor_type
            and np.array_equal(tensor.data, theirs[name].data)
            for name, tensor in ours.items()
        )
        compared[row] = {"identical": int(same), "quantized": len(ours)}
    study.set("as_shipped", compared)


def _shipped_text(payload: dict) -> str:
    rows = payload.get("as_shipped", {})
    if not rows:
        return ""
    lines = [[row, value["identical"], value["quantized"]] for row, value in rows.items()]
    return "\n\nQuantized tensors byte for byte those of the GGUF the model ships as\n\n" + format_table(
        ["file", "identical", "quantized tensors"], lines, markdown=True
    )


DECODE_PROMPT, DECODE_STEPS = 8, 128  # tokens read in one batch, then decoded one at a time
SPEED_REFERENCE = "q4_k"  # the block type every other type's decode time is a ratio to


def time_decode(paths: dict[str, Path], ids: list[int], args: argparse.Namespace) -> dict:
    """{name: Timing} of llama.cpp decoding DECODE_STEPS one-token steps after a DECODE_PROMPT-token prompt with
    each GGUF file of `paths`, all loaded at once and timed in interleaved rounds."""
    engines = {name: LlamaCpp(path, context=args.seq_len, threads=args.threads) for name, path in paths.items()}
    tokens = ids[: DECODE_PROMPT + DECODE_STEPS]
    return time_interleaved(
        {name: (lambda engine=engine: engine.decode(tokens, DECODE_PROMPT)) for name, engine in engines.items()},
        repeats=args.decode_rounds,
    )


def speed_types(model) -> list[str]:
    """The candidate block types that tile every block linear's rows of `model` (those a file can give them all)."""
    rows, _, _ = recipe_rows(model)
    lengths = {length for name, length in rows.items() if name not in ("token_embd", "output")}
    return [kind for kind in CANDIDATES if all(kind in candidates_for(length) for length in lengths)]


def pure_file(work: Path, kind: str) -> Path:
    return work / f"llama.cpp_all_{kind}.gguf"


def measure_type_speed(study: Study, work: Path, float_file: Path, model, ids: list[int], args) -> None:
    """llama.cpp's decode time of files that store every block linear as one block type (llama.cpp's own RTN of
    the F32 file, the token embedding and output head Q8_0 in all), each timed beside the SPEED_REFERENCE file
    (interleaved rounds, medians): the decode costs a mix's allocation keeps to its recipe's (`--decode-costs`)."""
    kinds = speed_types(model)
    if SPEED_REFERENCE not in kinds:
        return
    for kind in study.todo("type_speed", kinds):
        paths = {}
        for name in dict.fromkeys((SPEED_REFERENCE, kind)):
            paths[name] = pure_file(work, name)
            if not paths[name].exists():
                quantize_gguf(float_file, paths[name], name, threads=args.threads, pure=True, tables="q8_0")
        timings = time_decode(paths, ids, args)
        if kind != SPEED_REFERENCE:
            paths[kind].unlink()
        value = {
            "tokens_per_second": DECODE_STEPS / timings[kind].median,
            "reference_tokens_per_second": DECODE_STEPS / timings[SPEED_REFERENCE].median,
            "rounds": timings[kind].repeats,
            "relative_time": timings[kind].median / timings[SPEED_REFERENCE].median,
            "load_average": list(os.getloadavg()),
        }
        study.record(
            "type_speed",
            kind,
            value,
            summary=lambda v: f"decode time / {SPEED_REFERENCE.upper()}'s {v['relative_time']:.3f}",
        )


def decode_pairs(table: dict) -> dict[str, tuple[str, str]]:
    """{leanlm row of a llama.cpp file's size: (it, the llama.cpp importance-matrix file of that size)} for the rows
    saved."""
    pairs = {}
    for name in table:
        if name.startswith("leanlm") and ", size of " in name:
            theirs = f"llama.cpp {name.rpartition(' ')[2]} + imatrix"
            if theirs in table:
                pairs[name] = (name, theirs)
    return pairs


def measure_decode(study: Study, work: Path, ids: list[int], args: argparse.Namespace) -> None:
    """llama.cpp's decode speed on each leanlm mix beside its own recipe at that size: DECODE_STEPS one-token
    steps after a DECODE_PROMPT-token prompt, interleaved rounds, medians."""
    pairs = decode_pairs(study.payload.get("rows", {}))
    for row in study.todo("decode", pairs):
        timings = time_decode({name: row_file(work, name) for name in pairs[row]}, ids, args)
        value = {
            name: {"tokens_per_second": DECODE_STEPS / timing.median, "rounds": timing.repeats}
            for name, timing in timings.items()
        }
        value["ratio"] = value[pairs[row][0]]["tokens_per_second"] / value[pairs[row][1]]["tokens_per_second"]
        value["load_average"] = list(os.getloadavg())
        study.record("decode", row, value, summary=lambda v: f"leanlm / llama.cpp decode speed {v['ratio']:.3f}")


if __name__ == "__main__":
    main()
