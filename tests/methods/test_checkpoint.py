import json
import re

import pytest
import torch
from tiny import token_ids

from leanlm.errors import CorruptModelError, LeanLMError
from leanlm.methods import (
    QUANT_FILE,
    Calibration,
    SmoothQuantConfig,
    W8A8Config,
    calibrate,
    load_any,
    load_quantized,
    quantize_,
    save_quantized,
)
from leanlm.models import load_model
from leanlm.showcase import ROWS as SHOWCASE_ROWS


@pytest.fixture
def quantized_dir(tiny_llama_dir, tmp_path):
    loaded = load_model(tiny_llama_dir)
    stats = calibrate(loaded.model, torch.randint(0, 1000, (2, 16)))
    record = quantize_(
        loaded.model, [SmoothQuantConfig(0.5), W8A8Config(level="O3")], calibration=Calibration(int8_stats=stats)
    )
    out = save_quantized(loaded, loaded.model, record, tmp_path / "q")
    return out, loaded.model


def test_round_trip_gives_identical_outputs(quantized_dir):
    out, model = quantized_dir
    loaded, record = load_quantized(out)
    ids = torch.randint(0, 1000, (1, 12))
    with torch.inference_mode():
        assert torch.equal(loaded.model(ids).logits, model(ids).logits)
    assert record["method"] == "smoothquant" and record["smoothquant"]["alpha"] == 0.5
    assert load_any(out).model.config._attn_implementation == model.config._attn_implementation


def test_a_bfloat16_load_holds_the_tables_once_in_bfloat16_and_computes_in_it(quantized_dir):
    out, _ = quantized_dir
    reference, fast = load_any(out).model, load_any(out, "bfloat16").model
    embedding, head = fast.get_input_embeddings(), fast.get_output_embeddings()
    assert embedding.weight.dtype == torch.bfloat16 and head.weight is embedding.weight  # still tied, stored once
    assert fast.model.norm.weight.dtype == torch.bfloat16 and not embedding._forward_hooks  # no cast between
    with torch.inference_mode():
        for length in (1, 12):  # leanlm's GEMV (at most 8 rows), then a bfloat16 GEMM
            ids = torch.randint(0, 1000, (1, length))
            assert embedding(ids).dtype == torch.bfloat16  # W8A8's int8 layers take and return it
            expected, got = reference(ids).logits, fast(ids).logits
            assert got.dtype == torch.bfloat16
            assert (got.float() - expected).abs().max() < 0.03 * expected.abs().max()


@pytest.mark.parametrize("row", [row for row in SHOWCASE_ROWS if row.steps], ids=lambda row: row.name)
def test_a_showcase_row_loaded_in_bfloat16_computes_as_its_float32_load(tiny_llama_dir, tmp_path, row):
    """Every quantized row's layers, int8 attention products included (per-token and per-tensor, dynamic and
    static), take and give bfloat16 in a bfloat16 load, within bfloat16's rounding of the float32 load."""
    loaded = load_model(tiny_llama_dir)
    calibration = Calibration(loaded.tokenizer, token_ids=token_ids(4, 32, vocab_size=1000))
    record = quantize_(loaded.model, row.steps, calibration=calibration)
    out = save_quantized(loaded, loaded.model, record, tmp_path / "q")
    _assert_the_bfloat16_load_computes_as_the_float32_load(load_any(out).model, load_any(out, "bfloat16").model)


def _assert_the_bfloat16_load_computes_as_the_float32_load(reference, fast) -> None:
    with torch.inference_mode():
        for length in (4, 40):
            ids = token_ids(1, length, seed=length, vocab_size=1000)
            expected, got = reference(ids).logits, fast(ids).logits
            assert got.dtype == torch.bfloat16 and expected.dtype == torch.float32
            # bfloat16 activations, embedding and head: up to 4% of the largest logit with 3-bit weights
            assert (got.float() - expected).abs().max() < 0.05 * expected.abs().max()


@pytest.mark.parametrize("method", ["kbit", "gptq", "gptq-3bit", "gptq-q4_0"])
def test_a_bfloat16_load_of_a_quantized_checkpoint_computes_in_bfloat16(tiny_llama_dir, tmp_path, method):
    """A bfloat16 load computes in bfloat16 as a float model loaded so does: its norms are held in it and every
    layer's activations are in it; the k-bit, GPTQ and GGUF-block layers take and return it, their prefill GEMMs
    in bfloat16 on a CPU that multiplies it in hardware (both operands rounded to it), float32 elsewhere. RoPE's
    frequencies stay float32. Decode sizes and float32 loads are as before."""
    from leanlm.kernels.kbit_gemm import prefill_dtype
    from leanlm.methods import GPTQConfig, KbitConfig
    from leanlm.nn import GGUFLinear, KbitLinear, SpQRLinear

    config = {
        "kbit": KbitConfig(),
        "gptq": GPTQConfig(group_size=32),
        "gptq-3bit": GPTQConfig(bits=3, group_size=32),
        "gptq-q4_0": GPTQConfig(gguf_type="q4_0"),
    }[method]
    loaded = load_model(tiny_llama_dir)
    ids = token_ids(4, 32, vocab_size=1000)
    record = quantize_(loaded.model, config, calibration=Calibration(token_ids=ids))
    out = save_quantized(loaded, loaded.model, record, tmp_path / "q")
    reference, fast = load_any(out).model, load_any(out, "bfloat16").model
    kinds = (KbitLinear, SpQRLinear, GGUFLinear)
    layers = [module for module in fast.modules() if isinstance(module, kinds)]
    assert layers and (method == "gptq-q4_0") == any(isinstance(module, GGUFLinear) for module in layers)
    float_parameters = [p for name, p in fast.named_parameters() if p.is_floating_point()]
    assert float_parameters and all(p.dtype == torch.bfloat16 for p in float_parameters)
    assert all(b.dtype == torch.float32 for name, b in fast.named_buffers() if name.endswith("inv_freq"))
    assert all(p.dtype == torch.float32 for name, p in reference.named_parameters() if p.is_floating_point())
    seen = []
    fast.model.layers[0].register_forward_hook(lambda module, args, output: seen.append(args[0].dtype))
    _assert_the_bfloat16_load_computes_as_the_float32_load(reference, fast)
    assert seen == [torch.bfloat16, torch.bfloat16]
    layer, x = layers[0], torch.randn(40, layers[0].in_features)
    weight = layer.dense_weight() if isinstance(layer, SpQRLinear) else layer.dequantized_weight()
    if isinstance(layer, SpQRLinear) and layer.permutation is not None:
        x = x[:, torch.argsort(layer.permutation.long())]  # the layer permutes its input back into this order
        weight = weight[:, torch.argsort(layer.permutation.long())]
    gemm = prefill_dtype(torch.bfloat16)
    expected = torch.nn.functional.linear(x.bfloat16().to(gemm), weight.to(gemm)).float()
    with torch.inference_mode():
        got = layer(x.bfloat16())
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), expected, rtol=1e-2, atol=1e-2)


def test_checkpoint_is_safetensors_and_json_only(quantized_dir):
    out, _ = quantized_dir
    suffixes = {p.suffix for p in out.iterdir()}
    assert suffixes <= {".safetensors", ".json", ".jinja"}


def test_damaged_record_is_named(quantized_dir):
    out, _ = quantized_dir
    record = json.loads((out / QUANT_FILE).read_text())
    first = next(iter(record["modules"]))
    record["modules"][first]["class"] = "Int3Linear"
    (out / QUANT_FILE).write_text(json.dumps(record))
    with pytest.raises(CorruptModelError, match="unknown module class 'Int3Linear'"):
        load_quantized(out)


def _edit_record(out, edit):
    record = json.loads((out / QUANT_FILE).read_text())
    (out / QUANT_FILE).write_text(json.dumps(edit(record)))


def _first_linear(record):
    return next(entry for entry in record["modules"].values() if entry["class"] == "W8A8Linear")


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda r: [r], "holds a JSON list; a checkpoint record is an object"),
        (lambda r: {**r, "method": "awq"}, "method 'awq' is not a leanlm method"),
        (lambda r: {**r, "method": "cushion+awq"}, "method 'cushion+awq' is not a leanlm method or composition"),
        (lambda r: {**r, "level": "O4"}, "level 'O4' is not one of O1, O2, O3"),
        (lambda r: {**r, "modules": []}, "'modules' must be an object"),
        (lambda r: {**r, "table_dtype": "float8"}, "table_dtype 'float8' is not one of float32, bfloat16"),
        (lambda r: {**r, "table_dtype": "bfloat16"}, "lm_head.weight: F32 [49152, 64], expected BF16"),
        (lambda r: (_first_linear(r)["args"].update(colour="red"), r)[1], "unexpected keyword argument 'colour'"),
        (lambda r: (_first_linear(r)["args"].update(in_features=7), r)[1], "does not replace a linear of that shape"),
        (lambda r: (_first_linear(r)["args"].update(bias=True), r)[1], "does not match its leanlm_quant.json"),
        (lambda r: {**r, "modules": {"model.nowhere.q_proj": _first_linear(r)}}, "has no module 'model.nowhere'"),
        # found by the fuzz test: an empty name, and a name that is a parameter, not a module
        (
            lambda r: {**r, "modules": {"": {"class": "BmmQuantizer", "args": {}}}},
            "module name '' is not a module path",
        ),
        (
            lambda r: {**r, "modules": {"model.norm.weight": {"class": "BmmQuantizer", "args": {}}}},
            "model.norm.weight is a Parameter of the model, not a module",
        ),
    ],
)
def test_every_damaged_record_is_named_before_anything_is_allocated(quantized_dir, edit, message):
    out, _ = quantized_dir
    _edit_record(out, edit)
    with pytest.raises(CorruptModelError, match=re.escape(message)):
        load_any(out)


def test_a_record_with_absurd_sizes_allocates_nothing(quantized_dir):
    """Module args are checked on the meta device, so a record asking for a terabyte fails in a moment."""
    out, _ = quantized_dir
    _edit_record(out, lambda r: (_first_linear(r)["args"].update(in_features=10**6, out_features=10**6), r)[1])
    with pytest.raises(CorruptModelError, match="does not replace a linear of that shape"):
        load_any(out)


def test_tensors_without_their_record_are_refused_not_read_as_float(quantized_dir):
    out, _ = quantized_dir
    (out / QUANT_FILE).unlink()
    with pytest.raises(
        CorruptModelError,
        match="holds leanlm quantized weights .* no leanlm_quant.json, so it was not written completely",
    ):
        load_any(out)


def test_a_checkpoint_without_config_is_named(quantized_dir):
    out, _ = quantized_dir
    (out / "config.json").unlink()
    with pytest.raises(LeanLMError, match="has no config.json"):
        load_any(out)


def test_a_quantized_checkpoint_is_not_taken_for_a_float_model(quantized_dir):
    out, _ = quantized_dir
    with pytest.raises(CorruptModelError, match="is a quantized checkpoint: this needs a float model"):
        load_model(out)


def test_a_float_directory_missing_tensors_is_refused(tiny_llama_dir):
    from safetensors.torch import load_file, save_file

    weights = tiny_llama_dir / "model.safetensors"
    tensors = load_file(str(weights))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(weights), metadata={"format": "pt"})
    with pytest.raises(CorruptModelError, match="lack 1 of the model's tensors .model.layers.1.mlp.down_proj"):
        load_model(tiny_llama_dir)


# One process imports leanlm once, then forks a child per kill point (torch has started no threads before the
# fork): the child runs `leanlm quantize` and SIGKILLs itself before its Nth write into the output. After each
# killed child the parent records what it left (output directory, staging directories) and keeps a copy of the
# staging directory for the test to load; it stops at the first run that finishes.
_KILLING_QUANTIZE = """
import json, os, shutil, signal, sys
from contextlib import contextmanager
import pathlib, transformers
import leanlm.methods.checkpoint as checkpoint
import leanlm.methods.out_of_core as out_of_core
from leanlm.cli.main import main

pipeline, snapshots, argv = sys.argv[1], pathlib.Path(sys.argv[2]), sys.argv[3:]
out = pathlib.Path(argv[argv.index("--out") + 1])
armed, calls, kill_at = [pipeline == "out of core"], [0], [0]  # in memory: the writes into the staging directory

def killing(write):
    def wrapper(*args, **kwargs):
        if armed[0]:
            calls[0] += 1
            if calls[0] == kill_at[0]:
                os.kill(os.getpid(), signal.SIGKILL)
        return write(*args, **kwargs)
    return wrapper

staged = checkpoint.staged_directory
@contextmanager
def arming(out):
    with staged(out) as staging:
        armed[0] = True
        yield staging

checkpoint.staged_directory = arming
checkpoint.save_safetensors_from = killing(checkpoint.save_safetensors_from)
out_of_core.save_file = killing(out_of_core.save_file)
transformers.PretrainedConfig.save_pretrained = killing(transformers.PretrainedConfig.save_pretrained)
transformers.PreTrainedTokenizerBase.save_pretrained = killing(transformers.PreTrainedTokenizerBase.save_pretrained)
pathlib.Path.write_text = killing(pathlib.Path.write_text)
pathlib.Path.replace = killing(pathlib.Path.replace)  # the rename that publishes the directory

runs = []
for point in range(1, 20):
    child = os.fork()
    if child == 0:
        kill_at[0] = point
        code = 1
        try:
            code = main(argv)
        finally:
            os._exit(code)
    status = os.waitpid(child, 0)[1]
    signal_number = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    staging = sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.partial-"))
    runs.append({"kill_at": point, "signal": signal_number, "exit": os.waitstatus_to_exitcode(status),
                 "out_exists": out.exists(), "staging": staging})
    if signal_number is None:
        break
    for name in staging:
        shutil.copytree(out.parent / name, snapshots / str(point) / name)
print(json.dumps(runs))
"""


@pytest.mark.parametrize(
    "pipeline, flags", [("in memory", ["--proxy-fraction", "0.02"]), ("out of core", ["--resume"])]
)
def test_a_quantize_killed_at_any_write_never_leaves_a_loadable_half_checkpoint(
    pipeline, flags, tiny_llama_dir, tmp_path, capsys
):
    """SIGKILL before each write step of `leanlm quantize` in turn (config, tokenizer, weights - each block's file
    out of core -, record, publish): the output directory either does not exist or is whole, and a half-written
    staging directory is refused. Out of core, each run resumes the one killed before it."""
    import subprocess
    import sys

    from leanlm.cli.main import main

    out, snapshots = tmp_path / "q", tmp_path / "snapshots"
    argv = ["quantize", str(tiny_llama_dir), "--method", "kbit", "--bits", "4", *flags, "--out", str(out)]
    eval_argv = ["--tasks", "wikitext2", "--max-tokens", "128", "--seq-len", "64", "--json"]
    run = subprocess.run(
        [sys.executable, "-c", _KILLING_QUANTIZE, pipeline, str(snapshots), *argv],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    runs = json.loads(run.stdout.strip().splitlines()[-1])
    *killed, finished = runs
    assert finished["exit"] == 0 and finished["out_exists"], run.stderr[-2000:]
    outcomes = []
    for each in killed:
        assert each["signal"] == 9 and not each["out_exists"], each
        assert len(each["staging"]) == 1, each
        staging = snapshots / str(each["kill_at"]) / each["staging"][0]
        code = main(["eval", str(staging), *eval_argv, str(tmp_path / f"{each['kill_at']}.json")])
        error = capsys.readouterr().err
        assert "Traceback" not in error
        outcomes.append(code)
        if code != 0:
            assert code == 2 and error.startswith("leanlm: error: ") and error.count("\n") == 1
    kill_at = finished["kill_at"]
    assert kill_at >= 5, "fewer write steps than config, tokenizer, weights, record and publish"
    # The last killed run had written everything but the rename: its staging directory is whole and loads; every
    # earlier one is refused with a reason.
    assert outcomes[:-1] == [2] * (len(outcomes) - 1) and outcomes[-1] == 0
    assert main(["eval", str(out), *eval_argv, str(tmp_path / "whole.json")]) == 0
    whole = json.loads((tmp_path / "whole.json").read_text())["results"]["wikitext2"]["perplexity"]
    last = json.loads((tmp_path / f"{kill_at - 1}.json").read_text())["results"]["wikitext2"]["perplexity"]
    assert last == whole
    # The finished run removed the staging directories of the killed ones, and nothing half-written is inside.
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]


def test_a_checkpoint_loads_straight_into_quantized_modules(quantized_dir, monkeypatch):
    """No float model is built first: every float linear made while loading starts on the meta device (the
    output projection then takes the stored tensor), so resident memory follows the stored bytes."""
    from torch import nn

    made = []
    original = nn.Linear.__init__

    def recording(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(self.weight.is_meta)

    monkeypatch.setattr(nn.Linear, "__init__", recording)
    out, model = quantized_dir
    loaded, _ = load_quantized(out)
    assert made and all(made)
    assert not any(t.is_meta for t in loaded.model.state_dict().values())
    assert loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight  # tied again


def test_each_tensor_of_a_weights_file_is_read_through_a_handle_of_its_own(quantized_dir, monkeypatch):
    """A handle keeps every page it read mapped until it closes: an in-memory checkpoint is one file of the whole
    model, so reading it through one handle held all of it resident beside the copies (benchmarks/plan_accuracy.py's
    cushion row). No handle reads more than one tensor, and the model is the same."""
    import leanlm.methods.checkpoint as checkpoint

    reads_per_handle = []
    original = checkpoint.safe_open

    class Counting:
        def __init__(self, *args, **kwargs):
            self.handle, self.reads = original(*args, **kwargs), 0

        def __enter__(self):
            self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            reads_per_handle.append(self.reads)
            return self.handle.__exit__(*exc)

        def get_tensor(self, name):
            self.reads += 1
            return self.handle.get_tensor(name)

        def __getattr__(self, name):
            return getattr(self.handle, name)

    monkeypatch.setattr(checkpoint, "safe_open", Counting)
    out, model = quantized_dir
    loaded, _ = load_quantized(out)
    assert len(list(out.glob("*.safetensors"))) == 1 and max(reads_per_handle) == 1 and sum(reads_per_handle) > 10
    ids = torch.randint(0, 1000, (1, 12))
    with torch.inference_mode():
        assert torch.equal(loaded.model(ids).logits, model(ids).logits)


@pytest.mark.skipif(
    not __import__("leanlm.kernels.int8_gemm", fromlist=["x"]).fbgemm_available(), reason="no fbgemm engine"
)
def test_a_loaded_w8a8_checkpoint_keeps_one_copy_of_each_int8_weight_and_none_of_the_files(quantized_dir):
    from leanlm.nn import W8A8Linear

    out, model = quantized_dir
    loaded, _ = load_quantized(out)
    int8 = [m for m in loaded.model.modules() if isinstance(m, W8A8Linear)]
    assert int8 and all(m._buffers["weight"] is None for m in int8)  # only fbgemm's packed copy
    assert loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight  # still tied after the copy
    # Nothing refers to the files' mappings any more: every tensor owns its memory (a view of a file would
    # keep the whole file's read pages resident).
    kept = [t for t in loaded.model.state_dict().values() if t.dtype != torch.int8]  # int8: unpacked to save
    assert all(t.untyped_storage().nbytes() == t.nbytes for t in kept)
    ids = torch.randint(0, 1000, (1, 12))
    with torch.inference_mode():
        assert torch.equal(loaded.model(ids).logits, model(ids).logits)
    record = {k: v for k, v in json.loads((out / QUANT_FILE).read_text()).items() if k != "modules"}
    again = save_quantized(loaded, loaded.model, record, out.parent / "again")  # saving unpacks them exactly
    with torch.inference_mode():
        assert torch.equal(load_quantized(again)[0].model(ids).logits, model(ids).logits)


def _wide_table_checkpoint(directory, family, tokenizer):
    """An NF4 checkpoint of a 2-block model whose embedding and head are its bulk: SmolLM2's 49152 tokens x 1024
    (192 MiB in float32, per table)."""
    import transformers as hf

    from leanlm.methods import KbitConfig

    config_class = {"llama": hf.LlamaConfig, "mistral": hf.MistralConfig}[family]
    torch.manual_seed(0)
    hf.AutoModelForCausalLM.from_config(
        config_class(
            vocab_size=len(tokenizer),
            hidden_size=1024,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=family == "llama",
        ),
        dtype=torch.float32,
    ).save_pretrained(directory / "float")
    tokenizer.save_pretrained(directory / "float")
    loaded = load_model(directory / "float")
    record = quantize_(loaded.model, KbitConfig())
    return save_quantized(loaded, loaded.model, record, directory / "q")


_PEAK_OF_LOAD = """
import json, sys
from pathlib import Path
from leanlm.bench.harness import process_memory_bytes
from leanlm.methods import load_any
from leanlm.models.loading import read_tokenizer
read_tokenizer(Path(sys.argv[1]))  # imports and a tokenizer's memory, before the baseline
before = process_memory_bytes("self", "VmRSS")
load_any(sys.argv[1], "bfloat16", sys.argv[2])
print(json.dumps({"before": before, "peak": process_memory_bytes("self")}))
"""  # VmHWM, not getrusage's ru_maxrss, which a child inherits across exec from the forking process (pytest's)


@pytest.mark.parametrize("family, head", [("llama", "int8"), ("mistral", "float"), ("mistral", "int8")])
def test_the_embedding_and_head_are_converted_as_they_are_read_never_whole_in_float32(
    family, head, tmp_path, smollm2_tokenizer
):
    """Loading with bfloat16 tables (and an 8-bit head) reads the stored float32 tables a MiB at a time: the
    load's peak stays below half their float32 bytes (reading them whole and converting after took 2.8x them here,
    tied), and the model is the one the convert-after-loading path gives."""
    import subprocess
    import sys

    from leanlm.methods.checkpoint import embeddings_to_, float_parts_to_, quantize_head_

    out = _wide_table_checkpoint(tmp_path, family, smollm2_tokenizer)
    float32_tables = len(smollm2_tokenizer) * 1024 * 4 * (1 if family == "llama" else 2)
    result = subprocess.run(
        [sys.executable, "-c", _PEAK_OF_LOAD, str(out), head], capture_output=True, text=True, check=True
    )
    memory = json.loads(result.stdout.strip().splitlines()[-1])
    assert memory["peak"] - memory["before"] < 0.5 * float32_tables
    streamed = load_any(out, "bfloat16", head).model
    converted = load_quantized(out)[0].model
    float_parts_to_(converted, torch.bfloat16)
    embeddings_to_(converted, torch.bfloat16)
    if head == "int8":
        quantize_head_(converted)
    ids = torch.randint(0, 1000, (1, 12))
    with torch.inference_mode():
        assert torch.equal(streamed(ids).logits, converted(ids).logits)
