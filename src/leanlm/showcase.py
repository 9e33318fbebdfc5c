"""The showcase: every method leanlm implements, side by side on one model, in a few minutes.

Each row is a name and a transformation of the float model; a method adds itself by adding a row. Quality
(WikiText-2 perplexity on a short prefix, zero-shot average on a few items per task), weight memory and
evaluation speed are measured the same way for every row. Rows that need calibration share one pass.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from leanlm.evaluation import ZERO_SHOT_TASKS, EvalSettings, evaluate
from leanlm.methods import Calibration, SmoothQuantConfig, W8A8Config, calibrate, quantize_
from leanlm.models import LoadedModel, load_model

SHOWCASE_CALIBRATION_SAMPLES = 32  # x 512 tokens; the methods' own defaults are larger


@dataclass(frozen=True)
class ShowcaseRow:
    name: str
    description: str
    steps: tuple = ()  # method configs for `quantize_`; none: the float model itself


ROWS: tuple[ShowcaseRow, ...] = (
    ShowcaseRow("fp32", "float32 weights and activations (the reference)"),
    ShowcaseRow("w8a8-O2", "naive int8: per-tensor weights, per-tensor dynamic activations",
                (W8A8Config(level="O2"),)),
    ShowcaseRow("smoothquant-O1", "SmoothQuant a=0.5, per-channel weights, per-token dynamic activations",
                (SmoothQuantConfig(0.5), W8A8Config(level="O1", weight_granularity="per_channel"))),
    ShowcaseRow("smoothquant-O3", "SmoothQuant a=0.7, per-channel weights, per-tensor static activations",
                (SmoothQuantConfig(0.7), W8A8Config(level="O3", weight_granularity="per_channel"))),
)

QUICK_SETTINGS = EvalSettings(tasks=("wikitext2", *ZERO_SHOT_TASKS), limit=20, max_tokens=4096, seq_len=512)


def run_showcase(source: str, settings: EvalSettings = QUICK_SETTINGS, rows=ROWS) -> dict:
    """{"model", "weights_note", "settings", "rows": {name: evaluate(...) + description + prepare_seconds}}.
    The int8 statistics are observed once, on the first row that needs them, and shared by the others."""
    shared = {}

    def calibration_for(loaded: LoadedModel) -> Calibration:
        calibration = Calibration(loaded.tokenizer, samples=SHOWCASE_CALIBRATION_SAMPLES)
        if "stats" not in shared:
            shared["stats"] = calibrate(loaded.model, calibration.batches())
        return Calibration(loaded.tokenizer, samples=SHOWCASE_CALIBRATION_SAMPLES, int8_stats=shared["stats"])

    results, note = {}, None
    for row in rows:
        loaded = load_model(source)
        note = loaded.weights_note
        started = time.perf_counter()
        if row.steps:
            quantize_(loaded.model, list(row.steps), calibration=calibration_for(loaded))
        prepare_seconds = time.perf_counter() - started
        results[row.name] = {"description": row.description, "prepare_seconds": prepare_seconds,
                             **evaluate(loaded.model, loaded.tokenizer, settings)}
    return {"model": source, "weights_note": note, "settings": asdict(settings), "rows": results}
