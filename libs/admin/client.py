"""The gateway's admin API, over HTTP: one authorized request, and deploying a model."""

from pathlib import Path

import httpx

from libs.cluster.launcher import ClusterError, ClusterState

# A local cluster (its state holds the gateway's URL and admin key) or any gateway: (url, admin key).
AdminTarget = ClusterState | tuple[str, str]


def _url_and_key(target: AdminTarget) -> tuple[str, str]:
    return (target.gateway_url, target.admin_key) if isinstance(target, ClusterState) else target


def admin_request(target: AdminTarget, method: str, path: str, body: dict | None = None,
                  params: dict | None = None, timeout_s: float = 30.0) -> httpx.Response:
    """One admin API call, authorized with the admin key; the answer as it is (errors included)."""
    url, key = _url_and_key(target)
    return httpx.request(method, url.rstrip("/") + path, json=body, params=params, timeout=timeout_s,
                         headers={"Authorization": f"Bearer {key}"})


def deploy_model(target: AdminTarget, name: str, path: Path, min_instances: int = 0,
                 max_instances: int = 4, keep_alive_s: float = 60.0, scaling_mode: str = "layercast",
                 policy: str | None = None, policy_params: dict[str, float] | None = None,
                 ttft_slo_s: float | None = None, tpot_slo_s: float = 0.25) -> dict:
    """Deploy a block checkpoint (PATH as the workers see it); a model already deployed under NAME is
    returned as it is. A refusal raises ClusterError with the gateway's message. `policy` None: the
    scaling mode's default (threshold for blitzscale, concurrency otherwise)."""
    r = admin_request(target, "POST", "/admin/v1/models", {
        "name": name, "path": str(path.resolve()), "min_instances": min_instances, "max_instances": max_instances,
        "keep_alive_s": keep_alive_s, "scaling_mode": scaling_mode, "policy": policy,
        "policy_params": policy_params or {}, "ttft_slo_s": ttft_slo_s, "tpot_slo_s": tpot_slo_s})
    if r.status_code == 409:
        return admin_request(target, "GET", f"/admin/v1/models/{name}").json()
    if r.status_code >= 400:
        raise ClusterError(r.json().get("error", {}).get("message", r.text))
    return r.json()
