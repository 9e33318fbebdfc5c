import pytest
import torch
from tiny import tiny_model, token_ids

from leanlm.errors import ConfigError
from leanlm.formats.gptq import solve
from leanlm.formats.minmax import search_symmetric
from leanlm.methods import Calibration, GPTQConfig, RTNConfig, SpQRConfig, load_quantized, quantize_, save_quantized
from leanlm.models import load_model
from leanlm.nn import GGUFLinear, SpQRLinear


def _calibration(vocab=128, samples=16, seq_len=32):
    return token_ids(samples, seq_len, seed=1, vocab_size=vocab)


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "gpt2", "opt"])
@pytest.mark.parametrize(
    "name, config",
    [
        ("rtn", RTNConfig(bits=4, group_size=16)),
        ("gptq", GPTQConfig(bits=4, group_size=16)),
        ("spqr", SpQRConfig(bits=3, beta1=16, beta2=16)),
    ],
    ids=["rtn", "gptq", "spqr"],
)
def test_every_block_linear_is_replaced_and_the_model_still_agrees(family, name, config):
    model = tiny_model(family)
    ids = _calibration()[:2]
    with torch.inference_mode():
        reference = model(input_ids=ids).logits
    record = quantize_(model, config, calibration=Calibration(token_ids=_calibration()))
    layers = [m for m in model.modules() if isinstance(m, SpQRLinear)]
    assert layers and record["avg_bits"] == pytest.approx(
        sum(m.bits_per_weight() * m.in_features * m.out_features for m in layers)
        / sum(m.in_features * m.out_features for m in layers)
    )
    with torch.inference_mode():
        quantized = model(input_ids=ids).logits
    relative = ((quantized - reference).norm() / reference.norm()).item()
    assert relative < 0.25, relative
    assert record["method"] == name and record["seconds"] > 0


def test_gptq_beats_rtn_on_the_calibration_text():
    ids = _calibration(samples=8)
    errors = {}
    for name, config in {"rtn": RTNConfig(bits=3, group_size=16), "gptq": GPTQConfig(bits=3, group_size=16)}.items():
        model = tiny_model("llama", layers=3)
        with torch.inference_mode():
            reference = model(input_ids=ids).logits
        quantize_(model, config, calibration=Calibration(token_ids=_calibration(samples=32)))
        with torch.inference_mode():
            errors[name] = (model(input_ids=ids).logits - reference).square().mean().item()
    assert errors["gptq"] < errors["rtn"]


def test_rtn_imatrix_weighs_each_scale_search_by_the_calibration_inputs_mean_squares():
    model = tiny_model("llama", layers=2)
    calibration = Calibration(token_ids=_calibration(samples=8))
    first = model.model.layers[0].self_attn.q_proj
    inputs = []
    handle = first.register_forward_hook(lambda module, args, out: inputs.append(args[0].flatten(0, -2)))
    with torch.inference_mode():  # block 0's inputs are the float model's (nothing before it is quantized)
        for window in calibration.batches():
            model(input_ids=window[None])
    handle.remove()
    importance = torch.cat(inputs).square().mean(dim=0)
    weight = first.weight.detach().clone()
    record = quantize_(
        model,
        RTNConfig(bits=4, group_size=16, grid="symmetric", scale_search=True, imatrix=True),
        calibration=calibration,
    )
    expected, _ = search_symmetric(weight.reshape(weight.shape[0], -1, 16), 4, importance.reshape(-1, 16)[None])
    stored = model.model.layers[0].self_attn.q_proj.scale.float()
    torch.testing.assert_close(stored, expected.half().float(), rtol=0, atol=0)
    assert record["imatrix"] and record["calibration_samples"] == 8
    with pytest.raises(ConfigError, match="which needs --scale-search"):
        RTNConfig(imatrix=True)
    with pytest.raises(ConfigError, match="calibration"):  # it reads text; plain RTN does not
        quantize_(tiny_model("llama", layers=1), RTNConfig(grid="symmetric", scale_search=True, imatrix=True))
    quantize_(tiny_model("llama", layers=1), RTNConfig(grid="symmetric", scale_search=True))


@pytest.mark.parametrize("columns", [7, 512, 1100])  # one panel, exactly one, and two and a part
def test_the_hessian_sum_is_x_transposed_x_from_its_upper_panels(columns):
    from leanlm.methods.gptq import _add_upper_gram, _mirror_upper

    generator = torch.Generator().manual_seed(columns)
    windows = [torch.randn(48, columns, generator=generator) for _ in range(3)]
    total = torch.zeros(columns, columns)
    for x in windows:
        _add_upper_gram(total, x)
    _mirror_upper(total)
    expected = sum(x.T.double() @ x.double() for x in windows)
    torch.testing.assert_close(total.double(), expected, rtol=1e-5, atol=1e-4)
    assert torch.equal(total, total.T)


def test_input_hessians_are_the_float_models_inputs_gram_of_the_asked_blocks():
    from leanlm.methods.gptq import input_hessians

    model, ids = tiny_model("llama", layers=3), _calibration(samples=4)
    inputs = {}
    hooks = [
        model.get_submodule(name).register_forward_pre_hook(
            lambda module, args, name=name: inputs.setdefault(name, []).append(args[0].reshape(-1, args[0].shape[-1]))
        )
        for name in ("model.layers.1.self_attn.q_proj", "model.layers.1.mlp.down_proj")
    ]
    with torch.inference_mode():
        model(input_ids=ids)
    for hook in hooks:
        hook.remove()
    hessians = input_hessians(model, ids, [1])
    assert {name.split(".")[2] for name in hessians} == {"1"} and len(hessians) == 7
    torch.testing.assert_close(hessians["model.layers.1.self_attn.k_proj"], hessians["model.layers.1.self_attn.q_proj"])
    for name, seen in inputs.items():
        x = torch.cat(seen).double()
        torch.testing.assert_close(hessians[name].double(), 2 * x.T @ x / len(x), rtol=1e-4, atol=1e-5)


def test_gptq_with_its_hessian_shrunk_to_the_diagonal_is_the_imatrix_rtn():
    """`--hessian-shrinkage 1` leaves GPTQ no feedback: every block's codes and scales are the importance-matrix
    RTN's, whose importance is the Hessian's diagonal collected through the same block pipeline."""
    calibration = Calibration(token_ids=_calibration(samples=8))
    grid = dict(bits=4, group_size=16, grid="symmetric", scale_search=True)
    shrunk, rtn = tiny_model("llama", layers=2), tiny_model("llama", layers=2)
    quantize_(shrunk, GPTQConfig(static_groups=True, hessian_shrinkage=1.0, **grid), calibration=calibration)
    quantize_(rtn, RTNConfig(imatrix=True, **grid), calibration=calibration)
    for (name, tensor), (_, expected) in zip(shrunk.state_dict().items(), rtn.state_dict().items(), strict=True):
        torch.testing.assert_close(tensor, expected, rtol=0, atol=0, msg=name)


def test_spqr_checkpoint_round_trips(tiny_llama_dir, tmp_path):
    loaded = load_model(tiny_llama_dir)
    batches = token_ids(8, 32, vocab_size=1000)
    record = quantize_(loaded.model, SpQRConfig(), calibration=Calibration(token_ids=batches))
    assert record["outlier_rate"] > 0
    out = save_quantized(loaded, loaded.model, record, tmp_path / "q")
    reloaded, saved = load_quantized(out)
    ids = torch.randint(0, 1000, (1, 12))
    with torch.inference_mode():
        assert torch.equal(reloaded.model(ids).logits, loaded.model(ids).logits)
    assert saved["method"] == "spqr" and saved["avg_bits"] == record["avg_bits"]


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3_text"])
@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_a_gguf_block_type_stores_every_block_linear_as_its_blocks(family, method):
    """Rows of 256 or 512 weights take Q4_K; Gemma's 64-wide attention output takes Q4_K's fallback, Q5_0."""
    model = tiny_model(family, width=256)
    ids = _calibration()[:2]
    with torch.inference_mode():
        reference = model(input_ids=ids).logits
    config = (RTNConfig if method == "rtn" else GPTQConfig)(gguf_type="q4_k")
    record = quantize_(model, config, calibration=Calibration(token_ids=_calibration()))
    layers = {name: m for name, m in model.named_modules() if isinstance(m, GGUFLinear)}
    assert layers and not any(isinstance(m, SpQRLinear) for m in model.modules())
    assert {m.block_type for m in layers.values() if m.in_features % 256 == 0} == {"q4_k"}
    assert {m.block_type for m in layers.values() if m.in_features % 256} <= {"q5_0"}
    assert record["block_type"] == "q4_k"
    assert record["avg_bits"] == pytest.approx(
        sum(m.format.bits_per_weight * m.in_features * m.out_features for m in layers.values())
        / sum(m.in_features * m.out_features for m in layers.values())
    )
    with torch.inference_mode():
        quantized = model(input_ids=ids).logits
    assert ((quantized - reference).norm() / reference.norm()).item() < 0.25  # as the min-max grids above


@pytest.mark.parametrize("kind", ["q3_k", "iq4_xs"])  # a uniform grid and a non-linear one
def test_gptq_beats_rtn_on_a_gguf_block_type(kind):
    ids = _calibration(samples=8)
    errors = {}
    for name, config in {"rtn": RTNConfig(gguf_type=kind), "gptq": GPTQConfig(gguf_type=kind)}.items():
        model = tiny_model("llama", layers=2, width=256)
        with torch.inference_mode():
            reference = model(input_ids=ids).logits
        quantize_(model, config, calibration=Calibration(token_ids=_calibration(samples=16)))
        with torch.inference_mode():
            errors[name] = (model(input_ids=ids).logits - reference).square().mean().item()
    assert errors["gptq"] < 0.8 * errors["rtn"], errors


def test_a_gguf_block_type_sets_the_grid_itself():
    recipe = GPTQConfig(gguf_type="q4_k", scale_search=True, grid="symmetric", group_size=32).solver()
    assert solve(torch.randn(4, 256), torch.eye(256), recipe).blocks[0].name == "q4_k"  # the recipe's grid yields
    with pytest.raises(ConfigError, match="choose from"):
        GPTQConfig(gguf_type="q4_k_m")
    RTNConfig(gguf_type="q4_k", imatrix=True)  # the importance matrix weighs the block type's own fit


def test_a_gguf_block_checkpoint_round_trips(tiny_llama_dir, tmp_path):
    loaded = load_model(tiny_llama_dir)
    record = quantize_(
        loaded.model, GPTQConfig(gguf_type="q6_k"), calibration=Calibration(token_ids=_calibration(1000))
    )
    out = save_quantized(loaded, loaded.model, record, tmp_path / "q")
    reloaded, saved = load_quantized(out)
    ids = torch.randint(0, 1000, (1, 12))
    with torch.inference_mode():
        assert torch.equal(reloaded.model(ids).logits, loaded.model(ids).logits)
    assert saved["block_type"] == "q6_k"
    assert {m.block_type for m in reloaded.model.modules() if isinstance(m, GGUFLinear)} == {"q8_0"}  # rows of 64
