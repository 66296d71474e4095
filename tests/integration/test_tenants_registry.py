"""API keys and usage in the registry, against real NATS and real Postgres (SQLite for the
store's upsert): stored hashed, looked up, revoked, usage added up, bad input refused."""

import asyncio
import hashlib

import psycopg
import pytest

from libs.bus.broker import RemoteError, call, request_body
from libs.db.session import make_engine, migrate
from libs.db.store import RegistryStore
from libs.protocol import messages as m
from libs.protocol import subjects
from test_registry import client, started  # noqa: F401 (client: the broker fixture)

SECRET = "sk-lc-registry-test-secret-0123456789"
HASH = hashlib.sha256(SECRET.encode()).hexdigest()


def new_key(name: str = "team-a", key_hash: str = HASH, **extra) -> m.CreateApiKey:
    return m.CreateApiKey(name=name, key_hash=key_hash, prefix=SECRET[:10], **extra)


async def test_keys_are_created_looked_up_by_hash_and_revoked(database_url, nats_url, client):
    reg = await started(database_url, nats_url)
    try:
        info = await call(client, subjects.REGISTRY_KEY_CREATE,
                          new_key(models=["a"], requests_per_minute=2, tokens_per_minute=100), m.ApiKeyInfo)
        assert (info.name, info.models, info.requests_per_minute, info.tokens_per_minute) == ("team-a", ["a"], 2, 100)
        found = await call(client, subjects.REGISTRY_KEY_LOOKUP, m.LookupApiKey(key_hash=HASH), m.ApiKeyInfo)
        assert found == info
        with pytest.raises(RemoteError, match="exists already"):  # one live key per name
            await call(client, subjects.REGISTRY_KEY_CREATE, new_key(key_hash="0" * 64), m.ApiKeyInfo)
        listed = await call(client, subjects.REGISTRY_KEY_LIST, m.ListApiKeys(), m.ApiKeyList)
        assert [k.key_id for k in listed.keys] == [info.key_id]

        revoked = await call(client, subjects.REGISTRY_KEY_REVOKE, m.ApiKeyRef(key_id=info.key_id), m.ApiKeyInfo)
        assert revoked.revoked_at is not None
        with pytest.raises(RemoteError, match="no such API key"):
            await call(client, subjects.REGISTRY_KEY_LOOKUP, m.LookupApiKey(key_hash=HASH), m.ApiKeyInfo)
        with pytest.raises(RemoteError, match="not found"):  # revoked once
            await call(client, subjects.REGISTRY_KEY_REVOKE, m.ApiKeyRef(key_id=info.key_id), m.ApiKeyInfo)
        assert (await call(client, subjects.REGISTRY_KEY_LIST, m.ListApiKeys(), m.ApiKeyList)).keys == []
        every = await call(client, subjects.REGISTRY_KEY_LIST, m.ListApiKeys(include_revoked=True), m.ApiKeyList)
        assert [k.key_id for k in every.keys] == [info.key_id]
        # The name is free again once its key is revoked.
        await call(client, subjects.REGISTRY_KEY_CREATE, new_key(key_hash="1" * 64), m.ApiKeyInfo)
    finally:
        await reg.stop()
    # The database holds the hash and a display prefix, never the secret.
    with psycopg.connect(database_url) as conn:
        rows = conn.execute("SELECT * FROM api_keys").fetchall()
    dump = repr(rows)
    assert HASH in dump and SECRET not in dump and SECRET[10:] not in dump


async def test_usage_adds_up_per_key_and_model(database_url, nats_url, client):
    reg = await started(database_url, nats_url)
    try:
        info = await call(client, subjects.REGISTRY_KEY_CREATE, new_key(), m.ApiKeyInfo)

        def batch(key_id: str, model: str, n: int) -> m.RecordUsage:
            return m.RecordUsage(entries=[m.UsageEntry(key_id=key_id, model=model, requests=1, prompt_tokens=n,
                                                       completion_tokens=2 * n)])
        # Gateways record at once: every increment is kept.
        await asyncio.gather(*(call(client, subjects.REGISTRY_USAGE_RECORD, batch(info.key_id, "a", n),
                                    m.UsageRecorded) for n in range(1, 11)))
        await call(client, subjects.REGISTRY_USAGE_RECORD, batch(m.STATIC_KEY_ID, "b", 5), m.UsageRecorded)
        report = await call(client, subjects.REGISTRY_USAGE_GET, m.GetUsage(), m.UsageReport)
        assert [(u.key_id, u.key_name, u.model, u.requests, u.prompt_tokens, u.completion_tokens)
                for u in report.usage] == [(info.key_id, "team-a", "a", 10, 55, 110),
                                           ("static", "static", "b", 1, 5, 10)]
        for key in (info.key_id, "team-a"):  # by id or by name
            by_key = await call(client, subjects.REGISTRY_USAGE_GET, m.GetUsage(key=key), m.UsageReport)
            assert [u.model for u in by_key.usage] == ["a"]
        by_model = await call(client, subjects.REGISTRY_USAGE_GET, m.GetUsage(model="b"), m.UsageReport)
        assert [u.key_id for u in by_model.usage] == ["static"]
    finally:
        await reg.stop()


async def test_usage_upsert_on_sqlite(tmp_path):
    url = f"sqlite:///{tmp_path / 'r.db'}"
    migrate(url)
    engine = make_engine(url)
    try:
        store = RegistryStore(engine)
        e = m.UsageEntry(key_id="k", model="a", requests=1, prompt_tokens=3, completion_tokens=4)
        await store.record_usage([e])
        await store.record_usage([e, e.model_copy(update={"model": "b"})])
        assert [(u.model, u.requests, u.prompt_tokens, u.completion_tokens) for u in await store.usage("k")] == [
            ("a", 2, 6, 8), ("b", 1, 3, 4)]
    finally:
        await engine.dispose()


async def test_malformed_key_and_usage_messages_are_refused_and_the_registry_goes_on(database_url, nats_url,
                                                                                   client):
    reg = await started(database_url, nats_url)
    try:
        bad = {
            subjects.REGISTRY_KEY_CREATE: [b"not json", {"name": "x"}, {"name": "a b", "key_hash": HASH, "prefix": "p"},
                                           {"name": "x", "key_hash": "not-hex", "prefix": "p"},
                                           {"name": "x", "key_hash": HASH, "prefix": "p", "requests_per_minute": 0}],
            subjects.REGISTRY_KEY_LOOKUP: [{"key_hash": SECRET}, [1]],
            subjects.REGISTRY_USAGE_RECORD: [{"entries": [{"key_id": "k", "model": "a", "prompt_tokens": -1}]},
                                             {"entries": "lots"}],
        }
        for subject, bodies in bad.items():
            for body in bodies:
                reply = await request_body(client, subject, body, timeout=15, grace=15)
                assert reply["code"] == "invalid" and "malformed" in reply["error"], (subject, body, reply)
        # Nothing was stored, and the registry still answers.
        assert (await call(client, subjects.REGISTRY_KEY_LIST, m.ListApiKeys(), m.ApiKeyList)).keys == []
        assert (await call(client, subjects.REGISTRY_USAGE_GET, m.GetUsage(), m.UsageReport)).usage == []
        await call(client, subjects.REGISTRY_KEY_CREATE, new_key(), m.ApiKeyInfo)
    finally:
        await reg.stop()
