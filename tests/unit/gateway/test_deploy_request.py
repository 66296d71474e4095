"""`POST /admin/v1/models` refuses what it cannot deploy with a declared 400 naming the field, before
it asks the registry: the in-process app (no cluster)."""

import json

import pytest
from fastapi.testclient import TestClient
from openapi_check import check_declared

from libs.protocol import messages as m
from services.gateway.app import create_app
from services.gateway.schemas import MAX_KEEP_ALIVE_S, MAX_SLO_S, DeployRequest
from services.gateway.service import GatewayConfig, GatewayService

KEY = "sk-admin"


@pytest.fixture(scope="module")
def client() -> TestClient:
    gateway = GatewayService(GatewayConfig())
    gateway._mark_synced()
    # Not entered as a context manager: the lifespan (connecting to NATS) does not run.
    return TestClient(create_app(gateway, [KEY], [KEY]), headers={"Authorization": f"Bearer {KEY}"})


@pytest.fixture(scope="module")
def doc(client) -> dict:
    return client.get("/openapi.json").json()


def deploy(client, doc, body: str) -> dict:
    r = client.post("/admin/v1/models", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    check_declared(doc, "/admin/v1/models", "POST", r)
    return r.json()["error"]


def test_ci_schemathesis_body_is_a_400(client, doc):
    """CI's stateful Schemathesis case (a 500, AttributeError): a path of "~" and a character that
    names no user, and durations of 1e308 s."""
    body = ('{"tpot_slo_s": 3.953382320949236e+307, "min_instances": 2994, "keep_alive_s": 1.4626140050963602e+308,'
            ' "name": "8Kp", "path": "~\\udae0\\udfea"}')
    assert deploy(client, doc, body)["param"] in ("keep_alive_s", "tpot_slo_s")


@pytest.mark.parametrize("path", ["~\U000c83ea", "~no-such-user-here/model"])  # (CI's: JSON's "~\udae0\udfea")
def test_a_path_under_an_unknown_users_home_is_a_400_naming_path(client, doc, path):
    # pathlib raises RuntimeError (no strerror) for an unknown ~user: once a 500.
    error = deploy(client, doc, json.dumps({"name": "m", "path": path}))
    assert error["param"] == "path" and "cannot be read" in error["message"], error


@pytest.mark.parametrize("field,value", [
    ("keep_alive_s", 1.4626140050963602e308), ("keep_alive_s", MAX_KEEP_ALIVE_S * 1.01),
    ("tpot_slo_s", 3.953382320949236e307), ("ttft_slo_s", MAX_SLO_S + 1),
    ("max_instances", 2**31), ("min_instances", 2**31), ("max_queue", 2**31),  # the registry's 32-bit columns
])
def test_a_value_past_its_bound_is_a_400_naming_it(client, doc, field, value):
    error = deploy(client, doc, json.dumps({"name": "m", "path": "/nonexistent", field: value}))
    assert (error["param"], error["code"]) == (field, "invalid_value"), error


def test_the_bounds_themselves_are_accepted():
    body = DeployRequest(name="m", path="/p", min_instances=m.INT32_MAX, max_instances=m.INT32_MAX,
                         max_queue=m.INT32_MAX, keep_alive_s=MAX_KEEP_ALIVE_S, ttft_slo_s=MAX_SLO_S,
                         tpot_slo_s=MAX_SLO_S)
    m.DeployModel(**body.model_dump(exclude={"path"}), path="/p", arch="llama", n_layers=1,
                  blocks=[m.BlockInfo(block_id=0, nbytes=1, checksum="x", layer_start=0, layer_end=1)])
