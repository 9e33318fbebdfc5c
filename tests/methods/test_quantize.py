"""The one verb: every method through `quantize_`, lists that compose, and the command line generated from the
configs."""

import pytest
import torch
from tiny import tiny_model, token_ids

import leanlm
from leanlm.errors import ConfigError
from leanlm.methods import (
    Calibration,
    CushionConfig,
    GPTQConfig,
    KbitConfig,
    LLMInt8Config,
    RTNConfig,
    SmoothQuantConfig,
    SpQRConfig,
    W8A8Config,
    load_quantized,
    quantize_,
    save_quantized,
)
from leanlm.methods.quantize import method_names
from leanlm.models import load_model
from leanlm.nn import KbitLinear, SpQRLinear, W8A8Linear


def _ids(samples=4, length=24):
    return token_ids(samples, length)


def test_the_verb_and_every_config_are_exported_from_the_package():
    assert leanlm.quantize_ is quantize_
    for name in (
        "KbitConfig",
        "RTNConfig",
        "GPTQConfig",
        "SpQRConfig",
        "W8A8Config",
        "SmoothQuantConfig",
        "LLMInt8Config",
        "CushionConfig",
        "Calibration",
        "QuantRecord",
    ):
        assert getattr(leanlm, name).__name__ == name
    assert set(method_names()) == {"kbit", "rtn", "gptq", "spqr", "w8a8", "smoothquant", "llm-int8", "cushion"}


@pytest.mark.parametrize(
    "config, module_type, name",
    [
        (KbitConfig(), KbitLinear, "kbit"),
        (RTNConfig(), SpQRLinear, "rtn"),
        (GPTQConfig(group_size=32), SpQRLinear, "gptq"),
        (SpQRConfig(), SpQRLinear, "spqr"),
        (W8A8Config(level="O3"), W8A8Linear, "w8a8"),
        (LLMInt8Config(), W8A8Linear, "llm-int8"),
        ([SmoothQuantConfig(0.5), W8A8Config(level="O1")], W8A8Linear, "smoothquant"),
        ([SmoothQuantConfig(0.5), GPTQConfig(group_size=32)], SpQRLinear, "smoothquant+gptq"),
    ],
)
def test_every_method_goes_through_the_one_verb(config, module_type, name):
    model = tiny_model("llama")
    record = quantize_(model, config, calibration=Calibration(token_ids=_ids()))
    assert record.method == name and record["seconds"] > 0
    assert sum(isinstance(m, module_type) for m in model.modules()) == 14


def test_smoothing_then_gptq_keeps_the_model_and_round_trips(tiny_llama_dir, tmp_path):
    loaded = load_model(tiny_llama_dir)
    ids = torch.randint(0, 1000, (1, 16))
    with torch.inference_mode():
        reference = loaded.model(ids).logits
    calibration = Calibration(token_ids=token_ids(8, 32, vocab_size=1000))
    record = quantize_(
        loaded.model, [SmoothQuantConfig(0.5), GPTQConfig(bits=8, group_size=32)], calibration=calibration
    )
    assert record["smoothquant"]["alpha"] == 0.5 and record["bits"] == 8
    with torch.inference_mode():
        quantized = loaded.model(ids).logits
    assert ((quantized - reference).norm() / reference.norm()) < 0.02  # smoothing is exact; 8 bits nearly so
    reloaded, saved = load_quantized(save_quantized(loaded, loaded.model, record, tmp_path / "q"))
    assert saved["method"] == "smoothquant+gptq"
    with torch.inference_mode():
        assert torch.equal(reloaded.model(ids).logits, quantized)


@pytest.mark.parametrize(
    "configs, message",
    [
        ([KbitConfig(), GPTQConfig()], "quantizes once: .* 2 quantizers \\(kbit, gptq\\)"),
        ([W8A8Config(), SmoothQuantConfig()], "smoothquant must come before the quantizer"),
        ([SmoothQuantConfig()], "0 quantizers"),
        (
            [CushionConfig(), KbitConfig()],
            "cushion prepares activations for int8 quantization: follow it with W8A8Config",
        ),
        ([SmoothQuantConfig(), SmoothQuantConfig(0.7), W8A8Config()], "a method appears twice"),
        ([{"bits": 4}], "dict is not a leanlm method config"),
        ([], "at least one method config"),
    ],
)
def test_compositions_that_make_no_sense_are_named(configs, message):
    with pytest.raises(ConfigError, match=message):
        quantize_(tiny_model("llama"), configs)


def test_methods_that_need_text_say_so_before_touching_the_model():
    model = tiny_model("llama")
    with pytest.raises(ConfigError, match="GPTQConfig needs calibration text"):
        quantize_(model, GPTQConfig())
    assert not any(isinstance(m, SpQRLinear) for m in model.modules())


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--method", "kbit"], [KbitConfig(double_quant=True)]),
        (["--method", "kbit", "--no-double-quant"], [KbitConfig()]),
        (
            ["--method", "gptq"],
            [GPTQConfig(grid="symmetric", group_size=32, static_groups=True, scale_search=True, hessian_shrinkage=0.5)],
        ),
        (
            ["--method", "gptq", "--grid", "minmax", "--group-size", "128", "--no-static-groups", "--no-scale-search"],
            [GPTQConfig(hessian_shrinkage=0.5)],
        ),
        (
            ["--method", "spqr", "--outlier-threshold", "none", "--no-act-order"],
            [SpQRConfig(outlier_threshold=None, act_order=False)],
        ),
        (["--method", "rtn", "--group-size", "0"], [RTNConfig(group_size=None)]),
        (["--method", "w8a8"], [W8A8Config()]),
        (
            ["--method", "smoothquant"],
            [SmoothQuantConfig(0.7), W8A8Config(level="O3", weight_granularity="per_channel")],
        ),
        (
            ["--method", "smoothquant", "--alpha", "auto", "--no-smooth-extension", "--calib-samples", "16"],
            [
                SmoothQuantConfig("auto", False, False, calibration_samples=16),
                W8A8Config(level="O3", weight_granularity="per_channel", calibration_samples=16),
            ],
        ),
        (["--method", "llm-int8", "--threshold", "inf"], [LLMInt8Config(None)]),
        (["--method", "kbit", "--block-size", "row"], [KbitConfig(block_size=None, double_quant=True)]),
        (
            ["--method", "cushion", "--base", "smoothquant", "--cushion-init", "\n", "--seed", "3"],
            [CushionConfig(initial_text="\n", seed=3), SmoothQuantConfig(), W8A8Config(level="O3")],
        ),
    ],
)
def test_the_command_line_builds_exactly_the_configs_with_the_recipes_defaults(argv, expected):
    from leanlm.cli.main import build_parser
    from leanlm.cli.options import method_configs

    args = build_parser().parse_args(["quantize", "m", *argv, "--out", "x"])
    configs, calibration = method_configs(args)
    assert configs == expected
    assert calibration == Calibration(seed=3 if "--seed" in argv else 0)


def test_every_command_line_field_has_a_flag_with_its_help():
    from leanlm.cli.main import build_parser
    from leanlm.cli.options import command_line_fields, flag_of
    from leanlm.methods.recipes import RECIPES

    help_text = build_parser()._subparsers._group_actions[0].choices["quantize"].format_help()
    for recipe in RECIPES.values():
        for config_type in (*recipe.steps, *(t for base in recipe.bases.values() for t in base)):
            for item in command_line_fields(config_type):
                assert flag_of(item) in help_text and item.metadata["help"].split()[0] in help_text
