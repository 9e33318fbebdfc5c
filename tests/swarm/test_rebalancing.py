"""Adaptive rebalancing's decision (Dettmers' thesis section 6.3.3) and the hand-over of a moving peer to its fresh start,
without starting a swarm."""

from types import SimpleNamespace

import pytest

from leanlm.errors import ConfigError
from leanlm.swarm import SwarmModelConfig, SwarmSettings
from leanlm.swarm import peer as peer_module
from leanlm.swarm.peer import StagePeer, peer_arguments, restart_peer


def decide(monkeypatch, announced: dict[int, dict[str, int]], peer_id: str, stage: int) -> int | None:
    """`rebalance_target` of peer `peer_id` serving `stage`, with `announced` = {stage: {peer: queue length}}."""
    monkeypatch.setattr(
        peer_module, "stage_peers", lambda dht, settings, s: {p: {"queue": q} for p, q in announced.get(s, {}).items()}
    )
    me = SimpleNamespace(dht=None, settings=SwarmSettings(), stage_index=stage, peer_id=peer_id)
    return StagePeer.rebalance_target(me)


def test_the_first_peer_of_the_idlest_stage_moves_to_the_busiest(monkeypatch):
    announced = {0: {"a": 0, "b": 1}, 1: {"c": 6, "d": 4}, 2: {"e": 1, "f": 2}}
    assert decide(monkeypatch, announced, "a", 0) == 1
    assert decide(monkeypatch, announced, "b", 0) is None  # only the first peer (by id) of the stage moves
    assert decide(monkeypatch, announced, "e", 2) is None  # stage 2 is not the idlest


def test_no_move_that_empties_a_stage_or_chases_a_small_imbalance(monkeypatch):
    assert decide(monkeypatch, {0: {"a": 0}, 1: {"c": 6, "d": 6}, 2: {"e": 1}}, "a", 0) is None  # last peer
    # 1.5 per peer against 1.0: below the 2x ratio, nothing moves
    assert decide(monkeypatch, {0: {"a": 1, "b": 1}, 1: {"c": 2, "d": 1}, 2: {"e": 1, "f": 2}}, "a", 0) is None


def test_a_moving_peer_hands_its_exact_settings_to_its_fresh_start(monkeypatch):
    settings = SwarmSettings(
        model=SwarmModelConfig(stages=4, hidden=64, heads=2),
        micro_batch=2,
        in_flight=3,
        rebalance_seconds=7.5,
        slowdown=0.1,
    )
    received = []
    monkeypatch.setattr(peer_module, "run_peer", lambda *arguments: received.append(arguments))
    restart_peer(peer_arguments(settings, 2, ["/ip4/127.0.0.1/tcp/1/p2p/x"], 12.5))
    assert received == [(settings, 2, ["/ip4/127.0.0.1/tcp/1/p2p/x"], 12.5)]


@pytest.mark.parametrize("field", ["micro_batch", "in_flight", "target_batch", "average_state_every"])
def test_swarm_settings_refuse_counts_below_one(field):
    with pytest.raises(ConfigError, match=field):
        SwarmSettings(**{field: 0})
