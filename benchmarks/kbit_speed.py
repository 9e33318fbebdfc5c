"""Weight-only NF4 linears side by side in one process: the float paths (FP32, and BF16, the fastest float path on
a CPU with bf16 instructions), leanlm NF4 + double quantization (its kernel as dispatched for this CPU, and forced
onto the AVX2 kernel, what a CPU without AVX-512 runs; and with its input in bfloat16, as a model computing in
bfloat16 runs it), bitsandbytes `Linear4bit` (nf4) and torchao's NF4 tensor, on a
4096 x 4096 linear at M = 1, 16, 64, 512, all interleaved round by round at every M; plus SmolLM2's batch-1
decode tokens/s in FP32, BF16 and with every block linear in leanlm NF4 + DQ. Speed-ups are over the best float
path at each M. NF4 without double quantization is no row of its own: the kernel reads the same float32 block
constants either way (double quantization is decoded once, when the layer first runs), so it would time the same
code on the same inputs twice.
Then, in a child process, the same linear as a CPU without AVX512-BF16 runs it (an AVX2-only machine):
bitsandbytes with that feature hidden from it (it then de-quantizes and calls FP32 `linear`) beside leanlm's
AVX2 kernel. And each 3-, 4- and 8-bit kernel's batch-1 streaming speed beside the machine's read bandwidth (the
`bandwidth` part), with the whole-weight de-quantization 3-bit layers ran before they had a kernel. Writes benchmarks/results/kbit_speed.json + .png.

    python benchmarks/kbit_speed.py
    python benchmarks/kbit_speed.py --without-avx512bf16   # the child's part alone, printed as JSON
    python benchmarks/kbit_speed.py --report               # the saved tables
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import time
import warnings

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from leanlm.bench import Study, print_report, study_arguments, time_modules, weight_bytes  # noqa: E402
from leanlm.bench.harness import InBfloat16, add_speedups, cpu_description, float_paths, speed_table  # noqa: E402
from leanlm.formats.int8 import quantize_weight  # noqa: E402
from leanlm.kernels.int8_gemm import int8_gemv  # noqa: E402
from leanlm.kernels.kbit_gemm import int8_kernel_isas, kernel_isas  # noqa: E402
from leanlm.methods import KbitConfig, quantize_  # noqa: E402
from leanlm.models import load_model  # noqa: E402
from leanlm.nn import KbitLinear  # noqa: E402
from leanlm.report import format_table, save_figure  # noqa: E402

warnings.filterwarnings("ignore")
ROWS = (1, 16, 64, 512)


class TorchaoNF4Linear(nn.Module):
    """torchao's NF4 tensor (QLoRA's format: block 64, scalers double-quantized in blocks of 256)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

        self.weight = nn.Parameter(to_nf4(linear.weight.detach()), requires_grad=False)

    def forward(self, x):
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

        return linear_nf4(x, self.weight)


def hide_avx512bf16_from_bitsandbytes() -> None:
    """Make bitsandbytes, imported after this, see a CPU without AVX512-BF16: its native library's feature probe
    answers no, so it registers none of its bf16 CPU kernels and keeps the plain packing, as on an AVX2-only CPU.
    (Its compiled de-quantization may still use AVX-512 here, which only makes it faster than on such a CPU.)"""
    if "bitsandbytes" in sys.modules:
        raise RuntimeError("bitsandbytes is already imported; the feature must be hidden before its first import")
    import ctypes

    load = ctypes.cdll.LoadLibrary

    class WithoutAvx512Bf16:
        def __init__(self, library):
            self._library = library

        def __getattr__(self, name):
            if name == "has_avx512bf16_cpu":
                return lambda: False
            return getattr(self._library, name)

    ctypes.cdll.LoadLibrary = lambda path: WithoutAvx512Bf16(load(path))


def bitsandbytes_nf4(linear: nn.Linear) -> nn.Module:
    import bitsandbytes as bnb

    module = bnb.nn.Linear4bit(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        compute_dtype=torch.float32,
        quant_type="nf4",
        compress_statistics=True,
    )
    module.load_state_dict(linear.state_dict())
    return module.to("cpu").eval()  # the move quantizes


def leanlm_nf4(linear: nn.Linear, kernel_isa: str = "auto") -> KbitLinear:
    """NF4, blocks of 64, double quantization: what `--method kbit` stores by default."""
    module = KbitLinear.from_float(linear.weight, None, "nf", 4, 64, double_quant=True)
    module.kernel_isa = kernel_isa
    return module


def bench_linear(repeats: int, without_avx512bf16: bool = False) -> dict:
    """Every implementation on one 4096 x 4096 linear at each M of ROWS. `without_avx512bf16`: the AVX2-only
    CPU's view (leanlm's AVX2 kernel; bitsandbytes, which must not be imported yet, without its bf16 kernels)."""
    if without_avx512bf16:
        hide_avx512bf16_from_bitsandbytes()
    torch.manual_seed(0)
    linear = nn.Linear(4096, 4096, bias=False)
    if without_avx512bf16:
        # No bf16 column: on a CPU without bf16 instructions float32 is the best float path (bf16 is emulated).
        modules = {
            "fp32": linear,
            "leanlm nf4+dq avx2": leanlm_nf4(linear, "avx2"),
            "bitsandbytes nf4": bitsandbytes_nf4(linear),
        }
        if modules["bitsandbytes nf4"].support_avx512bf16_for_cpu:
            raise RuntimeError("bitsandbytes still sees AVX512-BF16; the emulation did not take")
    else:
        modules = {
            **float_paths(linear),
            "leanlm nf4+dq": leanlm_nf4(linear),
            "leanlm nf4+dq avx2": leanlm_nf4(linear, "avx2"),
            # as a model computing in bfloat16 (`--dtype auto` here) runs the layer
            "leanlm nf4+dq, bf16 model": InBfloat16(leanlm_nf4(linear)),
            "bitsandbytes nf4": bitsandbytes_nf4(linear),
            "torchao nf4": TorchaoNF4Linear(linear),
        }
    results = {
        "weight_bytes": {name: weight_bytes(m) for name, m in modules.items()},
        "kernels": kernel_isas(),
        "cpu": cpu_description(),
    }
    for m in ROWS:
        x = torch.randn(m, 4096)
        with torch.inference_mode():
            exact = linear(x)
        entry = time_modules(modules, x, exact, repeats)
        for name in (n for n in modules if n.startswith("leanlm")):
            for peer in ("bitsandbytes", "torchao"):
                if f"{peer} nf4" in entry:
                    entry[name][f"speedup_vs_{peer}"] = entry[f"{peer} nf4"]["median_ms"] / entry[name]["median_ms"]
        results[str(m)] = entry
        print(
            f"M={m}: "
            + ", ".join(f"{n} {v['median_ms']:.2f} ms ({v['speedup_vs_best_float']:.2f}x)" for n, v in entry.items()),
            file=sys.stderr,
            flush=True,
        )
    return results


BANDWIDTH_SHAPE = (4096, 14336)  # Llama-3-8B's MLP down projection (out, in)
BANDWIDTH_LAYERS = 4  # 4 x ~30 MB of codes: more than the 32 MB L3, so every call streams from memory


def bandwidth_variants() -> dict[str, tuple[str, str, bool, int, int]]:
    """Row name -> (kind: kbit | w8a8, kernel, double quantization, bits, block) of the batch-1 streaming
    measurement; kernel "reference" de-quantizes the whole weight at every call (what 3-bit layers did before the
    3-bit kernel)."""
    variants = {}
    for isa in [*int8_kernel_isas(), *(i for i in kernel_isas() if i != "in-order")]:
        activations = "int8 activations" if isa.endswith("int8") else "float activations"
        variants[f"nf4+dq, {activations}, {isa}"] = ("kbit", isa, True, 4, 64)
    variants["nf4, int8 activations, auto"] = ("kbit", "auto", False, 4, 64)
    variants["int8 codes (Q8_0's kind), auto"] = ("kbit", "auto", False, 8, 64)
    for isa in int8_kernel_isas():
        variants[f"nf3+dq, int8 activations, {isa}"] = ("kbit", isa, True, 3, 64)
    variants["3-bit in blocks of 16 (SpQR's beta1), auto"] = ("kbit", "auto", False, 3, 16)
    variants["nf3+dq, de-quantized at every call"] = ("kbit", "reference", True, 3, 64)
    for isa in int8_kernel_isas():  # what the fused decode step runs for W8A8 and LLM.int8() linears
        variants[f"w8a8 (int8 per channel), {isa}"] = ("w8a8", isa, False, 8, 0)
    return variants


def read_bandwidth(array: torch.Tensor) -> float:
    started = time.perf_counter()
    array.sum()
    return array.numel() * array.element_size() / (time.perf_counter() - started)


def _streamed_layer(weight: torch.Tensor, kind: str, isa: str, double_quant: bool, bits: int, block: int, built: dict):
    """(a one-token call through the variant's kernel, the bytes it reads: codes and constants); one layer per
    format, shared by the variants that differ only in the kernel."""
    key = (kind, double_quant, bits, block)
    if key not in built:
        if kind == "w8a8":
            built[key] = quantize_weight(weight, "per_channel")
        else:
            dtype = "int" if bits == 8 or block == 16 else "nf"
            built[key] = KbitLinear.from_float(weight, None, dtype, bits, block, double_quant)
    layer = built[key]
    if kind == "w8a8":
        codes, scale = layer
        return (lambda x: int8_gemv(x, codes, scale, None, isa=isa)), codes.numel() + 4 * scale.numel()

    def run(x):
        layer.backend, layer.kernel_isa = ("reference", "auto") if isa == "reference" else ("avx2", isa)
        return layer(x)

    return run, layer.bits_per_weight() * layer.in_features * layer.out_features / 8


def bench_bandwidth(repeats: int) -> dict:
    """Batch-1 speed of each 3-, 4- and 8-bit kernel (and the one-token W8A8 kernel) as bytes of weight read per second,
    beside the machine's read bandwidth (the share of it the kernel reaches): BANDWIDTH_LAYERS weights of BANDWIDTH_SHAPE
    run in turn, so every call reads its weight from memory; the read bandwidth is a two-thread torch.sum of a
    256 MB float32 array, timed in the same rounds (interleaved), medians over `repeats` rounds."""
    torch.manual_seed(0)
    variants = bandwidth_variants()
    layers: dict[str, list[tuple]] = {name: [] for name in variants}
    for _ in range(BANDWIDTH_LAYERS):
        weight, built = torch.randn(*BANDWIDTH_SHAPE) * 0.02, {}
        for name, variant in variants.items():
            layers[name].append(_streamed_layer(weight, *variant, built))
        del weight, built
    x = torch.randn(1, BANDWIDTH_SHAPE[1])
    array = torch.randn(64 * 2**20)
    samples: dict[str, list[float]] = {name: [] for name in [*variants, "read bandwidth"]}
    with torch.inference_mode():
        for round_index in range(repeats + 1):  # the first round warms up
            read = read_bandwidth(array)
            for name in variants:
                started = time.perf_counter()
                for run, _ in layers[name]:
                    run(x)
                seconds = time.perf_counter() - started
                if round_index:
                    samples[name].append(sum(stored for _, stored in layers[name]) / seconds)
            if round_index:
                samples["read bandwidth"].append(read)
    result = {
        name: {"bytes_per_second": statistics.median(values), "samples": values} for name, values in samples.items()
    }
    weights = BANDWIDTH_LAYERS * BANDWIDTH_SHAPE[0] * BANDWIDTH_SHAPE[1]
    for name in variants:
        stored = sum(stored for _, stored in layers[name])
        result[name]["share_of_read_bandwidth"] = (
            result[name]["bytes_per_second"] / result["read bandwidth"]["bytes_per_second"]
        )
        result[name]["weights_per_second"] = result[name]["bytes_per_second"] * weights / stored
    result["cpu"] = cpu_description()
    return result


def decode_tokens_per_second(model, prompt: torch.Tensor, new_tokens: int) -> float:
    with torch.inference_mode():
        model.generate(prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False)  # warm-up
        started = time.perf_counter()
        model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        return new_tokens / (time.perf_counter() - started)


def bench_decode(model_name: str, new_tokens: int) -> dict:
    loaded = load_model(model_name)
    prompt = loaded.tokenizer("The history of the city begins", return_tensors="pt").input_ids
    loaded.model.generation_config.pad_token_id = loaded.tokenizer.eos_token_id
    nf4 = copy.deepcopy(loaded.model)
    quantize_(nf4, KbitConfig(dtype="nf", bits=4, block_size=64, double_quant=True))
    bf16 = copy.deepcopy(loaded.model).to(torch.bfloat16)
    results = {}
    for name, model in {"fp32": loaded.model, "bf16": bf16, "leanlm nf4+dq": nf4}.items():
        tokens_per_second = decode_tokens_per_second(model, prompt, new_tokens)
        results[name] = {
            "tokens_per_second": tokens_per_second,
            "ms_per_token": 1e3 / tokens_per_second,
            "weight_bytes": weight_bytes(model),
        }
        print(f"decode {name}: {tokens_per_second:.1f} tok/s", flush=True)
    add_speedups(results, "ms_per_token")
    results["note"] = loaded.weights_note
    return results


NAMES = [
    "fp32",
    "bf16",
    "leanlm nf4+dq",
    "leanlm nf4+dq avx2",
    "leanlm nf4+dq, bf16 model",
    "bitsandbytes nf4",
    "torchao nf4",
]
AVX2_NAMES = ["fp32", "leanlm nf4+dq avx2", "bitsandbytes nf4"]


def report(payload: dict) -> str:
    """The linear's speed on this CPU and as a CPU without AVX512-BF16 runs it, and the model's decode: ms, and
    in brackets the speed-up over the best float path at that M (bf16 where the CPU has bf16 instructions)."""
    out = []
    linears = (
        ("linear_4096", NAMES, "leanlm nf4+dq", None),
        (
            "linear_4096_without_avx512bf16",
            AVX2_NAMES,
            "leanlm nf4+dq avx2",
            "without AVX512-BF16 (bitsandbytes with the feature hidden; leanlm's AVX2 kernel):",
        ),
    )
    for part, names, leanlm, title in linears:
        if part not in payload:
            continue
        entries = payload[part]
        if title is None:
            title = (
                f"4096 x 4096 linear on {entries.get('cpu', 'this CPU')}, ms (speed-up over the best float path, "
                "or over fp32 where no bf16 was measured):"
            )
        else:
            out.append("")
        out += [
            title,
            speed_table(
                {m: entries[m] for m in map(str, ROWS)},
                names,
                extra={
                    f"{leanlm} / bitsandbytes": lambda row, leanlm=leanlm: (
                        f"{row[leanlm]['speedup_vs_bitsandbytes']:.2f}x"
                    )
                },
            ),
        ]
    if "bandwidth" in payload:
        entries = payload["bandwidth"]
        read = entries["read bandwidth"]["bytes_per_second"]
        rows = [
            [
                name,
                f"{entry['bytes_per_second'] / 1e9:.2f}",
                f"{100 * entry['share_of_read_bandwidth']:.0f}%",
                f"{entry['weights_per_second'] / 1e9:.2f}" if "weights_per_second" in entry else "",
            ]
            for name, entry in entries.items()
            if name not in ("cpu", "read bandwidth")
        ]
        out += [
            "",
            f"batch-1 streaming on {entries['cpu']}: {BANDWIDTH_LAYERS} weights of {BANDWIDTH_SHAPE[0]} x "
            f"{BANDWIDTH_SHAPE[1]} in turn, GB of stored weight read per second; the machine reads "
            f"{read / 1e9:.1f} GB/s (two-thread sum of 256 MB, same rounds):",
            format_table(["kernel", "GB/s", "of read bandwidth", "G weights/s"], rows, markdown=True),
        ]
    if "decode" in payload:
        decode = payload["decode"]
        out += [
            "",
            "batch-1 greedy decode, tokens/s:",
            format_table(
                ["model", *(name for name in decode if name != "note")],
                [
                    [
                        payload["settings"]["model"],
                        *(
                            f"{entry['tokens_per_second']:.1f}"
                            + (
                                ""
                                if name in ("fp32", "bf16")
                                else f" ({entry.get('speedup_vs_best_float', entry['speedup_vs_fp32']):.2f}x)"
                            )
                            for name, entry in decode.items()
                            if name != "note"
                        ),
                    ]
                ],
                markdown=True,
            ),
        ]
    return "\n".join(out)


def plot(payload: dict, path) -> None:
    if not {"linear_4096", "linear_4096_without_avx512bf16", "decode"} <= set(payload):
        return
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2))
    decode = payload["decode"]
    panels = [
        (
            payload["linear_4096"],
            NAMES,
            f"{payload['linear_4096']['cpu']}; {payload['settings']['model']} "
            f"decode: fp32 {decode['fp32']['tokens_per_second']:.1f}, bf16 {decode['bf16']['tokens_per_second']:.1f}, "
            f"leanlm nf4+dq {decode['leanlm nf4+dq']['tokens_per_second']:.1f} tok/s",
        ),
        (
            payload["linear_4096_without_avx512bf16"],
            AVX2_NAMES,
            "without AVX512-BF16 (bitsandbytes with the feature hidden)",
        ),
    ]
    for ax, (entries, shown, title) in zip(axes, panels):
        for name in shown[1:]:
            ax.plot(ROWS, [entries[str(m)][name]["speedup_vs_best_float"] for m in ROWS], marker="o", label=name)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("M (rows)")
        ax.set_ylabel("speed-up over the best float path, 4096x4096 linear")
        ax.legend(fontsize=8)
        ax.set_title(title, fontsize=9)
    save_figure(fig, path)


def main() -> None:
    parser = study_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument(
        "--without-avx512bf16",
        action="store_true",
        help="only the linear as a CPU without AVX512-BF16 runs it; print its results as JSON",
    )
    args = parser.parse_args()
    torch.set_num_threads(2)
    if args.without_avx512bf16:
        print(json.dumps(bench_linear(args.repeats, without_avx512bf16=True)))
        return
    if args.report:
        return print_report("kbit_speed", report)
    study = Study(
        "kbit_speed", {"model": args.model, "repeats": args.repeats, "new_tokens": args.new_tokens}, args, plot=plot
    )
    if study.pending("linear_4096"):
        study.set("linear_4096", bench_linear(args.repeats))
    if study.pending("bandwidth"):
        study.set("bandwidth", bench_bandwidth(args.repeats))
    if study.pending("decode"):
        study.set("decode", bench_decode(args.model, args.new_tokens))
    if study.pending("linear_4096_without_avx512bf16"):
        # Its own process: bitsandbytes decides at import which CPU kernels to register.
        child = subprocess.run(
            [sys.executable, __file__, "--without-avx512bf16", "--repeats", str(args.repeats)],
            stdout=subprocess.PIPE,
            check=True,
            text=True,
        )
        study.set("linear_4096_without_avx512bf16", json.loads(child.stdout))
    print(report(study.payload))
    print(f"wrote {study.path}")


if __name__ == "__main__":
    main()
