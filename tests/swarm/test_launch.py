"""How a swarm run on this machine watches its processes: a peer that cannot start stops the run at once with its
error, a peer lost while training is survived, and no process depends on torch's shared-memory daemon."""

import multiprocessing as mp
import queue
import resource
from types import SimpleNamespace

import pytest
import torch

from leanlm.errors import SwarmError
from leanlm.swarm import SwarmModelConfig, SwarmSettings
from leanlm.swarm.launch import ProcessWatch
from leanlm.swarm.peer import run_peer, share_memory_without_a_daemon

pytest.importorskip("hivemind", reason="hivemind is a leanlm dependency")


def ended(pid: int, code: int | None = 1) -> SimpleNamespace:
    return SimpleNamespace(pid=pid, exitcode=code)


def test_a_peer_that_cannot_start_stops_the_run_with_its_own_error():
    context = mp.get_context("spawn")
    events = context.Queue()
    settings = SwarmSettings(model=SwarmModelConfig(stages=2, layers_per_stage=1, hidden=32, heads=2, seq_len=16))
    # An initial peer whose address does not parse: the peer's DHT cannot start.
    peer = context.Process(target=run_peer, args=(settings, 1, ["/ip4/127.0.0.1/tcp/1/p2p/QmNotAPeer"], 30, events))
    peer.start()
    peer.join(60)
    assert peer.exitcode not in (None, 0)
    with pytest.raises(
        SwarmError, match=r"^peer 0 \(stage 1\) ended before it could serve: P2PDaemonError: .*QmNotAPeer"
    ):
        ProcessWatch().check(events, [peer], [1], [], killed=set())


def test_a_peer_lost_while_serving_is_survived_and_counted_once():
    events, watch = queue.Queue(), ProcessWatch()
    for pid in (11, 12, 13, 20):
        events.put((pid, "serving", ""))
    peers, trainers = [ended(11, None), ended(12), ended(13, -9)], [ended(20, None)]
    events.put((12, "failed", "RuntimeError: boom"))
    assert watch.check(events, peers, [0, 1, 0], trainers, killed={13}) == ["peer 1 (stage 1): RuntimeError: boom"]
    assert watch.check(events, peers, [0, 1, 0], trainers, killed={13}) == []  # noted once; the killed peer is no loss
    assert list(watch.lost.values()) == ["peer 1 (stage 1): RuntimeError: boom"]


def test_a_trainer_that_ends_stops_the_run():
    events = queue.Queue()
    events.put((20, "serving", ""))
    with pytest.raises(SwarmError, match=r"^trainer 0 ended while training: exit code -11$"):
        ProcessWatch().check(events, [], [], [ended(20, -11)], killed=set())


def test_tensors_are_shared_without_the_shared_memory_daemon():
    before = torch.multiprocessing.get_sharing_strategy()
    try:
        share_memory_without_a_daemon()
        assert torch.multiprocessing.get_sharing_strategy() == "file_descriptor"
        assert torch.zeros(4).share_memory_().is_shared()
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        assert soft == hard
    finally:
        torch.multiprocessing.set_sharing_strategy(before)
