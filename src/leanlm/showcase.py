"""The showcase: every method leanlm implements, side by side on one model, in a few minutes.

Each row is a name and a transformation of the float model; a method adds itself by adding a row. Quality
(WikiText-2 perplexity on a short prefix, zero-shot average on a few items per task), weight memory and
evaluation speed are measured the same way for every row. Rows that need calibration share one pass.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable

from leanlm.data import calibration_batches
from leanlm.evaluation import ZERO_SHOT_TASKS, EvalSettings, evaluate
from leanlm.methods import CalibrationStats, SmoothQuantConfig, W8A8Config, calibrate, quantize_w8a8_
from leanlm.models import LoadedModel, load_model

SHOWCASE_CALIBRATION_SAMPLES = 32  # x 512 tokens; the methods' own defaults are larger


@dataclass(frozen=True)
class ShowcaseRow:
    name: str
    description: str
    # Turns the freshly loaded float model into the one to evaluate; `stats` calibrates on first use.
    prepare: Callable[[LoadedModel, Callable[[], CalibrationStats]], object]


def _w8a8(config: W8A8Config):
    def prepare(loaded: LoadedModel, stats: Callable[[], CalibrationStats]):
        needs_stats = config.smoothquant is not None or config.level == "O3"
        quantize_w8a8_(loaded.model, config, stats() if needs_stats else None)
        return loaded.model

    return prepare


ROWS: tuple[ShowcaseRow, ...] = (
    ShowcaseRow("fp32", "float32 weights and activations (the reference)", lambda loaded, stats: loaded.model),
    ShowcaseRow("w8a8-O2", "naive int8: per-tensor weights, per-tensor dynamic activations",
                _w8a8(W8A8Config(level="O2"))),
    ShowcaseRow("smoothquant-O1", "SmoothQuant a=0.5, per-channel weights, per-token dynamic activations",
                _w8a8(W8A8Config(level="O1", weight_granularity="per_channel", smoothquant=SmoothQuantConfig(0.5)))),
    ShowcaseRow("smoothquant-O3", "SmoothQuant a=0.7, per-channel weights, per-tensor static activations",
                _w8a8(W8A8Config(level="O3", weight_granularity="per_channel", smoothquant=SmoothQuantConfig(0.7)))),
)

QUICK_SETTINGS = EvalSettings(tasks=("wikitext2", *ZERO_SHOT_TASKS), limit=20, max_tokens=4096, seq_len=512)


def run_showcase(source: str, settings: EvalSettings = QUICK_SETTINGS, rows=ROWS) -> dict:
    """{"model", "weights_note", "settings", "rows": {name: evaluate(...) + description + prepare_seconds}}."""
    cached: dict[str, CalibrationStats] = {}

    def stats_of(loaded: LoadedModel) -> Callable[[], CalibrationStats]:
        def stats() -> CalibrationStats:
            if "stats" not in cached:
                batches = calibration_batches(loaded.tokenizer, n_samples=SHOWCASE_CALIBRATION_SAMPLES, seq_len=512)
                cached["stats"] = calibrate(loaded.model, batches)
            return cached["stats"]

        return stats

    results, note = {}, None
    for row in rows:
        loaded = load_model(source)
        note = loaded.weights_note
        started = time.perf_counter()
        model = row.prepare(loaded, stats_of(loaded))
        prepare_seconds = time.perf_counter() - started
        results[row.name] = {"description": row.description, "prepare_seconds": prepare_seconds,
                             **evaluate(model, loaded.tokenizer, settings)}
    return {"model": source, "weights_note": note, "settings": asdict(settings), "rows": results}
