"""The showcase: every method leanlm implements, side by side on one model, within a few minutes.

Each row is a name and what turns the float model into the one evaluated: method configs for `quantize_`
(all of them go through the one verb), or a StreamingLLM cache, or a QLoRA adapter trained for a few steps.
Quality (WikiText-2 perplexity on a short prefix, zero-shot average on a few items per task), weight bytes as
stored, the peak resident memory of the row (loading the float model, preparing, evaluating) and speed are
measured the same way for every row. To fit in minutes, calibration is small (`SHOWCASE_CALIBRATION_SAMPLES`
windows of 512 tokens, against 128-512 in the papers) and the int8 statistics are observed once and shared;
the benchmarks in benchmarks/ use the papers' settings.
"""

from __future__ import annotations

import gc
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch

from leanlm.bench.harness import peak_memory, weight_bytes
from leanlm.evaluation import EvalSettings, evaluate
from leanlm.evaluation.streaming import StreamSettings, stream_evaluate
from leanlm.memory import trim_freed_memory
from leanlm.methods import (
    Calibration,
    CushionConfig,
    GPTQConfig,
    KbitConfig,
    LLMInt8Config,
    LoRAConfig,
    SmoothQuantConfig,
    SpQRConfig,
    W8A8Config,
    add_lora_,
    calibrate,
    quantize_,
)
from leanlm.methods.quantize import method_spec
from leanlm.methods.recipes import GPTQ_EXPORTABLE
from leanlm.models import LoadedModel, load_model
from leanlm.report import format_table

SHOWCASE_CALIBRATION_SAMPLES = 8  # x 512 tokens: the methods' own defaults are 128 (GPTQ) to 512 (SmoothQuant)
QLORA_STEPS = 16  # batch 2 x 256 tokens of LAMBADA development text
STREAM = StreamSettings(
    sinks=4, window=252, max_tokens=2048, strategies=("streaming",), latency_steps=32, recompute_tokens=16
)


@dataclass(frozen=True)
class ShowcaseRow:
    name: str
    description: str
    steps: tuple = ()  # method configs for `quantize_`; none: the float model (or what `prepare` makes of it)
    # Rows that are not a quantization: (loaded, settings) -> the row's results, replacing `evaluate`'s.
    run: Callable[[LoadedModel, EvalSettings], dict] | None = None


def _streaming(loaded: LoadedModel, settings: EvalSettings) -> dict:
    """The float model through a sink cache: a stream longer than the cache, in constant memory."""
    entry = stream_evaluate(loaded.model, loaded.tokenizer, STREAM)["settings"]["streaming"]
    return {
        "results": {
            "wikitext2": {
                "perplexity": entry["perplexity"],
                "tokens": entry["tokens"],
                "tokens_per_second": 1000 / entry["ms_per_token"],
            }
        },
        "zero_shot_average": None,
        "weights_bytes": weight_bytes(loaded.model),
        "note": f"stream of {entry['tokens']} tokens (WikiText-2 test) in a cache of {STREAM.cache_size}",
    }


def qlora_training(model) -> tuple:
    """The QLoRA row's training: LoRA r=8 added to `model` over an NF4 + double quantization base, for a few
    steps on calibration text; (lora config, finetune settings, documents)."""
    from leanlm.data import plain_text
    from leanlm.training import FinetuneSettings

    lora = LoRAConfig(base="nf4-dq", rank=8)
    training = FinetuneSettings(max_steps=QLORA_STEPS, batch_size=2, seq_len=256, save_every=QLORA_STEPS)
    torch.manual_seed(training.seed)  # the adapters' initialisation and dropout: the same row every run
    add_lora_(model, lora)
    return lora, training, plain_text("lambada-dev").splitlines()[:400]


def _qlora(loaded: LoadedModel, settings: EvalSettings) -> dict:
    """NF4 + double quantization base, LoRA adapters trained for a few steps on calibration text."""
    from leanlm.training import finetune

    lora, training, documents = qlora_training(loaded.model)
    with tempfile.TemporaryDirectory() as out:
        record = finetune(loaded.model, loaded.tokenizer, documents, training, lora, out, loaded.name, progress=False)
    return {
        **evaluate(loaded.model, loaded.tokenizer, settings),
        "note": f"train loss {record['train_loss_first']:.2f} -> {record['train_loss_last']:.2f}",
    }


ROWS: tuple[ShowcaseRow, ...] = (
    ShowcaseRow("fp32", "float32 weights and activations (the reference)"),
    ShowcaseRow("w8a8-O2", "naive int8: per-tensor weights, per-tensor dynamic activations", (W8A8Config(level="O2"),)),
    ShowcaseRow(
        "smoothquant-O1",
        "SmoothQuant a=0.5, per-channel weights, per-token dynamic activations",
        (SmoothQuantConfig(0.5), W8A8Config(level="O1", weight_granularity="per_channel")),
    ),
    ShowcaseRow(
        "smoothquant-O3",
        "SmoothQuant a=0.7, per-channel weights, per-tensor static activations",
        (SmoothQuantConfig(0.7), W8A8Config(level="O3", weight_granularity="per_channel")),
    ),
    ShowcaseRow(
        "cushion+smoothquant-O3",
        "the same with a searched 2-token CushionCache prefix (64 candidates)",
        (
            CushionConfig(candidates=64, max_length=2),
            SmoothQuantConfig(0.7),
            W8A8Config(level="O3", weight_granularity="per_channel"),
        ),
    ),
    ShowcaseRow(
        "llm-int8", "LLM.int8(): vector-wise int8, outlier dimensions (|x| >= 6) in float", (LLMInt8Config(6.0),)
    ),
    ShowcaseRow(
        "nf4-dq",
        "NF4 blocks of 64 + double quantization (QLoRA's storage)",
        (KbitConfig("nf", 4, 64, double_quant=True),),
    ),
    ShowcaseRow(
        "gptq-4bit",
        "GPTQ 4-bit as GGUF's Q4_0: symmetric groups of 32, act-order, scale search, Hessian shrinkage 0.5",
        (GPTQConfig(bits=4, **GPTQ_EXPORTABLE),),
    ),
    ShowcaseRow(
        "spqr", "SpQR: 3-bit base, beta1 = beta2 = 16, 3-bit statistics, fp16 outliers (tau 0.2)", (SpQRConfig(),)
    ),
    ShowcaseRow("streaming", "float32 through StreamingLLM's sink cache (4 sinks + 252 recent tokens)", run=_streaming),
    ShowcaseRow("qlora", f"LoRA r=8 on an NF4+DQ base, {QLORA_STEPS} steps", run=_qlora),
)

QUICK_SETTINGS = EvalSettings(tasks=("wikitext2", "piqa", "arc_easy"), limit=10, max_tokens=2048, seq_len=512)


def _release_memory() -> None:
    """Give the previous row's memory back to the system, so that each row's peak is its own."""
    gc.collect()
    trim_freed_memory()  # not glibc: the peaks then include what the allocator kept


def showcase_table(payload: dict) -> str:
    """The markdown table `leanlm showcase` prints (and the README quotes) from `run_showcase`'s payload."""
    rows = []
    for name, row in payload["rows"].items():
        wikitext = row["results"]["wikitext2"]
        zero_shot = row["zero_shot_average"]
        what = row["description"] + (f"; {row['note']}" if row.get("note") else "")
        rows.append(
            [
                name,
                f"{wikitext['perplexity']:.2f}",
                "-" if zero_shot is None else f"{zero_shot:.2f}",
                f"{row['weights_bytes'] / 2**20:.0f}",
                f"{row['peak_rss_bytes'] / 2**20:,.0f}",
                f"{wikitext['tokens_per_second']:.0f}",
                what.replace("|", "\\|"),
            ]
        )
    return format_table(
        ["method", "WikiText-2 ppl", "zero-shot avg", "weights MiB (stored)", "peak RSS MiB", "tok/s", "what"],
        rows,
        markdown=True,
    )


def run_showcase(source: str, settings: EvalSettings = QUICK_SETTINGS, rows=ROWS) -> dict:
    """{"model", "weights_note", "settings", "rows": {name: evaluate(...) + description + prepare_seconds +
    peak_rss_bytes}}. The int8 statistics are observed once, on the first row that needs them, and shared."""
    shared = {}

    def calibration_for(loaded: LoadedModel, steps: tuple) -> Calibration:
        calibration = Calibration(loaded.tokenizer, samples=SHOWCASE_CALIBRATION_SAMPLES)
        if not any(method_spec(step).needs_calibration(step) for step in steps):
            return calibration
        if "stats" not in shared:
            shared["stats"] = calibrate(loaded.model, calibration.batches())
        return replace(calibration, int8_stats=shared["stats"])

    results, note = {}, None
    for row in rows:
        _release_memory()
        with peak_memory() as memory:
            loaded = load_model(source)
            note = loaded.weights_note
            started = time.perf_counter()
            if row.steps:
                quantize_(loaded.model, list(row.steps), calibration=calibration_for(loaded, row.steps))
            prepare_seconds = time.perf_counter() - started
            result = row.run(loaded, settings) if row.run else evaluate(loaded.model, loaded.tokenizer, settings)
        results[row.name] = {
            "description": row.description,
            "prepare_seconds": prepare_seconds,
            **result,
            "peak_rss_bytes": memory.peak_bytes,
        }
        del loaded
    return {
        "model": source,
        "weights_note": note,
        "settings": asdict(settings),
        "calibration_samples": SHOWCASE_CALIBRATION_SAMPLES,
        "rows": results,
    }
