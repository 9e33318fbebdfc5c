"""llama.cpp's input rounding, emulated: Q8_0 and Q8_K leave every value on its block's int8 grid within half a
step, the largest magnitude of a Q8_K block kept; each linear of a GGUF file is paired with the rounding
llama.cpp's CPU matmul gives its stored type, and the rounding is gone once the context ends."""

import pytest
import torch

from leanlm.bench.llama_cpp import (
    INPUT_ROUNDING,
    ROUNDINGS,
    input_types,
    llama_cpp_inputs,
    round_trip_q8_0,
    round_trip_q8_k,
)
from leanlm.errors import ConfigError


@pytest.mark.parametrize(
    "rule, block, scale_dtype",
    [(round_trip_q8_0, 32, torch.float16), (round_trip_q8_k, 256, torch.float32)],
    ids=["q8_0", "q8_k"],
)
def test_values_lie_on_each_blocks_int8_grid_within_half_a_step(rule, block, scale_dtype):
    x = torch.randn(3, 4 * block, generator=torch.Generator().manual_seed(0)) * torch.logspace(-2, 1, 4 * block)
    x[0, :block] = 0  # an all-zero block stays zero
    rounded = rule(x).reshape(3, 4, block)
    blocks = x.reshape(3, 4, block)
    exact = blocks.abs().amax(dim=-1, keepdim=True) / 127
    step = exact.to(scale_dtype).float()  # the stored scale
    assert rounded[0, 0].eq(0).all()
    live = step.squeeze(-1) > 0
    levels = rounded[live] / step[live]
    assert torch.allclose(levels, levels.round(), atol=1e-4)
    assert levels.abs().max() <= 127 + 1e-4
    # rounded in units of the exact step, stored with the stored one: half a step and 127 times their difference
    assert ((rounded - blocks).abs() <= 0.5 * exact + 127 * (step - exact).abs() + 1e-6).all()


def test_q8_k_keeps_each_blocks_largest_magnitude_and_its_sign():
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(1))
    x[1, 300] = -9.0
    rounded = round_trip_q8_k(x).reshape(4, 256)
    blocks = x.reshape(4, 256)
    where = blocks.abs().argmax(dim=-1, keepdim=True)
    assert torch.allclose(rounded.gather(-1, where), blocks.gather(-1, where), rtol=1e-6, atol=0)
    assert rounded[3, 300 - 256] == pytest.approx(-9.0)


def test_every_linear_takes_the_rounding_of_its_stored_type_until_the_context_ends(tmp_path):
    from tiny import byte_tokenizer, tiny_model

    from leanlm.cli.main import main
    from leanlm.methods.checkpoint import load_quantized

    source, checkpoint, out = tmp_path / "tiny", tmp_path / "q", tmp_path / "q.gguf"
    tiny_model("llama", vocab_size=258, width=256).save_pretrained(source)
    byte_tokenizer().save_pretrained(source)
    arguments = ["quantize", str(source), "--method", "rtn", "--gguf-type", "q4_k", "--tensor-type=down_proj=q4_0"]
    assert main([*arguments, "--out", str(checkpoint)]) == 0
    assert main(["export", str(checkpoint), "--format", "gguf", "--out", str(out)]) == 0
    model = load_quantized(checkpoint)[0].model
    types = input_types(model, out)
    linears = {name for name, module in model.named_modules() if hasattr(module, "in_features")}
    assert set(types) == linears  # every block linear and the head
    assert {kind for name, kind in types.items() if name.endswith("down_proj")} == {"q4_0"}
    assert {kind for name, kind in types.items() if name.endswith("q_proj")} == {"q4_k"}

    seen = {}  # module -> [input before the rounding, input the module computes with]
    modules = dict(model.named_modules())

    def record(name):
        return lambda module, args: seen.setdefault(name, []).append(args[0].detach().clone())

    ids = torch.randint(0, 258, (1, 12), generator=torch.Generator().manual_seed(2))
    handles = [modules[name].register_forward_pre_hook(record(name)) for name in linears]
    plain = model(ids).logits
    seen.clear()
    with llama_cpp_inputs(model, types) as emulated:
        handles += [modules[name].register_forward_pre_hook(record(name)) for name in linears]
        rounded = emulated(ids).logits
    for name in linears:
        raw, used = seen[name]
        rule = INPUT_ROUNDING[types[name]]
        assert torch.equal(used, ROUNDINGS[rule](raw) if rule else raw), name
    assert not torch.allclose(rounded, plain)
    for handle in handles:
        handle.remove()
    assert torch.equal(model(ids).logits, plain)  # the rounding hooks are gone


def test_a_type_without_a_known_rounding_is_refused():
    model = torch.nn.Sequential(torch.nn.Linear(32, 32))
    with pytest.raises(ConfigError, match="iq2_xxs"), llama_cpp_inputs(model, {"0": "iq2_xxs"}):
        pass
