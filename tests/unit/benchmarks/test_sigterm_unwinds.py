"""A benchmark killed by SIGTERM (`timeout`, a CI runner) stops what it started: its ExitStack
unwinds as on Ctrl-C (bench mesh's cluster was left running with its cgroups before)."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

SCRIPT = """
import os, signal, sys, time
from contextlib import ExitStack
from benchmarks.harness import sigterm_unwinds
out = sys.argv[1]
try:
    with ExitStack() as stack:
        sigterm_unwinds(stack)
        stack.callback(lambda: open(out, "w").write("stopped"))
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
except KeyboardInterrupt:
    sys.exit(130)
"""


def test_sigterm_runs_the_stacks_callbacks(tmp_path):
    out = tmp_path / "stopped"
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 130, done.stderr[-2000:]
    assert out.read_text() == "stopped"

