"""`layercast up` in the foreground (supervised), stopped by SIGTERM or SIGINT, a second one
arriving while it stops (as `timeout` then `pkill`, or Ctrl-C pressed twice): every process it
started is gone, and none was restarted meanwhile. Once, a second signal cut the shutdown short
and left the services and NATS running 20 s later. Real processes: `layercast up` with its own
NATS, SQLite registry, planner, load-monitor and gateway (no worker: none is needed to stop)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import wait_for
from libs.cluster.launcher import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_a_supervised_up_stops_every_process_it_started_and_restarts_none(tmp_path, sig):
    state_dir, log = tmp_path / "state", tmp_path / "up.log"
    # Its own NATS and database: none of the machine's (nor the suite's) is touched.
    env = {k: v for k, v in os.environ.items() if k not in ("NATS_URL", "DATABASE_URL", "LAYERCAST_NAMESPACE")}
    env["PYTHONPATH"] = str(ROOT)
    with open(log, "wb") as out:
        up = subprocess.Popen([sys.executable, "-c", "from services.cli import main; main()", "up", "--workers", "0",
                               "--port", str(free_port()), "--state-dir", str(state_dir)],
                              stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    children: list[psutil.Process] = []
    try:
        wait_for(lambda: "Press Ctrl-C" in log.read_text() or up.poll() is not None, 240, "the cluster to start")
        assert up.poll() is None, log.read_text()[-3000:]
        children = psutil.Process(up.pid).children(recursive=True)
        started = {p["name"]: p["pid"] for p in json.loads((state_dir / "cluster.json").read_text())["processes"]}
        assert set(started) == {"nats", "registry", "planner", "load-monitor", "gateway"}
        assert set(started.values()) <= {c.pid for c in children}

        up.send_signal(sig)
        # The second one lands in the shutdown: a service has stopped; NATS is stopped after them all.
        wait_for(lambda: any(gone(c) for c in children) or up.poll() is not None, 60, "the shutdown to begin")
        up.send_signal(sig)
        code = up.wait(60)
        # Every process it started is gone: exited, and none started again in its place.
        _, alive = psutil.wait_procs(children, timeout=5)
        assert alive == [], [(p.pid, p.cmdline()) for p in alive]
        assert code == 0, log.read_text()[-3000:]
        after = log.read_text().split("(with backoff).", 1)[1]  # after "Press Ctrl-C to stop ..."
        # The supervisor's lines: "<name> (pid N) exited (...)", "<name> restarted (pid N, ...)".
        assert " restarted (pid" not in after and ") exited (" not in after, after
        assert "stopped" in after
        assert not (state_dir / "cluster.json").exists()
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(10)
        for p in children:  # whatever a failure left running
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
