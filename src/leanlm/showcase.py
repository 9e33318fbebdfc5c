"""The showcase: every method leanlm implements, side by side on one model, in a few minutes.

Each row is a name and a transformation of the loaded float model; a method adds itself by adding a row.
Quality (WikiText-2 perplexity on a short prefix, zero-shot average on a few items per task), weight memory
and evaluation speed are measured the same way for every row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from leanlm.evaluation import ZERO_SHOT_TASKS, EvalSettings, evaluate
from leanlm.models import LoadedModel, load_model


@dataclass(frozen=True)
class ShowcaseRow:
    name: str
    description: str
    # Returns the model to evaluate; may modify the float model it is given (it is loaded afresh per row).
    prepare: Callable[[LoadedModel], object]


ROWS: tuple[ShowcaseRow, ...] = (
    ShowcaseRow("fp32", "float32 weights and activations (the reference)", lambda loaded: loaded.model),
)

QUICK_SETTINGS = EvalSettings(tasks=("wikitext2", *ZERO_SHOT_TASKS), limit=20, max_tokens=4096, seq_len=512)


def run_showcase(source: str, settings: EvalSettings = QUICK_SETTINGS, rows=ROWS) -> dict:
    """{"model", "weights_note", "settings", "rows": {name: evaluate(...) + description}}."""
    results, note = {}, None
    for row in rows:
        loaded = load_model(source)
        note = loaded.weights_note
        model = row.prepare(loaded)
        results[row.name] = {"description": row.description, **evaluate(model, loaded.tokenizer, settings)}
    return {"model": source, "weights_note": note, "settings": vars(settings) | {"tasks": list(settings.tasks)},
            "rows": results}
