import json

import pytest

from leanlm.kernels import cpu

SIGILL = "import os, signal; os.kill(os.getpid(), signal.SIGILL)"


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty cache and no remembered answer."""
    monkeypatch.setenv("LEANLM_CACHE", str(tmp_path))
    cpu.has_native_bf16.cache_clear()
    yield tmp_path
    cpu.has_native_bf16.cache_clear()


@pytest.mark.parametrize(
    "flags, native",
    [({"avx2", "fma"}, False), ({"avx512f", "avx512_bf16"}, True), ({"avx512f", "amx_bf16"}, True), (set(), False)],
)
def test_native_bf16_needs_the_flags_and_a_probe_that_passes(monkeypatch, fresh, flags, native):
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(cpu, "_BF16_PROBE", "pass")
    assert cpu.has_native_bf16() is native


def test_listed_bf16_whose_product_faults_is_not_used(monkeypatch, fresh, caplog):
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx512f", "amx_bf16"}))
    monkeypatch.setattr(cpu, "_BF16_PROBE", SIGILL)
    assert cpu.has_native_bf16() is False
    assert "CPU probe bf16-gemm failed (exit status -4)" in caplog.text


def test_a_probe_runs_once_per_machine(fresh):
    assert cpu.probe("fails", SIGILL) is False
    assert cpu.probe("passes", "pass") is True
    (kept,) = (fresh / "cpu").glob("fails-*.json")
    assert json.loads(kept.read_text()) == {"ok": False, "status": -4}
    kept.write_text(json.dumps({"ok": True}))  # the kept answer is what a second call returns: nothing runs again
    assert cpu.probe("fails", SIGILL) is True


def test_a_cache_that_cannot_be_written_still_gives_the_answer(monkeypatch, tmp_path):
    blocked = tmp_path / "a file"
    blocked.write_text("")
    monkeypatch.setenv("LEANLM_CACHE", str(blocked / "cache"))
    assert cpu.probe("passes", "pass") is True
    assert cpu.probe("fails", SIGILL) is False


def test_a_probe_that_hangs_fails(fresh):
    assert cpu.probe("hangs", "import time; time.sleep(60)", timeout=1) is False


def test_this_machine_lists_its_flags():
    flags = cpu.cpu_flags()
    assert isinstance(flags, frozenset) and (not flags or "sse2" in flags)


def test_the_bf16_product_probe_passes_where_bf16_products_work(fresh):
    """torch computes bfloat16 products on every CPU (emulated in float32 where no instruction does): the probe
    itself must pass wherever nothing faults."""
    assert cpu.probe("bf16-gemm", cpu._BF16_PROBE) is True
