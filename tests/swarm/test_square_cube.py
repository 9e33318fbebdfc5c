from leanlm.swarm.square_cube import StageShape, stage_utilization


def test_compute_grows_as_the_square_of_the_hidden_size_and_communication_linearly():
    small, large = StageShape(1024, 1, 512, 1), StageShape(4096, 1, 512, 1)
    assert large.boundary_bytes() == 4 * small.boundary_bytes()
    assert 12 < large.forward_flops() / small.forward_flops() < 16  # H^2 terms dominate, L^2 H ones do not


def test_bigger_stages_hide_a_slow_network_and_latency_costs_more_for_small_ones():
    arguments = dict(flops_per_second=30e12, bandwidth_bits=500e6)
    base = StageShape(768, 1, 512, 1)
    gpt3 = StageShape(12288, 1, 512, 1)
    assert stage_utilization(gpt3, latency_seconds=0.0, **arguments) > 3 * stage_utilization(
        base, latency_seconds=0.0, **arguments
    )
    drop_small = stage_utilization(base, latency_seconds=0.0, **arguments) / stage_utilization(
        base, latency_seconds=0.1, **arguments
    )
    drop_large = stage_utilization(gpt3, latency_seconds=0.0, **arguments) / stage_utilization(
        gpt3, latency_seconds=0.1, **arguments
    )
    assert drop_small > drop_large > 1
    assert stage_utilization(gpt3, latency_seconds=0.0, bytes_per_value=1.0, **arguments) > stage_utilization(
        gpt3, latency_seconds=0.0, **arguments
    )  # 8-bit activations and gradients halve the bytes sent
