import torch

from leanlm.swarm import PeerBalancer, Stage, SwarmModelConfig, compression, full_model


def test_stages_compose_into_the_single_process_model():
    config = SwarmModelConfig(stages=3, layers_per_stage=1, hidden=32, heads=2, seq_len=16)
    ids = torch.randint(0, 256, (2, 16))
    hidden = ids
    for index in range(3):
        hidden = Stage(config, index)(hidden)  # every peer of a stage builds the same weights
    torch.testing.assert_close(hidden, full_model(config)(ids))
    assert Stage.loss(hidden, ids).item() > 0


def test_activations_travel_compressed_to_8_bits_within_a_stated_error():
    x = torch.randn(4, 16, 32)
    ids = torch.randint(0, 256, (4, 16))
    restored, exact_ids = compression.decode(compression.encode([x, ids], compress=True))
    assert torch.equal(exact_ids, ids)  # integers are never compressed
    assert ((restored - x).norm() / x.norm()).item() < 0.02
    assert torch.equal(compression.decode(compression.encode([x], compress=False))[0], x)


def test_the_balancer_sends_twice_as_many_micro_batches_to_a_peer_twice_as_fast():
    balancer = PeerBalancer(alpha=0.5)
    balancer.update_peers(["fast", "slow"])
    chosen = []
    for _ in range(300):
        peer = balancer.choose(4)
        balancer.report(peer, 4, 0.1 if peer == "fast" else 0.2)
        chosen.append(peer)
    ratio = chosen[100:].count("fast") / chosen[100:].count("slow")
    assert 1.7 < ratio < 2.3
    balancer.ban("fast")
    assert balancer.choose(4) == "slow"
    balancer.update_peers(["slow"])
    assert "fast" not in balancer.load
