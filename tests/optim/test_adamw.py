import pytest
import torch

from leanlm.errors import ConfigError
from leanlm.optim import AdamW


def _train(optimizer_factory, steps=20, seed=0):
    torch.manual_seed(seed)
    weight = torch.nn.Parameter(torch.randn(128, 64))
    small = torch.nn.Parameter(torch.randn(8))
    optimizer = optimizer_factory([weight, small])
    target = torch.randn(128, 64)
    for _ in range(steps):
        loss = (weight - target).square().mean() + small.square().sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return weight.detach(), small.detach(), optimizer


def test_float32_states_match_torch_adamw():
    ours = _train(lambda p: AdamW(p, lr=1e-2, weight_decay=0.01, state_bits=32))
    theirs = _train(lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.01))
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-5, atol=1e-6)


def test_8bit_states_track_float32_and_take_a_quarter_of_the_memory():
    eight = _train(lambda p: AdamW(p, lr=1e-2, state_bits=8))
    full = _train(lambda p: AdamW(p, lr=1e-2, state_bits=32))
    assert (eight[0] - full[0]).norm() / full[0].norm() < 0.01
    # 128x64 weight: 2 x (8192 one-byte codes + 32 float32 absmax); the 8-element vector keeps float32 states.
    assert eight[2].state_bytes() == 2 * (8192 + 32 * 4) + 2 * 8 * 4
    assert full[2].state_bytes() == 2 * (8192 + 8) * 4


def test_state_round_trips_through_tensors():
    weight, small, optimizer = _train(lambda p: AdamW(p, lr=1e-2, state_bits=8), steps=3)
    copy = AdamW([torch.nn.Parameter(weight.clone()), torch.nn.Parameter(small.clone())], lr=1e-2)
    copy.load_state_tensors(optimizer.state_tensors())
    assert copy.state_tensors().keys() == optimizer.state_tensors().keys()
    for name, value in optimizer.state_tensors().items():
        assert torch.equal(copy.state_tensors()[name], value), name


def test_bad_settings_are_refused():
    with pytest.raises(ConfigError, match="state bits must be 8 or 32"):
        AdamW([torch.nn.Parameter(torch.zeros(2))], state_bits=4)
