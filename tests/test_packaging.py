"""leanlm as a user installs it: the wheel, installed with --no-deps into a fresh virtualenv that sees the core
dependencies of this environment but none of the extras, imports, answers `--version` and `eval --help`, and says
in one line which extra a command needs."""

import site
import subprocess
import sys
from pathlib import Path

import pytest

from leanlm import __version__
from leanlm.errors import EXTRAS

ROOT = Path(__file__).resolve().parents[1]
# What the wheel must work without: every optional dependency, and leanlm's own editable install.
LEFT_OUT = (*EXTRAS, "mpl_toolkits", "leanlm", "__editable__", "_leanlm")


def _left_out(entry: str) -> bool:
    name = entry.lower().replace("-", "_")
    return any(name == prefix or name.startswith((f"{prefix}.", f"{prefix}-", f"{prefix}_")) for prefix in LEFT_OUT)


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> Path:
    """A virtualenv holding the wheel built from this checkout, on top of this environment's packages less the
    extras (linked into one folder that a .pth file adds to its path)."""
    work = tmp_path_factory.mktemp("fresh")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", work, ROOT],
        check=True,
    )
    (wheel,) = work.glob("leanlm-*.whl")
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--no-deps", "--no-index", wheel],
        check=True,
    )
    core = work / "core"
    core.mkdir()
    for packages in map(Path, site.getsitepackages()):
        for entry in packages.iterdir():
            if not _left_out(entry.name) and entry.suffix != ".pth" and not (core / entry.name).exists():
                (core / entry.name).symlink_to(entry)
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True
    ).stdout.strip()
    (Path(purelib) / "core.pth").write_text(f"{core}\n")
    return venv / "bin"


def _run(bin: Path, *command: str) -> subprocess.CompletedProcess:
    return subprocess.run([bin / command[0], *command[1:]], capture_output=True, text=True, cwd=bin, timeout=300)


def test_the_wheel_runs_without_any_extra(fresh):
    for module in ("fastapi", "hivemind", "matplotlib", "compressed_tensors"):
        assert _run(fresh, "python", "-c", f"import {module}").returncode != 0, f"{module} is importable"
    where = _run(fresh, "python", "-c", "import leanlm; print(leanlm.__file__)").stdout
    assert "site-packages" in where and str(ROOT / "src") not in where
    done = _run(fresh, "leanlm", "--version")
    assert done.returncode == 0 and done.stdout.strip() == f"leanlm {__version__}"
    done = _run(fresh, "leanlm", "eval", "--help")
    assert done.returncode == 0 and "--tasks" in done.stdout, done.stderr


def test_help_imports_no_torch(fresh):
    probe = "import sys; from leanlm.cli.main import build_parser; build_parser(only=''); print('torch' in sys.modules)"
    assert _run(fresh, "python", "-c", probe).stdout.strip() == "False"
    done = _run(fresh, "leanlm", "--help")
    assert done.returncode == 0 and "quantize" in done.stdout


@pytest.mark.parametrize(
    "command, extra",
    [(["serve", "smollm2-135m"], "serve"), (["swarm", "--max-steps", "1"], "swarm")],
)
def test_a_missing_extra_is_one_line_naming_it(fresh, command, extra):
    done = _run(fresh, "leanlm", *command)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f'pip install "leanlm[{extra}]"' in lines[0], done.stderr
