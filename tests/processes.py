"""Starting leanlm as a child process the way a user's terminal does."""

from __future__ import annotations

import signal
import subprocess
import sys


def leanlm_process(*argv: str, **popen) -> subprocess.Popen:
    """`python -m leanlm.cli.main ARGV` with Ctrl-C (SIGINT) at its default, whatever the suite was started from.

    A shell without job control starts background jobs with SIGINT ignored, and a child keeps that; Python then
    installs no KeyboardInterrupt handler, so a test sending SIGINT would wait for nothing. CI runs in the
    foreground, a suite started with `&` does not: restoring the default makes the tests independent of that.
    """
    return subprocess.Popen(
        [sys.executable, "-m", "leanlm.cli.main", *argv],
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        **popen,
    )
