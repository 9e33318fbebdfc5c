"""Loaders for every shipped data set, as plain Python records (see raw/README.md for provenance).

Each returns exactly what the evaluation or calibration code needs, with the conventions of the papers and of
lm-evaluation-harness stated where there is a choice.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from leanlm.data.files import verified_path
from leanlm.errors import DataError


def _jsonl(relative: str) -> list[dict]:
    with open(verified_path(relative), encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _labels(relative: str) -> list[int]:
    return [int(line) for line in verified_path(relative).read_text().split()]


def wikitext2_test_text() -> str:
    """WikiText-2 raw test, rows joined by blank lines: the GPTQ / SmoothQuant / SpQR convention."""
    rows = json.loads(verified_path("wikitext2/test_rows.json").read_text(encoding="utf-8"))
    return "\n\n".join(rows)


def ptb_text(split: Literal["test", "valid"] = "test") -> str:
    """Penn Treebank (Mikolov's LM version), sentences stripped and joined by single spaces (GPTQ's join)."""
    lines = verified_path(f"ptb/ptb.{split}.txt").read_text(encoding="utf-8").split("\n")
    return " ".join(line.strip() for line in lines if line.strip())


def lambada_test_texts() -> list[str]:
    """LAMBADA test, OpenAI's detokenized version (lm-evaluation-harness' `lambada_openai`)."""
    return [record["text"] for record in _jsonl("lambada/lambada_test.jsonl")]


PlainText = Literal["lambada-dev", "lambada-test", "lee"]  # the long running texts `plain_text` reads


def plain_text(name: PlainText) -> str:
    """Long running text: LAMBADA development novels (the calibration and fine-tuning text), LAMBADA test
    passages (held-out text), or the Lee news corpus."""
    relative = {
        "lambada-dev": "lambada/lambada_development_plain_text.txt",
        "lambada-test": "lambada/lambada_test_plain_text.txt",
        "lee": "calibration/lee_background.cor",
    }.get(name)
    if relative is None:
        raise DataError(f"unknown text {name!r}; choose lambada-dev, lambada-test or lee")
    return verified_path(relative).read_text(encoding="utf-8")


@dataclass(frozen=True)
class PiqaItem:
    goal: str
    solutions: tuple[str, str]
    label: int


def piqa_items() -> list[PiqaItem]:
    records, labels = _jsonl("piqa/dev.jsonl"), _labels("piqa/dev-labels.lst")
    if len(records) != len(labels):
        raise DataError(f"PIQA: {len(records)} items but {len(labels)} labels")
    return [PiqaItem(r["goal"], (r["sol1"], r["sol2"]), label) for r, label in zip(records, labels)]


@dataclass(frozen=True)
class HellaswagItem:
    context: str  # "activity_label: ctx", as stored
    endings: tuple[str, str, str, str]
    label: int


def hellaswag_items() -> list[HellaswagItem]:
    """HellaSwag validation; the file stores each item as 6 lines: context, label, four endings."""
    lines = verified_path("hellaswag/hellaswag_val_full.txt").read_text(encoding="utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if len(lines) % 6:
        raise DataError(f"HellaSwag: {len(lines)} lines is not a multiple of 6")
    return [HellaswagItem(lines[i], tuple(lines[i + 2 : i + 6]), int(lines[i + 1])) for i in range(0, len(lines), 6)]


@dataclass(frozen=True)
class ArcItem:
    question: str
    choices: tuple[str, ...]
    label: int


def arc_items(subset: Literal["easy", "challenge"]) -> list[ArcItem]:
    name = {"easy": "ARC-Easy", "challenge": "ARC-Challenge"}.get(subset)
    if name is None:
        raise DataError(f"unknown ARC subset {subset!r}; choose easy or challenge")
    items = []
    for record in _jsonl(f"arc/{name}-Test.jsonl"):
        choices = record["question"]["choices"]
        labels = [choice["label"] for choice in choices]
        items.append(
            ArcItem(record["question"]["stem"], tuple(c["text"] for c in choices), labels.index(record["answerKey"]))
        )
    return items


@dataclass(frozen=True)
class WinograndeItem:
    sentence: str  # with "_" where an option goes
    options: tuple[str, str]
    label: int


def winogrande_items() -> list[WinograndeItem]:
    records, labels = _jsonl("winogrande/dev.jsonl"), _labels("winogrande/dev-labels.lst")
    if len(records) != len(labels):
        raise DataError(f"WinoGrande: {len(records)} items but {len(labels)} labels")
    return [WinograndeItem(r["sentence"], (r["option1"], r["option2"]), label - 1) for r, label in zip(records, labels)]
