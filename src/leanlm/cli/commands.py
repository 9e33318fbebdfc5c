"""What each `leanlm` command does: read its settings from the parsed flags (`leanlm.cli.options`), check its
paths before anything slow, call the Python API, print a short table and write `--json`."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

from leanlm.bench.harness import process_peak_rss_bytes
from leanlm.cli.options import settings_from_args
from leanlm.errors import ConfigError
from leanlm.evaluation import EvalSettings
from leanlm.report import format_table
from leanlm.storage import (
    check_output_directory,
    check_output_file,
    staged_directory,
    staged_file,
    write_text_atomically,
)


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
    """Write --json beside its place and rename it into it: a reader never sees half of it."""
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomically(path, json.dumps(payload, indent=2) + "\n")
    except OSError as error:
        raise ConfigError(f"cannot write --json {path}: {error}") from error


def _task_rows(results: dict) -> list[list]:
    rows = []
    for task, metrics in results.items():
        if "perplexity" in metrics and "tokens" in metrics:
            rows.append(
                [
                    task,
                    "perplexity",
                    metrics["perplexity"],
                    f"{metrics['tokens']} tokens",
                    f"{metrics['tokens_per_second']:.0f} tok/s",
                ]
            )
        for metric in ("acc", "acc_norm", "perplexity"):
            if metric in metrics and "n" in metrics:
                rows.append([task, metric, metrics[metric], f"{metrics['n']} items", ""])
    return rows


def command_eval(args) -> None:
    from leanlm.evaluation import evaluate
    from leanlm.methods import load_any
    from leanlm.models import LoadSettings

    settings = settings_from_args(EvalSettings, args)
    loading = settings_from_args(LoadSettings, args)
    _check_json_path(args.json)
    loaded = load_any(
        args.model, loading.dtype, loading.head, loading.one_adapter(args.command), loading.keep_freed_memory
    )
    payload = {
        "model": args.model,
        "weights_note": loaded.weights_note,
        "dtype": loaded.dtype,
        **evaluate(loaded.model, loaded.tokenizer, settings),
    }
    payload["peak_rss_bytes"] = process_peak_rss_bytes()
    print(
        f"\nmodel: {args.model}, computing in {payload['dtype']}"
        + (f" ({loaded.weights_note})" if loaded.weights_note else "")
    )
    print(format_table(["task", "metric", "value", "on", "speed"], _task_rows(payload["results"])))
    if payload["zero_shot_average"] is not None:
        print(f"zero-shot average acc: {payload['zero_shot_average']:.4f}")
    print(
        f"weights: {payload['weights_bytes'] / 2**20:.1f} MiB stored, peak resident memory "
        f"{payload['peak_rss_bytes'] / 2**20:.0f} MiB   time: {payload['seconds']:.1f} s"
    )
    _write_json(args.json, payload)


def command_showcase(args) -> None:
    from dataclasses import asdict

    from leanlm.showcase import QUICK_SETTINGS, run_showcase, showcase_table

    _check_json_path(args.json)
    payload = run_showcase(args.model, settings_from_args(EvalSettings, args, asdict(QUICK_SETTINGS)))
    settings = payload["settings"]
    print(f"\nleanlm showcase on {args.model}" + (f" ({payload['weights_note']})" if payload["weights_note"] else ""))
    print(
        f"WikiText-2: first {settings['max_tokens']} tokens in windows of {settings['seq_len']}; zero-shot "
        f"({', '.join(t for t in settings['tasks'] if t != 'wikitext2')}): first {settings['limit']} items of each; "
        f"calibration: {payload['calibration_samples']} windows of 512 tokens"
    )
    print(showcase_table(payload))
    _write_json(args.json, payload)


def _describe(record: dict) -> str:
    """One line of what `quantize_` did, from its record."""
    parts = [record["method"]]
    if "level" in record:
        parts.append(f"{record['level']}, weights {record['weight_granularity']}")
    if record.get("smoothquant"):
        parts.append(f"alpha {record['smoothquant']['alpha']}")
    if record.get("avg_bits") is not None:
        parts.append(f"average {record['avg_bits']:.3f} bits per weight")
    if record.get("tensor_types"):  # GGUF block types: how many linears took each (the map is in the record)
        counts = Counter(record["tensor_types"].values())
        parts.append("GGUF " + " / ".join(f"{name.upper()} x {count}" for name, count in sorted(counts.items())))
    if record.get("outlier_rate"):
        parts.append(f"{100 * record['outlier_rate']:.2f}% outliers")
    if record.get("cushion"):
        parts.append(f"cushion {record['cushion']['text']!r} ({record['cushion']['length']} tokens)")
    return ", ".join(parts)


def command_quantize(args) -> None:
    from leanlm.cli.options import method_configs
    from leanlm.methods.checkpoint import check_table_dtype
    from leanlm.methods.out_of_core import quantize_checkpoint
    from leanlm.plan import check_quantizing

    configs, calibration = method_configs(args)  # every option checked before the model loads
    check_table_dtype(args.table_dtype, "--table-dtype")
    check_output_directory(args.out)
    _check_json_path(args.json)
    warning = check_quantizing(args.model, configs)  # refuses what the config rules out
    if warning:
        print(warning, flush=True)
    out, record = quantize_checkpoint(
        args.model,
        configs,
        args.out,
        calibration=calibration,
        resume=args.resume,
        table_dtype=args.table_dtype,
        say=lambda line: print(line, flush=True),
    )
    record["quantize_seconds"] = record["seconds"]
    curve = record.get("cushion", {}).get("tuning", {}).get("curve")
    if curve:  # an illustration beside the finished checkpoint, which does not need it
        from leanlm.report import plot_training_curves

        plot_training_curves(
            {name: [point[name] for point in curve] for name in curve[0]},
            out / "cushion_tuning.png",
            f"{args.model}: CushionCache prefix tuning",
        )
    print(f"wrote {out} ({_describe(record)}) in {record['seconds']:.0f} s")
    _write_json(
        args.json,
        {
            "method": record["method"],
            "avg_bits": record.get("avg_bits"),
            "peak_rss_bytes": process_peak_rss_bytes(),
            "seconds": record["seconds"],
            "record": record,
        },
    )


def command_plan(args) -> None:
    from leanlm.plan import PlanSettings, plan_model, plan_table

    settings = settings_from_args(PlanSettings, args)
    _check_json_path(args.json)
    payload = plan_model(args.model, settings)
    print(
        f"{args.model}: {payload['parameters'] / 1e9:.2f} B parameters, {payload['layers']} layers; memory "
        f"{payload['memory_bytes'] / 2**30:.2f} GiB ({payload['memory_from']})"
    )
    print(plan_table(payload))
    _write_json(args.json, payload)


def command_analyze(args) -> None:
    from leanlm.data import calibration_batches
    from leanlm.evaluation.outliers import analyze_outliers, plot_outliers, smoothing_view
    from leanlm.models import load_model

    loaded = load_model(args.model)
    batches = calibration_batches(loaded.tokenizer, n_samples=args.samples, seq_len=args.seq_len, source=args.text)
    report = analyze_outliers(loaded.model, batches)
    payload = {
        "model": args.model,
        "weights_note": loaded.weights_note,
        "samples": args.samples,
        "seq_len": args.seq_len,
        "text": args.text,
        **report.as_dict(),
    }
    print(
        f"\noutlier features of {args.model} (|x| >= 6 in >= 25% of layers and >= 6% of positions): "
        f"{report.outlier_dims or 'none'}"
    )
    print(
        f"layers affected: {report.layers_affected_pct:.1f}%   positions affected: "
        f"{report.tokens_affected_pct:.1f}%   largest magnitude: {report.max_magnitude:.1f}"
    )
    if args.plot:
        view = smoothing_view(loaded.model, batches[:2], report, alpha=0.5)
        title = args.model + (f" ({loaded.weights_note})" if loaded.weights_note else "")
        plot_outliers(report, args.plot, title, view)
        print(f"plot: {args.plot}")
    _write_json(args.json, payload)


def command_imatrix(args) -> None:
    from leanlm.data import calibration_batches
    from leanlm.formats.imatrix import write_imatrix
    from leanlm.methods.calibration import collect_importance
    from leanlm.models import load_model

    out = check_output_file(args.out, force=args.force)
    loaded = load_model(args.model)
    batches = calibration_batches(loaded.tokenizer, n_samples=args.samples, seq_len=args.seq_len, source=args.text)
    matrix = collect_importance(loaded.model, batches, source=args.text)
    with staged_file(out) as partial:
        write_imatrix(partial, matrix)
    print(f"wrote {out} ({len(matrix.sums)} weights, {args.samples} windows of {args.seq_len} tokens of {args.text})")


def command_stream(args) -> None:
    from leanlm.evaluation.streaming import StreamSettings, plot_stream, stream_evaluate
    from leanlm.methods import load_any
    from leanlm.models import LoadSettings

    settings = settings_from_args(StreamSettings, args)
    loading = settings_from_args(LoadSettings, args)
    loaded = load_any(
        args.model, loading.dtype, loading.head, loading.one_adapter(args.command), loading.keep_freed_memory
    )
    results = stream_evaluate(loaded.model, loaded.tokenizer, settings)
    payload = {"model": args.model, "weights_note": loaded.weights_note, **results}
    title = (
        f"{args.model}: {settings.max_tokens}-token stream, cache {settings.cache_size} tokens "
        f"(streaming: {settings.sinks} sinks + {settings.window}), chunk {settings.chunk}"
        + (f" ({loaded.weights_note})" if loaded.weights_note else "")
    )
    print(f"\n{title}")
    rows = []
    for strategy in settings.strategies:
        entry = results["settings"][strategy]
        rows.append(
            [
                strategy,
                entry["perplexity"],
                entry["tokens"],
                entry.get("perplexity_on_recompute_targets"),
                entry["ms_per_token"],
                entry["peak_memory_bytes"] / 2**20,
                entry.get("stopped") or entry.get("scored") or "",
            ]
        )
    start, stop = results["recompute_targets"]
    print(
        format_table(
            ["strategy", "perplexity", "tokens", f"ppl on tokens {start}-{stop}", "ms/token", "peak MiB", "note"], rows
        )
    )
    if args.plot:
        plot_stream(results, args.plot, title)
        print(f"plot: {args.plot}")
    _write_json(args.json, payload)


def command_chat(args) -> None:
    from dataclasses import asdict

    from leanlm.chat import ChatSettings, StreamingChat
    from leanlm.methods import load_any
    from leanlm.methods.streaming import StreamingConfig
    from leanlm.models import INTERACTIVE_LOADING, LoadSettings

    streaming = settings_from_args(StreamingConfig, args, asdict(ChatSettings().streaming))
    settings = settings_from_args(ChatSettings, args, {"streaming": streaming})
    loading = settings_from_args(LoadSettings, args, asdict(INTERACTIVE_LOADING))
    loaded = load_any(
        args.model, loading.dtype, loading.head, loading.one_adapter(args.command), loading.keep_freed_memory
    )
    chat = StreamingChat(loaded.model, loaded.tokenizer, settings)
    interactive = sys.stdin.isatty()
    if interactive:
        decoder = "leanlm's fused step" if chat.fused is not None else "transformers' forward"
        print(
            f"chatting with {args.model} in {loaded.dtype} (cache: {streaming.sinks} sinks + "
            f"{streaming.window} recent tokens; decoding through {decoder}); Ctrl-D ends"
        )
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


def command_serve(args) -> None:
    from dataclasses import asdict

    from leanlm.methods.streaming import StreamingConfig
    from leanlm.models import INTERACTIVE_LOADING, LoadSettings
    from leanlm.serve import ServeSettings, serve

    streaming = settings_from_args(StreamingConfig, args, asdict(ServeSettings().streaming))
    serve(
        args.model,
        settings_from_args(ServeSettings, args, {"streaming": streaming}),
        settings_from_args(LoadSettings, args, asdict(INTERACTIVE_LOADING)),
    )


def command_finetune(args) -> None:
    import torch

    from leanlm.memory import return_freed_memory_at_once
    from leanlm.methods import LORA_BASES, LoRAConfig, add_lora_, is_quantized_checkpoint, load_any
    from leanlm.methods.checkpoint import method_record, read_record
    from leanlm.methods.out_of_core import load_quantizing
    from leanlm.models import load_tokenizer
    from leanlm.models.loading import read_tokenizer
    from leanlm.storage import writable_directory
    from leanlm.training import FinetuneSettings, finetune, read_documents, training_blocks
    from leanlm.training.finetune import check_resumable, data_fingerprint, last_checkpoint_step

    lora = settings_from_args(LoRAConfig, args, {"base": "float"} if args.method == "lora" else {})
    if args.method == "lora" and lora.base != "float":
        raise ConfigError(f"--method lora trains over a float base; use --method qlora for --base {lora.base}")
    settings = settings_from_args(FinetuneSettings, args)
    documents = read_documents(args.data)
    writable_directory(args.out)
    if not settings.keep_freed_memory:  # from the start: loading the base leaves blocks in the heap too
        return_freed_memory_at_once()
    if last_checkpoint_step(args.out) is not None and not args.resume:
        raise ConfigError(
            f"{args.out} already holds a training checkpoint; add --resume to continue it, or choose another --out"
        )
    check_resumable(args.out, settings, lora, data_fingerprint(documents), args.model, args.resume)
    quantized_base = is_quantized_checkpoint(args.model)
    if quantized_base:  # a k-bit checkpoint is the frozen base as it is, loaded without a float model
        if args.method == "lora":
            raise ConfigError(f"{args.model} is a quantized checkpoint: --method lora needs a float model")
        method = read_record(args.model)["method"]
        if method != "kbit":
            raise ConfigError(
                f"QLoRA trains over a k-bit base; {args.model} holds a {method} checkpoint (quantize "
                "with --method kbit)"
            )
    # Data too short for one block fails here, in seconds, not after the model has loaded.
    tokenizer = read_tokenizer(Path(args.model)) if quantized_base else load_tokenizer(args.model)
    training_blocks(
        tokenizer, documents, settings.seq_len, settings.held_out_fraction, settings.seed, settings.max_eval_blocks
    )
    base_record = None
    if quantized_base:
        loaded = load_any(args.model)
        base_record = method_record(args.model)
    elif args.method == "qlora":  # the base is quantized as it loads: never more than one block in float
        loaded, base_record = load_quantizing(args.model, LORA_BASES[lora.base])
    else:
        loaded = load_any(args.model)
    torch.manual_seed(settings.seed)
    setup = add_lora_(loaded.model, lora)
    base = f"the k-bit checkpoint's base ({args.model})" if quantized_base else f"a {lora.base} base"
    print(
        f"{lora.method}: {setup['trainable_parameters']:,} trainable parameters over {base}"
        + (f" ({loaded.weights_note})" if loaded.weights_note else "")
    )
    record = finetune(
        loaded.model, loaded.tokenizer, documents, settings, lora, args.out, args.model, resume=args.resume
    )
    payload = {
        "model": args.model,
        "weights_note": loaded.weights_note,
        "data": str(args.data),
        "base_quantization": setup["base_quantization"] or base_record,
        **record,
    }
    print(
        f"steps {record['steps']}: train loss {record['train_loss_first']:.3f} -> {record['train_loss_last']:.3f}, "
        f"held-out perplexity {record['eval_perplexity']:.3f}, peak memory {record['peak_memory_bytes'] / 2**20:.0f} "
        f"MiB, {record['tokens_per_second']:.0f} tokens/s; adapter in {args.out}"
    )
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

    model = settings_from_args(SwarmModelConfig, args)
    settings = settings_from_args(SwarmSettings, args, {"model": model})
    record = run_local_swarm(settings_from_args(SwarmRun, args, {"settings": settings}))
    print(
        f"swarm: {record['steps']} optimizer steps in {record['seconds']:.0f} s, loss {record['loss_first']} -> "
        f"{record['loss_last']}, {record['samples_per_second']:.2f} samples/s, {record['peers_failed']} peers failed"
    )
    _write_json(args.json, record)


def command_bench(args) -> None:
    from leanlm.bench.suites import linear_suite, model_suite

    if args.suite == "linear":
        payload = {"suite": "linear", **linear_suite(args.size, repeats=args.repeats)}
        rows = [
            [
                f"M={m}",
                name,
                entry["median_ms"],
                entry["speedup_vs_fp32"],
                entry["speedup_vs_best_float"],
                entry["relative_error"],
            ]
            for m, variants in payload["rows"].items()
            for name, entry in variants.items()
        ]
        print(format_table(["rows", "linear", "median ms", "x fp32", "x best float", "rel. error"], rows))
    elif args.suite == "model":
        from leanlm.models import load_model

        loaded = load_model(args.model)
        payload = {
            "suite": "model",
            "model": args.model,
            "weights_note": loaded.weights_note,
            **model_suite(loaded, repeats=args.repeats),
        }
        rows = [
            [name, entry["tokens_per_second"], entry["decode_ms_per_token"], entry["weight_bytes"] / 2**20]
            for name, entry in payload["variants"].items()
        ]
        print(format_table(["model", "prefill tok/s", "decode ms/token", "weights MiB"], rows))
    else:
        from leanlm.evaluation.streaming import StreamSettings, stream_evaluate
        from leanlm.methods import load_any

        loaded = load_any(args.model)
        settings = StreamSettings(max_tokens=args.stream_tokens, latency_steps=256, recompute_tokens=16)
        payload = {"suite": "stream", "model": args.model, **stream_evaluate(loaded.model, loaded.tokenizer, settings)}
        rows = [
            [name, r["perplexity"], r["ms_per_token"], r["peak_memory_bytes"] / 2**20]
            for name, r in payload["settings"].items()
        ]
        print(format_table(["strategy", "perplexity", "ms/token", "peak MiB"], rows))
    _write_json(args.json, payload)


def command_export(args) -> None:
    from leanlm.export import export_compressed_tensors, export_gguf

    _check_json_path(args.json)
    if args.format == "gguf":
        result = export_gguf(
            args.model,
            args.out,
            args.type,
            force=args.force,
            token_embedding_type=args.token_embedding_type,
            output_tensor_type=args.output_tensor_type,
        )
        blocks = f", quantized matrices as {' / '.join(result['block_types'])}" if result["block_types"] else ""
        blocks += "".join(f", {name} as {kind}" for name, kind in result["table_types"].items())
        print(
            f"wrote {result['path']} ({result['file_type']}, {result['tensors']} tensors, "
            f"{result['bytes'] / 2**20:.1f} MiB{blocks}; metadata {result['metadata']})"
        )
    else:
        result = export_compressed_tensors(args.model, args.out)
        print(
            f"wrote {result['path']} ({result['format']}, {result['modules']} quantized linears, "
            f"{result['bytes'] / 2**20:.1f} MiB)"
        )
    _write_json(args.json, {**result, "peak_rss_bytes": process_peak_rss_bytes()})
