"""The launcher's supervision (libs/cluster/supervisor.py) on real processes: one that dies is
started again the way the launcher started it, after the backoff, logged, and the cluster's
state file names the new pid; a crash loop waits longer each time."""

import json
import sys
import threading
import time

from libs.cluster.launcher import ClusterState, ProcessInfo, kill_process, launch_process, process_alive, \
    restart_process, stop_processes
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


def test_an_exit_status_reaped_before_the_supervisor_looks_is_still_read(tmp_path):
    # kill_process (and stop_processes) reap the children that exited, as the fault suite's kills
    # do beside a running supervisor: that used to take the status ("exit code unknown").
    state = cluster_of(tmp_path, SLEEPER)
    kill_process(state, "svc")
    stop_processes([])  # reaps what exited, as every cluster's stop does (the fault suite's beside this)
    sup = Supervisor(state, backoff=RestartBackoff(initial_s=30.0, max_s=30.0), tell_registry=False)
    sup.check()
    assert [(e.kind, e.detail) for e in sup.events] == [("exited", "killed by signal 9")]


def test_a_supervisor_asked_to_stop_restarts_nothing_and_returns(tmp_path):
    # What `layercast up` does on SIGTERM/SIGINT before stopping the cluster: the processes the
    # stop ends must not come back.
    state = cluster_of(tmp_path, SLEEPER)
    first = state.processes[0].pid
    sup = Supervisor(state, backoff=RestartBackoff(initial_s=0.0), poll_s=0.01)
    sup.request_stop()
    kill_process(state, "svc")
    runner = threading.Thread(target=sup.run, daemon=True)
    runner.start()
    runner.join(10)
    assert not runner.is_alive()  # run() returned
    sup.check()
    assert sup.events == [] and state.processes[0].pid == first and not process_alive(first)


def test_the_state_file_is_replaced_whole_so_a_reader_never_sees_it_half_written(tmp_path):
    """The supervisor rewrites the state file at every restart while `layercast` commands (and
    this module's tests) read it; a reader must get the old file or the new one, never an empty
    one. The file stays readable by its owner only (the operator's NATS password is in it)."""
    p = ProcessInfo("svc", 1, None, str(tmp_path / "svc.log"), argv=["x" * 4096], env={}, cwd=str(tmp_path))
    state = ClusterState(str(tmp_path), "http://127.0.0.1:1", "k", "a", "nats://127.0.0.1:1", "sqlite://", "ns", [p])
    state.save()
    done, bad = threading.Event(), []

    def read() -> None:
        while not done.is_set():
            try:
                ClusterState.load(tmp_path)
            except json.JSONDecodeError as e:
                bad.append(e)
    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(400):
            p.restarts = i
            state.save()
    finally:
        done.set()
        reader.join()
    assert bad == []
    assert ClusterState.load(tmp_path).processes[0].restarts == 399
    assert oct((tmp_path / "cluster.json").stat().st_mode & 0o777) == "0o600"
    assert [f.name for f in tmp_path.iterdir() if f.name.startswith(".cluster.json")] == []  # no temp files left
