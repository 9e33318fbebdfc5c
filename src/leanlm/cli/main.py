"""`leanlm`: a thin command-line shell over the Python API (reference: docs/cli.md, generated from this parser). The
flags are generated from the config and settings dataclasses (`leanlm.cli.options`), the commands live in
`leanlm.cli.commands`; this module only wires them together and turns every failure into one line and an exit code.

Each command's options are built only when that command runs (or when the whole reference is generated), so
`leanlm --help` and `leanlm --version` import neither torch nor any optional extra, and a command imports only
what it uses."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

from leanlm.errors import LeanLMError, MissingExtraError, missing_extra

MODEL_HELP = "registry name, model directory, .gguf file or quantized checkpoint"


def _positive_int(text: str) -> int:
    """The few flags no settings dataclass holds (analyze's sample, bench's sizes) are checked here."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return int(text)


def _setup(
    parser: argparse.ArgumentParser,
    handler: str,
    *,
    model: str | None = "required",
    settings: tuple = (),
    defaults: dict | None = None,
    json: str | None = "write the results as one JSON object to this path",
    interrupted=None,
) -> None:
    """A command's MODEL argument (required, or optional with a default), the flags of its settings dataclasses,
    --json, the function that runs it (by name in `leanlm.cli.commands`) and what to say if Ctrl-C stops it."""
    from leanlm.cli.options import add_settings_options

    if model == "required":
        parser.add_argument("model", help=MODEL_HELP)
    elif model is not None:
        parser.add_argument("model", nargs="?", default=model, help=f"{MODEL_HELP} (default {model})")
    add_settings_options(parser, *settings, defaults=defaults)
    if json:
        parser.add_argument("--json", type=Path, help=json)
    parser.set_defaults(handler=handler, interrupted=interrupted)


def _eval(parser: argparse.ArgumentParser) -> None:
    from leanlm.evaluation import EvalSettings
    from leanlm.models import LoadSettings

    _setup(parser, "command_eval", settings=(EvalSettings, LoadSettings))


def _quantize(parser: argparse.ArgumentParser) -> None:
    from leanlm.cli.options import add_method_options
    from leanlm.methods.checkpoint import TABLE_DTYPES

    _setup(
        parser,
        "command_quantize",
        json="write method, avg_bits, peak_rss_bytes and seconds as JSON",
        interrupted=_quantize_interrupted,
    )
    add_method_options(parser)
    parser.add_argument("--out", type=Path, required=True, help="directory for the checkpoint")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="finish an interrupted run of the same command, keeping the blocks it wrote",
    )
    # Checked by the command (one line naming the flag, as every option's value is), not by argparse's choices.
    parser.add_argument(
        "--table-dtype",
        default="float32",
        metavar="{" + ",".join(TABLE_DTYPES) + "}",
        help="what the checkpoint stores the token embedding and float output head in (bfloat16: half their bytes)",
    )


def _plan(parser: argparse.ArgumentParser) -> None:
    from leanlm.plan import PlanSettings

    _setup(parser, "command_plan", settings=(PlanSettings,), json="write the plan as one JSON object to this path")


def _text_windows(parser: argparse.ArgumentParser, samples: int, help: str) -> None:
    """--samples windows of --seq-len tokens of one of the shipped running texts (--text)."""
    import typing

    from leanlm.data.datasets import PlainText

    parser.add_argument("--samples", type=_positive_int, default=samples, help=help)
    parser.add_argument("--seq-len", type=_positive_int, default=512)
    parser.add_argument("--text", choices=list(typing.get_args(PlainText)), default="lambada-dev")


def _analyze(parser: argparse.ArgumentParser) -> None:
    _setup(parser, "command_analyze", json="write the report as one JSON object to this path")
    _text_windows(parser, 8, "text windows analysed")
    parser.add_argument("--plot", type=Path, help="write a PNG: channel heat map + before/after SmoothQuant")


def _imatrix(parser: argparse.ArgumentParser) -> None:
    _setup(parser, "command_imatrix", json=None)
    parser.add_argument("--out", type=Path, required=True, help="the importance-matrix GGUF file to write")
    _text_windows(parser, 128, "calibration windows read")
    parser.add_argument("--force", action="store_true", help="replace an existing --out file")


def _stream(parser: argparse.ArgumentParser) -> None:
    from leanlm.evaluation.streaming import StreamSettings
    from leanlm.models import LoadSettings

    _setup(parser, "command_stream", settings=(StreamSettings, LoadSettings))
    parser.add_argument("--plot", type=Path, help="write a PNG: windowed perplexity and per-token latency")


def _interactive(parser: argparse.ArgumentParser, handler: str, settings_type: type) -> None:
    """chat and serve: a model (the default one unless given) behind a sink cache, loaded for answering."""
    from dataclasses import asdict

    from leanlm.methods.streaming import StreamingConfig
    from leanlm.models import DEFAULT_MODEL, INTERACTIVE_LOADING, LoadSettings

    _setup(
        parser,
        handler,
        model=DEFAULT_MODEL,
        settings=(StreamingConfig, settings_type, LoadSettings),
        defaults={**asdict(settings_type().streaming), **asdict(INTERACTIVE_LOADING)},
        json=None,
    )


def _chat(parser: argparse.ArgumentParser) -> None:
    from leanlm.chat import ChatSettings

    _interactive(parser, "command_chat", ChatSettings)


def _serve(parser: argparse.ArgumentParser) -> None:
    from leanlm.serve.server import ServeSettings

    _interactive(parser, "command_serve", ServeSettings)


def _finetune(parser: argparse.ArgumentParser) -> None:
    from leanlm.cli.options import option_dest
    from leanlm.methods import LoRAConfig
    from leanlm.training import FinetuneSettings

    _setup(parser, "command_finetune", settings=(FinetuneSettings, LoRAConfig), interrupted=_finetune_interrupted)
    parser.add_argument(
        "--method",
        choices=["qlora", "lora"],
        default="qlora",
        help="qlora: adapters over a frozen 4-bit base; lora: over the float base",
    )
    parser.add_argument(
        "--data",
        type=Path,
        required=True,
        help="plain text (one document per line) or JSONL (text / messages / instruction+output)",
    )
    parser.add_argument("--out", type=Path, required=True, help="directory for the adapter and checkpoints")
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    # Gradient checkpointing is the default; the flag that asked for it still works (the contract keeps it).
    parser.add_argument(
        "--gradient-checkpointing",
        dest=option_dest("--no-gradient-checkpointing"),
        action="store_const",
        const=True,
        default=argparse.SUPPRESS,
        help=argparse.SUPPRESS,
    )


def _merge(parser: argparse.ArgumentParser) -> None:
    _setup(parser, "command_merge", json=None, interrupted=_nothing_written)
    parser.add_argument("--adapter", type=Path, required=True, help="a PEFT-format adapter directory")
    parser.add_argument("--out", type=Path, required=True, help="directory for the merged model")
    parser.add_argument(
        "--requantize",
        choices=["nf4-dq", "nf4", "fp4", "int4"],
        help="re-quantize the merged weights (reports the error it adds); default: float32",
    )


def _bench(parser: argparse.ArgumentParser) -> None:
    from leanlm.models import DEFAULT_MODEL

    _setup(parser, "command_bench", model=None)
    parser.add_argument(
        "suite",
        choices=["linear", "model", "stream"],
        help="linear: one size x size layer at M = 1/16/64/512 (fp32, w8a8, llm-int8, nf4); model: "
        "prefill and decode speed of fp32 / nf4+dq / w8a8; stream: the StreamingLLM strategies",
    )
    parser.add_argument(
        "model", nargs="?", default=DEFAULT_MODEL, help="for model and stream (default: the default model)"
    )
    parser.add_argument("--size", type=_positive_int, default=4096, help="linear: in = out features")
    parser.add_argument("--repeats", type=_positive_int, default=5)
    parser.add_argument("--stream-tokens", type=_positive_int, default=8192, help="stream: length of the stream")


def _export(parser: argparse.ArgumentParser) -> None:
    from leanlm.export.to_gguf import FILE_TYPES
    from leanlm.formats.gguf_blocks import BLOCK_TYPES

    _setup(parser, "command_export")
    parser.add_argument(
        "--format",
        choices=["gguf", "compressed-tensors"],
        required=True,
        help="gguf: llama.cpp's file; compressed-tensors: llm-compressor's directory",
    )
    parser.add_argument("--out", type=Path, required=True, help="the file (gguf) or directory to write")
    parser.add_argument(
        "--type",
        choices=list(FILE_TYPES),
        default="f32",
        help="gguf: tensor type of the float matrices (a checkpoint's quantized ones keep their "
        "blocks; norms stay f32; default f32)",
    )
    for flag, table in (
        ("--token-embedding-type", "the token embedding"),
        ("--output-tensor-type", "a float output head"),
    ):
        parser.add_argument(
            flag,
            choices=list(BLOCK_TYPES),
            default=None,
            help=f"gguf: {table} as blocks of this type, rounded to nearest (llama-quantize's option of the same "
            "name; default: the type llama.cpp's file gives it for a checkpoint quantized with --size-of, else "
            "--type)",
        )
    parser.add_argument(
        "--force",
        action="store_true",
        help="gguf: replace an existing --out file (never the model's own files); without it an existing "
        "--out is refused",
    )


def _swarm(parser: argparse.ArgumentParser) -> None:
    from leanlm.swarm import SwarmModelConfig, SwarmRun, SwarmSettings

    _setup(parser, "command_swarm", model=None, settings=(SwarmModelConfig, SwarmRun, SwarmSettings))


def _showcase(parser: argparse.ArgumentParser) -> None:
    from dataclasses import asdict

    from leanlm.evaluation import EvalSettings
    from leanlm.models import DEFAULT_MODEL
    from leanlm.showcase import QUICK_SETTINGS

    _setup(parser, "command_showcase", model=DEFAULT_MODEL, settings=(EvalSettings,), defaults=asdict(QUICK_SETTINGS))


# name -> (one-line help, the function that adds its options)
COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None]]] = {
    "eval": ("perplexity and zero-shot accuracy of a model", _eval),
    "quantize": ("quantize a model and write a reloadable checkpoint", _quantize),
    "plan": (
        "what each method stores, holds when running and needs while quantizing, and what fits this machine, "
        "from the model's config alone (nothing loads)",
        _plan,
    ),
    "analyze": ("activation outlier features (as in LLM.int8(), section 2.3)", _analyze),
    "imatrix": (
        "llama.cpp's importance matrix of a model on calibration text (the GGUF file llama-quantize --imatrix "
        "and leanlm quantize --imatrix-file read)",
        _imatrix,
    ),
    "stream": (
        "streaming perplexity, latency and memory over a long text (dense, window, re-computation, StreamingLLM)",
        _stream,
    ),
    "chat": (
        "multi-round chat that never runs out of context (StreamingLLM); reads one message per line from stdin "
        "when it is not a terminal",
        _chat,
    ),
    "serve": (
        "an OpenAI-compatible server (/v1/chat/completions, /v1/completions, /v1/models, /health) whose "
        "conversations never run out of context: each lives in a sink cache",
        _serve,
    ),
    "finetune": ("LoRA / QLoRA fine-tuning; writes a PEFT adapter", _finetune),
    "merge": ("fold LoRA adapters into the de-quantized base weights", _merge),
    "bench": ("quick side-by-side measurements (the full studies are the scripts in benchmarks/)", _bench),
    "export": (
        "write a model for another engine: a GGUF file llama.cpp runs alone (a float model as F32 / F16 / "
        "BF16 / Q8_0; RTN or GPTQ with --gguf-type or --target-bits as their own blocks, or with --grid "
        "symmetric --group-size 32 --no-act-order as Q4_0 / Q8_0), or a compressed-tensors directory that "
        "transformers and vLLM load (W8A8 / SmoothQuant with --no-bmm; RTN or GPTQ with --grid symmetric "
        "--no-act-order)",
        _export,
    ),
    "swarm": (
        "SWARM parallelism: a local swarm of pipeline peers and trainers on 127.0.0.1 (hivemind), training a "
        "small byte-level LM on the shipped text",
        _swarm,
    ),
    "showcase": ("every leanlm method side by side on one model, in minutes", _showcase),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; with `only`, the options of that command alone (the others are listed by name and
    help), which is all one run of `leanlm` needs."""
    from leanlm import __version__

    parser = argparse.ArgumentParser(
        prog="leanlm", description="Cheap LLM inference and fine-tuning on the hardware you have."
    )
    parser.add_argument("--version", action="version", version=f"leanlm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help, add_options) in COMMANDS.items():
        command = sub.add_parser(name, help=help, description=help)
        if only is None or only == name:
            add_options(command)
    return parser


def _nothing_written(args) -> str:
    return f"nothing was written to {args.out} (the partial output was removed); run the same command to start again"


def _quantize_interrupted(args) -> str:
    from leanlm.storage import resumable_staging

    staging = resumable_staging(args.out)
    blocks = len(list(staging.glob("block-*.safetensors"))) if staging.is_dir() else 0
    if not blocks:
        return _nothing_written(args)
    return (
        f"{args.out} is not written yet; the {blocks} blocks done are kept in {staging}: add --resume to the same "
        "command to continue from them"
    )


def _finetune_interrupted(args) -> str:
    from leanlm.training.finetune import last_checkpoint_step

    step = last_checkpoint_step(args.out)
    if step is None:
        return "no checkpoint was written yet; run the same command to start again"
    return f"the checkpoint of step {step} is in {args.out}; add --resume to the same command to continue from it"


INTERRUPTED = 130  # the shell's code for a process ended by SIGINT


def _command_word(argv: list[str]) -> str:
    """The command a command line names (its first word that is not an option), or '' for none."""
    return next((word for word in argv if not word.startswith("-")), "")


def _error(text: str) -> None:
    print(f"leanlm: error: {' '.join(text.split())}", file=sys.stderr)  # one line, whatever a library put in it


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="leanlm: %(message)s")
    argv = sys.argv[1:] if argv is None else list(argv)
    command = _command_word(argv)
    args = None
    try:
        args = build_parser(only=command if command in COMMANDS else "").parse_args(argv)
        from leanlm.cli import commands

        getattr(commands, args.handler)(args)
    except LeanLMError as error:
        _error(str(error))
        return 2
    except ModuleNotFoundError as error:
        extra = missing_extra(error)
        if extra is None:
            return _internal_error(error)
        _error(str(MissingExtraError(f"leanlm {command}", error.name, extra)))
        return 2
    except KeyboardInterrupt:
        interrupted = getattr(args, "interrupted", None)
        print("\nleanlm: interrupted" + (f"; {interrupted(args)}" if interrupted else ""), file=sys.stderr)
        return INTERRUPTED
    except OSError as error:  # the disk filled up, a file vanished, a path became unreadable mid-run
        _error(f"{error.strerror or error}" + (f": {error.filename}" if error.filename else "") + _kept(args))
        return 1
    except Exception as error:
        if _disk_full(error):  # safetensors reports a failed write as its own error type
            _error(f"the disk is full: a file could not be written ({error})" + _kept(args))
            return 1
        return _internal_error(error)
    return 0


def _disk_full(error: Exception) -> bool:
    return type(error).__name__ == "SafetensorError" and any(
        sign in str(error) for sign in ("No space left", "StorageFull", "os error 28")
    )


def _kept(args) -> str:
    """What a failed run leaves for the next one (blocks to resume from), as its interruption would say."""
    interrupted = getattr(args, "interrupted", None)
    return f"; {interrupted(args)}" if interrupted else ""


def _internal_error(error: Exception) -> int:
    """A bug: one line for the user, the traceback on request."""
    if os.environ.get("LEANLM_TRACEBACK"):
        raise error
    print(
        f"leanlm: internal error: {type(error).__name__}: {error} (a bug in leanlm; run again with "
        "LEANLM_TRACEBACK=1 to see where)",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
