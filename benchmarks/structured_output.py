"""What constrained decoding costs per token in `leanlm serve` (response_format json_schema, through llguidance):
for each installed registry model's tokenizer, the time to compute the mask of the tokens the schema allows next
and apply it to a vocabulary's logits, and to advance the grammar by the chosen token, over a valid answer's
tokens. Writes benchmarks/results/structured_output.json + .png.

    python benchmarks/structured_output.py [--repeats 20]
    python benchmarks/structured_output.py --report
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from leanlm.bench import Study, print_report, study_arguments, titled  # noqa: E402
from leanlm.report import format_table, save_figure  # noqa: E402

NAME = "structured_output"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "pet": {"enum": ["cat", "dog", "none"]},
    },
    "required": ["name", "age", "tags", "pet"],
    "additionalProperties": False,
}
ANSWER = {"name": "Ada Lovelace", "age": 36, "tags": ["mathematics", "engines", "poetry"], "pet": "cat"}


def installed_models() -> list[str]:
    from leanlm.models import REGISTRY
    from leanlm.models.registry import is_installed

    return [name for name, model in REGISTRY.items() if is_installed(model)]


def measure(name: str, repeats: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    from leanlm.models import load_tokenizer

    tokenizer = load_tokenizer(name)
    grammar_tokenizer = llguidance.hf.from_tokenizer(tokenizer)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
    tokens = tokenizer.encode(json.dumps(ANSWER, separators=(",", ":")), add_special_tokens=False)
    logits = torch.zeros(len(tokenizer))
    mask = llguidance.torch.allocate_token_bitmask(1, grammar_tokenizer.vocab_size)
    width = min(len(logits), grammar_tokenizer.vocab_size)
    masking, consuming = [], []
    for _ in range(repeats):
        matcher = llguidance.LLMatcher(grammar_tokenizer, grammar)
        for token in tokens:
            started = time.perf_counter()
            llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)
            masked = logits.clone()
            llguidance.torch.apply_token_bitmask_inplace(masked[:width], mask[0])
            middle = time.perf_counter()
            assert matcher.consume_token(token), matcher.get_error()
            masking.append(middle - started)
            consuming.append(time.perf_counter() - middle)
        assert matcher.is_accepting()
    return {
        "vocabulary": len(tokenizer),
        "answer_tokens": len(tokens),
        "mask_us": statistics.median(masking) * 1e6,
        "consume_us": statistics.median(consuming) * 1e6,
        "per_token_us": (statistics.median(masking) + statistics.median(consuming)) * 1e6,
        "repeats": repeats,
    }


COLUMNS = (
    ("vocabulary", "vocabulary", "{:,}"),
    ("mask_us", "mask + apply, µs", "{:.0f}"),
    ("consume_us", "advance, µs", "{:.0f}"),
    ("per_token_us", "per token, µs", "{:.0f}"),
)


def report(payload: dict) -> str:
    rows = [
        [model, *(form.format(r[key]) for key, _, form in COLUMNS)] for model, r in payload.get("models", {}).items()
    ]
    return format_table(["tokenizer of", *(title for _, title, _ in COLUMNS)], rows, markdown=True)


def plot(payload: dict, path) -> None:
    models = payload.get("models", {})
    if not models:
        return
    fig, axis = plt.subplots(figsize=(7, 3.5))
    names, below = list(models), [0.0] * len(models)
    for key, label in (("mask_us", "mask + apply"), ("consume_us", "advance the grammar")):
        heights = [models[n][key] for n in names]
        axis.bar(names, heights, bottom=below, label=label)
        below = [b + h for b, h in zip(below, heights, strict=True)]
    axis.set_ylabel("µs per generated token (median)")
    axis.legend()
    save_figure(fig, path, titled(payload, "JSON-schema constraint"))


def main() -> None:
    parser = study_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]), model=False)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if args.report:
        return print_report(NAME, report)
    study = Study(NAME, {"schema": SCHEMA, "answer": ANSWER, "repeats": args.repeats}, args, plot=plot)
    for name in study.todo("models", installed_models()):
        study.record(
            "models",
            name,
            measure(name, args.repeats),
            summary=lambda r: f"{r['per_token_us']:.0f} µs per token ({r['vocabulary']:,} tokens)",
        )
    study.save()


if __name__ == "__main__":
    main()
