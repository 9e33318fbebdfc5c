"""A SWARM trainer (Dettmers' thesis section 6.3.2): holds no parameters; routes each micro-batch forward and backward
through one peer per stage, found in the DHT and chosen by `PeerBalancer`, and re-routes a request when its peer
fails or times out."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time

import torch
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2

from leanlm.swarm import compression
from leanlm.swarm.peer import StagePeer, SwarmSettings, exit_after, make_dht, report, stage_peers, swarm_process
from leanlm.swarm.routing import PeerBalancer


class NoPeerError(RuntimeError):
    pass


class SwarmTrainer:
    def __init__(self, dht, p2p, settings: SwarmSettings, seed: int):
        self.dht, self.p2p, self.settings = dht, p2p, settings
        self.balancers = [PeerBalancer(seed=seed + stage) for stage in range(settings.model.stages)]
        self.refreshed = [0.0] * settings.model.stages
        self.failures = 0

    def _refresh(self, stage: int) -> None:
        """Re-read the stage's peers from the DHT now and then (a DHT read costs more than a micro-batch here),
        at once when no peer is left to try. Runs in a worker thread: the time is taken first so that the other
        micro-batches in flight do not start the same read."""
        if time.monotonic() - self.refreshed[stage] > 5 * self.settings.announce_seconds:
            self.refreshed[stage] = time.monotonic()
            self.balancers[stage].update_peers(stage_peers(self.dht, self.settings, stage))

    async def call(self, stage: int, method: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        request = runtime_pb2.ExpertRequest(
            uid=self.settings.stage_key(stage), tensors=compression.encode(tensors, self.settings.compress)
        )
        deadline = time.monotonic() + 3 * self.settings.request_timeout
        while time.monotonic() < deadline:
            await asyncio.get_running_loop().run_in_executor(None, self._refresh, stage)
            peer = self.balancers[stage].choose(len(tensors[0]))
            if peer is None:
                self.refreshed[stage] = 0.0
                await asyncio.sleep(0.2)
                continue
            stub = StagePeer.get_stub(self.p2p, PeerID.from_base58(peer))
            started = time.monotonic()
            try:
                response = await asyncio.wait_for(
                    getattr(stub, f"rpc_{method}")(request), self.settings.request_timeout
                )
            except Exception:  # dead, unreachable, moved to another stage or too slow: any other peer will do
                self.balancers[stage].ban(peer)
                self.failures += 1
                continue
            self.balancers[stage].report(peer, len(tensors[0]), time.monotonic() - started)
            return compression.decode(list(response.tensors))
        raise NoPeerError(f"no peer of stage {stage} answered within {3 * self.settings.request_timeout:.0f} s")

    async def train_micro_batch(self, ids: torch.Tensor) -> float:
        activations = [ids]
        for stage in range(self.settings.model.stages - 1):
            activations += await self.call(stage, "forward", [activations[-1]])
        gradient, loss = await self.call(self.settings.model.stages - 1, "backward", [activations[-1], ids])
        for stage in reversed(range(self.settings.model.stages - 1)):
            gradient = (await self.call(stage, "backward", [activations[stage], gradient]))[0]
        return loss.item()


def run_trainer(
    settings: SwarmSettings,
    initial_peers: list[str],
    blocks: torch.Tensor,
    seed: int,
    duration: float,
    stop,
    results: mp.Queue,
    events=None,
) -> None:
    """Process entry point: train until `stop` is set or `duration` seconds pass; every micro-batch's loss goes
    to `results` as (time, loss, samples, failures so far). `events` (the launcher's queue) hears "serving" once
    micro-batches are routed."""
    with swarm_process(events):
        dht = make_dht(initial_peers, client_mode=True)
        exit_after(duration + 5, dht)
        generator = torch.Generator().manual_seed(seed)

        async def lane(trainer: SwarmTrainer, deadline: float):
            while time.monotonic() < deadline and not stop.is_set():
                ids = blocks[torch.randint(0, len(blocks), (settings.micro_batch,), generator=generator)]
                try:
                    loss = await trainer.train_micro_batch(ids)
                except NoPeerError:
                    continue
                results.put((time.time(), loss, len(ids), trainer.failures))

        async def loop():
            # Several micro-batches in flight at once fill the pipeline: while one is in stage 2, the next is in
            # stage 0 (a trainer that waited for each micro-batch would leave all but one stage idle).
            trainer = SwarmTrainer(dht, await dht.replicate_p2p(), settings, seed)
            report(events, "serving")
            deadline = time.monotonic() + duration
            await asyncio.gather(*(lane(trainer, deadline) for _ in range(settings.in_flight)))

        try:
            asyncio.run(loop())
        finally:
            dht.shutdown()
