"""How a trainer picks the peer of a stage for each micro-batch (Dettmers' thesis section 6.3.2, "stochastic wiring"):
interleaved weighted round-robin. Every peer has a cumulative expected processing time; the next micro-batch
goes to the peer with the smallest, which then grows by the micro-batch's expected time there, from a moving
average (alpha = 0.1, bias-corrected) of that peer's measured seconds per sample. A peer twice as fast is thus
chosen twice as often. New peers enter at the current minimum so they are tried soon; a failed or timed-out peer
is banned for a while and the micro-batch goes to another peer of the stage."""

from __future__ import annotations

import random
import time


class PeerBalancer:
    def __init__(
        self, alpha: float = 0.1, initial_seconds_per_sample: float = 0.05, ban_seconds: float = 10.0, seed: int = 0
    ):
        self.alpha, self.initial, self.ban_seconds = alpha, initial_seconds_per_sample, ban_seconds
        self.load: dict[str, float] = {}  # cumulative expected seconds
        self.ema: dict[str, tuple[float, int]] = {}  # (moving average of seconds per sample, updates)
        self.banned_until: dict[str, float] = {}
        self.random = random.Random(seed)

    def update_peers(self, peers) -> None:
        peers = set(peers)
        for gone in set(self.load) - peers:
            del self.load[gone]
        floor = min(self.load.values(), default=0.0)
        for new in peers - set(self.load):
            self.load[new] = floor

    def seconds_per_sample(self, peer: str) -> float:
        if peer not in self.ema:
            return self.initial
        average, updates = self.ema[peer]
        return average / (1 - (1 - self.alpha) ** updates)

    def choose(self, samples: int) -> str | None:
        now = time.monotonic()
        available = [p for p in self.load if self.banned_until.get(p, 0.0) <= now]
        if not available:
            return None
        best = min(available, key=lambda p: (self.load[p], self.random.random()))
        self.load[best] += samples * self.seconds_per_sample(best)
        return best

    def report(self, peer: str, samples: int, seconds: float) -> None:
        average, updates = self.ema.get(peer, (0.0, 0))
        self.ema[peer] = (self.alpha * seconds / samples + (1 - self.alpha) * average, updates + 1)

    def ban(self, peer: str) -> None:
        self.banned_until[peer] = time.monotonic() + self.ban_seconds
