import os
import subprocess
import sys

import pytest

from leanlm.errors import ConfigError
from leanlm.storage import check_output_directory, staged_directory, writable_directory


def test_a_staged_directory_appears_only_when_its_block_ends(tmp_path):
    out = tmp_path / "result"
    with staged_directory(out) as staging:
        (staging / "a.txt").write_text("a")
        assert not out.exists() and staging.parent == tmp_path and staging.name.startswith(".result.partial-")
    assert (out / "a.txt").read_text() == "a"
    assert not staging.exists()


def test_a_failed_block_leaves_nothing(tmp_path):
    out = tmp_path / "result"
    with pytest.raises(KeyboardInterrupt):
        with staged_directory(out) as staging:
            (staging / "a.txt").write_text("a")
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []


def test_an_empty_existing_directory_is_replaced(tmp_path):
    (tmp_path / "result").mkdir()
    with staged_directory(tmp_path / "result") as staging:
        (staging / "a.txt").write_text("a")
    assert (tmp_path / "result" / "a.txt").is_file()


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: p.write_text("x"), "is an existing file"),
        (lambda p: (p.mkdir(), (p / "f").write_text("x")), "exists and is not empty"),
    ],
)
def test_unusable_destinations_are_named(tmp_path, make, message):
    make(tmp_path / "out")
    with pytest.raises(ConfigError, match=message):
        check_output_directory(tmp_path / "out")


def test_a_destination_that_cannot_be_created_is_refused_before_any_work():
    with pytest.raises(ConfigError, match="/proc/x cannot be created"):
        check_output_directory("/proc/x")
    with pytest.raises(ConfigError, match="cannot be created"):
        writable_directory("/proc/x")


def test_staging_left_by_a_killed_process_is_removed_by_the_next_write(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".result.partial-{int(dead.stdout)}"
    stale.mkdir()
    (stale / "half.bin").write_bytes(b"\0" * 10)
    with staged_directory(tmp_path / "result"):
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result"]
    assert os.getpid() != int(dead.stdout)
