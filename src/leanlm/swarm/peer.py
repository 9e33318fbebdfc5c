"""A SWARM peer (Dettmers' thesis section 6.3.2): serves one pipeline stage over hivemind's peer-to-peer RPC, announces
itself (and its queue length) in the DHT, accumulates parameter gradients from the backward passes it serves,
and synchronises with the other peers of its stage through `hivemind.Optimizer` (gradient all-reduce within the
stage, delayed parameter updates, and the latest parameters + optimizer state downloaded by a peer that joins).

Backward is stateless: the trainer sends the stage's inputs with the output gradients, the peer recomputes the
forward (activation checkpointing) and returns the input gradients, so any peer of the stage can serve it.
Every T seconds the peer looks at the per-peer queue length of every stage; the first peer (by id) of the least
loaded stage moves to the most loaded one when that is clearly busier (adaptive rebalancing, section 6.3.3).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import multiprocessing as mp
import os
import resource
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import hivemind
import torch
from hivemind.p2p import P2PContext, ServicerBase
from hivemind.proto import runtime_pb2
from hivemind.utils import get_dht_time

from leanlm.errors import ConfigError, one_line
from leanlm.settings import option
from leanlm.swarm import compression
from leanlm.swarm.model import Stage, SwarmModelConfig

LOCALHOST = ["/ip4/127.0.0.1/tcp/0"]  # every peer listens on the loopback only


@dataclass(frozen=True)
class SwarmSettings:
    model: SwarmModelConfig = option(SwarmModelConfig(), "the pipeline's model", cli=False)
    run_id: str = option("leanlm_swarm", "the swarm's name in the DHT", cli=False)
    micro_batch: int = option(4, "samples per micro-batch")
    # With one micro-batch in flight, all stages but one idle.
    in_flight: int = option(4, "micro-batches each trainer keeps in the pipeline at once")
    target_batch: int = option(32, "samples per optimizer step of a stage (summed over its peers)")
    lr: float = option(1e-3, "Adam learning rate", cli=False)
    compress: bool = option(
        True,
        "8-bit block-wise activations and gradients between stages",
        flag="--no-compression",
        off="send activations and gradients between stages in float",
    )
    announce_seconds: float = option(1.0, "seconds between a peer's load announcements", cli=False)
    rebalance_seconds: float = option(10.0, "T of adaptive rebalancing; 0 = off")
    rebalance_ratio: float = 2.0  # move only when the busiest stage's per-peer queue is this many times the idlest
    matchmaking_seconds: float = 1.0
    # A stage's all-reduce that cannot assemble its group gives up after this long and the step uses the local
    # gradients. Every peer's next step waits for it, so on 127.0.0.1 (an all-reduce of these stages takes
    # milliseconds) a short limit is what keeps a lost peer from stalling its stage.
    averaging_timeout: float = 5.0
    # Parameters and optimizer state are averaged every this many steps (the gradients every step): hivemind's
    # default of every step doubles the all-reduce rounds a stage must assemble.
    average_state_every: int = 10
    request_timeout: float = 20.0
    # How long a peer's progress and state-donor records live in the DHT (live peers re-publish at half of it).
    # hivemind's defaults (60 s / 30 s) keep a killed peer's higher epoch visible that long, and the survivors of
    # its stage stall trying to download state from it; on 127.0.0.1 a short life costs nothing.
    record_seconds: float = 10.0
    slowdown: float = 0.0  # seconds of extra work per sample (heterogeneous peers in experiments)

    def __post_init__(self):
        for name in ("micro_batch", "in_flight", "target_batch", "average_state_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.rebalance_seconds < 0:
            raise ConfigError(f"rebalance_seconds must be 0 (off) or more, got {self.rebalance_seconds}")

    def stage_key(self, stage: int) -> str:
        return f"{self.run_id}_stage{stage}"  # also the hivemind run id of the stage (no dots allowed)


def make_dht(initial_peers: list[str], client_mode: bool = False) -> hivemind.DHT:
    return hivemind.DHT(
        initial_peers=initial_peers,
        host_maddrs=LOCALHOST,
        client_mode=client_mode,
        use_relay=False,
        use_auto_relay=False,
        start=True,
    )


def stage_peers(dht: hivemind.DHT, settings: SwarmSettings, stage: int) -> dict[str, dict]:
    """{peer id: its latest announcement} for the peers currently serving `stage`."""
    found = dht.get(settings.stage_key(stage), latest=True)
    if found is None or not isinstance(found.value, dict):
        return {}
    return {peer: entry.value for peer, entry in found.value.items() if isinstance(entry.value, dict)}


class StagePeer(ServicerBase):
    def __init__(self, dht: hivemind.DHT, settings: SwarmSettings, stage: int):
        self.dht, self.settings = dht, settings
        self.executor = ThreadPoolExecutor(max_workers=1)  # one computation at a time: the rest queue up
        self.queued = 0
        self.samples = 0
        self.moving = False  # while True, requests are refused (their trainers re-route them)
        self.peer_id = dht.peer_id.to_base58()
        self.stage_index = stage
        self.stage = Stage(self.settings.model, stage)
        self.optimizer = hivemind.Optimizer(
            dht=self.dht,
            run_id=self.settings.stage_key(stage),
            params=self.stage.parameters(),
            optimizer=lambda params: torch.optim.Adam(params, lr=self.settings.lr),
            target_batch_size=self.settings.target_batch,
            batch_size_per_step=self.settings.micro_batch,
            # Delayed parameter updates (section 6.3.2): all-reduce and step run in the background while the peer
            # keeps serving with the previous parameters.
            delay_optimizer_step=True,
            delay_grad_averaging=True,
            matchmaking_time=self.settings.matchmaking_seconds,
            averaging_timeout=self.settings.averaging_timeout,
            average_state_every=self.settings.average_state_every,
            verbose=False,
            averager_opts={
                "request_timeout": self.settings.matchmaking_seconds / 2,
                "declare_state_period": self.settings.record_seconds,
            },
            tracker_opts={"metadata_expiration": self.settings.record_seconds},
        )
        if stage_peers(self.dht, self.settings, stage):
            self.optimizer.load_state_from_peers()  # a joining (or moving) peer catches up with its stage

    def leave(self) -> None:
        """Withdraw the announcement at once, so trainers stop routing here before the record would expire."""
        self.dht.store(
            self.settings.stage_key(self.stage_index),
            subkey=self.peer_id,
            value=None,
            expiration_time=get_dht_time() + 1,
        )

    def announce(self) -> None:
        self.dht.store(
            self.settings.stage_key(self.stage_index),
            subkey=self.peer_id,
            value={"queue": self.queued, "epoch": self.optimizer.local_epoch, "samples": self.samples},
            expiration_time=get_dht_time() + 5 * self.settings.announce_seconds,
        )

    def rebalance_target(self) -> int | None:
        """The stage this peer should move to now (section 6.3.3), or None: only the first peer (by id) of the
        least loaded stage moves, only if its stage keeps a peer, and only to a stage whose queue per peer is at
        least `rebalance_ratio` times this one's."""
        loads = {}
        for stage in range(self.settings.model.stages):
            peers = stage_peers(self.dht, self.settings, stage)
            loads[stage] = (sum(p.get("queue", 0) for p in peers.values()) / max(1, len(peers)), sorted(peers))
        idlest = min(loads, key=lambda s: loads[s][0])
        busiest = max(loads, key=lambda s: loads[s][0])
        mine = loads[self.stage_index]
        if (
            self.stage_index != idlest
            or len(mine[1]) < 2
            or mine[1][0] != self.peer_id
            or loads[busiest][0] < self.settings.rebalance_ratio * max(mine[0], 0.5)
        ):
            return None
        return busiest

    def _check_stage(self, request: runtime_pb2.ExpertRequest) -> None:
        if self.moving:
            raise ValueError(f"this peer is moving away from stage {self.stage_index}")
        if request.uid != self.settings.stage_key(self.stage_index):
            raise ValueError(f"this peer now serves stage {self.stage_index}, not {request.uid}")

    async def _run(self, function, request: runtime_pb2.ExpertRequest) -> runtime_pb2.ExpertResponse:
        self._check_stage(request)
        self.queued += 1
        try:
            inputs = compression.decode(list(request.tensors))
            outputs = await asyncio.get_running_loop().run_in_executor(self.executor, function, *inputs)
        finally:
            self.queued -= 1
        return runtime_pb2.ExpertResponse(tensors=compression.encode(outputs, self.settings.compress))

    def _forward(self, inputs: torch.Tensor) -> list[torch.Tensor]:
        with torch.no_grad():
            return [self.stage(inputs)]

    def _backward(self, inputs: torch.Tensor, target: torch.Tensor) -> list[torch.Tensor]:
        """Recompute the forward with gradients, backpropagate `target` (output gradients, or for the last
        stage the byte ids whose loss it computes), step the stage's optimizer; returns the input gradients."""
        if self.settings.slowdown:
            time.sleep(self.settings.slowdown * len(inputs))
        inputs = inputs if self.stage.first else inputs.detach().requires_grad_(True)
        outputs = self.stage(inputs)
        if self.stage.last:
            loss = Stage.loss(outputs, target)
            loss.backward()
            result = [inputs.grad, loss.detach().reshape(1)]
        else:
            outputs.backward(target)
            result = [inputs.grad] if not self.stage.first else [torch.zeros(1)]
        self.optimizer.step(batch_size=len(inputs))
        self.optimizer.zero_grad()
        self.samples += len(inputs)
        return result

    async def rpc_forward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        return await self._run(self._forward, request)

    async def rpc_backward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        return await self._run(self._backward, request)


def lead_own_process_group() -> None:
    """Make this process the leader of a new process group. hivemind forks helpers (the DHT, averagers) and
    starts a p2p daemon; a SIGKILL to this process alone leaves them running as orphans, a SIGKILL to the group
    (`end_process_group`) ends them all, which is also what a peer's machine going down looks like."""
    os.setpgid(0, 0)


def end_process_group(pid: int) -> None:
    """SIGKILL the group `pid` leads; a process that has not made its group yet is killed alone."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def exit_after(seconds: float, dht: hivemind.DHT) -> None:
    """A bounded run always ends: whatever this process is waiting on, it and its helpers end after `seconds`,
    even if the launcher was killed."""

    def watchdog():
        time.sleep(seconds)
        threading.Thread(target=dht.shutdown, daemon=True).start()
        time.sleep(3)
        end_process_group(os.getpid())

    threading.Thread(target=watchdog, daemon=True).start()


def share_memory_without_a_daemon() -> None:
    """Share tensors with the helpers this process forks through file descriptors. hivemind selects torch's
    `file_system` strategy, where every `share_memory_` waits at most one second for the torch_shm_manager daemon
    to answer: on a loaded machine the wait runs out and the process dies at start-up. The descriptor strategy
    needs no daemon and holds a descriptor per shared tensor, so the soft limit on open files is raised to the
    hard one."""
    torch.multiprocessing.set_sharing_strategy("file_descriptor")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def report(events, state: str, detail: str = "") -> None:
    """Tell the launcher's queue `events` (if any) that this process is "serving", or "failed" with `detail`."""
    if events is not None:
        events.put((os.getpid(), state, detail))


@contextlib.contextmanager
def swarm_process(events=None):
    """What every process of a swarm run does first, and its failure report: it leads its own process group,
    computes on one thread, lets hivemind's averagers fork their helpers (the process itself was spawned) and
    shares tensors without a daemon; an error inside is reported to `events` as "failed" before it propagates."""
    lead_own_process_group()
    torch.set_num_threads(1)
    mp.set_start_method("fork", force=True)
    share_memory_without_a_daemon()
    try:
        yield
    except Exception as error:
        report(events, "failed", f"{type(error).__name__}: {one_line(error)}")
        raise


def run_peer(settings: SwarmSettings, stage: int, initial_peers: list[str], duration: float, events=None) -> None:
    """Process entry point: serve `stage` for at most `duration` seconds (a bounded run always ends). A peer that
    rebalancing moves to another stage starts afresh there: this process is replaced (same pid and process group,
    so whoever started it still ends it) by a new peer of the new stage, which downloads the stage's latest
    parameters and optimizer state. A move inside one process would have to fork hivemind's averager helpers from
    a process whose threads are serving requests, and hivemind installs signal handlers, which only the main
    thread may do. `events` (the launcher's queue) hears "serving" once this peer answers requests."""
    with swarm_process(events):
        deadline = time.monotonic() + duration
        dht = make_dht(initial_peers)
        exit_after(duration + 5, dht)
        peer = StagePeer(dht, settings, stage)

        async def serve() -> int | None:
            """Serve until the deadline (None) or until this peer should move (the stage to move to)."""
            p2p = await dht.replicate_p2p()
            await peer.add_p2p_handlers(p2p)
            report(events, "serving")
            loop = asyncio.get_running_loop()
            next_rebalance = time.monotonic() + settings.rebalance_seconds
            while time.monotonic() < deadline:
                await loop.run_in_executor(None, peer.announce)
                if settings.rebalance_seconds and time.monotonic() >= next_rebalance:
                    next_rebalance = time.monotonic() + settings.rebalance_seconds
                    target = await loop.run_in_executor(None, peer.rebalance_target)
                    if target is not None:
                        peer.moving = True
                        await loop.run_in_executor(None, peer.leave)
                        # The executor runs one job at a time in order: once this no-op has run, every request
                        # accepted before the move has finished (and stepped the stage's optimizer).
                        await loop.run_in_executor(peer.executor, lambda: None)
                        return target
                await asyncio.sleep(settings.announce_seconds)
            return None

        try:
            target = asyncio.run(serve())
        finally:
            peer.optimizer.shutdown()
            dht.shutdown()
    remaining = deadline - time.monotonic()
    if target is not None and remaining > 0:
        sys.stdout.flush()
        sys.stderr.flush()
        fresh_start = "import sys; from leanlm.swarm.peer import restart_peer; restart_peer(sys.argv[1])"
        os.execv(
            sys.executable,
            [sys.executable, "-c", fresh_start, peer_arguments(settings, target, initial_peers, remaining)],
        )


def peer_arguments(settings: SwarmSettings, stage: int, initial_peers: list[str], duration: float) -> str:
    """`run_peer`'s arguments as the JSON a moving peer hands to its fresh start."""
    return json.dumps(
        {"settings": dataclasses.asdict(settings), "stage": stage, "initial_peers": initial_peers, "duration": duration}
    )


def restart_peer(arguments: str) -> None:
    """What a moving peer re-executes (see `run_peer`): `arguments` is `peer_arguments`' JSON."""
    arguments = json.loads(arguments)
    settings = arguments["settings"]
    settings = SwarmSettings(**{**settings, "model": SwarmModelConfig(**settings["model"])})
    run_peer(settings, arguments["stage"], arguments["initial_peers"], arguments["duration"])
