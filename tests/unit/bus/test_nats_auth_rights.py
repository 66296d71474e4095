"""The NATS rights of each service (libs/bus/auth.py), without a server: every subject a
service's code names is one its user may use, the rights the security model rests on hold,
subject matching follows NATS's wildcard rules, and client settings are read as documented.
(tests/integration/test_nats_auth.py checks the same rights on a real nats-server.)"""

import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from libs.bus import auth
from libs.bus.auth import NatsAuthError, client_auth, may, permissions, subject_matches
from libs.protocol import subjects

ROOT = Path(__file__).resolve().parents[3]
# Where each user's code lives (libs/bus/plans.py: the planner sends parts, workers consume them).
CODE = {
    "registry": ["services/registry"],
    "planner": ["services/planner", "libs/bus/worker_commands.py", "libs/bus/plans.py"],
    "load-monitor": ["services/load_monitor"],
    "gateway": ["services/gateway"],
    "worker": ["services/worker", "libs/bus/plans.py"],
}
NOT_SUBJECTS = {"PREFIX", "PLAN_STREAM", "QUIET_SUBJECTS"}
# A worker takes its plan parts through a JetStream consumer (created by the JetStream API,
# delivered to its own inbox), never by subscribing to the subject itself.
THROUGH_JETSTREAM = {"worker": {subjects.worker_plan("w-1")}}


def named_subjects(paths: list[str]) -> set[str]:
    """Every subject the code under `paths` names through libs.protocol.subjects (functions
    called with sample ids)."""
    found: set[str] = set()
    for rel in paths:
        root = ROOT / rel
        for path in [root] if root.is_file() else root.rglob("*.py"):
            for name in re.findall(r"subjects\.([A-Za-z_]+)", path.read_text()):
                if name in NOT_SUBJECTS or not hasattr(subjects, name):  # (a docstring's "REGISTRY_*")
                    continue
                value = getattr(subjects, name)
                if callable(value):
                    value = value("gw-1", "req-1") if name == "tokens" else value("w-1")
                found.add(value)
    return found


@pytest.mark.parametrize("user", auth.SERVICE_USERS)
def test_every_subject_a_service_names_is_one_its_user_may_use(user):
    named = named_subjects(CODE[user]) - THROUGH_JETSTREAM.get(user, set())
    assert len(named) >= 3, "the scan found (almost) nothing: the pattern is broken"
    missing = sorted(s for s in named if not (may(user, "publish", s) or may(user, "subscribe", s)))
    assert not missing, f"{user} names subjects its NATS user may not use: {missing}"


def users_who(action: str, subject: str) -> set[str]:
    return {u for u in auth.SERVICE_USERS if may(u, action, subject)}


def test_only_the_planner_commands_workers_and_only_gateways_read_token_streams():
    assert users_who("publish", subjects.worker_command("w-1")) == {"planner"}
    assert users_who("publish", subjects.worker_plan("w-1")) == {"planner"}
    assert users_who("subscribe", subjects.tokens("gw-1", "req-1")) == {"gateway"}
    assert users_who("publish", subjects.tokens("gw-1", "req-1")) == {"worker"}
    assert users_who("subscribe", subjects.worker_command("w-1")) == {"worker"}
    # API keys and usage: the gateway asks, the registry answers; nobody else comes near them.
    for rpc in (subjects.REGISTRY_KEY_LOOKUP, subjects.REGISTRY_KEY_CREATE, subjects.REGISTRY_USAGE_GET):
        assert users_who("publish", rpc) == {"gateway"}
        assert users_who("subscribe", rpc) == {"registry"}
    # Replies: each user reads its own inbox only.
    for user in auth.SERVICE_USERS:
        others = [u for u in auth.SERVICE_USERS if u != user]
        assert may(user, "subscribe", f"{auth.inbox(user)}.abc.1")
        assert not any(may(user, "subscribe", f"{auth.inbox(o)}.abc.1") for o in others)
        assert not may(user, "subscribe", "_INBOX.abc")
        assert not may(user, "subscribe", ">")


def test_rights_follow_the_namespace():
    assert may("planner", "publish", "other-ns.worker.w-1.command", prefix="other-ns")
    assert not may("planner", "publish", subjects.worker_command("w-1"), prefix="other-ns")
    assert permissions("other-ns")[auth.OPERATOR] is None


@given(st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=5),
       st.lists(st.sampled_from(["a", "b", "c", "*"]), min_size=1, max_size=5), st.booleans())
def test_subject_matching_follows_nats_wildcards(subject_tokens, pattern_tokens, tail):
    subject = ".".join(subject_tokens)
    pattern = ".".join(pattern_tokens + ([">"] if tail else []))
    n = len(pattern_tokens)
    prefix_ok = all(p in ("*", s) for p, s in zip(pattern_tokens, subject_tokens))
    expected = prefix_ok and (len(subject_tokens) > n if tail else len(subject_tokens) == n)
    assert subject_matches(pattern, subject) == expected


def test_generated_config_quotes_values_and_refers_to_environment_variables():
    text = auth.nats_config(auth.PASSWORD_VARIABLES, "ns", from_env=True)
    assert "password: $NATS_PASSWORD_LOAD_MONITOR" in text and '"ns.worker.*.command"' in text
    with pytest.raises(ValueError, match="cannot be written"):
        auth.nats_config({"planner": 'a"b'})
    with pytest.raises(ValueError, match="no rights"):
        auth.nats_config({"intruder": "x"})


def test_client_settings():
    url = "nats://127.0.0.1:4222"
    a = client_auth(url, {"LAYERCAST_NATS_USER": "planner", "LAYERCAST_NATS_PASSWORD": "pw"})
    assert (a.user, a.password, a.tls, a.inbox_prefix) == ("planner", "pw", None, "_INBOX.planner")
    b = client_auth("nats://gateway:pw@127.0.0.1:4222", {})
    assert (b.user, b.password, b.inbox_prefix) == ("gateway", None, "_INBOX.gateway")  # the URL carries it
    assert client_auth(url, {}).inbox_prefix == "_INBOX"  # a server without auth
    with pytest.raises(NatsAuthError, match="LAYERCAST_NATS_USER is not"):
        client_auth(url, {"LAYERCAST_NATS_PASSWORD": "pw"})
    with pytest.raises(NatsAuthError, match="given twice"):
        client_auth("nats://gateway:pw@h:1", {"LAYERCAST_NATS_USER": "gateway"})
    with pytest.raises(NatsAuthError, match="go together"):
        client_auth(url, {"LAYERCAST_NATS_TLS_CERT": "/c.pem"})
    assert auth.redact("nats://operator:secret@127.0.0.1:4222") == "nats://operator:***@127.0.0.1:4222"
    assert auth.redact(url) == url
