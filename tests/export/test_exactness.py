"""A checkpoint that cannot be exported exactly is refused with one line naming every `leanlm quantize` setting
it would need, in the command line's words (no class names)."""

import pytest
import torch

from leanlm.errors import ConfigError
from leanlm.export.exactness import require_exact
from leanlm.export.to_compressed_tensors import compressed_tensors_problems
from leanlm.export.to_gguf import gguf_problems
from leanlm.formats.gptq import SolverSettings, solve
from leanlm.nn import KbitLinear, SpQRLinear


def _gptq_module(**settings) -> SpQRLinear:
    """A 128 x 256 linear as GPTQ quantizes it by default: 4 bits, min-max groups of 128, act-order."""
    options = {"bits": 4, "group_size": 128, "act_order": True, "error_feedback": True, "grid": "minmax", **settings}
    solver = SolverSettings(**options)
    generator = torch.Generator().manual_seed(0)
    weight, inputs = torch.randn(128, 256, generator=generator), torch.randn(512, 256, generator=generator)
    return SpQRLinear.from_solved(solve(weight, inputs.T @ inputs / 512, solver), solver, None)


def test_gptq_with_the_papers_defaults_names_every_setting_gguf_needs_at_once():
    with pytest.raises(ConfigError) as refused:
        require_exact("GGUF", [_gptq_module(), _gptq_module()], gguf_problems)
    message = str(refused.value)
    assert "\n" not in message and "Linear" not in message
    for setting in ("--group-size 32", "--static-groups or --no-act-order", "--grid symmetric"):
        assert message.count(setting) == 1, (setting, message)


def test_compressed_tensors_names_the_grid_and_the_column_order_together():
    with pytest.raises(ConfigError) as refused:
        require_exact("compressed-tensors", [_gptq_module()], compressed_tensors_problems)
    message = str(refused.value)
    assert "--static-groups or --no-act-order" in message and "--grid symmetric" in message
    assert "--group-size" not in message  # 128 divides 256


@pytest.mark.parametrize("problems_of", [gguf_problems, compressed_tensors_problems])
def test_codebooks_name_the_methods_that_export(problems_of):
    (problem,) = problems_of(KbitLinear(64, 32, bias=False))
    assert problem.startswith("--method ") and "rtn or gptq" in problem and "Linear" not in problem


def test_an_exportable_module_has_no_problems():
    module = _gptq_module(group_size=32, act_order=False, grid="symmetric")
    assert gguf_problems(module) == compressed_tensors_problems(module) == []
