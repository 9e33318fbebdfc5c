import pytest
import torch

from leanlm.errors import ConfigError
from leanlm.kernels import int8_gemm
from leanlm.kernels.int8_gemm import (
    _split_gemm,
    fbgemm_available,
    fbgemm_saturates,
    int8_gemv,
    int8_linear,
    pack_weight,
    rounded_codes,
)
from leanlm.kernels.kbit_gemm import int8_kernel_isas
from leanlm.nn.w8a8_linear import W8A8Linear

pytestmark = pytest.mark.skipif(not fbgemm_available(), reason="PyTorch has no fbgemm/x86 quantized engine here")


def assert_same_scaled_product(out: torch.Tensor, eager: torch.Tensor, what: str) -> None:
    """Bit for bit, except where fbgemm saturates on this CPU: there the eager path adds two halves each scaled
    in float32 (`int8_gemm._split_gemm`), so it may differ by a few float32 roundings of the largest output,
    far below one code of any input (which moves an output by a whole scale step)."""
    if not fbgemm_saturates():
        assert torch.equal(out, eager), what
        return
    tolerance = 4 * torch.finfo(torch.float32).eps * float(eager.abs().max())
    assert float((out - eager).abs().max()) <= tolerance, what


@pytest.mark.parametrize("m, k, n", [(1, 64, 48), (7, 129, 33), (64, 576, 192), (300, 1536, 576)])
def test_integer_products_are_exact(m, k, n):
    """With unit scales the output is the integer product itself. Full-range uniform integers are the worst
    case for the int16 saturation that AVX2 int8 kernels can suffer."""
    torch.manual_seed(m + k + n)
    x = torch.randint(-128, 128, (m, k)).float()
    weight = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    ones = torch.ones(n)
    expected = x.double() @ weight.double().T
    for backend in ("reference", "fbgemm"):
        out = int8_linear(x, torch.tensor(1.0), weight, ones, None, backend)
        assert torch.equal(out, expected.float()), backend


@pytest.mark.parametrize("zero_point", [0, 3])
def test_the_split_product_is_exact_on_every_cpu(zero_point):
    """What a CPU whose fbgemm saturates runs (`fbgemm_saturates`), run here whatever this CPU does: two GEMMs of
    7-bit halves give the full-range integer products exactly, and the per-tensor scaling to float32 rounding."""
    torch.manual_seed(5)
    codes = torch.randint(-128 - zero_point, 128 - zero_point, (33, 1536)).float()
    weight = torch.randint(-127, 128, (40, 1536), dtype=torch.int8)
    packed = pack_weight(weight, torch.ones(40))
    expected = codes.double() @ weight.double().T
    assert torch.equal(_split_gemm(codes.clone(), 1.0, 128 + zero_point, packed), expected.float())
    scaled = _split_gemm(codes.clone(), 0.37, 128 + zero_point, packed)
    assert torch.allclose(scaled.double(), expected * 0.37, rtol=1e-6, atol=1e-3)


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_fbgemm_matches_the_reference_with_scales(per_token, bias, split, monkeypatch):
    """Both of fbgemm's paths on every CPU: the single GEMM and the split one that saturating CPUs take. The
    single GEMM's weights stay within +-63, where a pair of its uint8 x int8 products fits int16 even on a CPU
    whose fbgemm saturates (the full range is `test_the_split_product_is_exact_on_every_cpu`'s)."""
    monkeypatch.setattr(int8_gemm, "fbgemm_saturates", lambda: split)
    torch.manual_seed(1)
    x = torch.randn(9, 40) * 3
    bound = 128 if split else 64
    weight = torch.randint(1 - bound, bound, (24, 40), dtype=torch.int8)
    weight_scale = torch.rand(24) * 0.01 + 1e-3
    b = torch.randn(24) if bias else None
    x_scale = x.abs().amax(dim=1, keepdim=True) / 127 if per_token else torch.tensor(0.02)  # static: clamps
    reference = int8_linear(x, x_scale, weight, weight_scale, b, "reference")
    fast = int8_linear(x, x_scale, None, None, b, "fbgemm", pack_weight(weight, weight_scale))
    assert torch.allclose(fast, reference, rtol=1e-5, atol=1e-5)


def _near_ties(rows: int, k: int, scale: torch.Tensor) -> torch.Tensor:
    """Values a hair (1e-6 to 1e-5 of a step) from half steps of `scale`: where a kernel that rounds x times 1 / s,
    or adds the uint8 zero point before rounding in float32, picks the other code."""
    torch.manual_seed(4)
    steps = torch.randint(-140, 140, (rows, k)).float() + 0.5
    return (steps + torch.randn(rows, k) * 1e-5) * scale


@pytest.mark.parametrize("granularity", ["per_tensor", "per_token", "zero_point"])
def test_every_int8_path_rounds_ties_as_the_reference(granularity):
    """An identity weight with unit scales makes each output the input's code times its scale, so the codes of
    fbgemm's path and of the one-token kernel (every ISA) are compared with the reference's exactly, on inputs
    made of near-ties (and values beyond the range, which clamp)."""
    k = 256
    scale = torch.full((8, 1), 0.37) if granularity == "per_token" else torch.tensor(0.37)
    zero_point = 3 if granularity == "zero_point" else 0
    x = _near_ties(8, k, scale)
    identity, ones = torch.eye(k, dtype=torch.int8), torch.ones(k)
    expected = int8_linear(x, scale, identity, ones, None, "reference", x_zero_point=zero_point)
    fast = int8_linear(
        x.clone(), scale, None, None, None, "fbgemm", pack_weight(identity, ones), x_zero_point=zero_point
    )
    assert_same_scaled_product(fast, expected, "fbgemm")
    if zero_point == 0 and int8_kernel_isas():
        for isa in int8_kernel_isas():
            for row in range(8):
                out = int8_gemv(
                    x[row : row + 1], identity, ones, None, float(scale.flatten()[row % scale.numel()]), isa=isa
                )
                assert torch.equal(out, expected[row : row + 1]), isa


@pytest.mark.skipif(not int8_kernel_isas(), reason="leanlm's kernels cannot be built here")
@pytest.mark.parametrize("k", [13, 576, 1000])  # 13 and 1000: a scalar tail after the 8-wide loop
@pytest.mark.parametrize("granularity", ["per_tensor", "per_token", "zero_point"])
def test_the_compiled_rounding_pass_equals_the_pytorch_ops(k, granularity):
    """The one C++ pass that rounds prefill activations against the PyTorch ops it replaced (its oracle), bit for
    bit: near-ties, ordinary values, values beyond the range, infinities and NaN."""
    rows = 6
    scale = torch.rand(rows, 1) * 0.5 + 0.01 if granularity == "per_token" else torch.tensor(0.37)
    zero_point = 3 if granularity == "zero_point" else 0
    x = _near_ties(rows, k, scale)
    x[1] = torch.randn(k) * 20
    x[2, :4] = torch.tensor([float("inf"), float("-inf"), float("nan"), 1e30])
    rescale = granularity != "per_token"
    expected = rounded_codes(x, scale, zero_point, rescale=rescale, compiled=False)
    original = x.clone()
    in_place = x.clone()
    for compiled in (
        rounded_codes(x, scale, zero_point, rescale=rescale),
        rounded_codes(in_place, scale, zero_point, rescale=rescale, overwrite_input=True),
    ):
        assert torch.equal(compiled.isnan(), expected.isnan()) and compiled.isnan().sum() == 1
        assert torch.equal(compiled.nan_to_num(0.0), expected.nan_to_num(0.0))
    assert torch.equal(x.nan_to_num(0.0), original.nan_to_num(0.0))  # left alone without overwrite_input


@pytest.mark.parametrize("zero_point", [0, 3])
def test_the_packed_copy_gives_the_weight_back_exactly(zero_point):
    torch.manual_seed(2)
    weight = torch.randint(-127, 128, (24, 200), dtype=torch.int8)
    weight_scale = torch.rand(24) * 0.01 + 1e-3
    if zero_point:  # per tensor: one scale
        weight_scale = weight_scale[:1].expand(24).clone()
    packed = pack_weight(weight, weight_scale, zero_point)
    assert torch.equal(packed.unpacked(), weight)
    # a few columns, and more than one one-hot GEMM's worth (`ONE_HOT_ROWS`)
    for columns in (torch.tensor([0, 7, 199]), torch.randperm(200)[:150]):
        expected = ((weight[:, columns].float() - zero_point) * weight_scale[:, None]).T
        assert torch.equal(packed.dequantized_columns(columns, 200), expected)  # bit for bit: LLM.int8()'s float part


def test_unknown_backend_is_named():
    with pytest.raises(ValueError, match="unknown int8 backend 'cuda'"):
        int8_linear(
            torch.zeros(1, 2), torch.tensor(1.0), torch.zeros(1, 2, dtype=torch.int8), torch.ones(1), None, "cuda"
        )


needs_w8a8_kernel = pytest.mark.skipif(not int8_kernel_isas(), reason="leanlm's kernels cannot be built here")


@needs_w8a8_kernel
@pytest.mark.parametrize("k", [64, 576, 1000, 1536])  # 1000: a tail of 8 bytes after the vector loop
@pytest.mark.parametrize("static", [False, True])
def test_the_one_token_kernel_gives_the_eager_w8a8_product(k, static):
    """Every ISA against the float64 oracle (full-range integers at unit scales: exact, the AVX2 sign trick's
    saturation case included) and against fbgemm with real scales: the same floats bit for bit."""
    torch.manual_seed(k)
    weight = torch.randint(-127, 128, (96, k), dtype=torch.int8)
    ones = torch.ones(96)
    integers = torch.randint(-128, 128, (1, k)).float()
    expected = int8_linear(integers, torch.tensor(1.0), weight, ones, None, "reference")
    x = torch.randn(1, k) * 3
    weight_scale = torch.rand(96) * 0.01 + 1e-3
    bias = torch.randn(96)
    x_scale = torch.tensor(0.02) if static else x.abs().amax() / 127  # static: values beyond the range clamp
    eager = int8_linear(x.clone(), x_scale, None, None, bias, "fbgemm", pack_weight(weight, weight_scale))
    for isa in int8_kernel_isas():
        assert torch.equal(int8_gemv(integers, weight, ones, None, 1.0, isa=isa), expected), isa
        out = int8_gemv(x, weight, weight_scale, bias, float(x_scale) if static else None, isa=isa)
        assert_same_scaled_product(out, eager, isa)


@needs_w8a8_kernel
def test_the_one_token_kernel_runs_llm_int8s_outlier_columns_in_float():
    """LLM.int8(): |x| >= threshold positions leave the int8 product (and its scale) and are multiplied in float by
    their de-quantized weight column, as W8A8Linear's reference backend computes."""
    torch.manual_seed(3)
    x = torch.randn(1, 256)
    x[0, [5, 77, 200]] = torch.tensor([9.0, -12.0, 7.5])
    layer = W8A8Linear.from_float(
        torch.randn(64, 256),
        torch.randn(64),
        "per_channel",
        activation="per_token",
        backend="reference",
        outlier_threshold=6.0,
    )
    expected = layer(x)
    assert layer.decomposition_counts["outlier_dims"] == 3
    for isa in int8_kernel_isas():
        out = int8_gemv(x, layer.weight, layer.weight_scale, layer.bias, None, 6.0, isa=isa)
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-5)


@needs_w8a8_kernel
def test_the_one_token_kernel_names_an_unknown_instruction_set():
    with pytest.raises(ConfigError, match="unknown W8A8 kernel 'avx9'; choose auto or one of avx512-vnni-int8"):
        int8_gemv(torch.randn(1, 64), torch.zeros(8, 64, dtype=torch.int8), torch.ones(8), None, isa="avx9")
