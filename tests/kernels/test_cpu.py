import pytest

from leanlm.kernels import cpu


@pytest.mark.parametrize(
    "flags, native",
    [({"avx2", "fma"}, False), ({"avx512f", "avx512_bf16"}, True), ({"avx512f", "amx_bf16"}, True), (set(), False)],
)
def test_native_bf16_is_read_from_the_cpu_flags(monkeypatch, flags, native):
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset(flags))
    assert cpu.has_native_bf16() is native


def test_this_machine_lists_its_flags():
    flags = cpu.cpu_flags()
    assert isinstance(flags, frozenset) and (not flags or "sse2" in flags)
