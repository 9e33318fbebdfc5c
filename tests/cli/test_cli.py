import json

import pytest
from processes import leanlm_process

from leanlm.bench import weight_bytes
from leanlm.cli.main import main
from leanlm.methods import load_quantized
from leanlm.methods.checkpoint import weights_files
from leanlm.models import load_model

SMALL_CALIBRATION = ["--calib-samples", "4", "--calib-seq-len", "32"]


def test_eval_writes_the_contract_json(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "r.json"
    code = main(
        [
            "eval",
            str(tiny_llama_dir),
            "--tasks",
            "wikitext2,piqa,winogrande",
            "--limit",
            "2",
            "--max-tokens",
            "256",
            "--seq-len",
            "64",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    payload = json.loads(out.read_text())
    assert payload["model"] == str(tiny_llama_dir)
    wikitext = payload["results"]["wikitext2"]
    assert {"perplexity", "tokens", "tokens_per_second"} <= set(wikitext) and wikitext["tokens"] == 4 * 63
    assert {"acc", "acc_norm", "n"} <= set(payload["results"]["piqa"]) and payload["results"]["piqa"]["n"] == 2
    assert {"acc", "n"} <= set(payload["results"]["winogrande"])
    assert payload["weights_bytes"] > 0 and payload["seconds"] > 0
    assert payload["peak_rss_bytes"] > payload["weights_bytes"]  # resident memory, beside the bytes stored
    assert payload["dtype"] == "float32"  # the reference, unless --dtype says otherwise
    printed = capsys.readouterr().out
    assert "wikitext2" in printed and "perplexity" in printed and "zero-shot average" in printed


@pytest.mark.parametrize(
    "argv, message",
    [
        (["eval", "no-such-model"], "neither a registered model"),
        (["eval", "smollm2-135m", "--tasks", "mmlu"], "unknown task(s) mmlu"),
        (["eval", "smollm2-135m", "--limit", "0"], "--limit: limit must be a positive number, got 0"),
        (["eval", "smollm2-135m", "--seq-len", "abc"], "--seq-len: expected a whole number, got 'abc'"),
        (["stream", "smollm2-135m", "--sinks", "-1"], "--sinks: sinks must be 0 or more, got -1"),
        (["stream", "smollm2-135m", "--setting", "magic"], "unknown strategy magic; choose from dense"),
        (["swarm", "--stages", "3", "--peers", "2"], "--peers: peers 2 cannot serve 3 stages"),
        (["swarm", "--in-flight", "0"], "--in-flight: in_flight must be at least 1, got 0"),
        (["finetune", "m", "--data", "d", "--out", "o", "--lora-alpha", "0"], "--lora-alpha: LoRA alpha must be"),
        (["finetune", "m", "--data", "d", "--out", "o", "--optimizer-bits", "16"], "--optimizer-bits '16': choose"),
        (["finetune", "m", "--method", "lora", "--base", "nf4", "--data", "d", "--out", "o"], "use --method qlora"),
        (["chat", "--temperature", "-1"], "--temperature: temperature must be 0 or more, got -1.0"),
        (["serve", "smollm2-135m", "--port", "70000"], "--port: port must be at most 65535, got 70000"),
        (["serve", "smollm2-135m", "--max-batch", "0"], "--max-batch: max_batch must be positive, got 0"),
        (["eval", "smollm2-135m", "--dtype", "float16"], "--dtype 'float16': choose from auto, float32, bfloat16"),
        (["chat", "--dtype", "fp8"], "--dtype 'fp8': choose from auto, float32, bfloat16"),
        (["serve", "smollm2-135m", "--head", "int4"], "--head 'int4': choose from float, int8"),
        (
            ["quantize", "smollm2-135m", "--method", "kbit", "--table-dtype", "float16", "--out", "o"],
            "--table-dtype 'float16': choose from float32, bfloat16",
        ),
    ],
)
def test_bad_input_gets_a_one_line_error(argv, message, capsys):
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own usage errors
        code = exit_.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_seq_len_larger_than_the_text_is_explained(tiny_llama_dir, capsys):
    assert main(["eval", str(tiny_llama_dir), "--max-tokens", "100", "--seq-len", "2048"]) == 2
    assert "do not fill one window" in capsys.readouterr().err


def test_quantize_then_eval_the_checkpoint(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "sq"
    assert (
        main(
            [
                "quantize",
                str(tiny_llama_dir),
                "--method",
                "smoothquant",
                "--level",
                "O3",
                "--alpha",
                "0.6",
                "--calib-samples",
                "2",
                "--calib-seq-len",
                "32",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert "(smoothquant, O3, weights per_channel, alpha 0.6)" in capsys.readouterr().out
    result = tmp_path / "r.json"
    assert main(["eval", str(out), "--max-tokens", "128", "--seq-len", "64", "--json", str(result)]) == 0
    payload = json.loads(result.read_text())
    assert payload["results"]["wikitext2"]["perplexity"] > 1
    float_bytes = weight_bytes(load_model(tiny_llama_dir).model)
    linear_bytes = sum(
        m.weight.numel() * 4
        for n, m in load_model(tiny_llama_dir).model.named_modules()
        if n.startswith("model.layers") and n.endswith("proj")
    )
    # Every block linear went from 4 bytes to 1 byte per weight (plus small scales).
    assert payload["weights_bytes"] < float_bytes - 0.7 * linear_bytes


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--method", "w8a8", "--alpha", "0.5"],
            "--alpha is not an option of --method w8a8 (it is one of cushion, smoothquant)",
        ),
        (["--method", "smoothquant", "--alpha", "2"], "must lie in [0, 1]"),
        (["--method", "awq"], "invalid choice"),
        (["--method", "kbit", "--block-size", "big"], "--block-size: expected a whole number or 'row', got 'big'"),
        (["--method", "kbit", "--dtype", "nf9"], "--dtype 'nf9': choose from int, int_asym, fp, nf, dynamic"),
        (["--method", "w8a8", "--dtype", "nf"], "--dtype is not an option of --method w8a8 (it is one of kbit)"),
        (
            ["--method", "w8a8", "--bits", "4"],
            "--bits is not an option of --method w8a8 (it is one of gptq, kbit, rtn, spqr)",
        ),
        (["--method", "kbit", "--bits", "2"], "--bits: bits must be between 3 and 8, got 2"),
        (["--method", "kbit", "--bits", "9"], "bits must be between 3 and 8, got 9"),
        (["--method", "kbit", "--seed", "3"], "--seed: --method kbit as set reads no calibration text"),
        (["--method", "gptq", "--beta1", "8"], "--beta1 is not an option of --method gptq (it is one of spqr)"),
        (["--method", "spqr", "--group-size", "64"], "--group-size is not an option of --method spqr"),
        (["--method", "llm-int8", "--level", "O3"], "--level is not an option of --method llm-int8"),
        (["--method", "w8a8", "--base", "smoothquant"], "--base applies to --method cushion"),
        (["--method", "cushion", "--alpha", "0.5"], "--alpha is not an option of --method cushion --base w8a8"),
    ],
)
def test_quantize_option_errors(argv, message, tmp_path, capsys):
    try:
        code = main(["quantize", "smollm2-135m", *argv, "--out", str(tmp_path / "x")])
    except SystemExit as exit_:
        code = exit_.code
    assert code == 2 and message in capsys.readouterr().err


def test_analyze_writes_the_contract_keys_and_a_plot(tiny_llama_dir, tmp_path):
    report, plot = tmp_path / "a.json", tmp_path / "a.png"
    assert (
        main(
            [
                "analyze",
                str(tiny_llama_dir),
                "--samples",
                "2",
                "--seq-len",
                "32",
                "--json",
                str(report),
                "--plot",
                str(plot),
            ]
        )
        == 0
    )
    payload = json.loads(report.read_text())
    assert {"outlier_dims", "layers_affected_pct", "tokens_affected_pct", "max_magnitude"} <= set(payload)
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_llm_int8_checkpoint_round_trip(tiny_llama_dir, tmp_path):
    out = tmp_path / "int8"
    assert main(["quantize", str(tiny_llama_dir), "--method", "llm-int8", "--threshold", "6", "--out", str(out)]) == 0
    record = json.loads((out / "leanlm_quant.json").read_text())
    assert record["method"] == "llm-int8" and record["outlier_threshold"] == 6.0
    assert main(["eval", str(out), "--max-tokens", "128", "--seq-len", "64"]) == 0


def test_kbit_checkpoint_records_measured_average_bits(tiny_llama_dir, tmp_path):
    out = tmp_path / "nf4"
    assert (
        main(
            [
                "quantize",
                str(tiny_llama_dir),
                "--method",
                "kbit",
                "--dtype",
                "nf",
                "--bits",
                "4",
                "--block-size",
                "64",
                "--double-quant",
                "--out",
                str(out),
                "--json",
                str(tmp_path / "q.json"),
            ]
        )
        == 0
    )
    record = json.loads((out / "leanlm_quant.json").read_text())
    assert record["method"] == "kbit" and 4.12 < record["avg_bits"] < 4.2
    summary = json.loads((tmp_path / "q.json").read_text())
    assert summary["method"] == "kbit" and summary["avg_bits"] == record["avg_bits"]
    assert summary["peak_rss_bytes"] > 0 and summary["seconds"] > 0
    assert main(["eval", str(out), "--max-tokens", "128", "--seq-len", "64"]) == 0
    halved = tmp_path / "nf4-bf16-tables"
    assert (
        main(
            [
                "quantize",
                str(tiny_llama_dir),
                "--method",
                "kbit",
                "--double-quant",
                "--table-dtype",
                "bfloat16",
                "--out",
                str(halved),
            ]
        )
        == 0
    )
    assert json.loads((halved / "leanlm_quant.json").read_text())["table_dtype"] == "bfloat16"
    stored = [sum(path.stat().st_size for path in weights_files(directory)) for directory in (halved, out)]
    assert stored[0] < stored[1]
    assert main(["eval", str(halved), "--max-tokens", "128", "--seq-len", "64"]) == 0


def test_stream_writes_the_contract_keys_and_a_plot(tiny_llama_dir, tmp_path, capsys):
    out, plot = tmp_path / "s.json", tmp_path / "s.png"
    code = main(
        [
            "stream",
            str(tiny_llama_dir),
            "--max-tokens",
            "400",
            "--window",
            "28",
            "--chunk",
            "8",
            "--recompute-tokens",
            "4",
            "--latency-steps",
            "32",
            "--json",
            str(out),
            "--plot",
            str(plot),
        ]
    )
    assert code == 0
    payload = json.loads(out.read_text())
    for strategy in ("dense", "window", "recompute", "streaming"):
        assert {"perplexity", "tokens", "ms_per_token", "peak_memory_bytes"} <= set(payload["settings"][strategy])
    assert plot.stat().st_size > 0
    assert "streaming" in capsys.readouterr().out


@pytest.mark.parametrize(
    "loading", [["--dtype", "float32"], ["--dtype", "bfloat16"], ["--head", "int8"], ["--no-fused"]]
)
def test_chat_reads_messages_from_stdin_and_outlives_its_cache(tiny_llama_dir, monkeypatch, capsys, loading):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("Hello there\n\nWhat is two plus two?\nAnd three?\n"))
    code = main(["chat", str(tiny_llama_dir), "--window", "24", "--max-new-tokens", "6", *loading])
    assert code == 0
    assert capsys.readouterr().out.count("assistant> ") == 3  # the blank line is skipped


@pytest.mark.parametrize(
    "argv, loaded",
    [
        (["chat"], "auto float"),
        (["serve"], "auto float"),
        (["eval"], "float32 float"),
        (["stream"], "float32 float"),
        (["eval", "--dtype", "auto"], "auto float"),
        (["serve", "--head", "int8"], "auto int8"),
    ],
)
def test_chat_and_serve_take_the_fastest_float_path_measurements_the_reference(monkeypatch, argv, loaded):
    import socket

    import leanlm.methods

    class Loaded(Exception):
        pass

    def load_any(source, dtype="float32", head="float", adapter=None, keep_freed_memory=False):
        raise Loaded(f"{dtype} {head}")

    monkeypatch.setattr(leanlm.methods, "load_any", load_any)
    monkeypatch.setenv("LEANLM_TRACEBACK", "1")
    with socket.socket() as probe:  # serve checks its address before loading: a free port
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(Loaded, match=f"^{loaded}$"):
        main([argv[0], "smollm2-135m", *argv[1:], *(["--port", str(port)] if argv[0] == "serve" else [])])


def test_stream_refuses_a_learned_position_model(tmp_path, smollm2_tokenizer, capsys):
    from tiny import tiny_model

    tiny_model("gpt2", vocab_size=len(smollm2_tokenizer)).save_pretrained(tmp_path)
    smollm2_tokenizer.save_pretrained(tmp_path)
    code = main(["stream", str(tmp_path), "--max-tokens", "300", "--window", "28", "--setting", "streaming"])
    assert code == 2
    assert "absolute position" in capsys.readouterr().err


def _finetune_argv(model_dir, data, out, *extra):
    return [
        "finetune",
        str(model_dir),
        "--method",
        "qlora",
        "--data",
        str(data),
        "--out",
        str(out),
        "--max-steps",
        "120",
        "--batch-size",
        "2",
        "--seq-len",
        "32",
        "--save-every",
        "2",
        "--rank",
        "4",
        *extra,
    ]


def test_finetune_killed_and_resumed_gives_the_same_adapters(tiny_llama_dir, tmp_path):
    """A real interruption: the training process is SIGKILLed after a checkpoint, then resumed."""
    import os
    import signal
    import subprocess
    import time

    import torch
    from safetensors.torch import load_file

    from leanlm.data import plain_text

    data = tmp_path / "train.txt"
    data.write_text("\n".join(plain_text("lambada-dev").splitlines()[:150]) + "\n")
    killed_out, whole_out = tmp_path / "killed", tmp_path / "whole"
    process = leanlm_process(
        *_finetune_argv(tiny_llama_dir, data, killed_out),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    state = killed_out / "checkpoint" / "trainer_state.json"

    def saved_step() -> int:
        try:  # the trainer replaces its checkpoint whole: the file can vanish between two reads
            return json.loads(state.read_text() or "{}").get("step", 0)
        except (FileNotFoundError, json.JSONDecodeError):
            return 0

    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and process.poll() is None:
        if saved_step() >= 6:
            break
        time.sleep(0.02)
    assert process.poll() is None, "training ended before it could be interrupted"
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    interrupted_at = max(
        json.loads((d / "trainer_state.json").read_text())["step"]
        for d in killed_out.iterdir()
        if (d / "trainer_state.json").is_file()
    )
    assert 6 <= interrupted_at < 120

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same arithmetic as the killed process
    try:
        assert main(_finetune_argv(tiny_llama_dir, data, killed_out, "--resume")) == 0
        assert main(_finetune_argv(tiny_llama_dir, data, whole_out, "--json", str(tmp_path / "f.json"))) == 0
    finally:
        torch.set_num_threads(threads)
    resumed = load_file(str(killed_out / "adapter_model.safetensors"))
    whole = load_file(str(whole_out / "adapter_model.safetensors"))
    assert resumed.keys() == whole.keys() and all(torch.equal(resumed[k], whole[k]) for k in whole)
    payload = json.loads((tmp_path / "f.json").read_text())
    assert {"train_loss_first", "train_loss_last", "eval_perplexity", "peak_memory_bytes", "steps"} <= set(payload)
    assert payload["steps"] == 120 and (whole_out / "adapter_config.json").is_file()


def test_merge_writes_a_float_model_with_the_adapters_folded_in(tiny_llama_dir, tmp_path):
    data = tmp_path / "train.txt"
    data.write_text("\n".join(f"line {i} of some text to learn from" for i in range(200)) + "\n")
    adapter = tmp_path / "adapter"
    assert main(_finetune_argv(tiny_llama_dir, data, adapter, "--max-steps", "3")) == 0
    assert main(["merge", str(tiny_llama_dir), "--adapter", str(adapter), "--out", str(tmp_path / "merged")]) == 0
    merged = load_model(str(tmp_path / "merged"))
    assert merged.model.model.layers[0].self_attn.q_proj.weight.shape == (64, 64)
    assert (
        main(
            [
                "merge",
                str(tiny_llama_dir),
                "--adapter",
                str(adapter),
                "--out",
                str(tmp_path / "q"),
                "--requantize",
                "nf4-dq",
            ]
        )
        == 0
    )
    assert main(["eval", str(tmp_path / "q"), "--tasks", "wikitext2", "--max-tokens", "256", "--seq-len", "64"]) == 0


@pytest.mark.parametrize(
    "method, options",
    [
        ("gptq", ["--bits", "4", "--group-size", "16", *SMALL_CALIBRATION]),
        ("spqr", ["--bits", "3", "--beta1", "16", "--beta2", "16", "--outlier-threshold", "0.2", *SMALL_CALIBRATION]),
        ("spqr", ["--bits", "4", "--beta1", "32", "--statistic-bits", "8", "--no-act-order", *SMALL_CALIBRATION]),
        ("rtn", ["--bits", "4", "--group-size", "0"]),  # reads no calibration text
    ],
)
def test_quantize_gptq_family_writes_a_reloadable_checkpoint(tiny_llama_dir, tmp_path, method, options):
    out = tmp_path / method
    assert main(["quantize", str(tiny_llama_dir), "--method", method, *options, "--out", str(out)]) == 0
    record = json.loads((out / "leanlm_quant.json").read_text())
    assert record["method"] == method and record["avg_bits"] > 0 and "outlier_rate" in record
    if "--no-act-order" in options:
        assert record["act_order"] is False and record["statistic_bits"] == 8 and record["group_size"] == 32
    assert main(["eval", str(out), "--tasks", "wikitext2", "--max-tokens", "256", "--seq-len", "64"]) == 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--method", "gptq", "--beta1", "16"], "--beta1 is not an option of --method gptq"),
        (["--method", "spqr", "--group-size", "16"], "--group-size is not an option of --method spqr"),
        (
            ["--method", "rtn", "--no-act-order"],
            "--no-act-order is not an option of --method rtn (it is one of gptq, spqr)",
        ),
        (["--method", "w8a8", "--bits", "4"], "--bits is not an option of --method w8a8"),
        (
            ["--method", "w8a8", "--group-size", "0", "--weight-granularity", "per_group"],
            "group_size must be at least 1",
        ),
    ],
)
def test_gptq_family_option_mistakes_are_named(tiny_llama_dir, tmp_path, capsys, argv, message):
    assert main(["quantize", str(tiny_llama_dir), *argv, "--out", str(tmp_path / "x")]) == 2
    assert message in capsys.readouterr().err


def test_quantize_with_a_cushion_writes_a_checkpoint_that_reattaches_it(tiny_llama_dir, tmp_path):
    out = tmp_path / "cushion"
    assert (
        main(
            [
                "quantize",
                str(tiny_llama_dir),
                "--method",
                "cushion",
                "--base",
                "smoothquant",
                "--level",
                "O3",
                "--cushion-candidates",
                "8",
                "--cushion-max-length",
                "1",
                "--cushion-min-improvement",
                "0",
                "--cushion-tune-steps",
                "2",
                "--calib-samples",
                "2",
                "--calib-seq-len",
                "32",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert (out / "cushion_tuning.png").is_file()
    record = json.loads((out / "leanlm_quant.json").read_text())
    assert record["method"] == "cushion+smoothquant" and record["level"] == "O3"
    assert record["cushion"]["length"] == 1 and (out / "cushion.safetensors").is_file()
    assert (
        main(["eval", str(out), "--tasks", "wikitext2,piqa", "--limit", "2", "--max-tokens", "256", "--seq-len", "64"])
        == 0
    )
    assert (
        main(
            ["quantize", str(tiny_llama_dir), "--method", "w8a8", "--base", "smoothquant", "--out", str(tmp_path / "x")]
        )
        == 2
    )


def test_bench_linear_and_model_write_json(tiny_llama_dir, tmp_path):
    assert main(["bench", "linear", "--size", "128", "--repeats", "1", "--json", str(tmp_path / "l.json")]) == 0
    linear = json.loads((tmp_path / "l.json").read_text())
    assert set(linear["rows"]) == {"1", "16", "64", "512"}
    assert linear["rows"]["1"]["nf4 block 64"]["relative_error"] < 0.2
    assert main(["bench", "model", str(tiny_llama_dir), "--repeats", "1", "--json", str(tmp_path / "m.json")]) == 0
    model = json.loads((tmp_path / "m.json").read_text())
    assert {"fp32", "bf16", "nf4 + double quant", "w8a8 O1"} == set(model["variants"])
    assert all(v["decode_ms_per_token"] > 0 for v in model["variants"].values())


def _one_line_error(capsys) -> str:
    error = capsys.readouterr().err
    assert "Traceback" not in error and error.startswith("leanlm: error: ") and error.count("\n") == 1, error
    return error


@pytest.fixture
def no_model_loading(monkeypatch):
    """Fails the test if a command loads a model: its input checks must come first."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad input was refused")

    monkeypatch.setattr("leanlm.models.load_model", refuse)


@pytest.mark.parametrize(
    "options, out, message",
    [
        (["--method", "kbit"], "/proc/x", "output directory /proc/x cannot be created"),
        (["--method", "kbit"], "FILE", "is an existing file"),
        (["--method", "kbit", "--block-size", "7"], "x", "block_size must be a power of two from 16 to 4096"),
        (["--method", "kbit", "--bits", "2"], "x", "bits must be between 3 and 8"),
        (["--method", "kbit", "--json", "/proc/x/r.json"], "x", "cannot write --json /proc/x/r.json"),
    ],
)
def test_quantize_refuses_bad_input_before_loading_the_model(tmp_path, capsys, no_model_loading, options, out, message):
    if out == "FILE":
        out = tmp_path / "file"
        out.write_text("x")
    code = main(["quantize", "smollm2-135m", *options, "--out", str(tmp_path / out if out == "x" else out)])
    assert code == 2 and message in _one_line_error(capsys)


@pytest.mark.parametrize(
    "content, message",
    [
        (b"\x00\x01\x02binary\xff", "is not UTF-8 text"),
        (b"too short\nfor a block\n", "the data fill 0 training and 0 held-out blocks"),
    ],
)
def test_finetune_refuses_bad_data_before_loading_the_model(
    tiny_llama_dir, tmp_path, capsys, no_model_loading, content, message
):
    data = tmp_path / "d.txt"
    data.write_bytes(content)
    assert main(["finetune", str(tiny_llama_dir), "--data", str(data), "--out", str(tmp_path / "a")]) == 2
    assert message in _one_line_error(capsys)


def _interrupt_at_write(monkeypatch, writes_before: int, fault=KeyboardInterrupt) -> None:
    """Ctrl-C (or another `fault`) as the out-of-core quantization writes its file number `writes_before` + 1."""
    from leanlm.methods import out_of_core

    save_file = out_of_core.save_file
    calls = []

    def interrupt(*args, **kwargs):
        calls.append(1)
        if len(calls) > writes_before:
            raise fault
        return save_file(*args, **kwargs)

    monkeypatch.setattr(out_of_core, "save_file", interrupt)


def test_ctrl_c_in_quantize_says_nothing_was_written(tiny_llama_dir, tmp_path, capsys, monkeypatch):
    _interrupt_at_write(monkeypatch, 0)
    out = tmp_path / "q"
    assert main(["quantize", str(tiny_llama_dir), "--method", "kbit", "--out", str(out)]) == 130
    error = capsys.readouterr().err
    assert "Traceback" not in error
    assert f"leanlm: interrupted; nothing was written to {out} (the partial output was removed)" in error
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".q", "q"))]


def test_ctrl_c_in_quantize_keeps_the_blocks_written_and_resume_finishes(tiny_llama_dir, tmp_path, capsys, monkeypatch):
    _interrupt_at_write(monkeypatch, 1)  # the first block is written, the second is not
    out = tmp_path / "q"
    argv = ["quantize", str(tiny_llama_dir), "--method", "kbit", "--out", str(out)]
    assert main(argv) == 130
    error = capsys.readouterr().err
    assert "Traceback" not in error
    assert f"{out} is not written yet; the 1 blocks done are kept in" in error and "add --resume" in error
    monkeypatch.undo()
    assert main(argv) == 2
    assert "add --resume to finish it" in capsys.readouterr().err
    assert main([*argv, "--resume"]) == 0
    assert "resuming .q.partial-resumable: 1 of 2 blocks already written" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith((".q", "q"))) == ["q"]
    assert load_quantized(out)[1]["method"] == "kbit"


def test_a_full_disk_in_quantize_is_one_line_and_keeps_the_blocks_for_resume(
    tiny_llama_dir, tmp_path, capsys, monkeypatch
):
    from safetensors import SafetensorError

    full = SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space" })')
    _interrupt_at_write(monkeypatch, 1, full)
    out = tmp_path / "q"
    argv = ["quantize", str(tiny_llama_dir), "--method", "kbit", "--out", str(out)]
    assert main(argv) == 1
    error = capsys.readouterr().err.strip().splitlines()[-1].split("\r")[-1]
    assert error.startswith("leanlm: error: the disk is full")
    assert "the 1 blocks done are kept in" in error and "add --resume" in error
    monkeypatch.undo()
    assert main([*argv, "--resume"]) == 0
    assert load_quantized(out)[1]["method"] == "kbit"


def test_ctrl_c_in_finetune_names_the_saved_step_and_resume(tiny_llama_dir, tmp_path):
    """A real SIGINT to a running `leanlm finetune`: exit 130, one line naming the checkpoint's step and --resume."""
    import signal
    import subprocess
    import time

    from leanlm.data import plain_text

    data = tmp_path / "train.txt"
    data.write_text("\n".join(plain_text("lambada-dev").splitlines()[:150]) + "\n")
    out = tmp_path / "adapter"
    process = leanlm_process(
        *_finetune_argv(tiny_llama_dir, data, out), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    state = out / "checkpoint" / "trainer_state.json"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and process.poll() is None and not state.is_file():
        time.sleep(0.02)
    assert process.poll() is None, "training ended before it could be interrupted"
    process.send_signal(signal.SIGINT)
    _, error = process.communicate(timeout=60)
    step = json.loads(state.read_text())["step"]
    assert process.returncode == 130 and "Traceback" not in error
    assert f"leanlm: interrupted; the checkpoint of step {step} is in {out}; add --resume" in error


def test_an_unexpected_failure_is_one_line_not_a_traceback(tiny_llama_dir, capsys, monkeypatch):
    def broken(*args, **kwargs):
        raise IndexError("index 3 is out of bounds")

    monkeypatch.setattr("leanlm.evaluation.evaluate", broken)
    assert main(["eval", str(tiny_llama_dir)]) == 1
    error = capsys.readouterr().err
    assert "\nleanlm: internal error: IndexError: index 3 is out of bounds (a bug" in error and "Traceback" not in error


def test_qlora_over_a_kbit_checkpoint_equals_qlora_over_the_float_model(tiny_llama_dir, tmp_path, capsys):
    """The out-of-core path to QLoRA: a k-bit checkpoint is the frozen base as it loads (no float model); its
    training is the one the float model quantized in memory gives, loss for loss."""
    from leanlm.data import plain_text

    data = tmp_path / "train.txt"
    data.write_text("\n".join(plain_text("lambada-dev").splitlines()[:60]) + "\n")
    assert (
        main(["quantize", str(tiny_llama_dir), "--method", "kbit", "--double-quant", "--out", str(tmp_path / "nf4")])
        == 0
    )
    runs = {}
    for name, model in (("checkpoint", tmp_path / "nf4"), ("float", tiny_llama_dir)):
        argv = [*_finetune_argv(model, data, tmp_path / f"adapter-{name}", "--json", str(tmp_path / f"{name}.json"))]
        argv[argv.index("--max-steps") + 1] = "4"
        assert main(argv) == 0
        runs[name] = json.loads((tmp_path / f"{name}.json").read_text())
    assert "over the k-bit checkpoint's base" in capsys.readouterr().out
    assert runs["checkpoint"]["losses"] == runs["float"]["losses"]
    assert runs["checkpoint"]["base_quantization"]["double_quant"] is True
    assert main(["quantize", str(tiny_llama_dir), "--method", "w8a8", "--out", str(tmp_path / "int8")]) == 0
    assert main(_finetune_argv(tmp_path / "int8", data, tmp_path / "adapter-int8")) == 2
    assert "QLoRA trains over a k-bit base" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, checkpointing, keep",
    [
        ([], True, False),
        (["--gradient-checkpointing"], True, False),
        (["--no-gradient-checkpointing", "--keep-freed-memory"], False, True),
    ],
)
def test_finetune_checkpoints_gradients_and_returns_freed_memory_by_default(argv, checkpointing, keep):
    from leanlm.cli.main import build_parser
    from leanlm.cli.options import settings_from_args
    from leanlm.training import FinetuneSettings

    args = build_parser().parse_args(["finetune", "m", "--data", "d", "--out", "o", *argv])
    settings = settings_from_args(FinetuneSettings, args)
    assert (settings.gradient_checkpointing, settings.keep_freed_memory) == (checkpointing, keep)
    # neither changes the numbers, so a run checkpointed one way resumes the other
    assert {"gradient_checkpointing", "keep_freed_memory"} <= FinetuneSettings.ignored_on_resume()


@pytest.mark.parametrize(
    "command, argv, keep",
    [
        ("serve", [], True),
        ("serve", ["--no-keep-freed-memory"], False),
        ("serve", ["--keep-freed-memory"], True),
        ("chat", ["--no-keep-freed-memory"], False),
        ("eval", [], False),
        ("eval", ["--keep-freed-memory"], True),
    ],
)
def test_chat_and_serve_keep_freed_memory_by_default_and_a_flag_gives_it_back(command, argv, keep):
    """The interactive commands read prompts again and again, so they keep freed memory for reuse; the batch ones
    keep resident memory to the live tensors `leanlm plan` counts."""
    from dataclasses import asdict

    from leanlm.cli.main import build_parser
    from leanlm.cli.options import settings_from_args
    from leanlm.models import INTERACTIVE_LOADING, LoadSettings

    args = build_parser().parse_args([command, "m", *argv])
    defaults = asdict(INTERACTIVE_LOADING) if command in ("chat", "serve") else None
    assert settings_from_args(LoadSettings, args, defaults).keep_freed_memory is keep
    if command == "eval":
        with pytest.raises(SystemExit):
            build_parser().parse_args([command, "m", "--no-keep-freed-memory"])


@pytest.mark.parametrize(
    "argv",
    [["quantize", "m", "--method", "smoothquant", "--out", "o"], ["finetune", "m", "--data", "d", "--out", "o"]],
)
def test_a_seed_beyond_64_bits_is_one_line(argv, capsys):
    assert main([*argv, "--seed", str(2**70)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"leanlm: error: --seed: seed must be a whole number from 0 to 2**63 - 1, got {2**70}"
    )


def test_imatrix_writes_llama_cpps_file_and_rtn_reads_it(tiny_llama_dir, tmp_path, capsys):
    from leanlm.formats.imatrix import read_imatrix

    out = tmp_path / "m.imatrix.gguf"
    assert main(["imatrix", str(tiny_llama_dir), "--out", str(out), "--samples", "2", "--seq-len", "16"]) == 0
    assert read_imatrix(out).counts["blk.0.attn_q.weight"] == 32
    assert main(["imatrix", str(tiny_llama_dir), "--out", str(out), "--samples", "2", "--seq-len", "16"]) == 2
    assert "--force" in capsys.readouterr().err  # an existing file is kept
    checkpoint = tmp_path / "q"
    arguments = ["quantize", str(tiny_llama_dir), "--method", "rtn", "--gguf-type", "q4_0", "--imatrix-file", str(out)]
    assert main([*arguments, "--out", str(checkpoint)]) == 0
    assert "Q4_0 x 14" in capsys.readouterr().out
