import json

import numpy as np
import torch
from tiny import tiny_model

from leanlm.bench import peak_memory, previous_results, time_call, time_interleaved, weight_bytes, write_results


def test_time_call_warms_up_then_repeats():
    calls = []
    timing = time_call(lambda: calls.append(1), warmup=2, repeats=5)
    assert len(calls) == 7 and timing.repeats == 5
    assert timing.min <= timing.median <= timing.max


def test_peak_memory_sees_a_transient_allocation():
    with peak_memory() as memory:
        block = np.ones(100 * 2**20 // 8)  # 100 MiB, touched
        del block
    assert memory.added_bytes >= 90 * 2**20


def test_weight_bytes_counts_tied_embeddings_once():
    model = tiny_model("llama")  # tied embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    unique = {p.data_ptr(): p.numel() * 4 for p in model.parameters()}
    assert weight_bytes(model) == sum(unique.values())
    model.half()
    assert weight_bytes(model) == sum(unique.values()) // 2


def test_results_are_written_with_their_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("LEANLM_RESULTS", str(tmp_path))
    path = write_results("demo", {"ratio": 2.0}, plot=lambda png: png.write_bytes(b"png"))
    payload = json.loads(path.read_text())
    assert payload["ratio"] == 2.0 and payload["environment"]["torch"] == torch.__version__
    assert (tmp_path / "demo.png").read_bytes() == b"png"


def test_weight_bytes_reads_through_tensor_subclasses():
    import importlib.util

    import pytest

    if importlib.util.find_spec("torchao") is None:
        pytest.skip("torchao is not installed")
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    model = torch.nn.Sequential(torch.nn.Linear(256, 128, bias=False))
    quantize_(model, Int8DynamicActivationInt8WeightConfig())
    # the int8 weight plus small per-row metadata, not the float32 size the subclass reports
    assert 256 * 128 <= weight_bytes(model) <= 256 * 128 + 128 * 8 + 64


def test_time_modules_and_prefill_report_ratios_against_the_float_paths():
    from leanlm.bench import time_modules, time_prefill

    linear = torch.nn.Linear(16, 8)
    x = torch.randn(4, 16)
    results = time_modules(
        {"fp32": linear, "half": torch.nn.Sequential(linear, torch.nn.Identity())}, x, linear(x).detach(), repeats=2
    )
    assert results["fp32"]["speedup_vs_fp32"] == 1.0 and results["half"]["relative_error"] == 0.0
    model = tiny_model("llama")
    timings = time_prefill({"fp32": model}, torch.randint(0, 128, (1, 8)), repeats=1)
    assert timings["fp32"]["tokens_per_second"] > 0 and timings["fp32"]["weight_bytes"] == weight_bytes(model)
    head_rows = []  # positions the lm_head sees: every one, or only the last (a generation's prefill)
    model.lm_head.register_forward_hook(lambda module, args, out: head_rows.append(out.shape[-2]))
    time_prefill({"fp32": model}, torch.randint(0, 128, (1, 8)), repeats=1)
    time_prefill({"fp32": model}, torch.randint(0, 128, (1, 8)), repeats=1, logits_to_keep=1)
    assert head_rows == [8, 8, 1, 1]  # warm-up and one timed round each


def test_previous_results_are_kept_only_for_the_same_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("LEANLM_RESULTS", str(tmp_path))
    assert previous_results("demo") == {}
    write_results("demo", {"settings": {"tasks": ("wikitext2",), "limit": 10}, "rows": {"FP32": 1.0}})
    assert previous_results("demo")["rows"] == {"FP32": 1.0}
    assert previous_results("demo", {"tasks": ("wikitext2",), "limit": 10})["rows"] == {"FP32": 1.0}  # tuple == list
    assert previous_results("demo", {"tasks": ("wikitext2",), "limit": 20}) == {}


def test_interleaved_timing_calls_each_function_once_per_round():
    calls = []
    timings = time_interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, warmup=1, repeats=3)
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]  # warm-ups, then rounds in rotated order
    assert {name: t.repeats for name, t in timings.items()} == {"a": 3, "b": 3}


def test_speed_ups_are_quoted_against_the_faster_float_path():
    from leanlm.bench.harness import InBfloat16, add_speedups, float_paths, speed_table

    results = add_speedups({"fp32": {"ms": 4.0}, "bf16": {"ms": 2.0}, "int8": {"ms": 1.0}}, "ms")
    assert results["int8"]["speedup_vs_fp32"] == 4.0 and results["int8"]["speedup_vs_best_float"] == 2.0
    assert results["int8"]["best_float"] == "bf16"
    slow_bf16 = add_speedups({"fp32": {"ms": 2.0}, "bf16": {"ms": 8.0}, "int8": {"ms": 1.0}}, "ms")
    assert slow_bf16["int8"]["speedup_vs_best_float"] == 2.0  # an emulated bf16 is no reference
    linear = torch.nn.Linear(64, 32)
    x = torch.randn(3, 64)
    paths = float_paths(linear)
    assert paths["fp32"] is linear and isinstance(paths["bf16"], InBfloat16)
    assert paths["bf16"].module.weight.dtype == torch.bfloat16
    out = paths["bf16"](x)
    assert out.dtype == torch.float32 and torch.allclose(out, linear(x), atol=0.05)
    entries = {"1": {name: {"median_ms": ms} for name, ms in (("fp32", 4.0), ("bf16", 2.0), ("int8", 1.0))}}
    table = speed_table({m: add_speedups(row, "median_ms") for m, row in entries.items()})
    assert table.splitlines()[2].split("|")[1:-1] == [" 1 ", " 4.00 ", " 2.00 ", " 1.00 (2.00x) "]


def test_results_are_named_after_the_whole_registry_name_a_directory_or_a_file_s_stem():
    from leanlm.bench.harness import results_name

    assert results_name("decode", "qwen2.5-coder-1.5b") == "decode_qwen2.5-coder-1.5b"
    assert results_name("decode", "/tmp/x/Llama-3.1-8B") == "decode_Llama-3.1-8B"
    assert results_name("decode", "/models/tiny.Q4_0.gguf", "xeon") == "decode_tiny.Q4_0_xeon"
