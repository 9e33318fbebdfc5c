"""Benchmark studies: the rows of one result file, measured one at a time, saved after each, resumed by settings.

Every script in benchmarks/ is a study. `study_arguments` gives each the same flags (--model, --resume, --only,
--skip, --report); `Study` holds its result file (`benchmarks/results/NAME.json` and `NAME.png`), written after
every row so that a run stopped anywhere keeps what it finished; `Study.quantized_rows` is the loop most tables
are (copy the float model, apply the row's method configs with `quantize_`, measure the copy, save). A script
keeps only its rows, its extra measurements, its plot and its `report` (the tables the README quotes, printed
from the JSON by `--report`).

What a previous file gives a new run: if it was measured with exactly these settings (compared through JSON),
all of its parts are kept, and with --resume its finished rows are not measured again (without it, the rows
this run selects are measured anew and replace theirs). With other settings nothing is kept but the parts the
script declares independent of them (a kernel's speed on random weights).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from torch import nn

from leanlm.bench.harness import environment, peak_memory, previous_results, results_dir, weight_bytes, write_results

# The file's top-level "environment" is the last run's; a file filled by several runs (--only, --resume) also
# keeps, for every row and part, the run that measured it (its command, commit, date, CPU, load average), so a row
# measured on a quiet host, or another machine, is not credited to the one that added another row later.
RUNS_KEY = "measured_by"
RUN_FIELDS = ("command", "date", "git_commit", "cpu", "load_average")

Plot = Callable[[dict, Path], None]
Report = Callable[[dict], str]
Part = str | tuple[str, ...]  # a key of the file, or a path of keys to a nested part ("alpha_sweep", "O1")


def study_arguments(
    parser: argparse.ArgumentParser, *, model: bool = True, tag: bool = False
) -> argparse.ArgumentParser:
    """The flags every benchmark script shares (`tag`: and --tag, for a speed study run on more than one CPU)."""
    if model:
        from leanlm.models import DEFAULT_MODEL

        parser.add_argument("--model", default=DEFAULT_MODEL)
    if tag:
        parser.add_argument(
            "--tag", default=None, help="results in <study>_<model>_<tag>.json, beside (not over) another machine's"
        )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the rows a previous run with the same settings finished; measure only the rest",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        default=None,
        metavar="TEXT",
        help="measure only the parts whose name starts with one of these and the rows whose name contains one",
    )
    parser.add_argument(
        "--skip",
        nargs="+",
        default=[],
        metavar="PART",
        help="leave these parts out (what the previous run saved of them is kept)",
    )
    parser.add_argument("--report", action="store_true", help="print the saved results' tables; measure nothing")
    return parser


def titled(payload: dict, text: str) -> str:
    """A figure's title: the model, what the study shows, and the note on its weights (de-quantized GGUF)."""
    note = payload.get("weights_note")
    return " ".join(filter(None, [payload.get("model"), text])) + (f" ({note})" if note else "")


def print_report(name: str, report: Report) -> None:
    """What `--report` prints: the tables of the committed `NAME.json`, nothing measured."""
    payload = previous_results(name)
    if not payload:
        raise SystemExit(f"no saved results in {results_dir() / name}.json: run the study first")
    print(report(payload))


def measured_on(payload: dict, key: str) -> str | None:
    """The CPU that measured `key` ("part/row") of a saved file: its run's stamp, or, for a stamp from before runs
    named their CPU, the file's environment where the run that wrote it last (same command and commit) measured
    the key; None where the file does not say."""
    run = payload.get(RUNS_KEY, {}).get(key)
    if run is None:
        return None
    if "cpu" in run:
        return run["cpu"]
    last = payload.get("environment", {})
    return last.get("cpu") if all(run.get(field) == last.get(field) for field in ("command", "git_commit")) else None


class Study:
    """One result file, built part by part (a dict of rows each) and saved after every row."""

    def __init__(
        self,
        name: str,
        settings: dict,
        args: argparse.Namespace,
        *,
        plot: Plot | None = None,
        independent: Iterable[str] = (),
    ):
        self.name = name
        self.resume = args.resume
        self.only = args.only
        self.skip = set(args.skip)
        self.plot = plot
        self._order: dict[str, list[str]] = {}
        settings = json.loads(json.dumps(settings))
        previous = previous_results(name)
        self.payload: dict[str, Any] = {"settings": settings}
        if previous.get("settings") == settings:
            self.payload.update({k: v for k, v in previous.items() if k not in ("settings", "environment")})
        else:
            self.payload.update({k: previous[k] for k in independent if k in previous})
            kept = {key: run for key, run in previous.get(RUNS_KEY, {}).items() if key.split("/", 1)[0] in independent}
            if kept:
                self.payload[RUNS_KEY] = kept
        self._run = None  # this run's command, commit, date, CPU and load: stamped on each row it saves

    @property
    def path(self) -> Path:
        return results_dir() / f"{self.name}.json"

    def load_model(self, name: str, dtype: str = "float32"):
        """Load the study's model (computing in `dtype`) and record its name, dtype and the note on its weights in
        the file."""
        from leanlm.models import load_model

        loaded = load_model(name, dtype=dtype)
        self.payload.update(model=name, weights_note=loaded.weights_note, dtype=loaded.dtype)
        return loaded

    def rows(self, part: Part, *, create: bool = True) -> dict:
        """The saved rows of `part` (created empty, or with `create=False` an unsaved empty dict)."""
        rows = self.payload
        for key in (part,) if isinstance(part, str) else part:
            rows = rows.setdefault(key, {}) if create else rows.get(key, {})
        return rows

    def runs(self, part: Part, row: str = "") -> bool:
        """Whether this run measures `row` of `part` (or the part, without a row): not skipped, named by --only."""
        keys = (part,) if isinstance(part, str) else part
        if any(key.startswith(skipped) for key in keys for skipped in self.skip):  # "alpha_sweep" skips its _fp32
            return False
        # --only TEXT names a part by the start of its key ("latency", "speed"), a row by any part of its name
        # with its sub-part ("O3 0.5" in the alpha sweep, "FP32" in a table).
        name = " ".join((*keys[1:], row))
        return not self.only or any(keys[0].startswith(text) or (name and text in name) for text in self.only)

    def todo(self, part: Part, rows: Iterable[str], done: Callable[[Any], bool] = lambda value: True) -> Iterator[str]:
        """The rows of `part` to measure now, in the order given (the order the part is saved in): those this run
        selects, less the ones a --resume finds finished (`done` says whether a saved row is finished)."""
        rows = list(rows)
        self._order[str(part)] = rows
        saved = self.rows(part, create=False)  # a part none of whose rows run stays out of the file
        for row in rows:
            if self.runs(part, row) and not (self.resume and row in saved and done(saved[row])):
                yield row

    def pending(self, key: str, part: str | None = None) -> bool:
        """Whether `key`, measured in one go (not row by row), is to be measured now; `part`: the name --only and
        --skip know it by, if not the key's."""
        return self.runs(part or key) and not (self.resume and key in self.payload)

    def record(self, part: Part, row: str, value: Any, summary: Callable[[Any], str] | None = None) -> None:
        """Store a finished row (the part kept in its rows' order), print its summary line, save the file."""
        rows = self.rows(part)
        rows[row] = value
        order = self._order.get(str(part), [])
        ordered = sorted(rows.items(), key=lambda item: order.index(item[0]) if item[0] in order else len(order))
        rows.clear()
        rows.update(ordered)
        if summary is not None:
            label = row if isinstance(part, str) else " ".join((*part[1:], row))
            print(f"{label}: {summary(value)}", flush=True)
        self._stamp("/".join(((part,) if isinstance(part, str) else part) + (row,)))
        self.save()

    def set(self, key: str, value: Any) -> None:
        """Store a part measured in one go and save."""
        self.payload[key] = value
        self._stamp(key)
        self.save()

    def _stamp(self, key: str) -> None:
        """Record this run as the one that measured `key` ("part/row"); the load average is read now, at the row's
        end, as the file's environment always was."""
        if self._run is None:
            self._run = {field: value for field, value in environment().items() if field in RUN_FIELDS}
        self.payload.setdefault(RUNS_KEY, {})[key] = {**self._run, "load_average": list(os.getloadavg())}

    def save(self) -> Path:
        plot = None if self.plot is None else (lambda path: self.plot(self.payload, path))
        return write_results(self.name, self.payload, plot)

    def quantized_rows(
        self,
        part: Part,
        model: nn.Module,
        rows: dict[str, Any],
        measure: Callable[[nn.Module, Any], Any],
        *,
        calibration=None,
        summary: Callable[[Any], str] | None = None,
    ) -> None:
        """The usual table: for each row to measure, a copy of the float `model` with the row's configs applied by
        `quantize_` (a config, a list of them, or None for the float model itself), then `measure(copy,
        record)` (record: the `QuantRecord`, None for the float row) is saved as the row, with (if it is a dict)
        "memory": the model's stored weight bytes and the process's peak resident memory during the row (the
        float model stays resident beside the row's copy: `rss_before_bytes` is what was resident before it)."""
        from leanlm.methods import quantize_

        for row in self.todo(part, rows):
            configs = rows[row]
            with peak_memory() as memory:
                measured = copy.deepcopy(model) if configs else model  # the float row measures the model itself
                record = quantize_(measured, configs, calibration=calibration) if configs else None
                value = measure(measured, record)
            if isinstance(value, dict):  # stored bytes beside resident memory, for every row
                value["memory"] = {
                    "weight_bytes": weight_bytes(measured),
                    "peak_rss_bytes": memory.peak_bytes,
                    "rss_before_bytes": memory.before_bytes,
                }
            self.record(part, row, value, summary)
            del measured
