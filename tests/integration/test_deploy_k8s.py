"""The Kubernetes manifests (k8s/): every overlay renders with kustomize
(kubectl's built-in), passes the Kubernetes schemas strictly, and holds the
properties the deployment relies on. Offline; the tools come with the dev extras."""

import base64
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from libs.planning.sharing import sharing_setting

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
OVERLAYS = ["dev", "prod", "prod-managed", "prod-tls"]
CONTROL = ["gateway", "registry", "planner", "load-monitor"]
# Created by the operator in prod (the command is in k8s/README.md), generated in dev.
OPERATOR_SECRET = "layercast-secrets"
# NATS over TLS (components/nats-tls): the server's certificate, its key and the CA; by the operator.
TLS_SECRET = "layercast-nats-tls"
OPERATOR_SECRETS = {OPERATOR_SECRET, TLS_SECRET}


def tool(name: str) -> str:
    here = Path(sys.executable).parent / name
    if here.is_file():
        return str(here)
    found = shutil.which(name)
    if not found:
        pytest.fail(f"{name} not found: install the dev extras (pip install -e '.[dev]')")
    return found


def run(*args: str) -> str:
    r = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"{' '.join(args)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    return r.stdout


_rendered: dict[str, str] = {}


def render(overlay: str) -> str:
    if overlay not in _rendered:
        _rendered[overlay] = run(tool("kubectl"), "kustomize", str(K8S / "overlays" / overlay))
    return _rendered[overlay]


def objects(overlay: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(render(overlay)) if d]


def find(objs: list[dict], kind: str, name: str) -> dict:
    matches = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind}/{name}, found {len(matches)}"
    return matches[0]


def workloads(objs: list[dict], kinds=("Deployment", "StatefulSet")) -> list[dict]:
    return [o for o in objs if o["kind"] in kinds]


def containers(workload: dict) -> list[dict]:
    spec = workload["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def ours(container: dict) -> bool:
    """A container of the layercast image (whatever registry and tag the overlay set)."""
    return container["image"].rsplit(":", 1)[0].rsplit("/", 1)[-1] == "layercast"


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def config(objs: list[dict]) -> dict[str, str]:
    [cm] = [o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("layercast-config")]
    return cm["data"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_passes_strict_schema_validation(overlay, tmp_path):
    out = tmp_path / f"{overlay}.yaml"
    out.write_text(render(overlay))
    run(tool("kubernetes-validate"), "--strict", "--quiet", str(out))


@pytest.mark.parametrize("overlay", ["dev", "prod"])
def test_our_containers_have_health_probes_resources_and_run_as_non_root(overlay):
    objs = objects(overlay)
    seen = set()
    for w in workloads(objs):
        pod = w["spec"]["template"]["spec"]
        for c in filter(ours, containers(w)):
            seen.add(w["metadata"]["name"])
            where = f"{overlay}: {w['kind']}/{w['metadata']['name']} container {c['name']}"
            # The gateway's liveness is its own process (/livez): its readiness (/health) waits for the
            # registry, and a registry outage must take gateways out of the Service, not restart them.
            live = "/livez" if w["metadata"]["name"] == "gateway" else "/health"
            paths = {"readinessProbe": "/health", "livenessProbe": live, "startupProbe": live}
            for probe, path in paths.items():
                assert c.get(probe, {}).get("httpGet", {}).get("path") == path, f"{where}: {probe}"
            for part in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c.get("resources", {}).get(part, {})), f"{where}: {part}"
            sc = {**pod.get("securityContext", {}), **c.get("securityContext", {})}
            assert sc.get("runAsNonRoot") is True and sc.get("runAsUser", 0) != 0, f"{where}: runs as root"
            assert sc.get("allowPrivilegeEscalation") is False, where
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], where
    assert seen == {*CONTROL, "worker"}


@pytest.mark.parametrize("overlay", ["dev", "prod"])
def test_every_control_service_has_a_pdb_that_selects_it_without_blocking_drains(overlay):
    objs = objects(overlay)
    pdbs = [o for o in objs if o["kind"] == "PodDisruptionBudget"]
    for name in CONTROL:
        dep = find(objs, "Deployment", name)
        labels = dep["spec"]["template"]["metadata"]["labels"]
        mine = [p for p in pdbs if p["spec"]["selector"]["matchLabels"].items() <= labels.items()]
        assert len(mine) == 1, f"{overlay}: {len(mine)} PodDisruptionBudgets select {name}"
        spec, replicas = mine[0]["spec"], dep["spec"].get("replicas", 1)
        allowed = spec["maxUnavailable"] if "maxUnavailable" in spec else replicas - spec["minAvailable"]
        assert allowed >= 1, f"{overlay}: the PDB of {name} allows no eviction: it would block node drains"


@pytest.mark.parametrize("overlay", ["dev", "prod"])
def test_worker_identity_and_topology_come_from_the_downward_api(overlay):
    worker = find(objects(overlay), "StatefulSet", "worker")
    assert worker["spec"]["podManagementPolicy"] == "Parallel"
    env = env_of(worker["spec"]["template"]["spec"]["containers"][0])
    expected = {
        "LAYERCAST_WORKER_ID": "metadata.name",
        "LAYERCAST_DATA_ADVERTISE_HOST": "status.podIP",
        "LAYERCAST_TOPOLOGY_HOST": "spec.nodeName",
        "LAYERCAST_TOPOLOGY_LEAF": "metadata.labels['topology.kubernetes.io/zone']",
    }
    for var, field in expected.items():
        assert env.get(var, {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == field, var
    assert env["LAYERCAST_DATA_PORT"]["value"] == "7000"


def test_prod_workers_get_one_gpu_each_and_dev_workers_none():
    prod, dev = objects("prod"), objects("dev")
    res = find(prod, "StatefulSet", "worker")["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert res["limits"].get("nvidia.com/gpu") == 1 and res["requests"].get("nvidia.com/gpu") == 1
    assert config(prod)["LAYERCAST_DEVICE"] == "cuda"
    assert "nvidia.com/gpu" not in render("dev")
    assert config(dev)["LAYERCAST_DEVICE"] == "cpu"


@pytest.mark.parametrize("overlay", ["dev", "prod"])
def test_the_sharing_setting_reaches_workers_and_gateway(overlay):
    objs = objects(overlay)
    sharing_setting(config(objs)["LAYERCAST_SHARING"])  # a known setting (ValueError otherwise)
    for name in ("worker", "gateway"):
        kind = "StatefulSet" if name == "worker" else "Deployment"
        [container] = find(objs, kind, name)["spec"]["template"]["spec"]["containers"][:1]
        assert any(e.get("configMapRef", {}).get("name", "").startswith("layercast-config")
                   for e in container.get("envFrom", [])), name


def references(objs: list[dict]) -> set[tuple[str, str, str | None]]:
    """(kind, name, key) of every ConfigMap, Secret and PVC a pod template uses."""
    refs = set()
    for w in workloads(objs, ("Deployment", "StatefulSet", "Job")):
        pod = w["spec"]["template"]["spec"]
        for v in pod.get("volumes", []):
            if "configMap" in v:
                refs.add(("ConfigMap", v["configMap"]["name"], None))
            if "secret" in v:
                items = v["secret"].get("items") or [{"key": None}]
                refs |= {("Secret", v["secret"]["secretName"], item["key"]) for item in items}
            if "persistentVolumeClaim" in v:
                refs.add(("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"], None))
        for c in containers(w):
            for src in c.get("envFrom", []):
                for field, kind in (("configMapRef", "ConfigMap"), ("secretRef", "Secret")):
                    if field in src:
                        refs.add((kind, src[field]["name"], None))
            for e in c.get("env", []):
                for field, kind in (("configMapKeyRef", "ConfigMap"), ("secretKeyRef", "Secret")):
                    ref = e.get("valueFrom", {}).get(field)
                    if ref:
                        refs.add((kind, ref["name"], ref["key"]))
    return refs


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_reference_is_rendered_or_the_documented_operator_secret(overlay):
    objs = objects(overlay)
    rendered = {(o["kind"], o["metadata"]["name"]): o for o in objs}
    readme = (K8S / "README.md").read_text()
    refs = references(objs)
    assert ("Secret", OPERATOR_SECRET, "NATS_URL") in refs
    for kind, name, key in refs:
        obj = rendered.get((kind, name))
        if obj is None and overlay != "dev" and kind == "Secret" and name in OPERATOR_SECRETS:
            # Operator-provided: the README's `kubectl create secret` must set the key.
            assert f"kubectl create secret generic {name}" in readme
            assert key is None or f"--from-literal={key}=" in readme or f"--from-file={key}=" in readme, \
                f"k8s/README.md does not set {key} of {name}"
            continue
        assert obj is not None, f"{overlay}: {kind}/{name} is referenced but not rendered"
        if key is not None:
            assert key in obj.get("data", {}), f"{overlay}: {kind}/{name} has no key {key}"


def test_prod_expects_the_operator_secret_and_managed_variant_drops_the_datastores():
    assert not any(o["kind"] == "Secret" for o in objects("prod"))
    names = {(o["kind"], o["metadata"]["name"]) for o in objects("prod-managed")}
    for kind in ("StatefulSet", "Service", "NetworkPolicy"):
        assert (kind, "nats") not in names and (kind, "postgres") not in names
    assert ("StatefulSet", "worker") in names


def test_nats_requires_a_user_per_service_with_its_secret_password():
    from libs.bus import auth as nats_auth

    objs = objects("dev")
    [conf] = [o["data"]["nats.conf"] for o in objs
              if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("nats-config")]
    # Generated from libs/protocol/subjects.py: regenerate with `python -m libs.bus.auth`.
    assert nats_auth.deployment_config() in conf, "k8s/base/nats.conf is out of step with libs/bus/auth.py"
    assert conf.count("user:") == len(nats_auth.SERVICE_USERS), "a user beside the services'"
    nats = find(objs, "StatefulSet", "nats")["spec"]["template"]["spec"]["containers"][0]
    secret = {k: base64.b64decode(v).decode() for k, v in find(objs, "Secret", OPERATOR_SECRET)["data"].items()}
    for user in nats_auth.SERVICE_USERS:
        var = nats_auth.PASSWORD_VARIABLES[user]
        ref = env_of(nats)[var]["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"]) == (OPERATOR_SECRET, var)
        assert secret[var][0].isalpha(), f"{var}: nats.conf reads a password starting with a digit as a number"
        kind = "StatefulSet" if user == "worker" else "Deployment"
        [service] = [c for c in containers(find(objs, kind, user)) if ours(c)]
        env = env_of(service)
        assert env["LAYERCAST_NATS_USER"]["value"] == user
        ref = env["LAYERCAST_NATS_PASSWORD"]["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"]) == (OPERATOR_SECRET, var), user
        # Only its own password: a service holding another's could use that one's rights.
        others = {nats_auth.PASSWORD_VARIABLES[u] for u in nats_auth.SERVICE_USERS if u != user}
        assert not others & {e.get("valueFrom", {}).get("secretKeyRef", {}).get("key") for e in env.values()}
    nats_url, db_url = urlsplit(secret["NATS_URL"]), urlsplit(secret["DATABASE_URL"])
    assert (nats_url.username, nats_url.password, nats_url.hostname) == (None, None, "nats")
    assert (db_url.password, db_url.hostname) == (secret["POSTGRES_PASSWORD"], "postgres")

def _secret_volumes(pod: dict, secret: str) -> dict[str, list[str]]:
    """The pod's volumes of `secret`: volume name -> the keys it holds."""
    return {v["name"]: [i["key"] for i in v["secret"].get("items", [])] for v in pod.get("volumes", [])
            if v.get("secret", {}).get("secretName") == secret}


def _mounted(container: dict, volumes: dict[str, list[str]]) -> dict[str, str]:
    """key -> the path it has in `container`, for the keys of `volumes` it mounts."""
    return {key: f"{m['mountPath']}/{key}" for m in container.get("volumeMounts", []) if m["name"] in volumes
            for key in volumes[m["name"]]}


def _flag(args: list[str], name: str) -> str:
    [value] = [a.split("=", 1)[1] for a in args if a.startswith(f"{name}=")]
    return value


@pytest.mark.parametrize("overlay", ["prod-tls", "prod"])
def test_nats_tls_where_configured_server_and_every_service_agree(overlay):
    """With components/nats-tls the server requires TLS with the Secret's certificate and key, and
    every layercast service trusts the Secret's CA (and holds nothing else of it); without, none does."""
    objs = objects(overlay)
    nats = find(objs, "StatefulSet", "nats")["spec"]["template"]["spec"]
    args = nats["containers"][0]["command"] + nats["containers"][0].get("args", [])
    services = [(w, c) for w in workloads(objs) for c in containers(w) if ours(c)]
    assert {w["metadata"]["name"] for w, _ in services} == {*CONTROL, "worker"}
    if overlay == "prod":
        assert "--tls" not in args and "LAYERCAST_NATS_TLS_CA" not in config(objs)
        assert not any(_secret_volumes(w["spec"]["template"]["spec"], TLS_SECRET) for w, _ in services)
        return
    assert "--tls" in args
    server = _mounted(nats["containers"][0], _secret_volumes(nats, TLS_SECRET))
    assert (_flag(args, "--tlscert"), _flag(args, "--tlskey")) == (server["tls.crt"], server["tls.key"])
    ca = config(objs)["LAYERCAST_NATS_TLS_CA"]
    for w, c in services:
        held = _mounted(c, _secret_volumes(w["spec"]["template"]["spec"], TLS_SECRET))
        assert held == {"ca.crt": ca}, f"{w['metadata']['name']}: {held}"  # the CA at that path, never the key
    # The probes stay on the monitoring port (plain HTTP), not the TLS client port.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert nats["containers"][0][probe]["httpGet"]["port"] == "monitor"
