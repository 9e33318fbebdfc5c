"""compressed-tensors export: a leanlm checkpoint written by the compressed-tensors package loads in transformers
and computes what leanlm computes (weight-only and static W8A8: the same logits; dynamic activations: within the
difference of the two scale rules, absmax / 127 in leanlm against absmax / 127.5 in compressed-tensors), with
leanlm's own integer codes; every form it cannot hold is refused with the reason, before anything is written."""

import json

import pytest
import torch
from safetensors import safe_open
from tiny import token_ids
from transformers import AutoModelForCausalLM

from leanlm.cli.main import main
from leanlm.methods.checkpoint import load_quantized

CASES = {
    "w8a8 O1 per-channel": (
        [
            "--method",
            "w8a8",
            "--level",
            "O1",
            "--no-bmm",
            "--weight-granularity",
            "per_channel",
            "--calib-samples",
            "4",
        ],
        "int-quantized",
        0.02,
    ),
    "smoothquant O3": (
        ["--method", "smoothquant", "--level", "O3", "--no-bmm", "--calib-samples", "4"],
        "int-quantized",
        1e-5,
    ),
    "rtn int4 g32": (["--method", "rtn", "--grid", "symmetric", "--group-size", "32"], "pack-quantized", 1e-5),
    "gptq int4 g32": (
        ["--method", "gptq", "--grid", "symmetric", "--group-size", "32", "--no-act-order", "--calib-samples", "4"],
        "pack-quantized",
        1e-5,
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_a_checkpoint_loads_in_transformers_and_computes_what_leanlm_computes(case, tiny_llama_dir, tmp_path):
    arguments, form, tolerance = CASES[case]
    checkpoint, out = tmp_path / "checkpoint", tmp_path / "ct"
    assert main(["quantize", str(tiny_llama_dir), *arguments, "--out", str(checkpoint)]) == 0
    assert main(["export", str(checkpoint), "--format", "compressed-tensors", "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == form
    assert config["ignore"] == ["lm_head"]

    ours, _ = load_quantized(checkpoint)
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = token_ids(2, 40, vocab_size=1000)
    with torch.no_grad():
        expected, got = ours.model(ids).logits, theirs(ids).logits
    assert (got - expected).abs().max().item() <= tolerance * expected.abs().max().item()
    if form == "int-quantized":  # the file holds leanlm's int8 codes themselves
        with safe_open(str(out / "model.safetensors"), "pt") as handle:
            codes = handle.get_tensor("model.layers.0.mlp.down_proj.weight")
        assert codes.dtype == torch.int8
        assert torch.equal(codes, ours.model.model.layers[0].mlp.down_proj.weight)


@pytest.mark.parametrize(
    "arguments, reason",
    [
        (["--method", "w8a8", "--level", "O3", "--calib-samples", "4"], "--no-bmm (attention's int8"),
        (
            ["--method", "smoothquant", "--level", "O2", "--no-bmm", "--calib-samples", "4"],
            "--level O1 or O3 (dynamic per-tensor int8 activations",
        ),
        (["--method", "rtn", "--group-size", "32"], "fractional zeros"),
        (["--method", "kbit"], "--method w8a8, smoothquant, rtn or gptq (k-bit codebooks"),
        (["--method", "llm-int8"], "outlier columns"),
        (["--method", "rtn", "--grid", "symmetric", "--group-size", "48"], "compressed-tensors packs whole groups"),
    ],
)
def test_forms_it_cannot_hold_are_refused_with_the_reason(arguments, reason, tiny_llama_dir, tmp_path, capsys):
    checkpoint, out = tmp_path / "checkpoint", tmp_path / "ct"
    assert main(["quantize", str(tiny_llama_dir), *arguments, "--out", str(checkpoint)]) == 0
    capsys.readouterr()
    assert main(["export", str(checkpoint), "--format", "compressed-tensors", "--out", str(out)]) == 2
    assert reason in capsys.readouterr().err
    assert not out.exists()


def test_a_float_model_is_refused(tiny_llama_dir, tmp_path, capsys):
    assert main(["export", str(tiny_llama_dir), "--format", "compressed-tensors", "--out", str(tmp_path / "ct")]) == 2
    assert "takes a leanlm quantized checkpoint" in capsys.readouterr().err


def test_round_trip_in_leanlm_evaluates_and_requantizes_the_exported_directory(tiny_llama_dir, tmp_path):
    checkpoint, out = tmp_path / "checkpoint", tmp_path / "ct"
    assert (
        main(
            [
                "quantize",
                str(tiny_llama_dir),
                "--method",
                "smoothquant",
                "--level",
                "O3",
                "--no-bmm",
                "--calib-samples",
                "4",
                "--out",
                str(checkpoint),
            ]
        )
        == 0
    )
    assert main(["export", str(checkpoint), "--format", "compressed-tensors", "--out", str(out)]) == 0
    perplexities = []
    for source in (checkpoint, out):
        assert (
            main(
                ["eval", str(source), "--max-tokens", "2048", "--seq-len", "256", "--json", str(tmp_path / "eval.json")]
            )
            == 0
        )
        perplexities.append(json.loads((tmp_path / "eval.json").read_text())["results"]["wikitext2"]["perplexity"])
    assert perplexities[1] == pytest.approx(perplexities[0], rel=1e-4)
    assert main(["quantize", str(out), "--method", "rtn", "--out", str(tmp_path / "again")]) == 0
