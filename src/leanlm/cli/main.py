"""`leanlm`: a thin command-line shell over the Python API (contract: CONTRACT.md)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from leanlm.errors import ConfigError, LeanLMError
from leanlm.evaluation import ALL_TASKS, EvalSettings
from leanlm.models import DEFAULT_MODEL
from leanlm.bench.harness import process_peak_rss_bytes
from leanlm.cli.options import add_method_options
from leanlm.report import format_table
from leanlm.storage import check_output_directory, staged_directory


def _whole_number(text: str, minimum: int, meaning: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected {meaning}, got {value}")
    return value


def _positive_int(text: str) -> int:
    return _whole_number(text, 1, "a positive number")


def _non_negative_int(text: str) -> int:
    return _whole_number(text, 0, "0 or more")


def _task_list(text: str) -> tuple[str, ...]:
    tasks = tuple(t.strip() for t in text.split(",") if t.strip())
    unknown = [t for t in tasks if t not in ALL_TASKS]
    if unknown or not tasks:
        raise argparse.ArgumentTypeError(
            f"unknown task(s) {', '.join(unknown) or '(none given)'}; choose from {','.join(ALL_TASKS)}"
        )
    return tasks


def _add_eval_options(parser: argparse.ArgumentParser, defaults: EvalSettings) -> None:
    parser.add_argument("--tasks", type=_task_list, default=defaults.tasks,
                        help=f"comma-separated, from {','.join(ALL_TASKS)} (default: {','.join(defaults.tasks)})")
    parser.add_argument("--limit", type=_positive_int, default=defaults.limit,
                        help="first N items of each zero-shot task")
    parser.add_argument("--max-tokens", type=_positive_int, default=defaults.max_tokens,
                        help="first N tokens of each perplexity text")
    parser.add_argument("--seq-len", type=_positive_int, default=defaults.seq_len,
                        help=f"perplexity window (default {defaults.seq_len})")
    parser.add_argument("--json", type=Path, help="write the results as one JSON object to this path")


def _settings(args) -> EvalSettings:
    return EvalSettings(tasks=args.tasks, limit=args.limit, max_tokens=args.max_tokens, seq_len=args.seq_len)


def _check_json_path(path: Path | None) -> None:
    """Refuse an unwritable --json before the work whose result it would hold."""
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"cannot write --json {path}: {error.strerror or error}") from None
    if path.is_dir():
        raise ConfigError(f"--json {path} is a directory; give a file path")


def _write_json(path: Path | None, payload: dict) -> None:
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=2) + "\n")
    except OSError as error:
        raise ConfigError(f"cannot write --json {path}: {error}") from error


def _task_rows(results: dict) -> list[list]:
    rows = []
    for task, metrics in results.items():
        if "perplexity" in metrics and "tokens" in metrics:
            rows.append([task, "perplexity", metrics["perplexity"], f"{metrics['tokens']} tokens",
                         f"{metrics['tokens_per_second']:.0f} tok/s"])
        for metric in ("acc", "acc_norm", "perplexity"):
            if metric in metrics and "n" in metrics:
                rows.append([task, metric, metrics[metric], f"{metrics['n']} items", ""])
    return rows


def command_eval(args) -> None:
    from leanlm.evaluation import evaluate
    from leanlm.methods import load_any

    settings = _settings(args)
    _check_json_path(args.json)
    loaded = load_any(args.model)
    payload = {"model": args.model, "weights_note": loaded.weights_note, **evaluate(loaded.model, loaded.tokenizer, settings)}
    payload["peak_rss_bytes"] = process_peak_rss_bytes()
    print(f"\nmodel: {args.model}" + (f" ({loaded.weights_note})" if loaded.weights_note else ""))
    print(format_table(["task", "metric", "value", "on", "speed"], _task_rows(payload["results"])))
    if payload["zero_shot_average"] is not None:
        print(f"zero-shot average acc: {payload['zero_shot_average']:.4f}")
    print(f"weights: {payload['weights_bytes'] / 2**20:.1f} MiB stored, peak resident memory "
          f"{payload['peak_rss_bytes'] / 2**20:.0f} MiB   time: {payload['seconds']:.1f} s")
    _write_json(args.json, payload)


def command_showcase(args) -> None:
    from leanlm.showcase import run_showcase, showcase_table

    _check_json_path(args.json)
    payload = run_showcase(args.model, _settings(args))
    settings = payload["settings"]
    print(f"\nleanlm showcase on {args.model}" + (f" ({payload['weights_note']})" if payload["weights_note"] else ""))
    print(f"WikiText-2: first {settings['max_tokens']} tokens in windows of {settings['seq_len']}; zero-shot "
          f"({', '.join(t for t in settings['tasks'] if t != 'wikitext2')}): first {settings['limit']} items of each; "
          f"calibration: {payload['calibration_samples']} windows of 512 tokens")
    print(showcase_table(payload))
    _write_json(args.json, payload)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value}")
    return value


def _describe(record: dict) -> str:
    """One line of what `quantize_` did, from its record."""
    parts = [record["method"]]
    if "level" in record:
        parts.append(f"{record['level']}, weights {record['weight_granularity']}")
    if record.get("smoothquant"):
        parts.append(f"alpha {record['smoothquant']['alpha']}")
    if record.get("avg_bits") is not None:
        parts.append(f"average {record['avg_bits']:.3f} bits per weight")
    if record.get("outlier_rate"):
        parts.append(f"{100 * record['outlier_rate']:.2f}% outliers")
    if record.get("cushion"):
        parts.append(f"cushion {record['cushion']['text']!r} ({record['cushion']['length']} tokens)")
    return ", ".join(parts)


def command_quantize(args) -> None:
    from dataclasses import replace

    from leanlm.cli.options import method_configs
    from leanlm.methods import quantize_, save_quantized
    from leanlm.models import load_model

    configs, calibration = method_configs(args)  # every option checked before the model loads
    check_output_directory(args.out)
    _check_json_path(args.json)
    loaded = load_model(args.model)
    record = quantize_(loaded.model, configs, calibration=replace(calibration, tokenizer=loaded.tokenizer))
    record["quantize_seconds"] = record["seconds"]
    out = save_quantized(loaded, loaded.model, record, args.out)
    curve = record.get("cushion", {}).get("tuning", {}).get("curve")
    if curve:  # an illustration beside the finished checkpoint, which does not need it
        from leanlm.report import plot_training_curves

        plot_training_curves({name: [point[name] for point in curve] for name in curve[0]},
                             out / "cushion_tuning.png", f"{args.model}: CushionCache prefix tuning")
    print(f"wrote {out} ({_describe(record)}) in {record['seconds']:.0f} s")
    _write_json(args.json, {"method": record["method"], "avg_bits": record.get("avg_bits"),
                            "peak_rss_bytes": process_peak_rss_bytes(), "seconds": record["seconds"],
                            "record": record})


def command_analyze(args) -> None:
    from leanlm.data import calibration_batches
    from leanlm.evaluation.outliers import analyze_outliers, plot_outliers, smoothing_view
    from leanlm.models import load_model

    loaded = load_model(args.model)
    batches = calibration_batches(loaded.tokenizer, n_samples=args.samples, seq_len=args.seq_len, source=args.text)
    report = analyze_outliers(loaded.model, batches)
    payload = {"model": args.model, "weights_note": loaded.weights_note,
               "samples": args.samples, "seq_len": args.seq_len, "text": args.text, **report.as_dict()}
    print(f"\noutlier features of {args.model} (|x| >= 6 in >= 25% of layers and >= 6% of positions): "
          f"{report.outlier_dims or 'none'}")
    print(f"layers affected: {report.layers_affected_pct:.1f}%   positions affected: "
          f"{report.tokens_affected_pct:.1f}%   largest magnitude: {report.max_magnitude:.1f}")
    if args.plot:
        view = smoothing_view(loaded.model, batches[:2], report, alpha=0.5)
        title = args.model + (f" ({loaded.weights_note})" if loaded.weights_note else "")
        plot_outliers(report, args.plot, title, view)
        print(f"plot: {args.plot}")
    _write_json(args.json, payload)


def command_stream(args) -> None:
    from leanlm.evaluation.streaming import STRATEGIES, StreamSettings, plot_stream, stream_evaluate
    from leanlm.methods import load_any

    settings = StreamSettings(sinks=args.sinks, window=args.window, max_tokens=args.max_tokens, chunk=args.chunk,
                              recompute_tokens=args.recompute_tokens, latency_steps=args.latency_steps,
                              strategies=tuple(dict.fromkeys(args.setting or STRATEGIES)))
    loaded = load_any(args.model)
    results = stream_evaluate(loaded.model, loaded.tokenizer, settings)
    payload = {"model": args.model, "weights_note": loaded.weights_note, **results}
    title = (f"{args.model}: {settings.max_tokens}-token stream, cache {settings.cache_size} tokens "
             f"(streaming: {settings.sinks} sinks + {settings.window}), chunk {settings.chunk}"
             + (f" ({loaded.weights_note})" if loaded.weights_note else ""))
    print(f"\n{title}")
    rows = []
    for strategy in settings.strategies:
        entry = results["settings"][strategy]
        rows.append([strategy, entry["perplexity"], entry["tokens"], entry.get("perplexity_on_recompute_targets"),
                     entry["ms_per_token"], entry["peak_memory_bytes"] / 2**20,
                     entry.get("stopped") or entry.get("scored") or ""])
    start, stop = results["recompute_targets"]
    print(format_table(["strategy", "perplexity", "tokens", f"ppl on tokens {start}-{stop}", "ms/token",
                        "peak MiB", "note"], rows))
    if args.plot:
        plot_stream(results, args.plot, title)
        print(f"plot: {args.plot}")
    _write_json(args.json, payload)


def command_chat(args) -> None:
    from leanlm.chat import ChatSettings, StreamingChat
    from leanlm.methods import load_any
    from leanlm.methods.streaming import StreamingConfig

    settings = ChatSettings(streaming=StreamingConfig(sinks=args.sinks, window=args.window),
                            max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed)
    loaded = load_any(args.model)
    chat = StreamingChat(loaded.model, loaded.tokenizer, settings)
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"chatting with {args.model} (cache: {args.sinks} sinks + {args.window} recent tokens); Ctrl-D ends")
    while True:
        if interactive:
            print("you> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:
            break
        if not line.strip():
            continue
        print("assistant> ", end="", flush=True)
        chat.reply(line.strip(), on_text=lambda piece: print(piece, end="", flush=True))
        print(flush=True)


def command_finetune(args) -> None:
    import torch

    from leanlm.methods import LoRAConfig, add_lora_
    from leanlm.models import load_model, load_tokenizer
    from leanlm.storage import writable_directory
    from leanlm.training import FinetuneSettings, finetune, read_documents, training_blocks

    if args.method == "lora" and args.base not in (None, "float"):
        raise ConfigError(f"--method lora trains over a float base; use --method qlora for --base {args.base}")
    lora = LoRAConfig(base="float" if args.method == "lora" else (args.base or "nf4-dq"), rank=args.rank,
                      alpha=args.lora_alpha, dropout=args.dropout)
    settings = FinetuneSettings(
        max_steps=args.max_steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
        held_out_fraction=args.held_out, save_every=args.save_every, seed=args.seed,
        gradient_checkpointing=args.gradient_checkpointing, optimizer_bits=args.optimizer_bits)
    documents = read_documents(args.data)
    writable_directory(args.out)
    # Data too short for one block fails here, in seconds, not after the model has loaded.
    training_blocks(load_tokenizer(args.model), documents, settings.seq_len, settings.held_out_fraction, settings.seed,
                    settings.max_eval_blocks)
    loaded = load_model(args.model)
    torch.manual_seed(args.seed)
    setup = add_lora_(loaded.model, lora)
    print(f"{lora.method}: {setup['trainable_parameters']:,} trainable parameters over a {lora.base} base"
          + (f" ({loaded.weights_note})" if loaded.weights_note else ""))
    record = finetune(loaded.model, loaded.tokenizer, documents, settings, lora, args.out, args.model,
                      resume=args.resume)
    payload = {"model": args.model, "weights_note": loaded.weights_note, "data": str(args.data),
               "base_quantization": setup["base_quantization"], **record}
    print(f"steps {record['steps']}: train loss {record['train_loss_first']:.3f} -> {record['train_loss_last']:.3f}, "
          f"held-out perplexity {record['eval_perplexity']:.3f}, peak memory {record['peak_memory_bytes'] / 2**20:.0f} "
          f"MiB, {record['tokens_per_second']:.0f} tokens/s; adapter in {args.out}")
    _write_json(args.json, payload)
    _write_json(args.out / "leanlm_finetune.json", payload)


def command_merge(args) -> None:
    from leanlm.methods import LORA_BASES, add_lora_, load_adapters_, merge_lora_, save_quantized
    from leanlm.methods.qlora import read_adapter_config
    from leanlm.models import load_model

    lora = read_adapter_config(args.adapter)
    check_output_directory(args.out)
    loaded = load_model(args.model)
    add_lora_(loaded.model, lora)
    load_adapters_(loaded.model, args.adapter)
    requantize = LORA_BASES[args.requantize] if args.requantize else None
    record = merge_lora_(loaded.model, requantize)
    if requantize is None:
        with staged_directory(args.out) as staging:
            loaded.model.save_pretrained(staging)
            loaded.tokenizer.save_pretrained(staging)
    else:
        save_quantized(loaded, loaded.model, {"method": "kbit", **record, "lora_base": lora.base}, args.out)
        print(f"re-quantized to {args.requantize}: relative weight error {record['requantization_relative_error']:.5f}")
    print(f"merged adapters from {args.adapter} into {args.out}")


def command_swarm(args) -> None:
    from leanlm.swarm import SwarmModelConfig, SwarmRun, SwarmSettings, run_local_swarm

    if args.peers < args.stages:
        raise ConfigError(f"--peers {args.peers} cannot serve {args.stages} stages (at least one peer per stage)")
    settings = SwarmSettings(model=SwarmModelConfig(stages=args.stages), micro_batch=args.micro_batch,
                             target_batch=args.target_batch, in_flight=args.in_flight,
                             compress=not args.no_compression, rebalance_seconds=args.rebalance_seconds)
    run = SwarmRun(settings, peers=args.peers, trainers=args.trainers, max_steps=args.max_steps,
                   max_seconds=args.max_seconds)
    record = run_local_swarm(run)
    print(f"swarm: {record['steps']} optimizer steps in {record['seconds']:.0f} s, loss {record['loss_first']} -> "
          f"{record['loss_last']}, {record['samples_per_second']:.2f} samples/s, {record['peers_failed']} peers failed")
    _write_json(args.json, record)


def command_bench(args) -> None:
    from leanlm.bench.suites import linear_suite, model_suite

    if args.suite == "linear":
        payload = {"suite": "linear", **linear_suite(args.size, repeats=args.repeats)}
        rows = [[f"M={m}", name, entry["median_ms"], entry["speedup_vs_fp32"], entry["relative_error"]]
                for m, variants in payload["rows"].items() for name, entry in variants.items()]
        print(format_table(["rows", "linear", "median ms", "x fp32", "rel. error"], rows))
    elif args.suite == "model":
        from leanlm.models import load_model

        loaded = load_model(args.model)
        payload = {"suite": "model", "model": args.model, "weights_note": loaded.weights_note,
                   **model_suite(loaded, repeats=args.repeats)}
        rows = [[name, entry["tokens_per_second"], entry["decode_ms_per_token"], entry["weight_bytes"] / 2**20]
                for name, entry in payload["variants"].items()]
        print(format_table(["model", "prefill tok/s", "decode ms/token", "weights MiB"], rows))
    else:
        from leanlm.evaluation.streaming import StreamSettings, stream_evaluate
        from leanlm.methods import load_any

        loaded = load_any(args.model)
        settings = StreamSettings(max_tokens=args.stream_tokens, latency_steps=256, recompute_tokens=16)
        payload = {"suite": "stream", "model": args.model, **stream_evaluate(loaded.model, loaded.tokenizer, settings)}
        rows = [[name, r["perplexity"], r["ms_per_token"], r["peak_memory_bytes"] / 2**20]
                for name, r in payload["settings"].items()]
        print(format_table(["strategy", "perplexity", "ms/token", "peak MiB"], rows))
    _write_json(args.json, payload)


def build_parser() -> argparse.ArgumentParser:
    from leanlm.showcase import QUICK_SETTINGS

    parser = argparse.ArgumentParser(prog="leanlm", description="Cheap LLM inference and fine-tuning on the hardware you have.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    evaluate = commands.add_parser("eval", help="perplexity and zero-shot accuracy of a model")
    evaluate.add_argument("model", help=f"registry name (default model: {DEFAULT_MODEL}), model directory or .gguf file")
    _add_eval_options(evaluate, EvalSettings())
    evaluate.set_defaults(handler=command_eval)

    quantize = commands.add_parser("quantize", help="quantize a model and write a reloadable checkpoint")
    quantize.add_argument("model", help="registry name, model directory or .gguf file")
    add_method_options(quantize)
    quantize.add_argument("--out", type=Path, required=True, help="directory for the checkpoint")
    quantize.add_argument("--json", type=Path, help="write method, avg_bits, peak_rss_bytes and seconds as JSON")
    quantize.set_defaults(handler=command_quantize, interrupted=_nothing_written)

    analyze = commands.add_parser("analyze", help="activation outlier features (LLM.int8() section 2.3)")
    analyze.add_argument("model", help="registry name, model directory or .gguf file")
    analyze.add_argument("--samples", type=_positive_int, default=8, help="text windows analysed")
    analyze.add_argument("--seq-len", type=_positive_int, default=512)
    analyze.add_argument("--text", choices=["lambada-dev", "lambada-test", "lee"], default="lambada-dev")
    analyze.add_argument("--json", type=Path, help="write the report as one JSON object to this path")
    analyze.add_argument("--plot", type=Path, help="write a PNG: channel heat map + before/after SmoothQuant")
    analyze.set_defaults(handler=command_analyze)

    stream = commands.add_parser("stream", help="streaming perplexity, latency and memory over a long text "
                                 "(dense, window, re-computation, StreamingLLM)")
    stream.add_argument("model", help="registry name, model directory, .gguf file or quantized checkpoint")
    stream.add_argument("--sinks", type=_non_negative_int, default=4, help="StreamingLLM's attention sinks (default 4)")
    stream.add_argument("--window", type=_positive_int, default=1020,
                        help="recent tokens StreamingLLM keeps (default 1020); window attention and re-computation "
                             "get sinks + window tokens")
    stream.add_argument("--max-tokens", type=_positive_int, default=100_000,
                        help="stream length: WikiText-2 test then LAMBADA test text (default 100000)")
    stream.add_argument("--chunk", type=_positive_int, default=32,
                        help="tokens per forward for the cache strategies; 1 = token by token (default 32)")
    stream.add_argument("--recompute-tokens", type=_positive_int, default=64,
                        help="targets scored by sliding window with re-computation (default 64)")
    stream.add_argument("--latency-steps", type=_positive_int, default=2048,
                        help="single-token decode steps timed for the latency curve (default 2048)")
    stream.add_argument("--setting", action="append", choices=["dense", "window", "recompute", "streaming"],
                        help="run only this setting (repeatable; default: all four)")
    stream.add_argument("--json", type=Path, help="write the results as one JSON object to this path")
    stream.add_argument("--plot", type=Path, help="write a PNG: windowed perplexity and per-token latency")
    stream.set_defaults(handler=command_stream)

    chat = commands.add_parser("chat", help="multi-round chat that never runs out of context (StreamingLLM); "
                               "reads one message per line from stdin when it is not a terminal")
    chat.add_argument("model", nargs="?", default=DEFAULT_MODEL, help=f"an instruct model (default {DEFAULT_MODEL})")
    chat.add_argument("--sinks", type=_non_negative_int, default=4)
    chat.add_argument("--window", type=_positive_int, default=2000, help="recent tokens kept (default 2000)")
    chat.add_argument("--max-new-tokens", type=_positive_int, default=256)
    chat.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    chat.add_argument("--seed", type=int, default=0)
    chat.set_defaults(handler=command_chat)

    finetune = commands.add_parser("finetune", help="LoRA / QLoRA fine-tuning; writes a PEFT adapter")
    finetune.add_argument("model", help="registry name, model directory or .gguf file")
    finetune.add_argument("--method", choices=["qlora", "lora"], default="qlora",
                          help="qlora: adapters over a frozen 4-bit base; lora: over the float base")
    finetune.add_argument("--base", choices=["nf4-dq", "nf4", "fp4", "int4", "float"],
                          help="qlora: the base's 4-bit format (default nf4-dq: NF4 + double quantization)")
    finetune.add_argument("--data", type=Path, required=True,
                          help="plain text (one document per line) or JSONL (text / messages / instruction+output)")
    finetune.add_argument("--out", type=Path, required=True, help="directory for the adapter and checkpoints")
    finetune.add_argument("--max-steps", type=_positive_int, default=200)
    finetune.add_argument("--batch-size", type=_positive_int, default=4)
    finetune.add_argument("--seq-len", type=_positive_int, default=256)
    finetune.add_argument("--lr", type=_positive_float, default=2e-4)
    finetune.add_argument("--rank", type=_positive_int, default=16, help="LoRA r (default 16)")
    finetune.add_argument("--lora-alpha", type=_positive_float, default=16.0, help="scale s = alpha / r")
    finetune.add_argument("--dropout", type=float, default=0.05, help="LoRA dropout on the adapter path")
    finetune.add_argument("--held-out", type=float, default=0.05, help="share of documents held out (default 0.05)")
    finetune.add_argument("--save-every", type=_positive_int, default=50, help="steps between checkpoints")
    finetune.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    finetune.add_argument("--gradient-checkpointing", action="store_true",
                          help="recompute block activations in backward (less memory, ~30%% more time)")
    finetune.add_argument("--optimizer-bits", type=int, choices=[8, 32], default=8,
                          help="AdamW moment storage: block-wise 8-bit (default) or float32")
    finetune.add_argument("--seed", type=int, default=0)
    finetune.add_argument("--json", type=Path, help="write the results as one JSON object to this path")
    finetune.set_defaults(handler=command_finetune, interrupted=_finetune_interrupted)

    merge = commands.add_parser("merge", help="fold LoRA adapters into the de-quantized base weights")
    merge.add_argument("model", help="the base the adapter was trained on (registry name, directory, .gguf)")
    merge.add_argument("--adapter", type=Path, required=True, help="a PEFT-format adapter directory")
    merge.add_argument("--out", type=Path, required=True, help="directory for the merged model")
    merge.add_argument("--requantize", choices=["nf4-dq", "nf4", "fp4", "int4"],
                       help="re-quantize the merged weights (reports the error it adds); default: float32")
    merge.set_defaults(handler=command_merge, interrupted=_nothing_written)

    bench = commands.add_parser("bench", help="quick side-by-side measurements (the full studies are the scripts "
                                "in benchmarks/)")
    bench.add_argument("suite", choices=["linear", "model", "stream"],
                       help="linear: one size x size layer at M = 1/16/64/512 (fp32, w8a8, llm-int8, nf4); model: "
                            "prefill and decode speed of fp32 / nf4+dq / w8a8; stream: the StreamingLLM strategies")
    bench.add_argument("model", nargs="?", default=DEFAULT_MODEL, help="for model and stream (default: the default model)")
    bench.add_argument("--size", type=_positive_int, default=4096, help="linear: in = out features")
    bench.add_argument("--repeats", type=_positive_int, default=5)
    bench.add_argument("--stream-tokens", type=_positive_int, default=8192, help="stream: length of the stream")
    bench.add_argument("--json", type=Path, help="write the results as one JSON object to this path")
    bench.set_defaults(handler=command_bench)

    swarm = commands.add_parser("swarm", help="SWARM parallelism: a local swarm of pipeline peers and trainers on "
                                "127.0.0.1 (hivemind), training a small byte-level LM on the shipped text")
    swarm.add_argument("--stages", type=_positive_int, default=3)
    swarm.add_argument("--peers", type=_positive_int, default=6, help="peer processes, stages assigned round-robin")
    swarm.add_argument("--trainers", type=_positive_int, default=2)
    swarm.add_argument("--max-steps", type=_positive_int, default=20, help="optimizer steps of the slowest stage")
    swarm.add_argument("--max-seconds", type=_positive_float, default=300.0, help="stop after this long in any case")
    swarm.add_argument("--micro-batch", type=_positive_int, default=4)
    swarm.add_argument("--target-batch", type=_positive_int, default=32, help="samples per optimizer step of a stage")
    swarm.add_argument("--in-flight", type=_positive_int, default=4,
                       help="micro-batches each trainer keeps in the pipeline at once")
    swarm.add_argument("--rebalance-seconds", type=float, default=10.0, help="T of adaptive rebalancing; 0 = off")
    swarm.add_argument("--no-compression", action="store_true", help="send float32 activations and gradients")
    swarm.add_argument("--json", type=Path, help="write the results as one JSON object to this path")
    swarm.set_defaults(handler=command_swarm)

    showcase = commands.add_parser("showcase", help="every leanlm method side by side on one model, in minutes")
    showcase.add_argument("model", nargs="?", default=DEFAULT_MODEL, help=f"default: {DEFAULT_MODEL}")
    _add_eval_options(showcase, QUICK_SETTINGS)
    showcase.set_defaults(handler=command_showcase)
    return parser


def _nothing_written(args) -> str:
    return f"nothing was written to {args.out} (the partial output was removed); run the same command to start again"


def _finetune_interrupted(args) -> str:
    from leanlm.training.finetune import last_checkpoint_step

    step = last_checkpoint_step(args.out)
    if step is None:
        return (f"no checkpoint was written yet (one every --save-every {args.save_every} steps); run the same "
                "command to start again")
    return f"the checkpoint of step {step} is in {args.out}; add --resume to the same command to continue from it"


INTERRUPTED = 130  # the shell's code for a process ended by SIGINT


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="leanlm: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        args.handler(args)
    except LeanLMError as error:
        # One line, whatever a library below put into the message.
        print(f"leanlm: error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        where = getattr(args, "interrupted", None)
        print("\nleanlm: interrupted" + (f"; {where(args)}" if where else ""), file=sys.stderr)
        return INTERRUPTED
    except OSError as error:  # the disk filled up, a file vanished, a path became unreadable mid-run
        print(f"leanlm: error: {error.strerror or error}" + (f": {error.filename}" if error.filename else ""),
              file=sys.stderr)
        return 1
    except Exception as error:  # a bug: one line for the user, the traceback on request
        if os.environ.get("LEANLM_TRACEBACK"):
            raise
        print(f"leanlm: internal error: {type(error).__name__}: {error} (a bug in leanlm; run again with "
              "LEANLM_TRACEBACK=1 to see where)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
