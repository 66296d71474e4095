"""The launcher's supervision (libs/cluster/supervisor.py) on real processes: one that dies is
started again the way the launcher started it, after the backoff, logged, and the cluster's
state file names the new pid; a crash loop waits longer each time."""

import json
import sys
import time

from libs.cluster.launcher import ClusterState, ProcessInfo, kill_process, launch_process, process_alive, \
    restart_process
from libs.cluster.supervisor import Supervisor
from libs.planning.supervision import RestartBackoff


def cluster_of(tmp_path, argv: list[str], name: str = "svc") -> ClusterState:
    (tmp_path / "logs").mkdir(exist_ok=True)
    p = ProcessInfo(name, 0, None, str(tmp_path / "logs" / f"{name}.log"), argv=argv, env={"FAULT_TEST": "yes"},
                    cwd=str(tmp_path))
    p.pid = launch_process(p).pid
    state = ClusterState(str(tmp_path), "http://127.0.0.1:1", "k", "a", "nats://127.0.0.1:1", "sqlite://", "ns", [p])
    state.save()
    return state


SLEEPER = [sys.executable, "-c", "import os, time; print(os.environ['FAULT_TEST'], os.getcwd(), flush=True); "
                                 "time.sleep(60)"]


def wait(predicate, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return value


def test_a_killed_process_is_restarted_as_it_was_started_and_the_restart_is_recorded(tmp_path):
    state = cluster_of(tmp_path, SLEEPER)
    lines: list[str] = []
    first = state.processes[0].pid
    wait(lambda: "yes" in open(state.processes[0].log).read(), 60)  # started (under a busy machine: slowly)
    with Supervisor(state, backoff=RestartBackoff(initial_s=0.3, max_s=1.0), report=lines.append,
                    poll_s=0.02) as sup:
        killed_at = time.monotonic()
        kill_process(state, "svc")
        restarted = wait(lambda: [e for e in sup.events if e.kind == "restarted"])
        p = state.processes[0]
        assert [e.kind for e in sup.events] == ["exited", "restarted"]
        assert restarted[0].at - killed_at >= 0.3  # after the backoff, not at once
        assert p.pid != first and process_alive(p.pid) and p.restarts == 1
        assert "killed by signal 9" in sup.events[0].detail
        saved = json.loads((tmp_path / "cluster.json").read_text())["processes"][0]
        assert saved["pid"] == p.pid and saved["restarts"] == 1
        assert any("svc" in line and "exited" in line for line in lines)
        assert any("svc restarted" in line for line in lines)
        # Started the same way: environment, directory, output appended to its log.
        wait(lambda: open(p.log).read().count(f"yes {tmp_path}") == 2, 60)
    kill_process(state, "svc")


def test_a_crash_loop_waits_longer_each_time_up_to_the_cap(tmp_path):
    state = cluster_of(tmp_path, [sys.executable, "-c", "raise SystemExit(3)"])
    with Supervisor(state, backoff=RestartBackoff(initial_s=0.05, max_s=0.2, stable_s=5), poll_s=0.01) as sup:
        wait(lambda: sum(e.kind == "restarted" for e in sup.events) >= 4)
    exits = [e for e in sup.events if e.kind == "exited"]
    assert all(e.detail == "exit code 3" for e in exits)
    delays = [b.at - a.at for a, b in zip(sup.events, sup.events[1:]) if a.kind == "exited" and b.kind == "restarted"]
    assert delays[0] >= 0.05 and delays[1] >= 0.1 and delays[2] >= 0.2 and delays[3] >= 0.2
    assert max(delays) < 1.0  # capped at 0.2 s (plus a poll and a busy machine's slack)


def test_restart_process_kills_and_starts_again_without_a_supervisor(tmp_path):
    state = cluster_of(tmp_path, SLEEPER)
    old = state.processes[0].pid
    new = restart_process(state, "svc")
    assert not process_alive(old) and process_alive(new.pid) and new.restarts == 1
    assert ClusterState.load(tmp_path).processes[0].pid == new.pid
    kill_process(state, "svc")
