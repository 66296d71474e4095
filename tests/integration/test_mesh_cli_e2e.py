"""LLM-Mesh settings through a real cluster's gateway (NATS, Postgres, registry, gateway; no
worker is needed): deployment SLOs from `layercast model deploy`, profiles measured and stored
with `layercast model profile --publish` and read back with `layercast model profiles`."""

import json
import uuid

import httpx
import pytest
from typer.testing import CliRunner

from conftest import TEST_ADMIN_KEY, TEST_API_KEY, running_cluster
from services.cli.app import app as cli
from test_serving_e2e import assert_openai_error

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, nats_url, postgres_server_url, tiny_checkpoint):
    with running_cluster(postgres_server_url, tiny_checkpoint, dict(ttft_slo_s=1.5, tpot_slo_s=0.1),
                         state_dir=tmp_path_factory.mktemp("cluster"), api_key=TEST_API_KEY,
                         admin_key=TEST_ADMIN_KEY, workers=0, nats_url=nats_url,
                         namespace=f"lcm{uuid.uuid4().hex[:8]}") as state:
        yield state


@pytest.fixture
def admin(cluster) -> httpx.Client:
    return httpx.Client(base_url=cluster.gateway_url, headers={"Authorization": f"Bearer {TEST_ADMIN_KEY}"},
                        timeout=60)


def target(cluster) -> list[str]:
    return ["--gateway-url", cluster.gateway_url, "--admin-key", TEST_ADMIN_KEY]


def test_deployment_slos_from_the_admin_api_and_the_cli(cluster, admin, tiny_checkpoint):
    model = admin.get("/admin/v1/models/tiny").json()
    assert (model["ttft_slo_s"], model["tpot_slo_s"]) == (1.5, 0.1)

    runner = CliRunner()
    out = runner.invoke(cli, ["model", "deploy", "slo-cli", str(tiny_checkpoint), "--tpot-slo-s", "0.05",
                              "--ttft-slo-s", "0.8", *target(cluster)])
    assert out.exit_code == 0, out.output
    model = admin.get("/admin/v1/models/slo-cli").json()
    assert (model["ttft_slo_s"], model["tpot_slo_s"]) == (0.8, 0.05)
    default = runner.invoke(cli, ["model", "deploy", "slo-default", str(tiny_checkpoint), *target(cluster)])
    assert default.exit_code == 0, default.output
    model = admin.get("/admin/v1/models/slo-default").json()
    assert (model["ttft_slo_s"], model["tpot_slo_s"]) == (None, 0.25)

    bad = runner.invoke(cli, ["model", "deploy", "slo-bad", str(tiny_checkpoint), "--tpot-slo-s", "0",
                              *target(cluster)])
    assert bad.exit_code == 1 and "--tpot-slo-s must be a positive" in bad.output
    assert_openai_error(admin.post("/admin/v1/models", json={"name": "slo-bad", "path": str(tiny_checkpoint),
                                                              "ttft_slo_s": -1}), 400, "ttft_slo_s")
    assert admin.get("/admin/v1/models/slo-bad").status_code == 404


def test_a_profile_measured_by_the_cli_is_stored_and_read_back(cluster, admin, tiny_checkpoint):
    runner = CliRunner()
    none = runner.invoke(cli, ["model", "profiles", "tiny", *target(cluster)])
    assert none.exit_code == 0 and json.loads(none.output) == {"cpu": None, "cuda": None}

    out = runner.invoke(cli, ["model", "profile", str(tiny_checkpoint), "--max-len", "8", "--max-batch", "2",
                              "--repeats", "1", "--publish", "tiny", *target(cluster)])
    assert out.exit_code == 0, out.output
    measured = json.loads(out.output.splitlines()[0])
    assert "stored as the profile of tiny on cpu" in out.output

    listed = runner.invoke(cli, ["model", "profiles", "tiny", *target(cluster)])
    assert listed.exit_code == 0, listed.output
    stored = json.loads(listed.output)
    assert stored["cuda"] is None and stored["cpu"]["source"] == "cli"
    assert {k: stored["cpu"][k] for k in measured} == measured

    # A device that is no kind fails before the measurement; a broken profile is a 400 naming its field.
    odd = runner.invoke(cli, ["model", "profile", str(tiny_checkpoint), "--device", "mps", "--publish", "tiny",
                              *target(cluster)])
    assert odd.exit_code == 1 and "neither cpu nor cuda" in odd.output
    broken = {**stored["cpu"], "decode_s": stored["cpu"]["decode_s"][:1]}
    err = assert_openai_error(admin.post("/admin/v1/profiles", json=broken), 400, "decode_s")
    assert "invalid profile: decode_s" in err["message"]
    assert json.loads(runner.invoke(cli, ["model", "profiles", "tiny", *target(cluster)]).output) == stored
