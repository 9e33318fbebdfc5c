"""`leanlm`: a thin command-line shell over the Python API (contract: CONTRACT.md). The flags are generated from
the config and settings dataclasses (`leanlm.cli.options`), the commands live in `leanlm.cli.commands`; this module
only wires them together and turns every failure into one line and an exit code."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import asdict
from pathlib import Path

from leanlm.cli import commands
from leanlm.cli.options import add_method_options, add_settings_options, option_dest
from leanlm.errors import LeanLMError
from leanlm.models import DEFAULT_MODEL

MODEL_HELP = "registry name, model directory, .gguf file or quantized checkpoint"


def _positive_int(text: str) -> int:
    """The few flags no settings dataclass holds (analyze's sample, bench's sizes) are checked here."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return int(text)


def _command(commands_: argparse._SubParsersAction, name: str, help: str, handler, *, model: str | None = "required",
             settings: tuple = (), defaults: dict | None = None, json: str | None = "write the results as one JSON "
             "object to this path", interrupted=None) -> argparse.ArgumentParser:
    """A sub-command: its MODEL argument (required, or optional with a default), the flags of its settings
    dataclasses, --json, and what to say if Ctrl-C stops it."""
    parser = commands_.add_parser(name, help=help)
    if model == "required":
        parser.add_argument("model", help=MODEL_HELP)
    elif model is not None:
        parser.add_argument("model", nargs="?", default=model, help=f"{MODEL_HELP} (default {model})")
    add_settings_options(parser, *settings, defaults=defaults)
    if json:
        parser.add_argument("--json", type=Path, help=json)
    parser.set_defaults(handler=handler, interrupted=interrupted)
    return parser


def build_parser() -> argparse.ArgumentParser:
    from leanlm.chat import ChatSettings
    from leanlm.evaluation import EvalSettings
    from leanlm.evaluation.streaming import StreamSettings
    from leanlm.export import FILE_TYPES
    from leanlm.methods import LoRAConfig
    from leanlm.methods.checkpoint import TABLE_DTYPES
    from leanlm.methods.streaming import StreamingConfig
    from leanlm.models import INTERACTIVE_LOADING, LoadSettings
    from leanlm.serve.server import ServeSettings
    from leanlm.showcase import QUICK_SETTINGS
    from leanlm.swarm import SwarmModelConfig, SwarmRun, SwarmSettings
    from leanlm.training import FinetuneSettings

    parser = argparse.ArgumentParser(prog="leanlm", description="Cheap LLM inference and fine-tuning on the hardware "
                                     "you have.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _command(sub, "eval", "perplexity and zero-shot accuracy of a model", commands.command_eval,
             settings=(EvalSettings, LoadSettings))

    quantize = _command(sub, "quantize", "quantize a model and write a reloadable checkpoint",
                        commands.command_quantize, json="write method, avg_bits, peak_rss_bytes and seconds as JSON",
                        interrupted=_quantize_interrupted)
    add_method_options(quantize)
    quantize.add_argument("--out", type=Path, required=True, help="directory for the checkpoint")
    quantize.add_argument("--resume", action="store_true",
                          help="finish an interrupted run of the same command, keeping the blocks it wrote")
    # Checked by the command (one line naming the flag, as every option's value is), not by argparse's choices.
    quantize.add_argument("--table-dtype", default="float32", metavar="{" + ",".join(TABLE_DTYPES) + "}",
                          help="what the checkpoint stores the token embedding and float output head in (bfloat16: "
                               "half their bytes)")

    analyze = _command(sub, "analyze", "activation outlier features (LLM.int8() section 2.3)", commands.command_analyze,
                       json="write the report as one JSON object to this path")
    analyze.add_argument("--samples", type=_positive_int, default=8, help="text windows analysed")
    analyze.add_argument("--seq-len", type=_positive_int, default=512)
    analyze.add_argument("--text", choices=["lambada-dev", "lambada-test", "lee"], default="lambada-dev")
    analyze.add_argument("--plot", type=Path, help="write a PNG: channel heat map + before/after SmoothQuant")

    stream = _command(sub, "stream", "streaming perplexity, latency and memory over a long text (dense, window, "
                      "re-computation, StreamingLLM)", commands.command_stream, settings=(StreamSettings, LoadSettings))
    stream.add_argument("--plot", type=Path, help="write a PNG: windowed perplexity and per-token latency")

    _command(sub, "chat", "multi-round chat that never runs out of context (StreamingLLM); reads one message per "
             "line from stdin when it is not a terminal", commands.command_chat, model=DEFAULT_MODEL,
             settings=(StreamingConfig, ChatSettings, LoadSettings),
             defaults={**asdict(ChatSettings().streaming), **asdict(INTERACTIVE_LOADING)}, json=None)

    _command(sub, "serve", "an OpenAI-compatible server (/v1/chat/completions, /v1/completions, /v1/models, "
             "/health) whose conversations never run out of context: each lives in a sink cache", commands.command_serve,
             settings=(StreamingConfig, ServeSettings, LoadSettings),
             defaults={**asdict(ServeSettings().streaming), **asdict(INTERACTIVE_LOADING)}, json=None)

    finetune = _command(sub, "finetune", "LoRA / QLoRA fine-tuning; writes a PEFT adapter", commands.command_finetune,
                        settings=(FinetuneSettings, LoRAConfig), interrupted=_finetune_interrupted)
    finetune.add_argument("--method", choices=["qlora", "lora"], default="qlora",
                          help="qlora: adapters over a frozen 4-bit base; lora: over the float base")
    finetune.add_argument("--data", type=Path, required=True,
                          help="plain text (one document per line) or JSONL (text / messages / instruction+output)")
    finetune.add_argument("--out", type=Path, required=True, help="directory for the adapter and checkpoints")
    finetune.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    # Gradient checkpointing became the default; the flag that asked for it still works (the contract keeps it).
    finetune.add_argument("--gradient-checkpointing", dest=option_dest("--no-gradient-checkpointing"),
                          action="store_const", const=True, default=argparse.SUPPRESS, help=argparse.SUPPRESS)

    merge = _command(sub, "merge", "fold LoRA adapters into the de-quantized base weights", commands.command_merge,
                     json=None, interrupted=_nothing_written)
    merge.add_argument("--adapter", type=Path, required=True, help="a PEFT-format adapter directory")
    merge.add_argument("--out", type=Path, required=True, help="directory for the merged model")
    merge.add_argument("--requantize", choices=["nf4-dq", "nf4", "fp4", "int4"],
                       help="re-quantize the merged weights (reports the error it adds); default: float32")

    bench = _command(sub, "bench", "quick side-by-side measurements (the full studies are the scripts in "
                     "benchmarks/)", commands.command_bench, model=None)
    bench.add_argument("suite", choices=["linear", "model", "stream"],
                       help="linear: one size x size layer at M = 1/16/64/512 (fp32, w8a8, llm-int8, nf4); model: "
                            "prefill and decode speed of fp32 / nf4+dq / w8a8; stream: the StreamingLLM strategies")
    bench.add_argument("model", nargs="?", default=DEFAULT_MODEL, help="for model and stream (default: the default model)")
    bench.add_argument("--size", type=_positive_int, default=4096, help="linear: in = out features")
    bench.add_argument("--repeats", type=_positive_int, default=5)
    bench.add_argument("--stream-tokens", type=_positive_int, default=8192, help="stream: length of the stream")

    export = _command(sub, "export", "write a model for another engine: a GGUF file llama.cpp runs alone (a float "
                      "model as F32 / F16 / BF16 / Q8_0; RTN or GPTQ with --grid symmetric --group-size 32 "
                      "--no-act-order as its exact Q4_0 / Q8_0 blocks), or a compressed-tensors directory that "
                      "transformers and vLLM load (W8A8 / SmoothQuant with --no-bmm; RTN or GPTQ with --grid "
                      "symmetric --no-act-order)", commands.command_export)
    export.add_argument("--format", choices=["gguf", "compressed-tensors"], required=True,
                        help="gguf: llama.cpp's file; compressed-tensors: llm-compressor's directory")
    export.add_argument("--out", type=Path, required=True, help="the file (gguf) or directory to write")
    export.add_argument("--type", choices=list(FILE_TYPES), default="f32",
                        help="gguf: tensor type of the float matrices (a checkpoint's quantized ones keep their "
                        "blocks; norms stay f32; default f32)")

    _command(sub, "swarm", "SWARM parallelism: a local swarm of pipeline peers and trainers on 127.0.0.1 "
             "(hivemind), training a small byte-level LM on the shipped text", commands.command_swarm, model=None,
             settings=(SwarmModelConfig, SwarmRun, SwarmSettings))
    _command(sub, "showcase", "every leanlm method side by side on one model, in minutes", commands.command_showcase,
             model=DEFAULT_MODEL, settings=(EvalSettings,), defaults=asdict(QUICK_SETTINGS))
    return parser


def _nothing_written(args) -> str:
    return f"nothing was written to {args.out} (the partial output was removed); run the same command to start again"


def _quantize_interrupted(args) -> str:
    from leanlm.storage import resumable_staging

    staging = resumable_staging(args.out)
    blocks = len(list(staging.glob("block-*.safetensors"))) if staging.is_dir() else 0
    if not blocks:
        return _nothing_written(args)
    return (f"{args.out} is not written yet; the {blocks} blocks done are kept in {staging}: add --resume to the same "
            "command to continue from them")


def _finetune_interrupted(args) -> str:
    from leanlm.training.finetune import last_checkpoint_step

    step = last_checkpoint_step(args.out)
    if step is None:
        return "no checkpoint was written yet; run the same command to start again"
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
        print("\nleanlm: interrupted" + (f"; {args.interrupted(args)}" if args.interrupted else ""), file=sys.stderr)
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
