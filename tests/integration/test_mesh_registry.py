"""LLM-Mesh state in the registry, against real NATS and real Postgres: deployment SLOs, the
device kind of instances, model profiles per device kind, and the migration that adds them."""

import asyncio
import math
import time

import pytest
from alembic import command
from sqlalchemy import create_engine, text

from libs.bus.broker import RemoteError, call, publish, request_body
from libs.db.session import alembic_config, migrate, sync_url
from libs.protocol import messages as m
from libs.protocol import subjects
from test_registry import client, deployment, started  # noqa: F401 (client: the broker fixture)


async def test_deployment_slos_round_trip_and_a_redeploy_updates_them(database_url, nats_url, client):
    reg = await started(database_url, nats_url)
    try:
        info = await call(client, subjects.REGISTRY_MODEL_DEPLOY, deployment(ttft_slo_s=1.5, tpot_slo_s=0.1),
                          m.ModelInfo)
        assert (info.ttft_slo_s, info.tpot_slo_s) == (1.5, 0.1)
        plain = await call(client, subjects.REGISTRY_MODEL_DEPLOY, deployment("plain"), m.ModelInfo)
        assert (plain.ttft_slo_s, plain.tpot_slo_s) == (None, 0.25)  # the paper's defaults

        got = await call(client, subjects.REGISTRY_MODEL_GET, m.ModelRef(name="demo"), m.ModelInfo)
        assert (got.ttft_slo_s, got.tpot_slo_s) == (1.5, 0.1)
        listed = await call(client, subjects.REGISTRY_MODEL_LIST, m.ListModels(), m.ModelList)
        assert {i.name: (i.ttft_slo_s, i.tpot_slo_s) for i in listed.models} == {"demo": (1.5, 0.1),
                                                                                 "plain": (None, 0.25)}
        view = await call(client, subjects.REGISTRY_CLUSTER, m.GetCluster(), m.ClusterView)
        assert {i.name: i.tpot_slo_s for i in view.models} == {"demo": 0.1, "plain": 0.25}

        await call(client, subjects.REGISTRY_MODEL_DELETE, m.ModelRef(name="demo"), m.ModelInfo)
        again = await call(client, subjects.REGISTRY_MODEL_DEPLOY, deployment(tpot_slo_s=0.5), m.ModelInfo)
        assert (again.ttft_slo_s, again.tpot_slo_s) == (None, 0.5)
        got = await call(client, subjects.REGISTRY_MODEL_GET, m.ModelRef(name="demo"), m.ModelInfo)
        assert (got.ttft_slo_s, got.tpot_slo_s) == (None, 0.5)
    finally:
        await reg.stop()


async def _instances(client) -> dict[str, m.InstanceInfo]:
    view = await call(client, subjects.REGISTRY_CLUSTER, m.GetCluster(), m.ClusterView)
    return {i.instance_id: i for i in view.instances}


async def _wait_for(client, check) -> dict[str, m.InstanceInfo]:
    deadline = time.monotonic() + 5
    while not check(found := await _instances(client)):
        assert time.monotonic() < deadline, f"not recorded: {found}"
        await asyncio.sleep(0.05)
    return found


async def test_an_instance_keeps_the_device_its_worker_reports(database_url, nats_url, client):
    """The planner creates an instance without knowing its device (cpu, the default); the
    worker's events say cuda, and the planner's later events (cpu again) do not undo it."""
    reg = await started(database_url, nats_url)
    stage = [m.Stage(worker_id="w1", block_start=0, block_end=2)]
    try:
        created = await call(client, subjects.REGISTRY_INSTANCE_CREATE,
                             m.CreateInstance(instance_id="i-gpu", model="demo", stages=stage), m.InstanceInfo)
        assert created.device == "cpu"
        ready = created.model_copy(update={"state": m.InstanceState.ready, "device": "cuda", "max_batch": 4})
        await publish(client, subjects.EVENT_INSTANCE, m.InstanceEvent(instance=ready))
        found = await _wait_for(client, lambda f: f["i-gpu"].state == m.InstanceState.ready)
        assert (found["i-gpu"].device, found["i-gpu"].max_batch) == ("cuda", 4)
        await publish(client, subjects.EVENT_INSTANCE, m.InstanceEvent(  # the planner's drain: device unknown
            instance=created.model_copy(update={"state": m.InstanceState.draining})))
        found = await _wait_for(client, lambda f: f["i-gpu"].state == m.InstanceState.draining)
        assert found["i-gpu"].device == "cuda"

        # Created by someone who knows the device, or first seen in a worker's event.
        told = await call(client, subjects.REGISTRY_INSTANCE_CREATE, m.CreateInstance(
            instance_id="i-told", model="demo", stages=stage, device="cuda"), m.InstanceInfo)
        assert told.device == "cuda"
        await publish(client, subjects.EVENT_INSTANCE, m.InstanceEvent(instance=m.InstanceInfo(
            instance_id="i-seen", model="demo", stages=stage, state=m.InstanceState.loading, created_at=time.time(),
            device="cuda")))
        found = await _wait_for(client, lambda f: "i-seen" in f)
        assert {i: found[i].device for i in ("i-gpu", "i-told", "i-seen")} == dict.fromkeys(
            ("i-gpu", "i-told", "i-seen"), "cuda")
    finally:
        await reg.stop()


def profile(device: str = "cpu", scale: float = 1.0, **update) -> m.ModelProfile:
    base = m.ModelProfile(model="demo", device=device, prefill_lengths=[1, 2, 4], prefill_s=[0.01, 0.02, 0.04],
                          batches=[1, 2], lengths=[1, 4], decode_s=[[0.005, 0.006], [0.007, 0.009]],
                          measured_at=1_700_000_000.5, source="w1")
    base = base.model_copy(update={"prefill_s": [t * scale for t in base.prefill_s]})
    return base.model_copy(update=update)


async def test_profiles_are_stored_per_device_kind_replaced_and_outlive_their_model(database_url, nats_url,
                                                                                     client):
    reg = await started(database_url, nats_url)
    try:
        with pytest.raises(RemoteError, match="no profile of model 'demo' on cpu") as e:
            await call(client, subjects.REGISTRY_PROFILE_GET, m.ProfileRef(model="demo", device="cpu"),
                       m.ModelProfile)
        assert e.value.code == "not_found"
        await call(client, subjects.REGISTRY_MODEL_DEPLOY, deployment(), m.ModelInfo)
        stored = await call(client, subjects.REGISTRY_PROFILE_PUT, profile(), m.ModelProfile)
        assert stored == profile()
        await call(client, subjects.REGISTRY_PROFILE_PUT, profile("cuda", scale=0.1, source="w2"), m.ModelProfile)

        async def get(device: str) -> m.ModelProfile:
            return await call(client, subjects.REGISTRY_PROFILE_GET, m.ProfileRef(model="demo", device=device),
                              m.ModelProfile)

        assert await get("cpu") == profile()
        assert await get("cuda") == profile("cuda", scale=0.1, source="w2")
        # A new measurement replaces the old one, of its device kind only.
        newer = profile(scale=2.0, batches=[1], decode_s=[[0.004, 0.005]], measured_at=1_700_000_100.0, source="cli")
        await call(client, subjects.REGISTRY_PROFILE_PUT, newer, m.ModelProfile)
        assert await get("cpu") == newer and (await get("cuda")).source == "w2"
        # Deleting the model keeps its profiles: a redeploy of it needs no new measurement.
        await call(client, subjects.REGISTRY_MODEL_DELETE, m.ModelRef(name="demo"), m.ModelInfo)
        assert await get("cpu") == newer
    finally:
        await reg.stop()


@pytest.mark.parametrize("update, field", [
    ({"prefill_s": [0.01, 0.02]}, "prefill_s"),
    ({"decode_s": [[0.005, 0.006]]}, "decode_s"),
    ({"decode_s": [[0.005, 0.006], [0.007]]}, "decode_s[1]"),
    ({"prefill_lengths": [1, 4, 2]}, "prefill_lengths"),
    ({"batches": [2, 1]}, "batches"),
    ({"prefill_s": [0.01, -1.0, 0.04]}, "prefill_s"),
    ({"decode_s": [[0.005, math.inf], [0.007, 0.009]]}, "decode_s[0]"),
    ({"model": "not a name"}, "model"),
])
async def test_a_broken_profile_is_refused_naming_its_field_and_nothing_is_stored(update, field, database_url,
                                                                                  nats_url, client):
    reg = await started(database_url, nats_url)
    try:
        with pytest.raises(RemoteError) as e:
            await call(client, subjects.REGISTRY_PROFILE_PUT, profile(**update), m.ModelProfile)
        assert e.value.code == "invalid" and f"invalid profile: {field}: " in e.value.error
        ref = m.ProfileRef(model=update.get("model", "demo"), device="cpu")
        with pytest.raises(RemoteError, match="no profile"):
            await call(client, subjects.REGISTRY_PROFILE_GET, ref, m.ModelProfile)
        # A body that is not a ModelProfile at all (an unknown device kind) is refused before the handler.
        body = await request_body(client, subjects.REGISTRY_PROFILE_PUT,
                                  {**profile().model_dump(mode="json"), "device": "tpu"}, timeout=15, grace=15)
        assert body["code"] == "invalid" and "ModelProfile" in body["error"] and "device" in body["error"]
    finally:
        await reg.stop()


@pytest.mark.parametrize("kind", ["postgres", "sqlite"])
def test_the_mesh_migration_gives_existing_rows_the_defaults_and_goes_back(kind, database_url, tmp_path):
    url = database_url if kind == "postgres" else f"sqlite:///{tmp_path / 'r.db'}"
    migrate(url, "0007")
    engine = create_engine(sync_url(url))
    try:
        with engine.begin() as conn:
            conn.execute(text(
                "INSERT INTO models (name, path, arch, n_layers, n_blocks, total_bytes, min_instances, max_instances,"
                " keep_alive_s, max_queue, scaling_mode, state, created_at) VALUES ('old', '/m', 'llama', 4, 2, 10,"
                " 0, 1, 60, 8, 'layercast', 'deployed', CURRENT_TIMESTAMP)"))
            conn.execute(text(
                "INSERT INTO instances (instance_id, model, mode, stages, state, created_at) VALUES ('i-old', 'old',"
                " 'local', '[]', 'ready', CURRENT_TIMESTAMP)"))
        migrate(url)
        with engine.connect() as conn:
            assert tuple(conn.execute(text("SELECT ttft_slo_s, tpot_slo_s FROM models")).one()) == (None, 0.25)
            assert conn.execute(text("SELECT device FROM instances")).scalar_one() == "cpu"
            assert conn.execute(text("SELECT count(*) FROM model_profiles")).scalar_one() == 0
        command.downgrade(alembic_config(url), "0007")
        with engine.connect() as conn:
            assert conn.execute(text("SELECT name FROM models")).scalar_one() == "old"
            with pytest.raises(Exception, match="model_profiles"):
                conn.execute(text("SELECT count(*) FROM model_profiles"))
        migrate(url)  # and up again
    finally:
        engine.dispose()
