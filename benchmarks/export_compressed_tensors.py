"""leanlm's compressed-tensors exports loaded by transformers: for each W8A8 / SmoothQuant level and
4-bit weight-only recipe, leanlm quantizes the model, scores it, writes the checkpoint, exports it with
`leanlm export --format compressed-tensors`, and transformers (`AutoModelForCausalLM.from_pretrained` with the
`compressed-tensors` package: the loader and quantized-forward emulation vLLM's checkpoints go through on a CPU)
scores the directory on the same WikiText-2 windows. Writes benchmarks/results/compressed_tensors_<model>.json + .png.

    python benchmarks/export_compressed_tensors.py                 # first 8 windows of 512 tokens
    python benchmarks/export_compressed_tensors.py --windows 0     # the full test set
    python benchmarks/export_compressed_tensors.py --report

Per row: leanlm's perplexity of its checkpoint, transformers' of the exported directory, their difference (the
goal: within 0.5%), the directory's bytes and the peak resident memory of the row (leanlm's float model, its
quantized copy and transformers' model at once). For the int8 rows two more leanlm perplexities of the same
checkpoint say how much of a difference is arithmetic:
- "PyTorch int8 reference": leanlm's oracle int8 path (products summed in float64). It gives fbgemm's path the
  same codes (both round x / s); what is left is the float32 rounding of the final scaling. Where per-tensor
  activation scales leave most activations on a few codes, a last-bit difference that flips a code moves the
  perplexity by percents (the README's reading of this table).
- "absmax / 127.5" (dynamic rows): compressed-tensors' emulation scales a token's activations by absmax / 127.5,
  leanlm and vLLM's int8 kernel by absmax / 127; this is leanlm with the emulation's rule.
O2 (dynamic per-tensor activations) is not a row: vLLM has no kernel for it and the export refuses it.
vLLM itself needs a GPU (not here): `vllm serve DIR` is the command on a machine that has one.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import shutil
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from leanlm.bench import Study, print_report, results_name, study_arguments, titled  # noqa: E402
from leanlm.bench.harness import peak_memory  # noqa: E402
from leanlm.data import datasets  # noqa: E402
from leanlm.evaluation.perplexity import perplexity_windows, windows_perplexity  # noqa: E402
from leanlm.export import export_compressed_tensors  # noqa: E402
from leanlm.methods import (
    Calibration,
    GPTQConfig,
    RTNConfig,
    SmoothQuantConfig,
    W8A8Config,
    quantize_,  # noqa: E402
    save_quantized,
)
from leanlm.nn import W8A8Linear  # noqa: E402
from leanlm.report import format_table, save_figure  # noqa: E402

GOAL = 0.005  # transformers' perplexity of the export within 0.5% of leanlm's of the checkpoint


@contextmanager
def compressed_tensors_activation_step():
    """leanlm's dynamic activation scales as compressed-tensors' emulation takes them: absmax / 127.5 (half its
    symmetric int8 range, 127 - (-128)) instead of absmax / 127; the codes are still clamped to int8. What is left
    between this and transformers' perplexity is the export's own difference."""
    from leanlm.nn import w8a8_linear

    leanlm_rule = w8a8_linear.activation_scale
    w8a8_linear.activation_scale = lambda x, granularity: leanlm_rule(x, granularity) * (127 / 127.5)
    try:
        yield
    finally:
        w8a8_linear.activation_scale = leanlm_rule


def rows(calibration_samples: int, group_size: int) -> dict:
    """Row name -> the configs `quantize_` applies (attention's q / k / v products stay float: compressed-tensors
    has no form for them)."""

    def w8a8(level: str, granularity: str = "per_tensor") -> W8A8Config:
        return W8A8Config(
            level=level, weight_granularity=granularity, quantize_bmm=False, calibration_samples=calibration_samples
        )

    smooth = SmoothQuantConfig(calibration_samples=calibration_samples)
    weight_only = dict(bits=4, group_size=group_size, grid="symmetric")
    return {
        "W8A8 O1, per-channel weights": w8a8("O1", "per_channel"),
        "SmoothQuant O1": [smooth, w8a8("O1")],
        "SmoothQuant O3 (static)": [smooth, w8a8("O3")],
        f"RTN int4, groups of {group_size}": RTNConfig(**weight_only),
        f"GPTQ int4, groups of {group_size}, act-order": GPTQConfig(
            static_groups=True, calibration_samples=calibration_samples, **weight_only
        ),
    }


def directory_bytes(path: Path) -> int:
    return sum(file.stat().st_size for file in path.rglob("*") if file.is_file())


def report(payload: dict) -> str:
    settings = payload["settings"]
    lines = []
    for name, row in payload.get("rows", {}).items():
        difference = row["transformers"] / row["leanlm"] - 1
        their_step, reference = row.get("leanlm_absmax_127_5"), row.get("leanlm_reference_int8")
        lines.append(
            [
                name,
                describe_scheme(row["scheme"]),
                f"{row['leanlm']:.3f}",
                f"{reference:.3f}" if reference else "",
                f"{their_step:.3f}" if their_step else "",
                f"{row['transformers']:.3f}",
                f"{100 * difference:+.2f}%",
                "yes" if abs(difference) <= GOAL else "no",
                f"{100 * (row['transformers'] / their_step - 1):+.2f}%" if their_step else "",
                f"{row['directory_bytes'] / 2**20:.1f}",
                f"{row['peak_rss_bytes'] / 2**20:,.0f}",
            ]
        )
    versions = (
        f"transformers {payload.get('transformers_version', '')}, "
        f"compressed-tensors {payload.get('compressed_tensors_version', '')}"
    )
    head = f"WikiText-2 test, {settings['windows'] or 'all'} windows of {settings['seq_len']} tokens; {versions}"
    return (
        head
        + "\n\n"
        + format_table(
            [
                "checkpoint",
                "compressed-tensors scheme",
                "leanlm ppl",
                "leanlm, PyTorch int8 reference",
                "leanlm, absmax / 127.5",
                "transformers ppl",
                "transformers vs leanlm",
                "within 0.5%",
                "vs leanlm at absmax / 127.5",
                "MiB on disk",
                "peak RSS MiB",
            ],
            lines,
            markdown=True,
        )
    )


def describe_scheme(scheme: dict) -> str:
    """W8A8 / W4A16 with the weights' and activations' strategies, e.g. "int8 channel, int8 token dynamic"."""
    weights = scheme["weights"]
    text = f"int{weights['num_bits']} {weights['strategy']}" + (
        f" {weights['group_size']}" if weights.get("group_size") else ""
    )
    activations = scheme.get("input_activations")
    if activations:
        text += f"; int8 {activations['strategy']} {'dynamic' if activations['dynamic'] else 'static'}"
    return text


def plot_rows(payload: dict, path: Path) -> None:
    table = payload.get("rows", {})
    if not table:
        return
    names = list(table)[::-1]
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(names) + 1.5))
    positions = torch.arange(len(names)).float()
    ax.barh(positions - 0.2, [table[n]["leanlm"] for n in names], height=0.4, label="leanlm, its checkpoint")
    ax.barh(
        positions + 0.2,
        [table[n]["transformers"] for n in names],
        height=0.4,
        label="transformers, the compressed-tensors export",
    )
    ax.set_yticks(positions.tolist(), names)
    values = [table[n][k] for n in names for k in ("leanlm", "transformers")]
    ax.set_xlim(min(values) * 0.9, max(values) * 1.05)
    ax.set_xlabel("WikiText-2 perplexity")
    ax.legend(loc="lower right", fontsize=8)
    save_figure(fig, path, titled(payload, "compressed-tensors exports in transformers"))


def main() -> None:
    parser = study_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    parser.add_argument("--windows", type=int, default=8, help="first N windows of the test set (0: all)")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--calib-samples", type=int, default=128)
    parser.add_argument(
        "--group-size",
        type=int,
        default=64,
        help="int4 rows: input columns per scale (compressed-tensors packs whole groups only, and "
        "SmolLM2's 576-column rows are 4.5 groups of 128)",
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        default=Path(os.environ.get("TMPDIR", "/tmp")) / "leanlm-compressed-tensors",
        help="where the checkpoints and exported directories are written (not kept in results)",
    )
    args = parser.parse_args()
    name = results_name("compressed_tensors", args.model) + ("" if args.windows == 8 else f"_windows{args.windows}")
    if args.report:
        return print_report(name, report)

    settings = {"windows": args.windows, "seq_len": args.seq_len, "calibration_samples": args.calib_samples}
    if args.group_size != 64:  # recorded when not the default, so the rows measured before the flag are kept
        settings["group_size"] = args.group_size
    study = Study(name, settings, args, plot=plot_rows)
    study.payload.update(
        transformers_version=version("transformers"), compressed_tensors_version=version("compressed-tensors")
    )
    loaded = study.load_model(args.model)
    windows = perplexity_windows(loaded.tokenizer, datasets.wikitext2_test_text(), seq_len=args.seq_len)
    windows = windows[: args.windows or None]
    work = args.workdir / Path(args.model).name
    work.mkdir(parents=True, exist_ok=True)
    calibration = Calibration(loaded.tokenizer, samples=args.calib_samples, seq_len=args.seq_len)

    recipes = rows(args.calib_samples, args.group_size)
    saved = study.rows("rows")
    for gone in set(saved) - set(recipes):  # rows the script no longer has (O2: the export refuses it now); the
        del saved[gone]  # file drops them with the next row it records
    for row in study.todo("rows", recipes):
        stem = work / row.replace(" ", "_").replace(",", "").replace("(", "").replace(")", "")
        checkpoint_dir, exported_dir = stem.with_name(stem.name + "-checkpoint"), stem.with_name(stem.name + "-ct")
        for stale in (checkpoint_dir, exported_dir):  # a previous run's: this row is measured anew
            shutil.rmtree(stale, ignore_errors=True)
        with peak_memory() as memory:
            model = copy.deepcopy(loaded.model)
            record = quantize_(model, recipes[row], calibration=calibration)
            ours = windows_perplexity(model, windows).perplexity
            int8 = [module for module in model.modules() if isinstance(module, W8A8Linear)]
            dynamic = any(not module.static for module in int8)
            if dynamic:
                with compressed_tensors_activation_step():
                    ours_with_their_step = windows_perplexity(model, windows).perplexity
            if int8:  # the same checkpoint through leanlm's other exact int8 arithmetic
                for module in int8:
                    module.use_reference_()
                ours_reference = windows_perplexity(model, windows).perplexity
            checkpoint = save_quantized(loaded, model, record, checkpoint_dir)
            del model
            exported = export_compressed_tensors(checkpoint, exported_dir)
            directory = Path(exported["path"])
            theirs_model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
            theirs = windows_perplexity(theirs_model, windows).perplexity
            del theirs_model
            gc.collect()
        value = {
            "leanlm": ours,
            **({"leanlm_absmax_127_5": ours_with_their_step} if dynamic else {}),
            **({"leanlm_reference_int8": ours_reference} if int8 else {}),
            "transformers": theirs,
            "scheme": exported["scheme"],
            "directory_bytes": directory_bytes(directory),
            "peak_rss_bytes": memory.peak_bytes,
        }
        study.record(
            "rows",
            row,
            value,
            summary=lambda v: (
                f"leanlm {v['leanlm']:.3f}, transformers "
                f"{v['transformers']:.3f} ({100 * (v['transformers'] / v['leanlm'] - 1):+.2f}%)"
            ),
        )
    print(report(study.payload))
    print(f"wrote {study.path}")


if __name__ == "__main__":
    main()
