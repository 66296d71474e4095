"""NATS authentication on a real nats-server with the configuration `layercast up` writes
(libs/bus/auth.py): a client without credentials is refused, a service's user can use only its
own subjects (only the planner commands workers, only a gateway reads token streams), and a
service started with a wrong password stops at once with an error that names the fix."""

import asyncio
import os
import subprocess
import sys

import nats
import pytest

from tls_certificates import make_certificates
from libs.bus import auth
from libs.bus.broker import make_broker, start_broker
from libs.cluster.launcher import ProcessInfo, start_nats, stop_processes
from libs.protocol import subjects

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    """An authenticated nats-server: (url without credentials, passwords)."""
    state = tmp_path_factory.mktemp("nats-auth")
    (state / "logs").mkdir()
    passwords = auth.new_passwords()
    proc, url = start_nats(state, passwords=passwords, namespace=subjects.PREFIX)
    assert oct((state / "nats.conf").stat().st_mode & 0o777) == "0o600"
    yield url, passwords
    stop_processes([ProcessInfo("nats", proc.pid, None, "")])


async def connect_as(url: str, passwords: dict, user: str, errors: list) -> nats.NATS:
    async def on_error(e: Exception) -> None:
        errors.append(str(e))

    return await nats.connect(url, user=user, password=passwords[user], error_cb=on_error,
                              inbox_prefix=auth.inbox(user), allow_reconnect=False)


async def delivered(sub, wait_s: float = 0.5) -> list[bytes]:
    got = []
    try:
        while True:
            got.append((await sub.next_msg(timeout=wait_s)).data)
    except nats.errors.TimeoutError:
        return got


def test_a_client_without_credentials_or_with_a_wrong_password_is_refused(secured):
    url, passwords = secured

    async def scenario():
        worker = await connect_as(url, passwords, "worker", [])
        commands = await worker.subscribe(subjects.worker_command("w-1"))
        await worker.flush()
        for kwargs in ({}, {"user": "planner", "password": "wrong"}, {"user": "nobody", "password": "x"}):
            with pytest.raises(Exception, match="Authorization Violation"):
                await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0, **kwargs)
        got = await delivered(commands)
        await worker.close()
        return got

    assert asyncio.run(scenario()) == []


def test_only_the_planner_publishes_worker_commands_and_only_a_gateway_reads_tokens(secured):
    url, passwords = secured
    command, tokens = subjects.worker_command("w-1"), subjects.tokens("gw-1", "req-1")

    async def scenario():
        errors: dict[str, list] = {u: [] for u in auth.SERVICE_USERS}
        c = {u: await connect_as(url, passwords, u, errors[u]) for u in auth.SERVICE_USERS}
        to_worker = await c["worker"].subscribe(command)
        to_gateway = await c["gateway"].subscribe(subjects.tokens_wildcard("gw-1"))
        spies = [await c[u].subscribe(tokens) for u in ("worker", "planner", "load-monitor", "registry")]
        for conn in c.values():
            await conn.flush()
        for u in auth.SERVICE_USERS:
            await c[u].publish(command, u.encode())
        await c["worker"].publish(tokens, b"token")
        for conn in c.values():
            await conn.flush()
        got = {"worker": await delivered(to_worker), "gateway": await delivered(to_gateway),
               "spies": [await delivered(s, 0.1) for s in spies]}
        for conn in c.values():
            await conn.close()
        return got, errors

    got, errors = asyncio.run(scenario())
    assert got["worker"] == [b"planner"]  # every other service's command never arrived
    assert got["gateway"] == [b"token"]
    assert got["spies"] == [[], [], [], []]
    for u in ("registry", "load-monitor", "gateway", "worker"):
        assert any("permissions violation for publish" in e.lower() and command in e for e in errors[u]), errors[u]
    for u in ("worker", "planner", "load-monitor", "registry"):
        assert any("permissions violation for subscription" in e.lower() and tokens in e for e in errors[u]), errors[u]
    assert errors["planner"] == [f'nats: permissions violation for subscription to "{tokens}"'], errors
    assert errors["gateway"] == [f'nats: permissions violation for publish to "{command}"'], errors


def test_a_service_with_wrong_credentials_stops_with_a_clear_error(secured, monkeypatch):
    url, passwords = secured
    monkeypatch.setenv("LAYERCAST_NATS_USER", "planner")
    monkeypatch.setenv("LAYERCAST_NATS_PASSWORD", passwords["planner"])

    async def connects() -> None:
        broker = make_broker(url)
        await start_broker(broker)  # the right password: connected, subscriptions flushed
        await broker.stop()

    asyncio.run(connects())

    env = {**os.environ, "NATS_URL": url, "LAYERCAST_NATS_USER": "load-monitor",
           "LAYERCAST_NATS_PASSWORD": "not-the-password", "PYTHONPATH": ROOT}
    r = subprocess.run([sys.executable, "-m", "services.load_monitor", "--health-port", "0"], env=env,
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert "refused user 'load-monitor'" in out and "LAYERCAST_NATS_PASSWORD" in out, out
    assert "not-the-password" not in out


def test_tls_where_configured_a_service_connects_with_the_ca_and_a_plain_client_is_refused(tmp_path, monkeypatch):
    ca, cert, key = make_certificates(tmp_path)
    (tmp_path / "logs").mkdir()
    passwords = auth.new_passwords()
    proc, url = start_nats(tmp_path, passwords=passwords, namespace=subjects.PREFIX, tls=(cert, key))
    try:
        monkeypatch.setenv("LAYERCAST_NATS_USER", "gateway")
        monkeypatch.setenv("LAYERCAST_NATS_PASSWORD", passwords["gateway"])

        async def service_connects() -> bool:
            broker = make_broker(url)
            await start_broker(broker)
            tls = broker._connection._transport._io_writer.get_extra_info("ssl_object") is not None  # noqa: SLF001
            await broker.stop()
            return tls

        monkeypatch.setenv("LAYERCAST_NATS_TLS_CA", ca)
        assert asyncio.run(service_connects())
        monkeypatch.delenv("LAYERCAST_NATS_TLS_CA")
        # Without the CA the server's certificate fails verification: no connection comes up (the
        # client keeps retrying, logging CERTIFICATE_VERIFY_FAILED), and none in plain text.
        with pytest.raises(TimeoutError):
            asyncio.run(asyncio.wait_for(service_connects(), 2))
    finally:
        stop_processes([ProcessInfo("nats", proc.pid, None, "")])
