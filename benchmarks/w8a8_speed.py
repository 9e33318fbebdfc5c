"""W8A8 speed and memory, side by side in one process: the float paths (FP32, and BF16, the fastest float path on a
CPU with bf16 instructions), leanlm W8A8 (O1 / O2 / O3, fbgemm int8 GEMM), bitsandbytes Linear8bitLt (CPU, eval
mode, threshold 0: plain vector-wise int8) and torchao int8 dynamic activation + int8 weight, all interleaved
round by round at every M; speed-ups are over the best float path. Writes benchmarks/results/w8a8_speed.json +
.png.

    python benchmarks/w8a8_speed.py            # 4096x4096 linear, SmolLM2's shapes, input rounding, whole-model prefill
    python benchmarks/w8a8_speed.py --quick    # fewer repeats, prefill at 512 only
    python benchmarks/w8a8_speed.py --report   # the saved tables

Whole-model rows use leanlm with attention in float (quantize_bmm=False, SDPA): the int8 attention matmuls
are simulated and not a speed path. The lm_head and embeddings stay FP32 in every row. leanlm runs the linears
that read one norm's output as one GEMM (q/k/v: 960 x 576 on SmolLM2; gate/up: 3072 x 576); the "separate GEMMs"
row is O1 without that, and the shapes table has the stacked shapes beside the single ones. Prefill timings
interleave the models round by round, once computing every position's logits (a perplexity forward) and once
only the last position's (what a generation's prefill computes, transformers' `logits_to_keep=1`).
"""

from __future__ import annotations

import argparse
import copy
import warnings

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from leanlm.bench import Study, print_report, study_arguments, time_call, time_modules, time_prefill, weight_bytes  # noqa: E402
from leanlm.bench.harness import cpu_description, float_paths, speed_table, time_interleaved  # noqa: E402
from leanlm.bench.peers import bitsandbytes_int8_linear, torchao_int8_dynamic_  # noqa: E402
from leanlm.data import calibration_batches  # noqa: E402
from leanlm.kernels.int8_gemm import int8_linear, pack_weight  # noqa: E402
from leanlm.methods import Calibration, SmoothQuantConfig, W8A8Config, calibrate, quantize_, share_input_gemms_  # noqa: E402
from leanlm.models import iter_quantizable_linears, load_model  # noqa: E402
from leanlm.nn import W8A8Linear  # noqa: E402
from leanlm.report import format_table, save_figure  # noqa: E402

warnings.filterwarnings("ignore")
# SmolLM2-135M's block linears (out x in): q/o, k/v, gate/up, down, and the stacked q/k/v and gate/up GEMMs.
SMOLLM2_SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (960, 576), (3072, 576)]
LEVEL_ACTIVATION = {"O1": ("per_token", None), "O2": ("per_tensor", None), "O3": ("per_tensor", 0.05)}


def peer_linears(linear: nn.Linear) -> dict[str, nn.Module]:
    """Every implementation of one float linear, keyed by name."""
    modules: dict[str, nn.Module] = float_paths(linear)
    for level, (activation, static_scale) in LEVEL_ACTIVATION.items():
        scale = torch.tensor(static_scale) if static_scale else None
        modules[f"leanlm {level}"] = W8A8Linear.from_float(
            linear.weight, linear.bias, "per_tensor", activation=activation, input_scale=scale
        )
    modules["bitsandbytes int8"] = bitsandbytes_int8_linear(linear, threshold=0.0)
    modules["torchao int8 dyn"] = torchao_int8_dynamic_(nn.Sequential(copy.deepcopy(linear)))
    return modules


def bench_linear(in_features: int, out_features: int, rows: list[int], repeats: int) -> dict:
    torch.manual_seed(0)
    linear = nn.Linear(in_features, out_features, bias=False)
    modules = peer_linears(linear)
    results: dict = {"shape": [out_features, in_features], "cpu": cpu_description(), "by_m": {}}
    for m in rows:
        x = torch.randn(m, in_features)
        expected = linear(x).detach()
        timings = time_modules(modules, x, expected, repeats)
        bnb_ms = timings["bitsandbytes int8"]["median_ms"]
        for level in LEVEL_ACTIVATION:
            timings[f"leanlm {level}"]["speedup_vs_bitsandbytes"] = bnb_ms / timings[f"leanlm {level}"]["median_ms"]
        results["by_m"][str(m)] = timings
        print(
            f"{out_features}x{in_features} M={m}: "
            + ", ".join(
                f"{name} {t['median_ms']:.2f} ms ({t['speedup_vs_best_float']:.2f}x)" for name, t in timings.items()
            ),
            flush=True,
        )
    bytes_fp32 = linear.weight.numel() * 4
    results["weight_bytes_ratio"] = {
        name: weight_bytes(module) / bytes_fp32 for name, module in modules.items() if name not in ("fp32", "bf16")
    }
    return results


ROUNDINGS = ("fbgemm's op rounds", "PyTorch ops round", "C++ pass rounds")


def bench_rounding(in_features: int, out_features: int, m: int, repeats: int) -> dict:
    """The eager int8 GEMM at prefill size with its input codes rounded three ways: by fbgemm's op itself (what
    leanlm ran before 2026-11-26: fast, but it moves near-ties, see the Kernels bullet), by PyTorch ops (six passes
    over x) and by leanlm's one C++ pass (what `int8_linear` runs now); per-tensor and per-token scales. ms."""
    gemm = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32
    torch.manual_seed(0)
    x = torch.randn(m, in_features) * 2
    packed = pack_weight(
        torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8), torch.rand(out_features) * 0.01 + 1e-3
    )
    results = {}
    for granularity in ("per_tensor", "per_token"):
        scale = x.abs().amax(dim=1, keepdim=True) / 127 if granularity == "per_token" else x.abs().amax() / 127
        per_tensor = granularity == "per_tensor"

        fns = {
            ROUNDINGS[0]: (lambda: gemm(x, float(scale), 128, packed.params))
            if per_tensor
            else (lambda: gemm(x / scale, 1.0, 128, packed.params).mul_(scale)),
            ROUNDINGS[1]: lambda: int8_linear(x, scale, None, None, None, "fbgemm", packed, compiled_rounding=False),
            ROUNDINGS[2]: lambda: int8_linear(x, scale, None, None, None, "fbgemm", packed),
        }
        timings = time_interleaved(fns, warmup=2, repeats=repeats)
        results[granularity] = {name: t.median * 1e3 for name, t in timings.items()}
        print(
            f"rounding {out_features}x{in_features} M={m} {granularity}: "
            + ", ".join(f"{name} {ms:.3f} ms" for name, ms in results[granularity].items()),
            flush=True,
        )
    return results


def model_variants(loaded) -> dict[str, nn.Module]:
    float_model = loaded.model
    variants: dict[str, nn.Module] = {"fp32": float_model, "bf16": copy.deepcopy(float_model).to(torch.bfloat16)}
    stats = calibrate(float_model, calibration_batches(loaded.tokenizer, n_samples=4, seq_len=256))
    for level in LEVEL_ACTIVATION:
        model = copy.deepcopy(float_model)
        quantize_(
            model,
            [SmoothQuantConfig(0.5), W8A8Config(level=level, quantize_bmm=False)],
            calibration=Calibration(int8_stats=stats),
        )
        variants[f"leanlm {level}"] = model
    separate = copy.deepcopy(variants["leanlm O1"])
    share_input_gemms_(separate, share=False)
    variants["leanlm O1 separate GEMMs"] = separate
    block_linears = {name for name, _ in iter_quantizable_linears(float_model)}
    variants["torchao int8 dyn"] = torchao_int8_dynamic_(copy.deepcopy(float_model), block_linears.__contains__)
    return variants


def bench_model(lengths: list[int], repeats: int) -> dict:
    loaded = load_model("smollm2-135m")
    variants = model_variants(loaded)
    # Every position's logits (a perplexity forward: the FP32 lm_head runs on every token), then only the last
    # position's, as a generation's prefill computes them (the diagnostic "separate GEMMs" row left out there).
    results: dict = {"by_length": {}, "by_length_last_logits": {}}
    for length in lengths:
        ids = torch.randint(0, loaded.tokenizer.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
        for key, keep in (("by_length", 0), ("by_length_last_logits", 1)):
            timed = {name: model for name, model in variants.items() if keep == 0 or "separate" not in name}
            timings = time_prefill(timed, ids, repeats, logits_to_keep=keep)
            results[key][str(length)] = timings
            print(
                f"prefill {length} ({'last' if keep else 'all'} logits): "
                + ", ".join(
                    f"{name} {t['tokens_per_second']:.0f} tok/s ({t['speedup_vs_best_float']:.2f}x)"
                    for name, t in timings.items()
                ),
                flush=True,
            )
    # What the FP32 lm_head costs of a prefill, and what an int8 lm_head would take instead.
    hidden = torch.randn(lengths[0], loaded.model.config.hidden_size)
    head = loaded.model.lm_head
    head_fp32 = time_call(lambda: head(hidden), warmup=1, repeats=repeats).median
    head_int8 = W8A8Linear.from_float(head.weight, None, "per_channel", activation="per_token")
    head_int8_s = time_call(lambda: head_int8(hidden), warmup=1, repeats=repeats).median
    results["lm_head"] = {
        "tokens": lengths[0],
        "fp32_s": head_fp32,
        "int8_per_token_s": head_int8_s,
        "share_of_fp32_prefill": head_fp32 / results["by_length"][str(lengths[0])]["fp32"]["median_s"],
        "share_of_leanlm_O1_prefill": head_fp32 / results["by_length"][str(lengths[0])]["leanlm O1"]["median_s"],
    }
    linear_bytes = {
        name: sum(weight_bytes(m) for _, m in iter_quantizable_linears(model)) for name, model in variants.items()
    }
    results["block_linear_bytes_ratio"] = {name: b / linear_bytes["fp32"] for name, b in linear_bytes.items()}
    results["model_weight_bytes"] = {
        name: t["weight_bytes"] for name, t in results["by_length"][str(lengths[0])].items()
    }
    return results


def rounding_row(shape: tuple[int, int], m: int) -> str:
    """The rounding part's row name: "OUTxIN M=m" (the saved key; `rounding_row_shape` reads it back)."""
    return f"{shape[0]}x{shape[1]} M={m}"


def rounding_row_shape(row: str) -> tuple[tuple[int, int], int]:
    shape, m = row.split(" M=")
    out_features, in_features = map(int, shape.split("x"))
    return (out_features, in_features), int(m)


def report(payload: dict) -> str:
    """ms (linears) or tokens/s (prefill), each quantized implementation with its speed-up over the best float path
    (the faster of FP32 and BF16 in the same interleaved rounds) in brackets."""
    out = []
    linear = payload.get("linear_4096", {})
    if linear:
        out.append(
            f"4096 x 4096 linear on {linear.get('cpu', 'this CPU')}, ms (speed-up over the best float path, "
            "or over fp32 where no bf16 was measured):"
        )
        out.append(
            speed_table(
                linear["by_m"],
                extra={"leanlm O1 vs bitsandbytes": lambda row: f"{row['leanlm O1']['speedup_vs_bitsandbytes']:.2f}x"},
            )
        )
    shapes = payload.get("smollm2_shapes_m512", {})
    if shapes:
        out.append(
            speed_table(
                {shape: entry["by_m"]["512"] for shape, entry in shapes.items()}, first="shape (out x in), M = 512"
            )
        )
    rounding = payload.get("rounding", {})
    if rounding:
        rows = []
        for row, entry in rounding.items():
            (out_features, in_features), m = rounding_row_shape(row)
            shape = f"{out_features}x{in_features}"
            for granularity, ms in entry.items():
                first = ms[ROUNDINGS[0]]
                rows.append(
                    [
                        shape,
                        m,
                        granularity.replace("_", "-"),
                        f"{first:.3f}",
                        *(f"{ms[name]:.3f} ({ms[name] / first:.2f}x)" for name in ROUNDINGS[1:]),
                    ]
                )
        out.append(
            "The int8 GEMM with its input codes rounded three ways, ms (time against fbgemm's own rounding):\n\n"
            + format_table(["shape (out x in)", "M", "activations", *ROUNDINGS], rows, markdown=True)
        )
    for key in ("by_length", "by_length_last_logits"):
        prefill = payload.get("model_prefill", {}).get(key, {})
        if prefill:
            names = list(next(iter(prefill.values())))
            out.append(
                format_table(
                    ["tokens", *names],
                    [
                        [
                            length,
                            *(
                                f"{row[n]['tokens_per_second']:.0f}"
                                + (
                                    ""
                                    if n in ("fp32", "bf16")
                                    else f" ({row[n].get('speedup_vs_best_float', row[n]['speedup_vs_fp32']):.2f}x)"
                                )
                                for n in names
                            ),
                        ]
                        for length, row in prefill.items()
                    ],
                    markdown=True,
                )
            )
    return "\n\n".join(out)


def plot(payload: dict, path) -> None:
    if not {"linear_4096", "model_prefill"} <= set(payload):
        return
    linear = payload["linear_4096"]["by_m"]
    names = [n for n in next(iter(linear.values())) if n not in ("fp32", "bf16")]
    fig, (left, *prefill_axes) = plt.subplots(1, 3, figsize=(18, 4.5))
    ms = list(linear)
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        left.bar(
            [j + i * width for j in range(len(ms))],
            [linear[m][name]["speedup_vs_best_float"] for m in ms],
            width=width,
            label=name,
        )
    left.axhline(1.0, color="black", linewidth=0.8)
    left.set_xticks([j + 0.4 - width / 2 for j in range(len(ms))], [f"M={m}" for m in ms])
    left.set_yscale("log")
    left.set_ylabel("speed-up over the best float path (log)")
    left.set_title("4096x4096 linear")
    left.legend(fontsize=8)
    colors = {name: f"C{i}" for i, name in enumerate(next(iter(payload["model_prefill"]["by_length"].values())))}
    for axis, (key, logits) in zip(
        prefill_axes, (("by_length", "every position's logits"), ("by_length_last_logits", "last position's logits"))
    ):
        prefill = payload["model_prefill"].get(key)
        if not prefill:
            continue
        lengths = list(prefill)
        names = list(next(iter(prefill.values())))
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            axis.bar(
                [j + i * width for j in range(len(lengths))],
                [prefill[n][name]["tokens_per_second"] for n in lengths],
                width=width,
                label=name,
                color=colors.get(name),
            )
        axis.set_xticks([j + 0.4 - width / 2 for j in range(len(lengths))], [f"{n} tokens" for n in lengths])
        axis.set_ylabel("prefill tokens / s")
        axis.set_title(f"SmolLM2-135M prefill, {logits} (lm_head FP32)")
        axis.legend(fontsize=8)
    save_figure(fig, path)


def main() -> None:
    parser = study_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]), model=False)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.report:
        return print_report("w8a8_speed", report)
    repeats = 3 if args.quick else 9
    study = Study("w8a8_speed", {"repeats": repeats, "quick": args.quick}, args, plot=plot)
    study.payload["threads"] = torch.get_num_threads()
    if study.pending("linear_4096"):
        study.set("linear_4096", bench_linear(4096, 4096, [1, 16, 64, 512], repeats))
    for shape in study.todo("smollm2_shapes_m512", [f"{o}x{i}" for o, i in SMOLLM2_SHAPES]):
        out_features, in_features = map(int, shape.split("x"))
        study.record("smollm2_shapes_m512", shape, bench_linear(in_features, out_features, [512], repeats))
    # SmolLM2's four single shapes at M = 512 and the 4096 x 4096 linear at M = 1 and 512
    rounding_rows = [rounding_row(shape, 512) for shape in SMOLLM2_SHAPES[:4]] + [
        rounding_row((4096, 4096), m) for m in (1, 512)
    ]
    for row in study.todo("rounding", rounding_rows):
        (out_features, in_features), m = rounding_row_shape(row)
        study.record("rounding", row, bench_rounding(in_features, out_features, m, 101 if not args.quick else 9))
    if study.pending("model_prefill"):
        study.set("model_prefill", bench_model([512] if args.quick else [512, 2048], repeats))
    print(report(study.payload))
    print(f"wrote {study.path}")


if __name__ == "__main__":
    main()
