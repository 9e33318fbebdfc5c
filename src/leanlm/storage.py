"""How leanlm writes results to disk so that nothing half-written is ever read back.

- Output directories appear only when complete: everything is written into a hidden staging directory beside
  the destination (`.NAME.partial-PID`) and renamed into place in one step (rename(2) is atomic within a file
  system, and replaces an empty directory), so a kill at any moment leaves either no result or a whole one. A
  later write to the same destination removes staging directories whose process no longer exists.
- A result that several processes may make at once (a cache entry) is made under `exclusive_lock`: one makes it,
  the others wait and read it. The lock is the kernel's (flock(2)), so a killed holder never leaves it held.
- Every safetensors file of a quantized checkpoint carries `QUANTIZED_MARKER` in its metadata, so a directory
  whose `leanlm_quant.json` is missing can be recognised and refused instead of being read as a float model.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from safetensors import SafetensorError, safe_open

from leanlm.errors import ConfigError, CorruptModelError

QUANT_FILE = "leanlm_quant.json"  # a quantized checkpoint's record: method, settings, replaced modules
QUANTIZED_MARKER = "leanlm_quantized"
# How config.json carries the record for transformers (`leanlm.integrations.transformers` reads it).
TRANSFORMERS_METHOD = "leanlm"
FORMAT_VERSION = 1


def transformers_quantization_config(record: dict) -> dict:
    return {"quant_method": TRANSFORMERS_METHOD, "format_version": FORMAT_VERSION, "record": record}


_STAGING_TAG = ".partial-"


def _staging_path(out: Path, pid: int) -> Path:
    return out.with_name(f".{out.name}{_STAGING_TAG}{pid}")


def cache_root() -> Path:
    """Where leanlm keeps what it makes once per machine (converted models, compiled kernels, CPU probes):
    `$LEANLM_CACHE`, else ~/.cache/leanlm."""
    return Path(os.environ.get("LEANLM_CACHE", Path.home() / ".cache" / "leanlm"))


def partial_path(path: Path) -> Path:
    """Where a file is written before it is renamed into `path` (rename(2) is atomic: a reader sees the old file
    or the whole new one)."""
    return _staging_path(path, os.getpid())


def write_text_atomically(path: Path, text: str) -> None:
    partial = partial_path(path)
    partial.write_text(text)
    os.replace(partial, path)


def resumable_staging(out: str | os.PathLike) -> Path:
    """The staging directory of a run that can resume after a kill (out-of-core quantization): it keeps its
    name across processes, and `_remove_stale_staging` leaves it alone."""
    out = Path(out).expanduser()
    return out.with_name(f".{out.name}{_STAGING_TAG}resumable")


def check_output_directory(out: str | os.PathLike) -> Path:
    """`out` as a Path, after checking that a result can be published there: it must not exist, or be an empty
    directory, and its parent must accept a new directory (tried for real: permission bits say nothing to root
    or on /proc). Cheap, so commands call it before any slow work."""
    out = Path(out).expanduser()
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output directory {out} is an existing file; give a path for a new directory")
    if out.is_dir() and any(out.iterdir()):
        raise ConfigError(f"output directory {out} exists and is not empty; choose a new directory")
    probe = _staging_path(out, os.getpid())
    try:
        probe.mkdir(parents=True, exist_ok=True)
        probe.rmdir()
    except OSError as error:
        raise ConfigError(f"output directory {out} cannot be created: {error.strerror or error}") from None
    return out


def check_output_file(out: str | os.PathLike, *, force: bool = False, inputs: tuple = ()) -> Path:
    """`out` as a Path, after checking that a file can be published there without destroying anything: not a
    directory, not an existing file that is one of `inputs` (the files or directories the result is made from) or
    inside one, not an existing file unless `force`, and in a directory that accepts a new file. Cheap, so commands call it before
    any slow work."""
    out = Path(out).expanduser()
    if out.is_dir():
        raise ConfigError(f"output {out} is a directory; give the path of the file to write")
    for source in inputs:
        source = Path(source).expanduser().resolve()
        if out.exists() and (out.resolve() == source or out.resolve().is_relative_to(source)):
            raise ConfigError(
                f"output {out} would write over the model it is made from ({source}); choose another path"
            )
    if out.exists() and not force:
        raise ConfigError(f"output {out} exists; choose a new path, or add --force to replace it")
    probe = partial_path(out)
    try:
        probe.touch()
        probe.unlink()
    except OSError as error:
        raise ConfigError(f"output {out} cannot be written: {error.strerror or error}") from None
    return out


@contextmanager
def staged_file(out: Path) -> Iterator[Path]:
    """Yields the path to write `out`'s content to; it becomes `out` in one rename when the block ends normally,
    and is removed when it raises (or is interrupted). Staging files of dead runs beside `out` are removed."""
    _remove_stale_staging(out)
    partial = partial_path(out)
    try:
        yield partial
        os.replace(partial, out)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def writable_directory(out: str | os.PathLike) -> Path:
    """`out`, created if need be, for a command that writes into it over time (fine-tuning's checkpoints)."""
    out = Path(out).expanduser()
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output directory {out} is an existing file; give a directory path")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"output directory {out} cannot be created: {error.strerror or error}") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise ConfigError(f"output directory {out} is not writable")
    return out


def _remove_stale_staging(out: Path) -> None:
    """Staging directories and files left beside `out` by killed processes (their PID no longer runs)."""
    if not out.parent.is_dir():
        return
    for candidate in out.parent.glob(f".{out.name}{_STAGING_TAG}*"):
        pid = candidate.name.rsplit(_STAGING_TAG, 1)[1]
        if pid.isdigit() and int(pid) != os.getpid() and not Path(f"/proc/{pid}").exists():
            if candidate.is_dir() and not candidate.is_symlink():
                shutil.rmtree(candidate, ignore_errors=True)
            else:
                candidate.unlink(missing_ok=True)


@contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """Holds an exclusive lock on the file `path` (created if missing) while active; another process asking for
    it waits until it is released or its holder exits."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextmanager
def staged_directory(out: str | os.PathLike) -> Iterator[Path]:
    """Yields an empty staging directory; when the block ends normally it becomes `out` in one rename, and when
    it raises (or is interrupted) it is removed."""
    out = check_output_directory(out)
    _remove_stale_staging(out)
    staging = _staging_path(out, os.getpid())
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        yield staging
        staging.replace(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def quantized_weights_file(directory: Path, marker_only: bool = False) -> Path | None:
    """The first safetensors file in `directory` that holds leanlm quantized tensors (marked, or, unless
    `marker_only`, int8 `weight`s as W8A8 stored them before the marker existed), or None. Reads headers only.
    (`marker_only` for a directory whose config.json declares a `quantization_config`: other formats store int8
    weights too.)"""
    for path in sorted(directory.glob("*.safetensors")):
        try:
            with safe_open(str(path), "pt") as handle:
                if QUANTIZED_MARKER in (handle.metadata() or {}):
                    return path
                if not marker_only and any(
                    name.endswith(".weight") and handle.get_slice(name).get_dtype() in ("I8", "U8")
                    for name in handle.keys()
                ):
                    return path
        except (SafetensorError, OSError, ValueError) as error:
            raise CorruptModelError(f"{path} is not a readable safetensors file: {error}") from None
    return None
