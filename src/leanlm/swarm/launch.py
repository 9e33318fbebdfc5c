"""`leanlm swarm`: a whole SWARM on this machine. Starts a DHT root, peers (one process each, stages assigned
round-robin) and trainers, all on 127.0.0.1; shows a status line per second (peers per stage, optimizer steps,
throughput, loss); can kill peers and start new ones on a schedule (fault tolerance); stops everything it
started when the steps are done or the time is up."""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from dataclasses import dataclass, field

from leanlm.data import plain_text
from leanlm.errors import ConfigError, SwarmError
from leanlm.settings import option
from leanlm.swarm.model import byte_blocks
from leanlm.swarm.peer import SwarmSettings, end_process_group, make_dht, run_peer, stage_peers
from leanlm.swarm.trainer import run_trainer


@dataclass(frozen=True)
class SwarmRun:
    settings: SwarmSettings = option(SwarmSettings(), "what every peer and trainer runs", cli=False)
    peers: int = option(6, "peer processes, stages assigned round-robin")
    trainers: int = option(2, "trainer processes")
    max_steps: int = option(20, "optimizer steps of the slowest stage")
    max_seconds: float = option(300.0, "stop after this long in any case (start-up included)")
    # The fault schedule and `train_seconds` count from the first finished micro-batch, not from the launch: how long
    # spawning the processes and bootstrapping the DHT takes depends on the machine's load (20 s alone here, more
    # on a busy CI machine), and a kill must land in the middle of training, not before it.
    # End this long after training started (None: max_steps / max_seconds). A peer that joins late is given the
    # training time its schedule promised (`train_seconds` minus its join time) from the moment it announces itself
    # in the DHT, which on a loaded machine can be well after it was started; `max_seconds` still bounds the run.
    train_seconds: float | None = None
    kill: tuple[tuple[float, int], ...] = ()  # (seconds of training, peer index) to SIGKILL
    join: tuple[tuple[float, int], ...] = ()  # (seconds of training, stage) of peers that join late
    slow_peers: dict[int, float] = field(default_factory=dict)  # peer index -> seconds per sample of extra work
    assignment: tuple[int, ...] = ()  # stage of each peer; default round-robin

    def __post_init__(self):
        for name in ("peers", "trainers", "max_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not self.max_seconds > 0:
            raise ConfigError(f"max_seconds must be positive, got {self.max_seconds}")
        stages = self.settings.model.stages
        if self.peers < stages:
            raise ConfigError(f"peers {self.peers} cannot serve {stages} stages (at least one peer per stage)")


@dataclass
class ProcessWatch:
    """What the launcher has heard from the processes it started (their `events`): a peer that ends before it
    serves, or a trainer that ends at all, stops the run at once with the process's error (waiting out
    `max_seconds` would only hide it); a peer that ends after serving is a lost peer, which the swarm survives."""

    serving: set[int] = field(default_factory=set)  # pids
    errors: dict[int, str] = field(default_factory=dict)  # pid -> the error it reported
    lost: dict[int, str] = field(default_factory=dict)  # pid -> "peer i (stage s): error", lost after serving

    def hear(self, events) -> None:
        try:
            while True:
                pid, state, detail = events.get_nowait()
                if state == "serving":
                    self.serving.add(pid)
                else:
                    self.errors[pid] = detail
        except queue.Empty:
            pass

    def check(self, events, peers: list, peer_stages: list[int], trainers: list, killed: set[int]) -> list[str]:
        """Raise SwarmError as above; returns the peers newly lost after serving."""
        ended = [
            (f"peer {index} (stage {peer_stages[index]})", process, True)
            for index, process in enumerate(peers)
            if process.exitcode is not None and process.pid not in killed
        ] + [
            (f"trainer {index}", process, False)
            for index, process in enumerate(trainers)
            if process.exitcode is not None
        ]
        self.hear(events)  # after the exit codes: an ended process reported before it ended
        newly = []
        for name, process, is_peer in ended:
            why = self.errors.get(process.pid) or f"exit code {process.exitcode}"
            if not is_peer or process.pid not in self.serving:
                when = "while training" if process.pid in self.serving else "before it could serve"
                raise SwarmError(f"{name} ended {when}: {why}")
            if process.pid not in self.lost:
                self.lost[process.pid] = f"{name}: {why}"
                newly.append(self.lost[process.pid])
        return newly


def _peer_epochs(dht, settings: SwarmSettings) -> list[dict[str, int]]:
    """Per stage: {peer id: the optimizer step (epoch) it announces}."""
    return [
        {peer: entry.get("epoch", 0) for peer, entry in stage_peers(dht, settings, stage).items()}
        for stage in range(settings.model.stages)
    ]


def run_local_swarm(run: SwarmRun, progress: bool = True) -> dict:
    context = mp.get_context("spawn")
    settings = run.settings
    root = make_dht([])
    initial = [str(address) for address in root.get_visible_maddrs()]
    blocks = byte_blocks(plain_text("lambada-dev"), settings.model.seq_len)
    stop = context.Event()
    results = context.Queue()
    events = context.Queue()
    started = time.monotonic()
    lifetime = run.max_seconds + 20  # children end themselves even if this process is killed

    def start_peer(stage: int, slowdown: float = 0.0):
        peer_settings = settings if not slowdown else SwarmSettings(**{**settings.__dict__, "slowdown": slowdown})
        process = context.Process(target=run_peer, args=(peer_settings, stage, initial, lifetime, events))
        process.start()
        peer_stages.append(stage)
        return process

    peer_stages = []  # the stage each started peer was given
    stages = run.assignment or tuple(i % settings.model.stages for i in range(run.peers))
    peers = [start_peer(stage, run.slow_peers.get(i, 0.0)) for i, stage in enumerate(stages)]
    trainers = [
        context.Process(
            target=run_trainer,
            args=(settings, initial, blocks, 1000 + i, lifetime, stop, results, events),
        )
        for i in range(run.trainers)
    ]
    for process in trainers:
        process.start()
    kills, joins = sorted(run.kill), sorted(run.join)
    seen = [set() for _ in range(settings.model.stages)]  # per stage: every peer id announced so far
    awaited = []  # (stage, ids seen before the join, seconds of training promised) of joined peers not yet announced
    end_at = run.train_seconds  # seconds of training after which the run ends
    losses, status = [], []
    watch = ProcessWatch()
    killed = set()  # pids of the peers the fault schedule killed
    steps = 0
    training_started = None  # monotonic time of the first finished micro-batch
    try:
        while time.monotonic() - started < run.max_seconds:
            elapsed = time.monotonic() - started
            try:
                while True:
                    at, loss, samples, _ = results.get_nowait()
                    losses.append((at, loss, samples))
                    training_started = training_started or time.monotonic()
            except queue.Empty:
                pass
            training = None if training_started is None else time.monotonic() - training_started
            if training is not None:
                while kills and kills[0][0] <= training:
                    victim = peers[kills.pop(0)[1]].pid
                    end_process_group(victim)  # the peer and its helpers, like a lost machine
                    killed.add(victim)
                while joins and joins[0][0] <= training:
                    at, stage = joins.pop(0)
                    peers.append(start_peer(stage))
                    if run.train_seconds is not None:
                        awaited.append((stage, set(seen[stage]), run.train_seconds - at))
            for lost in watch.check(events, peers, peer_stages, trainers, killed):
                if progress:
                    print(f"[{elapsed:5.0f}s] lost {lost}", flush=True)
            peer_epochs = _peer_epochs(root, settings)
            for stage, ids in enumerate(peer_epochs):
                seen[stage].update(ids)
            for entry in [entry for entry in awaited if seen[entry[0]] - entry[1]]:
                awaited.remove(entry)
                end_at = max(end_at, training + entry[2])
            counts, epochs = [len(e) for e in peer_epochs], [max(e.values(), default=0) for e in peer_epochs]
            steps = max(steps, min(epochs))
            recent = [s for at, _, s in losses if at > time.time() - 10]
            line = {
                "seconds": round(elapsed, 1),
                "training_seconds": None if training is None else round(training, 1),
                "peers_per_stage": counts,
                "steps_per_stage": epochs,
                "peer_epochs": peer_epochs,
                "samples_per_second": sum(recent) / 10 if recent else 0.0,
                "loss": losses[-1][1] if losses else None,
            }
            status.append(line)
            if progress:
                print(
                    f"[{elapsed:5.0f}s] peers/stage {counts}  steps/stage {epochs}  "
                    f"{line['samples_per_second']:.1f} samples/s  loss {line['loss'] if line['loss'] is None else round(line['loss'], 3)}",
                    flush=True,
                )
            if steps >= run.max_steps or (
                end_at is not None and training is not None and training >= end_at and not awaited
            ):
                break
            time.sleep(1.0)
    finally:
        stop.set()
        for process in trainers:  # a trainer stops after its current micro-batch
            process.join(timeout=10)
        for process in trainers + peers:  # peers hold nothing that must outlive the run
            end_process_group(process.pid)  # also the helpers hivemind forked, which outlive a lone SIGKILL
            process.join(timeout=5)
        root.shutdown()
    total_seconds = time.monotonic() - started
    samples = sum(s for _, _, s in losses)
    first = [loss for _, loss, _ in losses[:5]]
    last = [loss for _, loss, _ in losses[-5:]]
    return {
        "steps": steps,
        "loss_first": sum(first) / len(first) if first else None,
        "loss_last": sum(last) / len(last) if last else None,
        "peers_failed": len(killed) + len(watch.lost),
        "peer_errors": list(watch.lost.values()),
        "samples_per_second": samples / total_seconds,
        "seconds": total_seconds,
        "losses": [loss for _, loss, _ in losses],
        "status": status,
    }
