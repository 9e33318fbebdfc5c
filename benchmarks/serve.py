"""`leanlm serve` under load, beside llama.cpp's OpenAI server on the same model: 1, 4 and 8 concurrent
streaming clients, the same prompts for every server, each server a subprocess on a free 127.0.0.1 port. All
servers run at once and are loaded in a rotated order, round by round (medians over --rounds rounds).
Per server and client count: aggregate tokens/s (streamed content chunks over wall time), time to first token
and the gaps between tokens (p50 / p99), the server's peak RSS; and the time to first token of one long prompt.
Then a long conversation against leanlm (every turn resends the whole history, as chat front ends do): tokens
read per turn and the server's resident memory, turn by turn. Writes benchmarks/results/serve_<model>.json + .png.

    python benchmarks/serve.py                         # leanlm FP32 / NF4 + DQ / SmoothQuant O3
    pip install -c constraints.txt -e ".[llama]"       # adds llama.cpp's server rows (compiles llama.cpp)
    python benchmarks/serve.py --tag xeon-amx          # another CPU's run, kept beside the first
    python benchmarks/serve.py --report

leanlm's servers generate through its fused decode step (the default); the "transformers" row runs `--no-fused`
(every request's token batched through transformers' forward) for comparison.

Bounded: every request has max_tokens (--tokens), every client count runs its clients once, every server is
stopped at the end of its row; nothing listens beyond 127.0.0.1.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
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

CLIENTS = (1, 4, 8)
TOPICS = ["the sea", "a mountain", "bread", "the moon", "a city", "rain", "a library", "music"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """A server subprocess on a free loopback port, stopped on exit."""

    def __init__(self, command: list[str], port: int, log: Path, *, timeout: float = 600):
        self.port = port
        # Its output goes to a file: a pipe nobody reads fills up and blocks a talkative server (llama.cpp's).
        with open(log, "wb") as output:
            self.process = subprocess.Popen(
                command,
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
            except OSError:
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


def stream_once(client, model: str, messages: list[dict], tokens: int) -> dict:
    """One streamed chat completion: when each content chunk arrived."""
    started = time.perf_counter()
    arrivals, text = [], []
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=tokens, temperature=0, stream=True
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.perf_counter() - started)
            text.append(chunk.choices[0].delta.content)
    return {"arrivals": arrivals, "text": "".join(text)}


def clients_round(client, model: str, tokens: int, clients: int, round_index: int) -> dict:
    """`clients` concurrent clients, each streaming one answer to its own prompt (new in every round, so no
    server answers from a cache of the previous round's; a shared system prompt stays shared)."""
    results: list[dict] = [{} for _ in range(clients)]

    def run(index: int) -> None:
        messages = [
            {
                "role": "user",
                "content": f"Story {round_index}.{index}: write a short story about {TOPICS[index % len(TOPICS)]}.",
            }
        ]
        results[index] = stream_once(client, model, messages, tokens)

    started = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    produced = sum(len(r["arrivals"]) for r in results)
    return {
        "tokens_per_second": produced / wall,
        "tokens": produced,
        "seconds": wall,
        "first": [r["arrivals"][0] for r in results if r["arrivals"]],
        "gaps": [b - a for r in results for a, b in zip(r["arrivals"], r["arrivals"][1:])],
    }


def long_prompt(round_index: int) -> str:
    """About 1,800 tokens, different from the first token on in every round (a cold prefill)."""
    return f"Document {round_index}. " + " ".join(
        f"Sentence {i} of a long document about {TOPICS[(i + round_index) % len(TOPICS)]}." for i in range(150)
    )


def load_rounds(servers: dict[str, tuple], tokens: int, rounds: int) -> dict:
    """Every server under 1, 4 and 8 clients and one long prompt, the servers taken in a rotated order in each of
    `rounds` rounds (so that a slow spell of this shared machine falls on all alike); medians over the rounds,
    latency percentiles over every sample."""
    import openai

    clients = {
        name: openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
        for name, (url, _) in servers.items()
    }
    for name, (_, model) in servers.items():  # warm-up
        stream_once(clients[name], model, [{"role": "user", "content": "Hello"}], 4)
    samples = {name: {str(c): [] for c in CLIENTS} | {"long": []} for name in servers}
    names = list(servers)
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            model = servers[name][1]
            for count in CLIENTS:
                samples[name][str(count)].append(clients_round(clients[name], model, tokens, count, round_index))
            long = stream_once(
                clients[name], model, [{"role": "user", "content": long_prompt(round_index) + " Summarise it."}], 8
            )
            samples[name]["long"].append(long["arrivals"][0] if long["arrivals"] else None)
        print(
            f"round {round_index + 1}/{rounds}: "
            + ", ".join(f"{name} {samples[name]['8'][-1]['tokens_per_second']:.0f}" for name in names)
            + " tok/s at 8 clients",
            flush=True,
        )
    rows = {}
    for name in names:
        row = {}
        for count in CLIENTS:
            runs = samples[name][str(count)]
            first = sorted(t for r in runs for t in r["first"])
            gaps = sorted(g for r in runs for g in r["gaps"])
            row[str(count)] = {
                "aggregate_tokens_per_second": statistics.median(r["tokens_per_second"] for r in runs),
                "tokens": [r["tokens"] for r in runs],
                "seconds": [r["seconds"] for r in runs],
                "ttft_p50_s": statistics.median(first),
                "ttft_max_s": max(first),
                "token_gap_p50_s": statistics.median(gaps) if gaps else None,
                "token_gap_p99_s": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] if gaps else None,
            }
        row["long_prompt_ttft_s"] = statistics.median(t for t in samples[name]["long"] if t is not None)
        rows[name] = row
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


def systems(args, work: Path) -> dict[str, list[str] | None]:
    """Row name -> the command that starts its server (with PORT for the port), None where it cannot run here."""
    leanlm = [sys.executable, "-m", "leanlm.cli.main", "serve"]
    window = ["--window", str(args.window), "--max-batch", "8"]
    rows: dict[str, list[str] | None] = {
        "leanlm FP32": [*leanlm, args.model, *window],
        "leanlm NF4+DQ": [*leanlm, str(work / "nf4"), *window],
        "leanlm NF4+DQ, int8 head": [*leanlm, str(work / "nf4"), *window, "--head", "int8"],
        "leanlm SmoothQuant O3": [*leanlm, str(work / "sq-o3"), *window],
        "leanlm NF4+DQ, transformers": [*leanlm, str(work / "nf4"), *window, "--no-fused"],
    }
    have_llama = all(
        importlib.util.find_spec(name) is not None
        for name in ("llama_cpp", "starlette_context", "pydantic_settings", "sse_starlette")
    )
    for name, file in (("llama.cpp Q4_0", work / "q4_0.gguf"), ("llama.cpp F32", work / "f32.gguf")):
        rows[name] = (
            [
                sys.executable,
                "-m",
                "llama_cpp.server",
                "--model",
                str(file),
                "--n_threads",
                "2",
                "--n_ctx",
                "4096",
                "--model_alias",
                args.model,
                # By default a new request interrupts the one being generated: every stream but one would end
                # early. Here each request runs to its end, as leanlm's do.
                "--interrupt_requests",
                "False",
            ]
            if have_llama
            else None
        )
    return rows


def prepare(args, work: Path) -> None:
    """The checkpoints and GGUF files the servers load (made once, kept in the work directory)."""
    if not (work / "nf4").exists():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "leanlm.cli.main",
                "quantize",
                args.model,
                "--method",
                "kbit",
                "--double-quant",
                "--out",
                str(work / "nf4"),
            ],
            check=True,
        )
    if not (work / "sq-o3").exists():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "leanlm.cli.main",
                "quantize",
                args.model,
                "--method",
                "smoothquant",
                "--level",
                "O3",
                "--no-bmm",
                "--calib-samples",
                "64",
                "--out",
                str(work / "sq-o3"),
            ],
            check=True,
        )
    try:
        from leanlm.bench.llama_cpp import quantize_gguf
        from leanlm.export import export_gguf
    except ImportError:
        return
    if not (work / "f32.gguf").exists():
        export_gguf(args.model, work / "f32.gguf", "f32")
    if not (work / "q4_0.gguf").exists():
        try:
            quantize_gguf(work / "f32.gguf", work / "q4_0.gguf", "q4_0")
        except ImportError:
            pass


def report(payload: dict) -> str:
    rows = payload.get("rows", {})
    load = payload.get("load_average")
    out = [
        f"{payload.get('cpu', 'this CPU')}; {payload['settings']['tokens']} tokens per answer, greedy"
        + (f"; load average {load[0]:.1f} before / {load[1]:.1f} after" if load else "")
    ]
    table = []
    for name, row in rows.items():
        table.append(
            [
                name,
                *(f"{row[str(c)]['aggregate_tokens_per_second']:.1f}" for c in CLIENTS),
                *(f"{row[str(c)]['ttft_p50_s']:.2f}" for c in CLIENTS),
                f"{1e3 * row['8']['token_gap_p50_s']:.0f} / {1e3 * row['8']['token_gap_p99_s']:.0f}",
                f"{row['long_prompt_ttft_s']:.2f}",
                f"{row['peak_rss_bytes'] / 2**20:,.0f}",
            ]
        )
    out.append(
        format_table(
            [
                "server",
                *(f"tok/s, {c} clients" for c in CLIENTS),
                *(f"TTFT p50 s, {c}" for c in CLIENTS),
                "token gap p50 / p99 ms, 8 clients",
                "TTFT long prompt s",
                "peak RSS MiB",
            ],
            table,
            markdown=True,
        )
    )
    trace = payload.get("conversation")
    if trace:
        window = payload["settings"]["window"]
        rss = [t["server_rss_bytes"] / 2**20 for t in trace]
        full = next((i for i, t in enumerate(trace) if t["prompt_tokens"] > window), None)
        out.append(
            f"conversation of {len(trace)} turns against leanlm FP32 (window {window}): history "
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


def plot(payload: dict, path) -> None:
    rows = payload.get("rows", {})
    if not rows:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    for name, row in rows.items():
        left.plot(CLIENTS, [row[str(c)]["aggregate_tokens_per_second"] for c in CLIENTS], marker="o", label=name)
    left.set_xlabel("concurrent streaming clients")
    left.set_ylabel("aggregate tokens/s")
    left.legend(fontsize=8)
    trace = payload.get("conversation", [])
    if trace:
        right.plot([t["prompt_tokens"] for t in trace], [t["server_rss_bytes"] / 2**20 for t in trace], marker=".")
        right.set_xlabel("conversation history, tokens (resent every turn)")
        right.set_ylabel("server RSS, MiB")
    save_figure(fig, path, titled(payload, "leanlm serve"))


def main() -> None:
    parser = study_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]), tag=True)
    parser.add_argument("--tokens", type=int, default=64, help="max_tokens of every answer")
    parser.add_argument("--window", type=int, default=1000, help="leanlm's sink-cache window")
    parser.add_argument("--turns", type=int, default=80, help="turns of the long conversation")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the load test")
    parser.add_argument("--workdir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "leanlm-serve")
    args = parser.parse_args()
    name = results_name("serve", args.model, args.tag)
    if args.report:
        return print_report(name, report)
    study = Study(
        name,
        {"tokens": args.tokens, "window": args.window, "turns": args.turns, "rounds": args.rounds},
        args,
        plot=plot,
    )
    study.payload.update(model=args.model, cpu=cpu_description())
    work = args.workdir / Path(args.model).name  # a model directory's own name, not its whole path
    work.mkdir(parents=True, exist_ok=True)
    prepare(args, work)
    commands = systems(args, work)
    if study.pending("rows"):
        load_before = os.getloadavg()[0]
        running: dict[str, Server] = {}
        try:
            for row, command in commands.items():
                if command is not None:
                    running[row] = Server(
                        command + ["--port", str(port := free_port())], port, work / f"{row.replace(' ', '_')}.log"
                    )
            rows = load_rounds(
                {
                    row: (server.url, args.model if row.startswith("llama.cpp") else _served_name(commands[row]))
                    for row, server in running.items()
                },
                args.tokens,
                args.rounds,
            )
            for row, server in running.items():
                rows[row]["peak_rss_bytes"] = server.peak_rss()
        finally:
            for server in running.values():
                server.stop()
        study.payload["load_average"] = [load_before, os.getloadavg()[0]]  # a shared machine: before / after
        study.set("rows", rows)
    if study.pending("conversation"):
        server = Server(commands["leanlm FP32"] + ["--port", str(port := free_port())], port, work / "conversation.log")
        try:
            study.set("conversation", conversation(server.url, args.model, args.turns, 16, server.rss))
        finally:
            server.stop()
    print(report(study.payload))
    print(f"wrote {study.path}")


def _served_name(command: list[str]) -> str:
    return command[command.index("serve") + 1]


if __name__ == "__main__":
    main()
