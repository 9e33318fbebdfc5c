import pytest

from leanlm.evaluation import EvalSettings
from leanlm.evaluation.streaming import StreamSettings
from leanlm.showcase import ROWS, run_showcase


def test_every_method_has_a_row_and_quantized_rows_are_smaller(tiny_llama_dir, monkeypatch):
    monkeypatch.setattr("leanlm.showcase.SHOWCASE_CALIBRATION_SAMPLES", 2)
    settings = EvalSettings(tasks=("wikitext2", "piqa"), limit=2, max_tokens=256, seq_len=64)
    monkeypatch.setattr("leanlm.showcase.QLORA_STEPS", 2)
    monkeypatch.setattr(
        "leanlm.showcase.STREAM",
        StreamSettings(window=28, max_tokens=200, strategies=("streaming",), latency_steps=4, recompute_tokens=4),
    )
    payload = run_showcase(str(tiny_llama_dir), settings)
    assert (
        list(payload["rows"])
        == [row.name for row in ROWS]
        == [
            "fp32",
            "w8a8-O2",
            "smoothquant-O1",
            "smoothquant-O3",
            "cushion+smoothquant-O3",
            "llm-int8",
            "nf4-dq",
            "gptq-4bit",
            "spqr",
            "streaming",
            "qlora",
        ]
    )
    fp32 = payload["rows"]["fp32"]["weights_bytes"]
    for name, row in payload["rows"].items():
        assert row["results"]["wikitext2"]["perplexity"] > 1
        assert (row["zero_shot_average"] is None) == (name == "streaming")
        assert row["peak_rss_bytes"] > row["weights_bytes"]
        if name not in ("fp32", "streaming"):
            assert row["weights_bytes"] < fp32, name


@pytest.mark.parametrize(
    "method, row",
    [
        ("w8a8", "w8a8-O2"),
        ("smoothquant", "smoothquant-O3"),
        ("llm-int8", "llm-int8"),
        ("kbit", "nf4-dq"),
        ("gptq", "gptq-4bit"),
        ("spqr", "spqr"),
    ],
)
def test_each_methods_command_line_defaults_are_its_showcase_row(method, row):
    """`leanlm quantize --method NAME` with no other flag runs the recipe whose measured row the showcase shows."""
    from leanlm.cli.main import build_parser
    from leanlm.cli.options import method_configs

    configs, _ = method_configs(
        build_parser(only="quantize").parse_args(["quantize", "m", "--method", method, "--out", "x"])
    )
    assert tuple(configs) == next(r.steps for r in ROWS if r.name == row)
