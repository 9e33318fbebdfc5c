"""Mixed GGUF block types: a budget of bits per weight goes where the Fisher-weighted (or, per block,
Hessian-weighted) error falls most, never above the budget; a user's PATTERN=TYPE map (or a record's) fixes
types; bad maps and budgets are refused before any work."""

import json
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tiny import tiny_model, token_ids

from leanlm.errors import ConfigError
from leanlm.formats.ggml_inputs import ROUNDINGS
from leanlm.formats.gguf_blocks import BLOCK_TYPES
from leanlm.methods import Calibration, GPTQConfig, RTNConfig, quantize_
from leanlm.methods.bit_allocation import (
    SCALE,
    allocate,
    budget_types,
    candidates_for,
    parse_tensor_types,
    rounded,
    type_errors,
    with_input_errors,
)
from leanlm.nn import GGUFLinear


def test_the_budget_goes_where_the_error_falls_most():
    sizes = {"sensitive": 1000, "robust": 1000}
    errors = {
        "sensitive": {"q3_k": 100.0, "q4_k": 20.0, "q6_k": 1.0},
        "robust": {"q3_k": 2.0, "q4_k": 1.0, "q6_k": 0.5},
    }
    chosen = allocate(errors, sizes, target_bits=5.0)
    assert chosen == {"sensitive": "q6_k", "robust": "q3_k"}  # 6.5625 + 3.4375 = 10 bits over two tensors
    assert allocate(errors, sizes, target_bits=4.0) == {"sensitive": "q4_k", "robust": "q3_k"}
    assert allocate(errors, sizes, target_bits=8.0) == {"sensitive": "q6_k", "robust": "q6_k"}


def test_type_errors_fall_with_bits_and_weigh_the_columns_that_matter():
    weight = torch.randn(64, 512, generator=torch.Generator().manual_seed(0))
    errors = type_errors(weight, torch.ones(512), ["q3_k", "q4_k", "q5_k", "q6_k"])
    assert errors["q3_k"] > errors["q4_k"] > errors["q5_k"] > errors["q6_k"] > 0
    doubled = type_errors(weight, 2 * torch.ones(512), ["q4_k"])["q4_k"]
    assert doubled == pytest.approx(2 * errors["q4_k"], rel=1e-5)
    unit = type_errors(weight, torch.ones(512), ["q4_k"], output_weights=torch.ones(64))["q4_k"]
    assert unit == pytest.approx(errors["q4_k"], rel=1e-5)
    tripled = type_errors(weight, torch.ones(512), ["q4_k"], output_weights=torch.full((64,), 3.0))["q4_k"]
    assert tripled == pytest.approx(3 * errors["q4_k"], rel=1e-5)


def test_a_weight_on_an_asymmetric_grid_takes_it_back_from_a_budget():
    # rows of 576 (SmolLM2's hidden size) tile no K-quant: the blocks of 32 with a minimum are candidates there
    on_grid = rounded(torch.randn(64, 576, generator=torch.Generator().manual_seed(0)), "q4_1", torch.ones(576))
    assert {"q4_1", "q5_1"} <= set(candidates_for(576))
    errors = type_errors(on_grid, torch.ones(576), candidates_for(576))
    assert errors["q4_1"] == 0.0 and errors["q5_0"] > 0.0
    assert allocate({"w": errors}, {"w": on_grid.numel()}, target_bits=5.5) == {"w": "q4_1"}


def test_sensitivity_is_each_outputs_mean_squared_loss_gradient_and_each_inputs_mean_square():
    from leanlm.methods.calibration import collect_sensitivity

    model = tiny_model("llama", width=256)
    batches = token_ids(3, 16, seed=4)
    sensitivity = collect_sensitivity(model, batches)
    assert len(sensitivity) == 2 * 7 and all(p.requires_grad for p in model.parameters())
    linear = model.model.layers[1].mlp.down_proj
    seen = []

    def keep(module, args, out):
        out.retain_grad()
        seen.append((args[0], out))

    handle = linear.register_forward_hook(keep)
    for window in batches:
        model.zero_grad()
        model(input_ids=window[None], labels=window[None]).loss.backward()
    handle.remove()
    gradient = torch.cat([out.grad.reshape(-1, out.shape[-1]) for _, out in seen]).square().mean(0)
    inputs = torch.cat([x.detach().reshape(-1, x.shape[-1]) for x, _ in seen]).square().mean(0)
    torch.testing.assert_close(sensitivity["1.mlp.down_proj"].g, gradient, rtol=1e-4, atol=1e-12)
    torch.testing.assert_close(sensitivity["1.mlp.down_proj"].h, inputs, rtol=1e-5, atol=1e-8)
    # each int8 input rounding: the token-by-token Fisher estimate, mean over tokens of sum_i G_ti^2 (W dx_t)_i^2
    tokens = sum(x.numel() // x.shape[-1] for x, _ in seen)
    for rounding in ("q8_0", "q8_k"):
        loss = sum(
            float(
                (out.grad * F.linear(x.detach() - ROUNDINGS[rounding](x.detach()), linear.weight.detach()))
                .square()
                .sum()
            )
            for x, out in seen
        )
        assert sensitivity["1.mlp.down_proj"].inputs[rounding] == pytest.approx(loss / tokens, rel=2e-2)
    # rows of 256 inputs tile Q8_K's blocks; blocks of 32 lose less to an input's largest value than blocks of 256
    downs = sensitivity["1.mlp.down_proj"].inputs
    assert 0 < downs["q8_0"] < downs["q8_k"]


def test_llama_cpps_input_rounding_moves_a_linear_to_the_type_whose_rounding_costs_less():
    sizes = {"outliers": 1000, "plain": 1000}
    errors = {"outliers": {"q4_k": 1.0, "q4_1": 0.9}, "plain": {"q4_k": 1.0, "q4_1": 0.8}}
    inputs = {"outliers": {"q8_k": 5.0, "q8_0": 0.5}, "plain": {"q8_k": 0.01, "q8_0": 0.01}}
    assert allocate(errors, sizes, target_bits=4.75) == {"outliers": "q4_k", "plain": "q4_1"}
    counted = {name: with_input_errors(errors[name], inputs[name]) for name in sizes}
    assert counted["outliers"] == pytest.approx({"q4_k": 6.0, "q4_1": 1.4})
    assert allocate(counted, sizes, target_bits=4.75) == {"outliers": "q4_1", "plain": "q4_k"}
    # a measured allocation's scale takes the Fisher estimate of the inputs to its errors' scale
    assert with_input_errors({"q4_k": 2.0, SCALE: 2.0}, {"q8_k": 1.0}) == {"q4_k": 4.0}


def test_sensitivity_is_kept_for_the_same_model_and_text_and_measured_again_for_others(tmp_path, monkeypatch):
    from leanlm.methods import calibration

    monkeypatch.setenv("LEANLM_CACHE", str(tmp_path))
    passes = []
    measure = calibration.collect_sensitivity
    monkeypatch.setattr(calibration, "collect_sensitivity", lambda *args: passes.append(1) or measure(*args))
    model = tiny_model("llama", width=256)
    batches = token_ids(2, 16, seed=4)
    first = calibration.kept_sensitivity(model, batches)
    again = calibration.kept_sensitivity(model, batches)
    assert len(passes) == 1 and len(list((tmp_path / "sensitivity").iterdir())) == 1
    assert again.keys() == first.keys()
    for name, (g, h, inputs) in first.items():
        assert torch.equal(again[name].g, g) and torch.equal(again[name].h, h)
        assert again[name].inputs == inputs and set(inputs) == {"q8_0", "q8_k"}
    calibration.kept_sensitivity(model, token_ids(2, 16, seed=5))  # other text
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] += 1.0  # another model
    calibration.kept_sensitivity(model, batches)
    assert len(passes) == 3
    blocked = tmp_path / "a file"
    blocked.write_text("")
    monkeypatch.setenv("LEANLM_CACHE", str(blocked))  # a cache that cannot be written: measured, not kept
    assert calibration.kept_sensitivity(model, batches).keys() == first.keys()
    assert len(passes) == 4 and len(list((tmp_path / "sensitivity").iterdir())) == 3
    monkeypatch.setenv("LEANLM_CACHE", str(tmp_path))
    monkeypatch.setattr(calibration, "KEEP_SENSITIVITY", False)  # kept, but measured anew
    calibration.kept_sensitivity(model, batches)
    assert len(passes) == 5


def test_output_divergence_is_the_kl_of_the_next_token_distributions_from_the_models_at_the_start():
    from leanlm.methods.calibration import output_divergence

    model = tiny_model("llama", width=256)
    windows = token_ids(2, 16, seed=5)
    before = [model(input_ids=w[None]).logits[0].log_softmax(-1).detach() for w in windows]
    divergence = output_divergence(model, windows)
    assert divergence() == pytest.approx(0.0, abs=1e-6)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(1.5)
    after = [model(input_ids=w[None]).logits[0].log_softmax(-1).detach() for w in windows]
    expected = torch.stack([(p.exp() * (p - q)).sum(-1).mean() for p, q in zip(before, after, strict=True)]).mean()
    assert divergence() == pytest.approx(float(expected), rel=1e-4) and float(expected) > 1e-4


def test_a_measured_loss_rescales_each_linears_errors_and_moves_the_bits():
    weight = torch.randn(64, 512, generator=torch.Generator().manual_seed(0))
    weights = {"0.a": weight, "0.b": weight.clone()}
    ones = torch.ones(512)
    plain = budget_types(weights, {}, 4.5, lambda name: ones)
    assert plain["0.a"] == plain["0.b"]
    seen = []

    def measure(name, rounded):
        seen.append((name, rounded))
        return 100.0 if name == "0.a" else 0.01

    measured = budget_types(weights, {}, 4.5, lambda name: ones, measure=measure)
    assert [name for name, _ in seen] == ["0.a", "0.b"]
    cheapest = min(candidates_for(512), key=lambda t: BLOCK_TYPES[t].bits_per_weight)
    torch.testing.assert_close(seen[0][1], rounded(weight, cheapest, ones))
    assert BLOCK_TYPES[measured["0.a"]].bits_per_weight > BLOCK_TYPES[measured["0.b"]].bits_per_weight


def test_tensor_types_are_patterns_or_the_map_a_record_keeps(tmp_path):
    (pattern, name), *_ = parse_tensor_types(("mlp\\.down_proj=Q6_K",))
    assert pattern.search("3.mlp.down_proj") and name == "q6_k"
    record = tmp_path / "leanlm_quant.json"
    record.write_text(json.dumps({"method": "gptq", "tensor_types": {"^0\\.mlp\\.up_proj$": "q4_k"}}))
    assert [(p.pattern, t) for p, t in parse_tensor_types((str(record),))] == [("^0\\.mlp\\.up_proj$", "q4_k")]
    for bad, reason in (
        ("down_proj", "write PATTERN=TYPE"),
        ("(=q4_k", "not a regular expression"),
        ("x=q9_k", "choose"),
    ):
        with pytest.raises(ConfigError, match=reason):
            parse_tensor_types((bad,))


def test_a_budget_mixes_types_within_it_and_its_map_reproduces_the_model(tmp_path):
    calibration = Calibration(token_ids=token_ids(8, 32, seed=1))
    model = tiny_model("llama", width=256)
    record = quantize_(model, GPTQConfig(target_bits=5.0), calibration=calibration)
    layers = {name: m for name, m in model.named_modules() if isinstance(m, GGUFLinear)}
    assert len({m.block_type for m in layers.values()}) > 1
    assert record["avg_bits"] <= 5.0 and record["avg_bits"] > BLOCK_TYPES["q3_k"].bits_per_weight
    assert record["target_bits"] == 5.0 and len(record["tensor_types"]) == len(layers)
    assert record["allocation"] == "fisher"
    saved = tmp_path / "record.json"
    saved.write_text(json.dumps(record))
    again = tiny_model("llama", width=256)
    quantize_(again, GPTQConfig(tensor_types=(str(saved),)), calibration=calibration)
    assert {n: m.block_type for n, m in again.named_modules() if isinstance(m, GGUFLinear)} == {
        n: m.block_type for n, m in layers.items()
    }


def test_each_linears_type_errors_are_kept_for_the_same_model_and_text(tmp_path, monkeypatch):
    from leanlm.methods import bit_allocation

    monkeypatch.setenv("LEANLM_CACHE", str(tmp_path))
    measured = []
    measure = bit_allocation.type_error_table
    monkeypatch.setattr(
        bit_allocation,
        "type_error_table",
        lambda weights, *args: measured.append(len(weights)) or measure(weights, *args),
    )
    calibration = Calibration(token_ids=token_ids(4, 32, seed=1))

    def mix(config, calibration=calibration):
        return quantize_(tiny_model("llama", width=256), config, calibration=calibration)["tensor_types"]

    first = mix(RTNConfig(target_bits=5.0))
    linears = measured[0]
    assert mix(RTNConfig(target_bits=5.0)) == first and measured == [linears]  # read back: nothing measured
    assert mix(RTNConfig(target_bits=6.0)) != first and measured == [linears]  # another budget, the same errors
    fixed = mix(RTNConfig(target_bits=5.0, tensor_types=("down_proj=q8_0",)))
    assert measured == [linears] and all(t == "q8_0" for name, t in fixed.items() if "down_proj" in name)
    mix(RTNConfig(target_bits=5.0, allocation="measured"))  # what the errors measure differs
    mix(RTNConfig(target_bits=5.0), Calibration(token_ids=token_ids(4, 32, seed=2)))  # other text
    assert measured == [linears] * 3
    for kept in (tmp_path / "sensitivity").glob("*.errors.json"):
        kept.write_text("{not json")
    assert mix(RTNConfig(target_bits=5.0)) == first and measured == [linears] * 4  # unreadable: measured again


def test_a_budget_per_block_stays_within_it_too():
    calibration = Calibration(token_ids=token_ids(4, 32, seed=1))
    model = tiny_model("llama", width=256)
    record = quantize_(model, RTNConfig(target_bits=5.0, allocation="block"), calibration=calibration)
    assert record["allocation"] == "block" and BLOCK_TYPES["q3_k"].bits_per_weight < record["avg_bits"] <= 5.0


@pytest.mark.parametrize("allocation", ["fisher", "measured", "block"])
def test_leanlm_quantize_spends_a_fisher_budget_in_memory_and_a_per_block_one_out_of_core(
    tiny_llama_dir, tmp_path, allocation
):
    from leanlm.methods.out_of_core import quantize_checkpoint

    said = []
    calibration = Calibration(token_ids=token_ids(4, 32, seed=1, vocab_size=1000))
    config = RTNConfig(target_bits=6.0, allocation=allocation)
    _, record = quantize_checkpoint(tiny_llama_dir, (config,), tmp_path / "q", calibration=calibration, say=said.append)
    assert record["allocation"] == allocation
    in_memory = [line for line in said if line.startswith(f"quantizing in memory: --allocation {allocation}")]
    assert len(in_memory) == (allocation != "block"), said


@pytest.mark.parametrize(
    "config, reason",
    [
        (RTNConfig(target_bits=3.0), "take at least 3.438 bits per weight"),
        (RTNConfig(target_bits=9.0), "take at most 8.500 bits per weight"),
        (RTNConfig(gguf_type="q4_k", tensor_types=("attn_v=q6_k",)), "pattern 'attn_v' finds no linear"),
    ],
)
def test_bad_maps_and_budgets_are_refused_before_any_work(config, reason):
    with pytest.raises(ConfigError, match=reason):
        quantize_(tiny_model("llama", width=256), config, calibration=Calibration(token_ids=token_ids(2, 8)))


def test_an_unknown_allocation_is_refused_when_the_config_is_made():
    with pytest.raises(ConfigError, match="allocation must be one of fisher, measured, block, recipe, got 'hessian'"):
        GPTQConfig(target_bits=5.0, allocation="hessian")


def test_a_map_that_leaves_linears_untyped_needs_a_type_for_them():
    with pytest.raises(ConfigError, match="no type: add --gguf-type or --target-bits"):
        quantize_(tiny_model("llama", width=256), RTNConfig(tensor_types=("mlp=q6_k",)))


def test_the_importance_matrix_is_each_linears_mean_squared_input_under_its_gguf_name(tmp_path):
    from leanlm.formats.imatrix import ImportanceMatrix, write_imatrix
    from leanlm.methods.calibration import collect_importance

    model = tiny_model("llama", width=256)
    batches = token_ids(4, 16, seed=2)
    matrix = collect_importance(model, batches)
    inputs = []
    handle = model.model.layers[1].mlp.down_proj.register_forward_pre_hook(lambda m, a: inputs.append(a[0]))
    with torch.inference_mode():
        for window in batches:
            model(input_ids=window[None])
    handle.remove()
    x = torch.cat([i.reshape(-1, i.shape[-1]) for i in inputs])
    assert matrix.counts["blk.1.ffn_down.weight"] == 64 and matrix.chunk_count == 4 and matrix.chunk_size == 16
    torch.testing.assert_close(
        torch.from_numpy(matrix.sums["blk.1.ffn_down.weight"]), x.square().sum(0), rtol=1e-5, atol=1e-6
    )

    def rtn(imatrix_file=None):
        quantized = tiny_model("llama", width=256)
        quantize_(quantized, RTNConfig(gguf_type="q4_k", imatrix_file=imatrix_file))
        return quantized.model.layers[1].mlp.down_proj.blocks

    uniform = ImportanceMatrix(
        {name: np.ones_like(values) for name, values in matrix.sums.items()}, dict(matrix.counts), ["ones"], 1, 1
    )
    write_imatrix(tmp_path / "uniform.gguf", uniform)
    write_imatrix(tmp_path / "measured.gguf", matrix)
    assert torch.equal(rtn(str(tmp_path / "uniform.gguf")), rtn())  # uniform importance is plain RTN
    assert not torch.equal(rtn(str(tmp_path / "measured.gguf")), rtn())


def test_another_models_importance_matrix_is_refused_before_any_work(tmp_path):
    from leanlm.formats.imatrix import write_imatrix
    from leanlm.methods.calibration import collect_importance

    write_imatrix(tmp_path / "m.gguf", collect_importance(tiny_model("llama", width=64), token_ids(1, 8)))
    with pytest.raises(ConfigError, match="not this model's importance matrix: blk.0.attn_q.weight has 64 columns"):
        quantize_(tiny_model("llama", width=256), RTNConfig(gguf_type="q4_k", imatrix_file=str(tmp_path / "m.gguf")))
    with pytest.raises(ConfigError, match="--imatrix .* or --imatrix-file, not both"):
        RTNConfig(gguf_type="q4_k", imatrix=True, imatrix_file="x")
    with pytest.raises(ConfigError, match="--imatrix-file .*missing.gguf: no such file"):  # before the model loads
        RTNConfig(gguf_type="q4_k", imatrix_file=str(tmp_path / "missing.gguf"))


def test_size_of_spends_llama_cpps_bits_and_the_export_gives_the_tables_its_types(tmp_path):
    """`--size-of q4_k_m`: the budget is what llama.cpp's Q4_K_M spends on the model's block linears, and the
    export gives the token embedding and the untied head Q4_K_M's types (Q4_K, Q6_K) unless told otherwise."""
    import gguf
    from tiny import byte_tokenizer

    from leanlm.cli.main import main
    from leanlm.methods.bit_allocation import recipe_budget
    from leanlm.methods.checkpoint import read_record
    from leanlm.methods.out_of_core import quantize_checkpoint

    source = tmp_path / "tiny"
    model = tiny_model("llama", vocab_size=258, width=256, layers=1)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(torch.randn(258, 256, generator=torch.Generator().manual_seed(3)))
    model.save_pretrained(source)
    byte_tokenizer().save_pretrained(source)
    checkpoint = tmp_path / "q"
    calibration = Calibration(token_ids=token_ids(4, 32, seed=1, vocab_size=258))
    quantize_checkpoint(str(source), (RTNConfig(size_of="q4_k_m"),), checkpoint, calibration=calibration)
    record = read_record(checkpoint)
    budget = recipe_budget(model, "q4_k_m")
    assert record["size_of"] == "q4_k_m" and record["target_bits"] == budget.bits
    assert BLOCK_TYPES["q4_k"].bits_per_weight < budget.bits and record["avg_bits"] <= budget.bits
    assert record["gguf_table_types"] == {"token_embd": "q4_k", "output": "q6_k"}

    def tables(out, *flags):
        assert main(["export", str(checkpoint), "--format", "gguf", "--out", str(out), *flags]) == 0
        types = {tensor.name: tensor.tensor_type.name for tensor in gguf.GGUFReader(out).tensors}
        return types["token_embd.weight"], types["output.weight"]

    assert tables(tmp_path / "a.gguf") == ("Q4_K", "Q6_K")
    assert tables(tmp_path / "b.gguf", "--token-embedding-type", "q8_0") == ("Q8_0", "Q6_K")


def test_size_of_a_family_without_a_gguf_layout_is_refused_before_any_weight_is_read(tmp_path, capsys, monkeypatch):
    flags = ("--method", "rtn", "--size-of", "q4_k_m")
    named = "--size-of q4_k_m: leanlm does not know the GGUF layout"
    _refused_before_any_weight_is_read(tmp_path, capsys, monkeypatch, flags, named, tiny_model("qwen3", vocab_size=258))


@pytest.mark.parametrize(
    ("costs", "flags", "named"),
    [
        ({"q4_k": 1.0}, (), "no cost for q6_k"),
        ({"q4_k": 1.0, "q6_k": 1.3}, ("--tensor-type", "down_proj=q8_0"), "gives q8_0, for which --decode-costs"),
    ],
)
def test_decode_costs_missing_a_type_are_refused_before_any_weight_is_read(
    tmp_path, capsys, monkeypatch, costs, flags, named
):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(costs))
    flags = ("--method", "gptq", "--size-of", "q4_k_m", "--decode-costs", str(path), *flags)
    _refused_before_any_weight_is_read(tmp_path, capsys, monkeypatch, flags, named)


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (("--target-bits", "3.0"), "take at least 3.438 bits per weight"),
        (("--gguf-type", "q4_k", "--tensor-type", "attn_v=q6_k"), "pattern 'attn_v' finds no linear"),
        (("--tensor-type", "mlp=q6_k"), "no type: add --gguf-type or --target-bits"),
    ],
)
def test_bad_maps_and_budgets_are_refused_before_any_weight_is_read(tmp_path, capsys, monkeypatch, flags, named):
    _refused_before_any_weight_is_read(tmp_path, capsys, monkeypatch, ("--method", "rtn", *flags), named)


def _refused_before_any_weight_is_read(tmp_path, capsys, monkeypatch, flags, named, model=None):
    """`leanlm quantize` of `model` (a tiny llama if None), saved, with `flags` fails in one line containing
    `named`, writing nothing and reading no weight."""
    from tiny import byte_tokenizer

    import leanlm.methods.out_of_core as out_of_core
    from leanlm.cli.main import main

    source = tmp_path / "model"
    (model or tiny_model("llama", vocab_size=258, width=256, layers=2)).save_pretrained(source)
    byte_tokenizer().save_pretrained(source)
    monkeypatch.setattr(out_of_core, "quantize_checkpoint", lambda *a, **k: pytest.fail("weights were read"))
    out = tmp_path / "q"
    capsys.readouterr()
    assert main(["quantize", str(source), *flags, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0], err
    assert not out.exists()


def test_size_of_and_target_bits_are_one_or_the_other():
    with pytest.raises(ConfigError, match="give --target-bits or --size-of"):
        RTNConfig(target_bits=5.0, size_of="q4_k_m")
    with pytest.raises(ConfigError, match="must be one of"):
        GPTQConfig(size_of="q4_k_x")


def test_decode_costs_keep_the_summed_time_and_choose_only_the_types_they_name():
    sizes = {"a": 1000, "b": 1000}
    errors = {
        "a": {"q4_1": 1.0, "q4_k": 3.0, "q6_k": 0.5},
        "b": {"q4_1": 1.0, "q4_k": 3.0, "q6_k": 0.5},
    }
    assert allocate(errors, sizes, target_bits=5.0) == {"a": "q4_1", "b": "q4_1"}
    costs = {"q4_1": 2.0, "q4_k": 1.0, "q6_k": 1.5}
    # the recipe's q4_k on both costs 2000: one q4_1 (2.0) needs the other's q4_k's saving and then some
    assert allocate(errors, sizes, 5.0, costs, cost_limit=2000.0) == {"a": "q4_k", "b": "q4_k"}
    slower = allocate(errors, sizes, 5.0, costs, cost_limit=3000.0)
    assert sorted(slower.values()) == ["q4_1", "q4_k"]
    assert sum(costs[t] * sizes[n] for n, t in slower.items()) <= 3000.0
    assert allocate(errors, sizes, 5.0, costs, cost_limit=1e9) == {"a": "q4_1", "b": "q4_1"}
    # a type without a cost is never chosen
    assert set(allocate(errors, sizes, 8.0, {"q4_k": 1.0, "q4_1": 1.0}, cost_limit=1e9).values()) == {"q4_1"}


def test_decode_costs_are_a_type_map_or_the_benchmarks_results_and_need_size_of(tmp_path):
    from leanlm.methods.bit_allocation import read_decode_costs

    plain = tmp_path / "costs.json"
    plain.write_text(json.dumps({"Q4_K": 1.0, "q4_1": 1.3}))
    assert read_decode_costs(str(plain)) == {"q4_k": 1.0, "q4_1": 1.3}
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"type_speed": {"q4_k": {"relative_time": 1.0}, "q8_0": {"relative_time": 1.4}}}))
    assert read_decode_costs(str(results)) == {"q4_k": 1.0, "q8_0": 1.4}
    for text, reason in (
        ("[1, 2]", "expected a JSON object"),
        ('{"q4_k": -1}', "must be a positive number"),
        ('{"q4_k": true}', "must be a positive number"),
        ('{"q9_z": 1}', "q9_z"),
        ("{", "not a readable JSON file"),
    ):
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        with pytest.raises(ConfigError, match=reason):
            GPTQConfig(size_of="q4_k_m", decode_costs=str(bad))
    with pytest.raises(ConfigError, match="give --size-of with it"):
        RTNConfig(target_bits=5.0, decode_costs=str(plain))
    with pytest.raises(ConfigError, match="--allocation fisher or measured"):
        GPTQConfig(size_of="q4_k_m", allocation="block", decode_costs=str(plain))


def test_a_mix_kept_to_its_recipes_decode_cost_spends_its_bits_and_records_the_cost(tmp_path):
    """`--size-of q4_k_m --decode-costs`: the mix stays within Q4_K_M's bits and, by the costs given, within its
    recipe's decode time; a recipe type the costs lack is named."""
    from leanlm.methods.bit_allocation import recipe_budget

    model = tiny_model("llama", vocab_size=258, width=256, layers=2)
    budget = recipe_budget(model, "q4_k_m")
    costs = {"q4_k": 1.0, "q5_k": 1.2, "q6_k": 1.3, "q8_0": 3.0, "q4_1": 3.0}
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(costs))
    calibration = Calibration(token_ids=token_ids(4, 32, seed=1, vocab_size=258))
    record = quantize_(model, RTNConfig(size_of="q4_k_m", decode_costs=str(path)), calibration=calibration)
    assert record["avg_bits"] <= budget.bits and record["decode_costs"] == costs
    assert 0 < record["decode_cost"] <= 1.0
    used = {kind for kind in record["tensor_types"].values()}
    assert used <= set(costs)
    path.write_text(json.dumps({"q4_k": 1.0}))
    with pytest.raises(ConfigError, match="no cost for q6_k"):
        quantize_(
            tiny_model("llama", vocab_size=258, width=256, layers=2),
            GPTQConfig(size_of="q4_k_m", decode_costs=str(path)),
            calibration=calibration,
        )


def test_recipe_allocation_gives_each_linear_llama_cpps_type_without_reading_text():
    """`--size-of q4_k_m --allocation recipe`: every linear takes the type llama.cpp's Q4_K_M gives it (Q6_K for
    the value projections and down projections its rule picks, Q4_K for the rest), the user's patterns win, and
    RTN reads no calibration text (it needs none); it is refused without --size-of or with --decode-costs."""
    from leanlm.methods.bit_allocation import linear_gguf_names, recipe_budget
    from leanlm.methods.quantize import method_spec

    model = tiny_model("llama", vocab_size=258, width=256, layers=2)
    budget = recipe_budget(model, "q4_k_m")
    names = linear_gguf_names(model)
    config = RTNConfig(size_of="q4_k_m", allocation="recipe")
    assert not method_spec(config).needs_calibration(config)
    record = quantize_(model, config)
    expected = {f"^{re.escape(linear)}$": budget.linears[name][0] for linear, name in names.items()}
    assert record["tensor_types"] == expected and {"q4_k", "q6_k"} == set(expected.values())
    assert record["allocation"] == "recipe" and record["size_of"] == "q4_k_m"
    assert record["avg_bits"] == pytest.approx(budget.bits)
    model = tiny_model("llama", vocab_size=258, width=256, layers=2)
    kept = RTNConfig(size_of="q4_k_m", allocation="recipe", tensor_types=("0.self_attn.q_proj=q8_0",))
    assert quantize_(model, kept)["tensor_types"]["^0\\.self_attn\\.q_proj$"] == "q8_0"
    with pytest.raises(ConfigError, match="give --size-of"):
        GPTQConfig(target_bits=5.0, allocation="recipe")


def test_rtn_in_llama_cpps_types_weighs_its_fit_by_the_importance_matrix():
    """RTN with `--imatrix` in llama.cpp's Q4_K_M types: llama-quantize's importance-matrix file, rounded by leanlm,
    with the same types as without it and weights that differ where the importance matrix moves the fit."""
    calibration = Calibration(token_ids=token_ids(4, 32, seed=1, vocab_size=258))
    plain, weighted = (tiny_model("llama", vocab_size=258, width=256, layers=2) for _ in range(2))
    first = quantize_(plain, RTNConfig(size_of="q4_k_m", allocation="recipe"))
    second = quantize_(
        weighted, RTNConfig(size_of="q4_k_m", allocation="recipe", imatrix=True), calibration=calibration
    )
    assert first["tensor_types"] == second["tensor_types"] and second["imatrix"]
    up = [model.model.layers[0].mlp.up_proj.dequantized_weight() for model in (plain, weighted)]
    assert not torch.equal(*up)
    with pytest.raises(ConfigError, match="needs --scale-search or GGUF block types"):
        RTNConfig(imatrix=True)
