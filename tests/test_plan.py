"""`leanlm plan`: the stored bytes it predicts from the config alone are the bytes the methods' modules hold once
quantized; the command prints a row per method and its JSON; a size it cannot read or a model it cannot read is one
line; `leanlm quantize` warns before a job predicted to exceed the available memory."""

import json
import subprocess
import sys

import pytest
import torch

import leanlm.methods as m
import leanlm.plan as plan
from leanlm.bench import weight_bytes
from leanlm.cli.main import main
from leanlm.errors import ConfigError
from leanlm.kernels.kbit_gemm import avx2_available
from leanlm.methods import load_any
from leanlm.models.architectures import iter_quantizable_linears

METHODS = {
    "nf4-dq": (m.KbitConfig(double_quant=True),),
    "int8 blocks": (m.KbitConfig("int", 8),),
    "rtn": (m.RTNConfig(),),
    "gptq": (m.GPTQConfig(calibration_samples=4),),
    "w8a8-O2": (m.W8A8Config("O2"),),
    "llm-int8": (m.LLMInt8Config(),),
}


@pytest.mark.parametrize("method", METHODS)
def test_stored_bytes_are_the_bytes_the_quantized_layers_hold(tiny_llama_dir, method):
    facts = plan.model_facts(str(tiny_llama_dir))
    predicted, _, kernel_forms = plan.stored_estimate(facts, METHODS[method])
    loaded = load_any(tiny_llama_dir)
    calibration = m.Calibration(samples=4, seq_len=32, tokenizer=loaded.tokenizer)
    m.quantize_(loaded.model, METHODS[method], calibration=calibration)
    linears = sum(weight_bytes(module) for _, module in iter_quantizable_linears(loaded.model))
    assert predicted.parts["linears"] == linears
    assert predicted.total == pytest.approx(weight_bytes(loaded.model), rel=0.01)  # the attention's few scalars
    if method in ("rtn", "gptq") and avx2_available():  # the kernel's constants, derived at the first forward
        with torch.inference_mode():
            loaded.model(torch.randint(0, 100, (1, 8)))
        held = [t for _, module in iter_quantizable_linears(loaded.model) for t in module.kernel_constants()]
        assert kernel_forms == sum(t.numel() * t.element_size() for t in held) > 0


GGUF_CONFIGS = {
    "q4_0": m.RTNConfig(gguf_type="q4_0"),
    "q8_0, down q4_0": m.RTNConfig(gguf_type="q8_0", tensor_types=("mlp.down_proj=q4_0",)),
    "llama.cpp's Q3_K_M types": m.RTNConfig(size_of="q3_k_m", allocation="recipe"),
    "llama.cpp's Q4_K_M types, down q4_0": m.RTNConfig(
        size_of="q4_k_m", allocation="recipe", tensor_types=("mlp.down_proj=q4_0",)
    ),
}


@pytest.mark.parametrize("name", GGUF_CONFIGS)
def test_gguf_blocks_are_planned_in_their_types(tiny_llama_dir, name):
    config = GGUF_CONFIGS[name]
    facts = plan.model_facts(str(tiny_llama_dir))
    predicted, _, kernel_forms = plan.stored_estimate(facts, (config,))
    loaded = load_any(tiny_llama_dir)
    m.quantize_(loaded.model, (config,))
    modules = [module for _, module in iter_quantizable_linears(loaded.model)]
    assert predicted.parts["linears"] == sum(weight_bytes(module) for module in modules)
    if avx2_available():  # the 4-bit blocks' kernel form, derived at the first forward; Q8_0 has none
        with torch.inference_mode():
            loaded.model(torch.randint(0, 100, (1, 8)))
        held = [t for module in modules if module.runtime_bytes() for t in module.kernel_inputs()]
        assert kernel_forms == sum(t.numel() * t.element_size() for t in held) > 0


def test_a_budget_is_planned_as_the_two_types_that_spend_it(tiny_llama_dir):
    facts = plan.model_facts(str(tiny_llama_dir))
    weights = sum(i * o for _, i, o, _ in facts.linears)
    for target, types in ((5.25, {"q4_1", "q5_0"}), (5.0, {"q4_1"}), (4.5, {"q4_0"})):
        config = m.GPTQConfig(target_bits=target, allocation="block")
        planned = {block_type for *_, block_type in plan._planned_linears(facts, config)}
        assert planned == types
        linears = plan.stored_estimate(facts, (config,))[0].parts["linears"]
        biases = sum(o for _, _, o, b in facts.linears if b) * 4
        assert 8 * (linears - biases) / weights == pytest.approx(target, abs=1e-3)


def test_a_llama_cpp_files_size_is_planned_as_its_budget(tiny_llama_dir):
    facts = plan.model_facts(str(tiny_llama_dir))
    assert facts.recipe_bits["q4_0"] == 4.5 and facts.recipe_bits["q4_k_m"] > facts.recipe_bits["q4_0"]
    by_size = m.GPTQConfig(size_of="q4_k_m", allocation="block")
    by_bits = m.GPTQConfig(target_bits=facts.recipe_bits["q4_k_m"], allocation="block")
    assert plan._planned_linears(facts, by_size) == plan._planned_linears(facts, by_bits)


def test_facts_come_from_the_config_alone(tiny_llama_dir):
    facts = plan.model_facts(str(tiny_llama_dir))
    model = load_any(tiny_llama_dir).model
    assert facts.total_parameters == sum(p.numel() for p in model.parameters())
    assert len(facts.linears) == len(list(iter_quantizable_linears(model)))
    assert facts.layers == model.config.num_hidden_layers


def test_plan_prints_every_row_and_writes_json(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", str(tiny_llama_dir), "--memory", "8GiB", "--context", "512", "--json", str(out)]) == 0
    payload = json.loads(out.read_text())
    rows = {row["row"]: row for row in payload["rows"]}
    assert {"fp32", "bf16", "nf4-dq", "gptq-4bit", "smoothquant-O3", "llm-int8", "spqr", "streaming"} <= set(rows)
    assert payload["memory_bytes"] == 8 * 2**30 and all(row["fits"] for row in rows.values())
    assert rows["nf4-dq"]["stored_bytes"] < rows["fp32"]["stored_bytes"]
    assert rows["bf16"]["running_bytes"] < rows["fp32"]["running_bytes"]
    assert rows["fp32"]["quantizing_bytes"] is None and rows["gptq-4bit"]["quantizing_path"] == "out of core"
    assert rows["cushion+smoothquant-O3"]["quantizing_path"] == "in memory"
    assert "nf4-dq" in capsys.readouterr().out
    assert main(["plan", str(tiny_llama_dir), "--memory", "1MiB", "--json", str(out)]) == 0
    assert not any(row["fits"] for row in json.loads(out.read_text())["rows"])


def test_a_model_stored_in_bfloat16_runs_in_place_in_bfloat16_and_converts_for_float32(tiny_llama_dir, tmp_path):
    import torch

    loaded = load_any(tiny_llama_dir)
    loaded.model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    loaded.tokenizer.save_pretrained(tmp_path / "bf16")
    settings, parameters = plan.PlanSettings(context=64), sum(p.numel() for p in loaded.model.parameters())
    rows = {}
    for source in (tiny_llama_dir, tmp_path / "bf16"):
        facts = plan.model_facts(str(source))
        rows[facts.stored_dtype] = {n: plan.plan_row(facts, n, "", (), settings, 0).running for n in ("fp32", "bf16")}
    float32, bfloat16 = rows[torch.float32], rows[torch.bfloat16]
    assert "loading" not in float32["fp32"].parts and "loading" not in bfloat16["bf16"].parts  # used in place
    assert float32["bf16"].parts["loading"] == 4 * parameters and bfloat16["fp32"].parts["loading"] == 2 * parameters
    assert bfloat16["bf16"].total < float32["bf16"].total


@pytest.mark.parametrize(
    "configs", [(m.KbitConfig(proxy_fraction=0.02),), (m.SmoothQuantConfig(alpha="auto"), m.W8A8Config("O3"))]
)
def test_settings_that_need_the_whole_model_are_planned_in_memory(tiny_llama_dir, configs):
    facts = plan.model_facts(str(tiny_llama_dir))
    row = plan.plan_row(facts, "x", "", configs, plan.PlanSettings(), 0)
    assert row.quantizing_path == "in memory" and row.quantizing.parts["float model"] == 4 * facts.total_parameters


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3_text", "gpt2"])
def test_the_gradient_pass_on_fake_tensors_holds_what_the_real_one_holds(family):
    from tiny import tiny_config, tiny_model

    from leanlm.methods.calibration import activation_gradients

    tokens = 48
    predicted = plan.gradient_pass_bytes(tiny_config(family), tokens)
    model = tiny_model(family)
    ids = torch.randint(0, 128, (1, tokens))
    with activation_gradients(model), plan._LiveTensors(model) as live:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    with torch.no_grad():  # what the fake run's KV cache holds and the real one does not (gradient_pass_bytes)
        kept = model(input_ids=ids, use_cache=True).past_key_values
    cache = sum(layer.keys.nbytes + layer.values.nbytes for layer in kept.layers)
    assert live.peak > 0 and live.peak <= predicted <= live.peak + cache


def test_a_budget_ranked_by_gradients_plans_the_gradient_pass(tiny_llama_dir):
    facts = plan.model_facts(str(tiny_llama_dir))
    rows, phases = {}, {}
    for allocation in ("block", "fisher"):
        config = m.GPTQConfig(target_bits=4.5, allocation=allocation, calibration_samples=4)
        rows[allocation] = plan.plan_row(facts, "x", "", (config,), plan.PlanSettings(), 0)
        stored = plan.stored_estimate(facts, (config,))[0]
        phases[allocation] = plan.quantizing_phases(facts, (config,), stored, 0)
    assert rows["block"].quantizing_path == "out of core" and set(phases["block"]) == {"tables", "blocks"}
    assert (
        rows["fisher"].quantizing_path == "in memory" and phases["fisher"]["gradient pass"].parts["gradient pass"] > 0
    )
    # llama.cpp's input roundings keep each linear's output change per rounding its blocks tile, until the backward
    tokens = m.Calibration().seq_len
    roundings = sum(2 * tokens * o * ((i % 32 == 0) + (i % 256 == 0)) for _, i, o, _ in facts.linears)
    assert phases["fisher"]["gradient pass"].parts["llama.cpp input roundings"] == roundings > 0
    assert rows["fisher"].quantizing.total == max(phase.total for phase in phases["fisher"].values())
    assert "gptq-mix" in [name for name, _, _ in plan.method_rows()]


def test_the_kv_cache_grows_with_the_context(tiny_llama_dir):
    facts = plan.model_facts(str(tiny_llama_dir))
    small, large = (plan.plan_row(facts, "fp32", "", (), plan.PlanSettings(context=c), 0) for c in (512, 4096))
    assert large.running.parts["kv_cache"] == 8 * small.running.parts["kv_cache"] > 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--memory", "lots"], "memory 'lots': expected a size"),
        (["--context", "0"], "--context"),
    ],
)
def test_bad_sizes_are_one_line(tiny_llama_dir, argv, message, capsys):
    assert main(["plan", str(tiny_llama_dir), *argv]) != 0
    error = capsys.readouterr().err.strip()
    assert message in error and len(error.splitlines()) == 1


def test_a_model_it_cannot_read_is_one_line(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{not json")
    assert main(["plan", str(tmp_path)]) != 0
    error = capsys.readouterr().err.strip()
    assert "config.json cannot be read" in error and len(error.splitlines()) == 1
    assert main(["plan", str(tmp_path / "missing")]) != 0
    assert "neither a registered model" in capsys.readouterr().err


def test_quantize_warns_before_a_job_that_would_not_fit(tiny_llama_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(plan, "available_memory", lambda: 1 << 20)
    argv = ["quantize", str(tiny_llama_dir), "--method", "kbit", "--out", str(tmp_path / "q")]
    assert main(argv) == 0
    assert "warning: quantizing" in capsys.readouterr().out


def test_parse_bytes():
    assert plan.parse_bytes("8GiB") == 8 * 2**30
    assert plan.parse_bytes("1.5 GB") == 1_500_000_000
    assert plan.parse_bytes("4096") == 4096
    with pytest.raises(ConfigError):
        plan.parse_bytes("-1GiB")


_SOLVE_PEAK = """
import json, sys, types
import torch
from leanlm.bench.harness import peak_memory
from leanlm.formats.gptq import solve
from leanlm.methods.checkpoint import return_freed_memory_at_once
from leanlm.methods.gptq import GPTQConfig
import leanlm.plan as plan

return_freed_memory_at_once()
rows, columns = int(sys.argv[1]), int(sys.argv[2])
generator = torch.Generator().manual_seed(0)
weight = torch.randn(rows, columns, generator=generator) * 0.02
inputs = torch.randn(2 * columns, columns, generator=generator)
hessian = inputs.T @ inputs / inputs.shape[0]
del inputs
# a first solve of the same shapes pages in the code the libraries run at these sizes (their code is not the
# solve's memory; a smaller solve leaves some of it to be paged in during the measured one)
solve(weight.clone(), hessian.clone(), GPTQConfig().solver())
with peak_memory() as peak:
    solve(weight, hessian, GPTQConfig().solver(), overwrite_hessian=True)
facts = types.SimpleNamespace(linears=[("proj", columns, rows, False)], layers=1)
held = columns * columns * 4  # the Hessian, in memory before the solve as it is in the plan's "Hessians"
print(json.dumps({"measured": peak.added_bytes, "counted": plan.solver_peak(facts) - held}))
"""


@pytest.mark.parametrize("rows, columns", [(512, 3072), (4096, 512)], ids=["factor step", "column loop"])
def test_a_solve_holds_what_the_plan_counts_for_it(tmp_path, rows, columns):
    """One GPTQ solve's peak beyond its weight and Hessian, measured in a process of its own, is what
    `solver_peak` counts for it: a wide linear (a down projection's shape) peaks while its Hessian is factored, a
    tall one in the column loop."""
    script = tmp_path / "solve_peak.py"
    script.write_text(_SOLVE_PEAK)
    result = subprocess.run(
        [sys.executable, str(script), str(rows), str(columns)], capture_output=True, text=True, check=True, timeout=300
    )
    numbers = json.loads(result.stdout.strip().splitlines()[-1])
    assert numbers["measured"] == pytest.approx(numbers["counted"], rel=0.05)
