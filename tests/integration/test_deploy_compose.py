"""Offline checks of the Docker deployment: the Dockerfile (hadolint), docker-compose.yml
(the compose-spec schema and the rules this project relies on), the Prometheus and
Grafana configuration it mounts, and the image's entrypoint. No Docker daemon needed."""

import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
TLS_OVERRIDE = ROOT / "docker-compose.tls.yml"  # NATS over TLS, opt-in
COMPOSE_FILES = [COMPOSE, TLS_OVERRIDE] + [p for p in [ROOT / "docker-compose.gpu.yml"] if p.exists()]
ENTRYPOINT = ROOT / "deploy" / "docker-entrypoint.sh"
LAYERCAST_SERVICES = {"gateway", "registry", "planner", "load-monitor", "worker"}
# Long-running services that cannot have a healthcheck, and why.
NO_HEALTHCHECK = {"otel-collector": "a distroless image: no shell or HTTP client to run a check"}


def tool(name: str) -> str:
    """A command-line tool from the dev extras: next to this interpreter (the venv), else on PATH."""
    for candidate in (Path(sys.executable).parent / name, shutil.which(name)):
        if candidate and os.access(candidate, os.X_OK):
            return str(candidate)
    pytest.fail(f"{name} not found next to {sys.executable} nor on PATH: install the dev extras "
                f"(pip install -e '.[dev]')")


def run(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=60, cwd=ROOT, **kwargs)


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return compose["services"]


def uses_layercast_image(service: dict) -> bool:
    return str(service.get("image", "")).startswith("layercast:")


def is_one_shot(service: dict) -> bool:
    return service.get("restart") == "no"


# --- linters ------------------------------------------------------------------------------------

def test_dockerfile_passes_hadolint():
    r = run(tool("hadolint"), "Dockerfile")
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_compose_matches_compose_spec(path):
    r = run(tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(path))
    assert r.returncode == 0, r.stdout + r.stderr


def test_dockerfile_installs_torch_before_the_project():
    text = (ROOT / "Dockerfile").read_text()
    torch, project = text.find('"torch==${TORCH_VERSION}"'), text.find("pip install --no-cache-dir .")
    assert 0 <= torch < project, "torch must be installed (pinned) before `pip install .`"
    assert 'ENTRYPOINT ["/usr/local/bin/layercast-entrypoint"]' in text


# --- compose structure --------------------------------------------------------------------------

def test_long_running_services_have_healthchecks(services):
    missing = [name for name, s in services.items()
               if not is_one_shot(s) and name not in NO_HEALTHCHECK
               and (not s.get("healthcheck") or s["healthcheck"].get("disable"))]
    assert not missing, f"no healthcheck: {missing}"
    assert LAYERCAST_SERVICES <= {n for n, s in services.items() if uses_layercast_image(s)}


def test_every_dependency_has_a_condition(services):
    for name, s in services.items():
        deps = s.get("depends_on", {})
        assert isinstance(deps, dict), f"{name}: depends_on must be a mapping with conditions"
        for dep, spec in deps.items():
            assert dep in services, f"{name} depends on unknown {dep}"
            assert spec.get("condition") in ("service_started", "service_healthy",
                                             "service_completed_successfully"), f"{name} -> {dep}"
            if spec["condition"] == "service_healthy":
                assert services[dep].get("healthcheck"), f"{name} waits for {dep} healthy: it has no healthcheck"


def test_workers_scale(services):
    worker = services["worker"]
    assert "container_name" not in worker, "a container_name breaks --scale worker=N"
    assert not worker.get("ports"), "published ports break --scale worker=N"
    assert worker["deploy"]["replicas"] >= 2


def test_nats_requires_a_user_per_service(services):
    from libs.bus import auth

    nats = services["nats"]
    assert "--config=/etc/nats/nats.conf" in nats["command"][0]
    assert "./deploy/nats/nats.conf:/etc/nats/nats.conf:ro" in nats["volumes"]
    assert not any("--user" in c or "--pass" in c for c in nats["command"]), "a shared user bypasses the rights"
    conf = (ROOT / "deploy" / "nats" / "nats.conf").read_text()
    # Generated from libs/protocol/subjects.py: regenerate with `python -m libs.bus.auth`.
    assert auth.deployment_config() in conf, "deploy/nats/nats.conf is out of step with libs/bus/auth.py"
    for user in auth.SERVICE_USERS:
        var = auth.PASSWORD_VARIABLES[user]
        assert re.fullmatch(rf"\$\{{{var}:-[A-Za-z][^}}]*\}}", nats["environment"][var]), var
    users = {}
    for name, s in services.items():
        env = s.get("environment", {})
        if "NATS_URL" in env:
            assert env["NATS_URL"] == "nats://nats:4222", f"{name}: credentials belong in LAYERCAST_NATS_*"
        if "LAYERCAST_NATS_USER" in env:
            users[name] = env["LAYERCAST_NATS_USER"]
            var = auth.PASSWORD_VARIABLES[users[name]]
            assert env["LAYERCAST_NATS_PASSWORD"] == nats["environment"][var], name
    assert users == {name: name for name in LAYERCAST_SERVICES}


def test_nats_conf_admits_the_services_with_the_dev_passwords_and_nobody_else(services, tmp_path):
    """The compose nats.conf on a real nats-server, with the defaults docker-compose.yml gives."""
    import asyncio

    import nats

    from libs.cluster.launcher import free_port, nats_server_binary, wait_port

    env = {var: re.fullmatch(r"\$\{[A-Z_]+:-(.*)\}", value).group(1)
           for var, value in services["nats"]["environment"].items()}
    port = free_port()
    proc = subprocess.Popen([nats_server_binary(), "-c", str(ROOT / "deploy/nats/nats.conf"), "-a", "127.0.0.1",
                             "-p", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_port("127.0.0.1", port, 15)
        url = f"nats://127.0.0.1:{port}"

        async def check():
            worker = services["worker"]["environment"]
            password = env[re.fullmatch(r"\$\{([A-Z_]+):-.*\}", worker["LAYERCAST_NATS_PASSWORD"]).group(1)]
            nc = await nats.connect(url, user="worker", password=password, allow_reconnect=False)
            await nc.close()
            with pytest.raises(Exception, match="Authorization Violation"):
                await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0)

        asyncio.run(check())
    finally:
        proc.kill()
        proc.wait()


def _default(value: str) -> str:
    """`${VAR:-default}...` with the variable's default substituted (what compose does without .env)."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)


def _mounts(service: dict) -> dict[str, str]:
    """target -> source of a service's bind mounts, defaults substituted."""
    mounts = [_default(v).split(":") for v in service.get("volumes", [])]
    return {m[1]: m[0] for m in mounts}


def _flag(command: list[str], name: str) -> str:
    [value] = [c.split("=", 1)[1] for c in command if c.startswith(f"{name}=")]
    return value


def test_the_tls_override_gives_nats_its_certificate_and_every_service_the_ca_only(services):
    tls = yaml.safe_load(TLS_OVERRIDE.read_text())["services"]
    nats = tls["nats"]
    # A command is replaced, not merged: the override's is the base one plus the TLS flags.
    assert nats["command"][:len(services["nats"]["command"])] == services["nats"]["command"]
    assert nats["command"][len(services["nats"]["command"]):][0] == "--tls"
    served = _mounts(nats)
    cert, key = served[_flag(nats["command"], "--tlscert")], served[_flag(nats["command"], "--tlskey")]
    directory = cert.rsplit("/", 1)[0]  # ./deploy/nats/tls by default
    assert (cert, key) == (f"{directory}/server.crt", f"{directory}/server.key")
    clients = {name for name, s in services.items() if "LAYERCAST_NATS_USER" in s.get("environment", {})}
    assert clients == LAYERCAST_SERVICES and set(tls) == clients | {"nats"}
    for name in clients:
        env, mounts = tls[name]["environment"], _mounts(tls[name])
        assert mounts == {env["LAYERCAST_NATS_TLS_CA"]: f"{directory}/ca.crt"}, name  # the CA, never the key
        assert "NATS_URL" not in env  # nats://nats:4222 as in the base: the client upgrades when asked


def test_the_tls_override_on_a_real_nats_server_admits_a_service_with_the_ca_only_over_tls(services, tmp_path):
    """deploy/nats/nats.conf with the override's flags, its files in NATS_TLS_DIR: a service that
    has the CA (LAYERCAST_NATS_TLS_CA, as the override sets it) connects; a plain client does not."""
    import asyncio

    import nats

    from tls_certificates import make_certificates
    from libs.bus.auth import tls_context
    from libs.cluster.launcher import free_port, nats_server_binary, wait_port

    ca, cert, key = make_certificates(tmp_path)
    for src, name in ((ca, "ca.crt"), (cert, "server.crt"), (key, "server.key")):
        (tmp_path / name).write_bytes(Path(src).read_bytes())
    tls = yaml.safe_load(TLS_OVERRIDE.read_text())["services"]
    in_container = {target: source.replace("./deploy/nats/tls", str(tmp_path))
                    for target, source in _mounts(tls["nats"]).items()}
    flags = [f"{c.split('=', 1)[0]}={in_container[c.split('=', 1)[1]]}" if c.startswith("--tls") and "=" in c else c
             for c in tls["nats"]["command"] if c.startswith("--tls")]
    env = {var: _default(value) for var, value in services["nats"]["environment"].items()}
    port = free_port()
    proc = subprocess.Popen([nats_server_binary(), "-c", str(ROOT / "deploy/nats/nats.conf"), "-a", "127.0.0.1",
                             "-p", str(port), *flags], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_port("127.0.0.1", port, 15)
        url, password = f"nats://127.0.0.1:{port}", env["NATS_PASSWORD_GATEWAY"]
        ca_path = _mounts(tls["gateway"])[tls["gateway"]["environment"]["LAYERCAST_NATS_TLS_CA"]]
        context = tls_context({"LAYERCAST_NATS_TLS_CA": ca_path.replace("./deploy/nats/tls", str(tmp_path))})

        async def check():
            nc = await nats.connect(url, user="gateway", password=password, tls=context, allow_reconnect=False)
            assert nc.connected_url is not None and nc._transport._io_writer.get_extra_info("ssl_object")  # noqa: SLF001
            await nc.close()
            with pytest.raises(Exception):  # without the CA: the certificate does not verify, no plain text either
                await nats.connect(url, user="gateway", password=password, allow_reconnect=False,
                                   max_reconnect_attempts=0, connect_timeout=2)

        asyncio.run(check())
    finally:
        proc.kill()
        proc.wait()


def test_env_example_lists_every_interpolated_variable():
    text = "\n".join(p.read_text() for p in COMPOSE_FILES)
    # ${VAR...} or $VAR, but not $${VAR} / $$VAR (escaped: the container's own variable).
    used = set(re.findall(r"(?<!\$)\$\{?([A-Za-z_][A-Za-z0-9_]*)", text))
    listed = set(re.findall(r"^([A-Za-z_][A-Za-z0-9_]*)=", (ROOT / ".env.example").read_text(), re.M))
    assert used, "no variables found: the pattern is broken"
    assert not used - listed, f"missing from .env.example: {sorted(used - listed)}"
    unset_without_default = set(re.findall(r"(?<!\$)\$\{([A-Za-z_][A-Za-z0-9_]*)\}", text))
    assert not unset_without_default, f"give a default (${{VAR:-default}}): {sorted(unset_without_default)}"


def test_prometheus_scrapes_every_service(services):
    config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    targets = set()
    for job in config["scrape_configs"]:
        for static in job.get("static_configs", []):
            targets |= {tuple(t.rsplit(":", 1)) for t in static["targets"]}
        for dns in job.get("dns_sd_configs", []):
            targets |= {(name, str(dns["port"])) for name in dns["names"]}
    for name in LAYERCAST_SERVICES:
        port = services[name]["environment"]["LAYERCAST_HEALTH_PORT"]  # where /metrics is served
        assert (name, str(port)) in targets, f"prometheus does not scrape {name}:{port}"


def test_grafana_provisions_the_mounted_dashboards(services):
    mounts = {v.split(":")[1]: v.split(":")[0] for v in services["grafana"]["volumes"]}  # target -> source
    assert mounts["/etc/grafana/provisioning"] == "./deploy/grafana/provisioning"
    provider = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/layercast.yaml").read_text())
    path = provider["providers"][0]["options"]["path"]
    assert mounts.get(path) == "./deploy/grafana/dashboards", f"{path} is not where the dashboards are mounted"
    datasources = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/layercast.yaml").read_text())
    assert {d["uid"] for d in datasources["datasources"]} >= {"prometheus", "jaeger"}


# --- entrypoint ---------------------------------------------------------------------------------

def test_entrypoint_handles_every_compose_command(services):
    assert run("sh", "-n", str(ENTRYPOINT)).returncode == 0
    labels = set()
    for pattern in re.findall(r"^\s*([a-z|-]+)\)\s*$", ENTRYPOINT.read_text(), re.M):
        labels |= set(pattern.split("|"))
    commands = {s["command"][0] for s in services.values() if uses_layercast_image(s)}
    checks = {s["healthcheck"]["test"][2] for s in services.values()
              if uses_layercast_image(s) and not s["healthcheck"].get("disable")}
    assert commands >= LAYERCAST_SERVICES | {"migrate", "demo-model"}
    assert not (commands | checks) - labels, f"not handled by the entrypoint: {(commands | checks) - labels}"


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):  # noqa: N802
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("status,rc", [(200, 0), (503, 1)])
def test_entrypoint_healthcheck(status, rc):
    handler = type("Health", (_Health,), {"status": status})
    server = http.server.HTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "LAYERCAST_HEALTH_PORT": str(server.server_port)}
    try:
        r = run("sh", str(ENTRYPOINT), "healthcheck", env=env)
    finally:
        server.shutdown()
        server.server_close()
    assert r.returncode == rc, r.stdout + r.stderr
    assert run("sh", str(ENTRYPOINT), "echo", "other commands run as given").stdout.strip() == \
        "other commands run as given"
