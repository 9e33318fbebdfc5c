"""The benchmark study helper: rows saved as they finish, resumed only with the same settings, --only / --skip,
and the copy-quantize-measure loop leaving the float model untouched."""

import argparse
import json

import pytest
import torch
from tiny import tiny_model

from leanlm.bench import Study, measured_on, study_arguments
from leanlm.methods import KbitConfig
from leanlm.nn import KbitLinear


@pytest.fixture(autouse=True)
def results_in(tmp_path, monkeypatch):
    monkeypatch.setenv("LEANLM_RESULTS", str(tmp_path))
    return tmp_path


def arguments(*argv: str) -> argparse.Namespace:
    return study_arguments(argparse.ArgumentParser(), model=False).parse_args(list(argv))


def measure_all(study: Study, part: str, rows: list[str], measured: list[str]) -> None:
    for row in study.todo(part, rows):
        measured.append(row)
        study.record(part, row, {"value": len(measured)})


def test_rows_are_saved_as_they_finish_and_resume_skips_them(results_in):
    measured: list[str] = []
    study = Study("s", {"tokens": 8}, arguments())
    for row in study.todo("table", ["a", "b", "c"]):
        if row == "c":
            break  # the run stops after two rows
        measured.append(row)
        study.record("table", row, {"value": row})
    assert list(json.loads((results_in / "s.json").read_text())["table"]) == ["a", "b"]

    again: list[str] = []
    measure_all(Study("s", {"tokens": 8}, arguments("--resume")), "table", ["a", "b", "c"], again)
    assert again == ["c"]
    saved = json.loads((results_in / "s.json").read_text())
    assert saved["table"]["a"] == {"value": "a"} and list(saved["table"]) == ["a", "b", "c"]


def test_other_settings_keep_nothing_but_the_independent_parts(results_in):
    first = Study("s", {"tokens": 8}, arguments())
    first.record("table", "a", 1)
    first.set("speed", {"ms": 3.0})
    other = Study("s", {"tokens": 16}, arguments("--resume"), independent=("speed",))
    assert "table" not in other.payload and other.payload["speed"] == {"ms": 3.0}
    measured: list[str] = []
    measure_all(other, "table", ["a"], measured)
    assert measured == ["a"]


def test_without_resume_the_selected_rows_are_measured_again_and_the_rest_kept(results_in):
    measure_all(Study("s", {}, arguments()), "table", ["a", "b"], [])
    measured: list[str] = []
    study = Study("s", {}, arguments("--only", "b"))
    measure_all(study, "table", ["a", "b"], measured)
    assert measured == ["b"] and set(study.payload["table"]) == {"a", "b"}


def test_a_part_none_of_whose_rows_run_is_not_written(results_in):
    study = Study("s", {}, arguments("--only", "b"))
    assert list(study.todo(("parts", "a"), ["x", "y"])) == []
    measure_all(study, ("parts", "b"), ["x"], [])
    assert json.loads((results_in / "s.json").read_text())["parts"] == {"b": {"x": {"value": 1}}}


def test_only_and_skip_select_parts_and_rows():
    study = Study("s", {}, arguments("--only", "O3 0.5", "latency", "--skip", "alpha_sweep"))
    assert study.runs(("sweep", "O3"), "0.5") and not study.runs(("sweep", "O1"), "0.5")
    assert study.runs("latency") and not study.runs("stream")
    assert not study.runs("alpha_sweep_fp32")  # a skipped part's own keys go with it
    assert not study.pending("probe_key", "probe")


def test_quantized_rows_quantize_a_copy_and_measure_the_float_model_itself():
    model = tiny_model("llama")
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    seen = {}

    def measure(quantized, record):
        seen[record.method if record else "float"] = quantized
        kbit = [m for m in quantized.modules() if isinstance(m, KbitLinear)]
        return {"kbit_linears": len(kbit), "avg_bits": record.avg_bits if record else None}

    study = Study("s", {}, arguments())
    study.quantized_rows("table", model, {"FP32": None, "NF4": KbitConfig("nf", 4, 64)}, measure)
    assert seen["float"] is model and seen["kbit"] is not model
    fp32, nf4 = study.payload["table"]["FP32"], study.payload["table"]["NF4"]
    assert {k: fp32[k] for k in ("kbit_linears", "avg_bits")} == {"kbit_linears": 0, "avg_bits": None}
    assert nf4["memory"]["weight_bytes"] < fp32["memory"]["weight_bytes"] <= fp32["memory"]["peak_rss_bytes"]
    assert study.payload["table"]["NF4"]["kbit_linears"] == 14 and 4 < study.payload["table"]["NF4"]["avg_bits"] < 5
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())


def test_each_row_keeps_the_run_that_measured_it(results_in, monkeypatch):
    monkeypatch.setattr("sys.argv", ["bench.py"])
    first = Study("s", {"tokens": 8}, arguments())
    first.record("table", "a", 1)
    first.set("speed", {"ms": 3.0})
    monkeypatch.setattr("sys.argv", ["bench.py", "--only", "b"])
    second = Study("s", {"tokens": 8}, arguments("--only", "b"))
    second.record("table", "b", 2)
    saved = json.loads((results_in / "s.json").read_text())
    runs = saved["measured_by"]
    assert runs["table/a"]["command"] == "bench.py" and runs["speed"]["command"] == "bench.py"
    assert runs["table/b"]["command"] == "bench.py --only b" and saved["environment"]["command"] == "bench.py --only b"
    assert set(runs["table/a"]) == {"command", "date", "git_commit", "cpu", "load_average"}
    assert measured_on(saved, "table/b") == saved["environment"]["cpu"] and measured_on(saved, "table/c") is None
    del runs["table/a"]["cpu"], runs["table/b"]["cpu"]  # stamps from before runs named their CPU
    assert measured_on(saved, "table/b") == saved["environment"]["cpu"] and measured_on(saved, "table/a") is None
    # other settings keep an independent part's run beside the part, and nothing else
    other = Study("s", {"tokens": 16}, arguments(), independent=("speed",))
    assert list(other.payload["measured_by"]) == ["speed"]
