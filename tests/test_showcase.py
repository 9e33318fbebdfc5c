from leanlm.evaluation import EvalSettings
from leanlm.showcase import ROWS, run_showcase


def test_every_row_runs_and_int8_rows_are_smaller(tiny_llama_dir, monkeypatch):
    monkeypatch.setattr("leanlm.showcase.SHOWCASE_CALIBRATION_SAMPLES", 2)
    settings = EvalSettings(tasks=("wikitext2", "piqa"), limit=2, max_tokens=256, seq_len=64)
    payload = run_showcase(str(tiny_llama_dir), settings)
    assert list(payload["rows"]) == [row.name for row in ROWS]
    fp32 = payload["rows"]["fp32"]["weights_bytes"]
    for name, row in payload["rows"].items():
        assert row["results"]["wikitext2"]["perplexity"] > 1
        assert row["zero_shot_average"] is not None
        if name != "fp32":
            assert row["weights_bytes"] < fp32
