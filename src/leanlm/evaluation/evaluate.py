"""`evaluate`: run any set of tasks on any model (float or quantized: evaluation never cares which)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from leanlm import data
from leanlm.bench.harness import weight_bytes
from leanlm.errors import ConfigError
from leanlm.evaluation.loglikelihood import score_requests
from leanlm.evaluation.perplexity import perplexity
from leanlm.evaluation.tasks import TASKS, aggregate, doc_metrics
from leanlm.settings import option

PERPLEXITY_TEXTS: dict[str, Callable[[], str]] = {
    "wikitext2": data.wikitext2_test_text,
    "ptb": data.ptb_text,
}
ALL_TASKS = (*PERPLEXITY_TEXTS, *TASKS)
ZERO_SHOT_TASKS = tuple(TASKS)


@dataclass(frozen=True)
class EvalSettings:
    tasks: tuple[str, ...] = option(("wikitext2",), f"tasks, comma-separated, from {','.join(ALL_TASKS)}")
    limit: int | None = option(None, "first N items of each zero-shot task", none_word="all")
    max_tokens: int | None = option(None, "first N tokens of each perplexity text", none_word="all")
    seq_len: int = option(2048, "perplexity window (the papers' default)")

    def __post_init__(self):
        unknown = [t for t in self.tasks if t not in ALL_TASKS]
        if unknown:
            raise ConfigError(f"unknown task(s) {', '.join(unknown)}; choose from {', '.join(ALL_TASKS)}")
        if not self.tasks:
            raise ConfigError("no task given")
        for name in ("limit", "max_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be a positive number, got {value}")
        if self.seq_len < 2:
            raise ConfigError(f"seq_len must be at least 2, got {self.seq_len}")


def evaluate(model, tokenizer, settings: EvalSettings) -> dict:
    """{"results": {task: metrics}, "zero_shot_average", "weights_bytes", "seconds"} for one model."""
    started = time.perf_counter()
    results = {}
    for task in settings.tasks:
        if task in PERPLEXITY_TEXTS:
            result = perplexity(
                model,
                tokenizer,
                PERPLEXITY_TEXTS[task](),
                seq_len=settings.seq_len,
                max_tokens=settings.max_tokens,
                desc=task,
            )
            results[task] = {
                "perplexity": result.perplexity,
                "tokens": result.tokens,
                "tokens_per_second": result.tokens_per_second,
                "windows": result.windows,
                "seq_len": result.seq_len,
            }
        else:
            results[task] = zero_shot(model, tokenizer, task, settings.limit)
    zero_shot_accs = [results[t]["acc"] for t in settings.tasks if t in ZERO_SHOT_TASKS]
    return {
        "results": results,
        # Plain mean of `acc` over the zero-shot tasks run (None if none ran).
        "zero_shot_average": sum(zero_shot_accs) / len(zero_shot_accs) if zero_shot_accs else None,
        "weights_bytes": weight_bytes(model),
        "seconds": time.perf_counter() - started,
    }


def zero_shot(model, tokenizer, task_name: str, limit: int | None) -> dict:
    task = TASKS[task_name]
    docs = task.load_docs()[:limit]
    requests = [request for doc in docs for request in doc.requests]
    started = time.perf_counter()
    scores = score_requests(model, tokenizer, requests, desc=task_name)
    seconds = time.perf_counter() - started
    per_doc, position = [], 0
    for doc in docs:
        per_doc.append(doc_metrics(doc, scores[position : position + len(doc.requests)]))
        position += len(doc.requests)
    result = aggregate(task, per_doc)
    result["seconds"] = seconds
    return result
