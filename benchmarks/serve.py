"""`leanlm serve` under load beside llama.cpp's own `llama-server`, at equal bits, on the same weights.

For each client count (1, 4, 8 and 16 by default) every server is started afresh as a subprocess on a free
127.0.0.1 port: llama-server with as many parallel slots as clients (`-np`, continuous batching, each slot a
context of --context tokens), leanlm with as many requests in flight (`--max-batch`) and a sink-cache window of
--context tokens, so that both read every prompt token. All servers of a count run at once and are loaded in a
rotated order, round by round (medians over --rounds rounds, latency percentiles over every sample). In a round
each server gets, from as many concurrent streaming clients: short prompts (a greedy answer of --tokens tokens
each), then long prompts of about --long-prompt tokens (each client its own, new from the first token on in every
round: a cold prefill; --long-answer tokens each). Tokens are counted from the servers' usage
(`stream_options.include_usage`), not from chunks.

Per server and count: aggregate tokens/s, time to first token (TTFT) p50 / p99, the gaps between a stream's
tokens p50 / p99, long prompts' TTFT p50 / p99, the server's peak RSS; the load average before and after, and
the CPU. Then a long conversation against leanlm (every turn resends the whole history, as chat front ends do):
tokens read per turn and the server's resident memory, turn by turn. Writes benchmarks/results/serve_<model>.json
+ .png.

    make llama-server                                   # builds llama-server and llama-quantize (15-35 min)
    python benchmarks/serve.py                          # SmolLM2; llama.cpp's rows skipped without the build
    python benchmarks/serve.py --model qwen2.5-coder-1.5b --rounds 2
    python benchmarks/serve.py --clients 16             # one client count again (the others are kept)
    python benchmarks/serve.py --report

The servers: leanlm's bf16 float model, its 8-bit int blocks of 64 and its NF4 + DQ checkpoint (both with the
8-bit head, as llama.cpp's Q4_0 files hold theirs in Q8_0), through the fused decode step; llama.cpp's Q8_0 and
Q4_0 files written by `leanlm export` (Q4_0: an RTN checkpoint, symmetric, groups of 32, as its exact blocks) and
llama.cpp's Q4_K_M made by its own `llama-quantize` from leanlm's F32 export.

Bounded: every request has max_tokens, every client count runs its clients a fixed number of times, every server
is stopped at the end of its count; nothing listens beyond 127.0.0.1.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from leanlm.bench import Study, print_report, results_name, study_arguments, titled  # noqa: E402
from leanlm.bench.harness import cpu_description, process_memory_bytes  # noqa: E402
from leanlm.report import format_table, save_figure  # noqa: E402

CLIENTS = (1, 4, 8, 16)
TOPICS = ["the sea", "a mountain", "bread", "the moon", "a city", "rain", "a library", "music"]
LEANLM = "leanlm"
LLAMA = "llama.cpp"
# Each leanlm row beside the llama.cpp rows of about the same bits per weight.
EQUAL_BITS = {"leanlm NF4+DQ": ("llama.cpp Q4_0", "llama.cpp Q4_K_M"), "leanlm 8-bit": ("llama.cpp Q8_0",)}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """A server subprocess on a free loopback port, stopped on exit."""

    def __init__(self, command: list[str], log: Path, *, timeout: float = 900):
        self.port = free_port()
        # Its output goes to a file: a pipe nobody reads fills up and blocks a talkative server (llama.cpp's).
        with open(log, "wb") as output:
            self.process = subprocess.Popen(
                [*command, "--port", str(self.port)],
                stdout=output,
                stderr=subprocess.STDOUT,
                env={**os.environ, "TQDM_DISABLE": "1"},
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited: {log.read_text(errors='replace')[-2000:]}")
            try:
                urllib.request.urlopen(f"{self.url}/models", timeout=2).read()
                return
            except OSError:  # not listening yet, or 503 while the model loads
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"server did not answer within {timeout} s") from None
                time.sleep(0.5)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def peak_rss(self) -> int:
        return process_memory_bytes(self.process.pid)

    def rss(self) -> int:
        return process_memory_bytes(self.process.pid, "VmRSS")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def stream_once(client, model: str, prompt: str, tokens: int) -> dict:
    """One streamed greedy chat completion: when each content chunk arrived, and the server's token counts."""
    started = time.perf_counter()
    arrivals, usage = [], None
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.perf_counter() - started)
        if chunk.usage is not None:
            usage = chunk.usage
    if usage is None:
        raise RuntimeError("the server sent no usage with stream_options.include_usage")
    return {"arrivals": arrivals, "prompt_tokens": usage.prompt_tokens, "tokens": usage.completion_tokens}


def concurrent(client, model: str, prompts: list[str], tokens: int) -> dict:
    """Every prompt streamed by its own client thread at once: wall time, tokens, TTFTs and token gaps."""
    results: list[dict] = [{} for _ in prompts]
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            results[index] = stream_once(client, model, prompts[index], tokens)
        except BaseException as error:  # noqa: BLE001 - re-raised below, in the caller's thread
            errors.append(error)

    started = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    if errors:
        raise errors[0]
    return {
        "seconds": wall,
        "tokens": sum(r["tokens"] for r in results),
        "prompt_tokens": [r["prompt_tokens"] for r in results],
        "first": [r["arrivals"][0] for r in results if r["arrivals"]],
        "gaps": [b - a for r in results for a, b in zip(r["arrivals"], r["arrivals"][1:])],
    }


def short_prompt(round_index: int, index: int) -> str:
    """New in every round (so no server answers from a cache of an earlier round)."""
    return f"Story {round_index}.{index}: write a short story about {TOPICS[index % len(TOPICS)]}."


def long_prompt(sentences: int, round_index: int, index: int) -> str:
    """`sentences` sentences, different from the first token on for every round and client (a cold prefill)."""
    body = " ".join(
        f"Sentence {i} of a long document about {TOPICS[(i + round_index + index) % len(TOPICS)]}."
        for i in range(sentences)
    )
    return f"Document {round_index}.{index}. {body} Summarise it."


def long_prompt_sentences(model: str, target: int) -> int:
    """The sentence count whose long prompt is at least `target` tokens of the model's tokenizer."""
    from leanlm.models import load_tokenizer

    tokenizer = load_tokenizer(model)
    sentences = 16
    while len(tokenizer(long_prompt(sentences, 0, 0))["input_ids"]) < target:
        sentences += 8
    return sentences


def percentile(values: list[float], q: float) -> float | None:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


def load_rounds(servers: dict[str, tuple[str, str]], count: int, args, sentences: int) -> dict:
    """Every server under `count` clients, short prompts then long ones, the servers in a rotated order in each
    of `args.rounds` rounds (so that a slow spell of this shared machine falls on all alike)."""
    import openai

    clients = {
        name: openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=1800)
        for name, (url, _) in servers.items()
    }
    for name, (_, model) in servers.items():  # warm-up
        stream_once(clients[name], model, "Hello", 4)
    samples: dict[str, dict[str, list]] = {name: {"short": [], "long": []} for name in servers}
    names = list(servers)
    for round_index in range(args.rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            model = servers[name][1]
            short = [short_prompt(round_index, i) for i in range(count)]
            samples[name]["short"].append(concurrent(clients[name], model, short, args.tokens))
            long = [long_prompt(sentences, round_index, i) for i in range(count)]
            samples[name]["long"].append(concurrent(clients[name], model, long, args.long_answer))
        print(
            f"{count} clients, round {round_index + 1}/{args.rounds}: "
            + ", ".join(
                f"{name} {samples[name]['short'][-1]['tokens'] / samples[name]['short'][-1]['seconds']:.0f}"
                for name in names
            )
            + " tok/s",
            flush=True,
        )
    rows = {}
    for name in names:
        short, long = samples[name]["short"], samples[name]["long"]
        first = [t for r in short for t in r["first"]]
        gaps = [g for r in short for g in r["gaps"]]
        long_first = [t for r in long for t in r["first"]]
        rows[name] = {
            "aggregate_tokens_per_second": statistics.median(r["tokens"] / r["seconds"] for r in short),
            "tokens": [r["tokens"] for r in short],
            "seconds": [r["seconds"] for r in short],
            "ttft_p50_s": statistics.median(first),
            "ttft_p99_s": percentile(first, 0.99),
            "token_gap_p50_s": statistics.median(gaps) if gaps else None,
            "token_gap_p99_s": percentile(gaps, 0.99),
            "long_prompt_tokens": [
                min(t for r in long for t in r["prompt_tokens"]),
                max(t for r in long for t in r["prompt_tokens"]),
            ],
            "long_ttft_p50_s": statistics.median(long_first),
            "long_ttft_p99_s": percentile(long_first, 0.99),
            "long_prompt_tokens_per_second": statistics.median(sum(r["prompt_tokens"]) / r["seconds"] for r in long),
        }
    return rows


def conversation(url: str, model: str, turns: int, tokens: int, rss) -> list[dict]:
    """A conversation of `turns` turns, each resending the whole history; per turn: tokens read and server RSS."""
    import openai

    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
    messages, trace = [], []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Turn {turn}: tell me one more fact about {TOPICS[turn % 8]}."})
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=tokens, temperature=0)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        usage = reply.usage
        trace.append(
            {
                "prompt_tokens": usage.prompt_tokens,
                "read_tokens": usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens,
                "server_rss_bytes": rss(),
            }
        )
    return trace


def llama_binaries(given: Path | None) -> Path | None:
    """The directory holding llama-server and llama-quantize: --llama-bin, else the newest `make llama-server`
    build, else the PATH's; None without them."""
    from leanlm.models.loading import cache_root

    if given is not None:
        return given
    builds = sorted(
        (cache_root() / "llama.cpp").glob("*/build/bin/llama-server"),
        key=lambda path: [int(part) for part in path.parents[2].name.split(".") if part.isdigit()],
    )
    found = builds[-1] if builds else shutil.which("llama-server")
    return Path(found).parent if found else None


def systems(args, work: Path, binaries: Path | None, count: int) -> dict[str, tuple[list[str], str]]:
    """Row name -> the command that starts its server for `count` clients (the port appended by Server) and the
    model name requests give it."""
    leanlm = [sys.executable, "-m", "leanlm.cli.main", "serve", "--window", str(args.context)]
    leanlm += ["--max-batch", str(count)]
    rows = {
        f"{LEANLM} bf16": ([*leanlm, args.model, "--dtype", "bfloat16"], args.model),
        f"{LEANLM} 8-bit": ([*leanlm, str(work / "int8"), "--head", "int8"], str(work / "int8")),
        f"{LEANLM} NF4+DQ": ([*leanlm, str(work / "nf4"), "--head", "int8"], str(work / "nf4")),
    }
    if binaries is not None:
        for kind in ("Q8_0", "Q4_0", "Q4_K_M"):
            command = [
                str(binaries / "llama-server"),
                *("--model", str(work / f"{kind.lower()}.gguf"), "--alias", args.model),
                *("--host", "127.0.0.1", "--threads", "2", "--threads-batch", "2"),
                *("--parallel", str(count), "--ctx-size", str(count * args.context), "--cont-batching"),
                # Its idle prompt cache bounded as leanlm's idle conversations are (--cache-budget-mb, 1 GiB).
                *("--cache-ram", "1024", "--no-webui"),
            ]
            rows[f"{LLAMA} {kind}"] = (command, args.model)
    return rows


def prepare(args, work: Path, binaries: Path | None) -> None:
    """The checkpoints and GGUF files the servers load (made once, kept in the work directory)."""
    leanlm = [sys.executable, "-m", "leanlm.cli.main"]
    recipes = {
        "nf4": ["--method", "kbit", "--double-quant"],
        "int8": ["--method", "kbit", "--dtype", "int", "--bits", "8"],
        "rtn-4bit-g32": ["--method", "rtn", "--bits", "4", "--grid", "symmetric", "--group-size", "32"],
    }
    for name, recipe in recipes.items():
        if not (work / name).exists():
            subprocess.run([*leanlm, "quantize", args.model, *recipe, "--out", str(work / name)], check=True)
    if binaries is None:
        return
    exports = {"q8_0.gguf": (args.model, "q8_0"), "q4_0.gguf": (str(work / "rtn-4bit-g32"), "q8_0")}
    exports["f32.gguf"] = (args.model, "f32")
    for file, (source, kind) in exports.items():
        if not (work / file).exists():
            subprocess.run(
                [*leanlm, "export", source, "--format", "gguf", "--type", kind, "--out", str(work / file)], check=True
            )
    if not (work / "q4_k_m.gguf").exists():
        partial = work / ".q4_k_m.gguf.partial"
        subprocess.run(
            [str(binaries / "llama-quantize"), str(work / "f32.gguf"), str(partial), "Q4_K_M", "2"],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        partial.rename(work / "q4_k_m.gguf")


def report(payload: dict) -> str:
    counts = [c for c in CLIENTS if str(c) in payload.get("clients", {})]
    if not counts:
        return "no client count measured yet"
    runs = payload["clients"]
    last = str(counts[-1])
    settings = payload["settings"]
    loads = ", ".join(
        f"{c}: {runs[str(c)]['load_average'][0]:.1f} / {runs[str(c)]['load_average'][1]:.1f}" for c in counts
    )
    out = [
        f"{payload.get('cpu', 'this CPU')}; llama.cpp {payload.get('llama_cpp', 'not built')}; "
        f"{settings['rounds']} rounds; short prompts: {settings['tokens']} tokens per answer, greedy; long prompts: "
        f"{_span(runs, counts)} tokens, {settings['long_answer']} per answer; load average before / after, by "
        f"client count: {loads}"
    ]
    names = list(runs[last]["rows"])
    cells = {name: [runs[str(c)]["rows"].get(name) for c in counts] for name in names}
    short = [
        [
            name,
            *(f"{cell['aggregate_tokens_per_second']:.1f}" if cell else "" for cell in cells[name]),
            *(f"{cell['ttft_p50_s']:.2f} / {cell['ttft_p99_s']:.2f}" if cell else "" for cell in cells[name]),
            _gaps(runs[last]["rows"].get(name)),
            f"{runs[last]['rows'][name]['peak_rss_bytes'] / 2**20:,.0f}",
        ]
        for name in names
    ]
    out.append(
        format_table(
            [
                "server",
                *(f"tok/s, {c} clients" for c in counts),
                *(f"TTFT p50 / p99 s, {c}" for c in counts),
                f"token gap p50 / p99 ms, {last}",
                f"peak RSS MiB, {last}",
            ],
            short,
            markdown=True,
        )
    )
    long = [
        [
            name,
            *(f"{cell['long_ttft_p50_s']:.1f} / {cell['long_ttft_p99_s']:.1f}" if cell else "" for cell in cells[name]),
            *(f"{cell['long_prompt_tokens_per_second']:,.0f}" if cell else "" for cell in cells[name]),
        ]
        for name in names
    ]
    out.append(
        format_table(
            [
                "server",
                *(f"long prompts: TTFT p50 / p99 s, {c} clients" for c in counts),
                *(f"prompt tok/s, {c}" for c in counts),
            ],
            long,
            markdown=True,
        )
    )
    verdict = []
    for ours, peers in EQUAL_BITS.items():
        for peer in peers:
            pairs = [(c, runs[str(c)]["rows"].get(ours), runs[str(c)]["rows"].get(peer)) for c in counts]
            pairs = [(c, a, b) for c, a, b in pairs if a and b]
            if not pairs:
                continue
            verdict.append(
                [
                    f"{ours} / {peer}",
                    *(
                        f"{a['aggregate_tokens_per_second'] / b['aggregate_tokens_per_second']:.2f}"
                        for _, a, b in pairs
                    ),
                    *(f"{a['long_ttft_p50_s'] / b['long_ttft_p50_s']:.2f}" for _, a, b in pairs),
                ]
            )
    if verdict:
        out.append(
            format_table(
                [
                    "at equal bits",
                    *(f"tok/s ratio, {c}" for c in counts),
                    *(f"long-prompt TTFT ratio, {c}" for c in counts),
                ],
                verdict,
                markdown=True,
            )
        )
    trace = payload.get("conversation")
    if trace:
        window = settings["context"]
        rss = [t["server_rss_bytes"] / 2**20 for t in trace]
        full = next((i for i, t in enumerate(trace) if t["prompt_tokens"] > window), None)
        out.append(
            f"conversation of {len(trace)} turns against leanlm bf16 (window {window}): history "
            f"{trace[0]['prompt_tokens']} -> {trace[-1]['prompt_tokens']} tokens, tokens read per turn after the "
            f"first: max {max(t['read_tokens'] for t in trace[1:])}; server RSS turn 1 {rss[0]:,.0f} MiB"
            + (
                f", turn {full + 1} (history past the window) {rss[full]:,.0f} MiB, after it max "
                f"{max(rss[full:]):,.0f} MiB"
                if full is not None
                else ""
            )
            + f", last {rss[-1]:,.0f} MiB"
        )
    return "\n\n".join(out)


def _span(runs: dict, counts: list[int]) -> str:
    spans = [span for c in counts for row in runs[str(c)]["rows"].values() for span in row["long_prompt_tokens"]]
    return f"{min(spans):,}-{max(spans):,}"


def _gaps(cell: dict | None) -> str:
    if not cell or cell["token_gap_p50_s"] is None:
        return ""
    return f"{1e3 * cell['token_gap_p50_s']:.0f} / {1e3 * cell['token_gap_p99_s']:.0f}"


def plot(payload: dict, path) -> None:
    runs = payload.get("clients", {})
    counts = [c for c in CLIENTS if str(c) in runs]
    if not counts:
        return
    trace = payload.get("conversation", [])
    fig, axes = plt.subplots(1, 3 if trace else 2, figsize=(16 if trace else 11, 4.2))
    left, middle = axes[:2]
    for name in runs[str(counts[-1])]["rows"]:
        cells = [(c, runs[str(c)]["rows"].get(name)) for c in counts]
        cells = [(c, cell) for c, cell in cells if cell]
        style = "-" if name.startswith(LEANLM) else "--"
        xs = [c for c, _ in cells]
        left.plot(xs, [cell["aggregate_tokens_per_second"] for _, cell in cells], style, marker="o", label=name)
        middle.plot(xs, [cell["long_ttft_p50_s"] for _, cell in cells], style, marker="o", label=name)
    left.set_xlabel("concurrent streaming clients")
    left.set_ylabel("aggregate tokens/s, short prompts")
    left.legend(fontsize=8)
    middle.set_xlabel("concurrent streaming clients")
    middle.set_ylabel("long-prompt TTFT p50, s")
    if trace:
        right = axes[2]
        right.plot([t["prompt_tokens"] for t in trace], [t["server_rss_bytes"] / 2**20 for t in trace], marker=".")
        right.set_xlabel("conversation history, tokens (resent every turn)")
        right.set_ylabel("leanlm server RSS, MiB")
    save_figure(fig, path, titled(payload, "leanlm serve beside llama-server"))


def main() -> None:
    parser = study_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]), tag=True)
    parser.add_argument("--clients", type=int, nargs="+", default=list(CLIENTS), help="client counts to measure")
    parser.add_argument("--tokens", type=int, default=64, help="max_tokens of every short prompt's answer")
    parser.add_argument("--long-prompt", type=int, default=1500, help="tokens of every long prompt (at least)")
    parser.add_argument("--long-answer", type=int, default=8, help="max_tokens of every long prompt's answer")
    parser.add_argument("--context", type=int, default=2048, help="llama-server's context per slot; leanlm's window")
    parser.add_argument("--turns", type=int, default=80, help="turns of the long conversation")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the load test")
    parser.add_argument("--llama-bin", type=Path, default=None, help="directory of llama-server and llama-quantize")
    parser.add_argument("--workdir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "leanlm-serve")
    args = parser.parse_args()
    name = results_name("serve", args.model, args.tag)
    if args.report:
        return print_report(name, report)
    if args.long_prompt + args.long_answer + 64 > args.context:
        raise SystemExit(f"--context {args.context} cannot hold a {args.long_prompt}-token prompt and its answer")
    settings = {k: getattr(args, k) for k in ("tokens", "long_prompt", "long_answer", "context", "turns", "rounds")}
    study = Study(name, settings, args, plot=plot)
    binaries = llama_binaries(args.llama_bin)
    study.payload.update(model=args.model, cpu=cpu_description(), llama_cpp=binaries and binaries.parents[1].name)
    work = args.workdir / Path(args.model).name  # a model directory's own name, not its whole path
    work.mkdir(parents=True, exist_ok=True)
    prepare(args, work, binaries)
    sentences = long_prompt_sentences(args.model, args.long_prompt)
    for count in study.todo("clients", [str(c) for c in sorted(args.clients)]):
        commands = systems(args, work, binaries, int(count))
        load_before = os.getloadavg()[0]
        running: dict[str, Server] = {}
        try:
            for row, (command, _) in commands.items():
                running[row] = Server(command, work / f"{row.replace(' ', '_')}_{count}.log")
            served = {row: (server.url, commands[row][1]) for row, server in running.items()}
            rows = load_rounds(served, int(count), args, sentences)
            for row, server in running.items():
                rows[row]["peak_rss_bytes"] = server.peak_rss()
        finally:
            for server in running.values():
                server.stop()
        study.record("clients", count, {"rows": rows, "load_average": [load_before, os.getloadavg()[0]]})
    if args.turns and study.pending("conversation"):
        command, model = systems(args, work, None, 1)[f"{LEANLM} bf16"]
        server = Server(command, work / "conversation.log")
        try:
            study.set("conversation", conversation(server.url, model, args.turns, 16, server.rss))
        finally:
            server.stop()
    print(report(study.payload))
    print(f"wrote {study.path}")


if __name__ == "__main__":
    main()
