"""Zero-shot tasks with the prompt formats and metrics of lm-evaluation-harness (v0.4):

| task          | context                                  | continuations (delimiter " ")       | metrics        |
|---------------|------------------------------------------|-------------------------------------|----------------|
| lambada       | text without its last word               | the last word                       | acc (greedy), perplexity |
| piqa          | "Question: {goal}\\nAnswer:"              | sol1, sol2                          | acc, acc_norm  |
| hellaswag     | preprocess("{activity_label}: {ctx}")    | preprocess(ending) x 4              | acc, acc_norm  |
| arc_easy/_challenge | "Question: {question}\\nAnswer:"    | the choice texts                    | acc, acc_norm  |
| winogrande    | sentence up to "_", with each option     | the rest of the sentence (partial scoring) | acc     |

acc picks the choice of highest log-likelihood; acc_norm divides each log-likelihood by the character
length of the choice text (without the delimiter) first.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from leanlm import data
from leanlm.evaluation.loglikelihood import Request, Score


@dataclass(frozen=True)
class Doc:
    requests: tuple[Request, ...]
    gold: int
    choice_lengths: tuple[int, ...]  # characters of each choice text, for acc_norm


@dataclass(frozen=True)
class ZeroShotTask:
    name: str
    load_docs: Callable[[], list[Doc]]
    metrics: tuple[str, ...]


def _choices(context: str, choices, gold: int) -> Doc:
    return Doc(tuple(Request(context, " " + choice) for choice in choices), gold, tuple(len(c) for c in choices))


def lambada_doc(text: str) -> Doc:
    context, last_word = text.rsplit(" ", 1)
    return Doc((Request(context, " " + last_word),), 0, (len(last_word),))


def piqa_doc(item: data.datasets.PiqaItem) -> Doc:
    return _choices(f"Question: {item.goal}\nAnswer:", item.solutions, item.label)


def hellaswag_preprocess(text: str) -> str:
    """lm-evaluation-harness' clean-up of WikiHow artefacts in HellaSwag."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def hellaswag_doc(item: data.datasets.HellaswagItem) -> Doc:
    return _choices(hellaswag_preprocess(item.context), [hellaswag_preprocess(e) for e in item.endings], item.label)


def arc_doc(item: data.datasets.ArcItem) -> Doc:
    return _choices(f"Question: {item.question}\nAnswer:", item.choices, item.label)


def winogrande_doc(item: data.datasets.WinograndeItem) -> Doc:
    """Partial scoring (Trinh & Le 2018): the option fills the blank in the context, and the score is that of
    the (shared) rest of the sentence."""
    blank = item.sentence.index("_")
    continuation = " " + item.sentence[blank + 1 :].strip()
    requests = tuple(Request(item.sentence[:blank] + option, continuation) for option in item.options)
    return Doc(requests, item.label, tuple(len(option) for option in item.options))


TASKS: dict[str, ZeroShotTask] = {
    task.name: task
    for task in (
        ZeroShotTask("lambada", lambda: [lambada_doc(t) for t in data.lambada_test_texts()], ("acc", "perplexity")),
        ZeroShotTask("piqa", lambda: [piqa_doc(i) for i in data.piqa_items()], ("acc", "acc_norm")),
        ZeroShotTask("hellaswag", lambda: [hellaswag_doc(i) for i in data.hellaswag_items()], ("acc", "acc_norm")),
        ZeroShotTask("arc_easy", lambda: [arc_doc(i) for i in data.arc_items("easy")], ("acc", "acc_norm")),
        ZeroShotTask("arc_challenge", lambda: [arc_doc(i) for i in data.arc_items("challenge")], ("acc", "acc_norm")),
        ZeroShotTask("winogrande", lambda: [winogrande_doc(i) for i in data.winogrande_items()], ("acc",)),
    )
}


def doc_metrics(doc: Doc, scores: list[Score]) -> dict[str, float]:
    """Per-document metric values, from the scores of its requests in order."""
    lls = np.array([s.loglikelihood for s in scores])
    if len(doc.requests) == 1:  # LAMBADA: right if the whole last word is the greedy continuation
        return {"acc": float(scores[0].is_greedy), "loglikelihood": float(lls[0])}
    return {
        "acc": float(np.argmax(lls) == doc.gold),
        "acc_norm": float(np.argmax(lls / np.array(doc.choice_lengths)) == doc.gold),
    }


def aggregate(task: ZeroShotTask, per_doc: list[dict[str, float]]) -> dict[str, float]:
    result: dict[str, float] = {"n": len(per_doc)}
    for metric in task.metrics:
        if metric == "perplexity":
            result[metric] = math.exp(-float(np.mean([d["loglikelihood"] for d in per_doc])))
        else:
            result[metric] = float(np.mean([d[metric] for d in per_doc]))
    return result
