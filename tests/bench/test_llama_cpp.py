"""llama.cpp's input rounding, emulated: each linear of a GGUF file is paired with the rounding llama.cpp's CPU
matmul gives its stored type, and the rounding is gone once the context ends; the bindings' quantizer is asked only
for the file types it makes; two files scored on the same windows compare window by window."""

import pytest
import torch

from leanlm.bench.llama_cpp import input_types, llama_cpp_inputs, paired_difference
from leanlm.errors import ConfigError
from leanlm.formats.ggml_inputs import INPUT_ROUNDING, ROUNDINGS


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


def test_a_file_of_one_block_type_names_a_type_the_bindings_make_every_linear():
    from leanlm.bench.llama_cpp import PURE_FILE_TYPE, QUANTIZE_TYPES, quantize_gguf
    from leanlm.methods.bit_allocation import CANDIDATES

    assert set(CANDIDATES) <= set(PURE_FILE_TYPE)  # every type a budget chooses can be timed on its own
    assert set(PURE_FILE_TYPE.values()) <= set(QUANTIZE_TYPES)
    with pytest.raises(ValueError, match="got 'q4_k'"):
        quantize_gguf("in.gguf", "out.gguf", "q4_k")  # a block type, not a file type, without pure
    with pytest.raises(ValueError, match="got 'q4_k_m'"):
        quantize_gguf("in.gguf", "out.gguf", "q4_k_m", pure=True)


def test_two_files_scored_on_the_same_windows_differ_by_their_mean_nll_with_the_windows_standard_error():
    ours = {"window_nll": [10.0, 12.0, 11.0, 13.0], "tokens": 40}
    theirs = {"window_nll": [11.0, 12.5, 12.0, 13.5], "tokens": 40}
    difference, error = paired_difference(ours, theirs)
    assert difference == pytest.approx(-3.0 / 40)  # the windows' differences: -1, -0.5, -1, -0.5
    assert error == pytest.approx(torch.tensor([-1.0, -0.5, -1.0, -0.5]).std().item() * 2 / 40)
    assert paired_difference(ours, ours) == (0.0, 0.0)
    assert paired_difference(ours, {"perplexity": 3.0, "tokens": 40}) is None  # saved without its windows
    assert paired_difference(ours, {"window_nll": [1.0, 2.0], "tokens": 20}) is None  # other windows
