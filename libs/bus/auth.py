"""Who may say what on NATS: a user per service, each allowed only its own subjects.

`permissions(prefix)` derives every service's publish and subscribe rights from
`libs.protocol.subjects` (the one list of subjects), so a subject added there is added
here or a service cannot use it (tests/unit/bus/test_auth.py checks each service's code
names only subjects its user may use). `nats_config` renders them as nats-server
configuration for `layercast up`, docker-compose and the k8s manifests.

What the rights guarantee, among others:
- only the planner publishes worker commands and plan parts (`<ns>.worker.*.command`,
  `<ns>.plan.*`); workers tell each other of a live pair's end on `<ns>.worker.*.peer`;
- only a gateway subscribes to token streams (`<ns>.tokens.>`), only workers publish them;
- only the gateway reaches the API-key and usage RPCs of the registry;
- every user reads replies on its own inbox prefix only (`_INBOX.<user>.>`; the client sets
  it, see `inbox_prefix`), and answers requests through `allow_responses` (the reply
  subject of a request it received), not by publishing on inboxes at large;
- an unauthenticated client is refused at connect.

`operator` has every right: `layercast up` hands it to the tools that watch a cluster
(benchmarks, tests, `layercast` commands that talk NATS); deployments need not create it.

Clients: `client_auth()` reads LAYERCAST_NATS_USER / LAYERCAST_NATS_PASSWORD (or the
credentials inside NATS_URL) and LAYERCAST_NATS_TLS_CA / _CERT / _KEY. `layercast up` serves
TLS itself when LAYERCAST_NATS_SERVER_CERT and LAYERCAST_NATS_SERVER_KEY name its files.
"""

from __future__ import annotations

import os
import re
import secrets
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from libs.protocol import subjects

SERVICE_USERS = ("registry", "planner", "load-monitor", "gateway", "worker")
OPERATOR = "operator"
USERS = (*SERVICE_USERS, OPERATOR)
INBOX_ROOT = "_INBOX"

# The nats.conf variables the compose and k8s configurations read each password from.
PASSWORD_VARIABLES = {u: "NATS_PASSWORD_" + u.upper().replace("-", "_") for u in USERS}


class NatsAuthError(RuntimeError):
    """The NATS server refused this client's credentials (or wants some it has not)."""


@dataclass(frozen=True)
class Rights:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]


def _ns(subject: str, prefix: str) -> str:
    """`subject` (built under this process's namespace) moved to namespace `prefix`."""
    if not subject.startswith(subjects.PREFIX):
        raise ValueError(f"{subject!r} is not under the namespace {subjects.PREFIX!r}")
    return prefix + subject[len(subjects.PREFIX):]


def inbox(user: str) -> str:
    """The inbox prefix of `user`: its replies arrive under `<this>.>`."""
    return f"{INBOX_ROOT}.{user}"


def permissions(prefix: str = subjects.PREFIX) -> dict[str, Rights | None]:
    """Each user's rights under namespace `prefix` (None: every right, the operator)."""
    s = subjects
    ns = lambda *subs: tuple(_ns(x, prefix) for x in subs)  # noqa: E731
    stream = prefix + subjects.PLAN_STREAM[len(subjects.PREFIX):]
    events = _ns(f"{s.PREFIX}.events.>", prefix)
    any_worker = "*"

    def own_inbox(user: str) -> tuple[str, ...]:
        return (f"{inbox(user)}.>",)

    # JetStream API: the plan stream is created (or updated) by whoever starts first.
    js_stream = (f"$JS.API.STREAM.CREATE.{stream}", f"$JS.API.STREAM.UPDATE.{stream}",
                 f"$JS.API.STREAM.INFO.{stream}")
    registry_rpcs = (s.REGISTRY_WORKER_REGISTER, s.REGISTRY_MODEL_DEPLOY, s.REGISTRY_MODEL_GET,
                     s.REGISTRY_MODEL_LIST, s.REGISTRY_MODEL_DELETE, s.REGISTRY_CLUSTER,
                     s.REGISTRY_INSTANCE_CREATE, s.REGISTRY_SCALEOP_RECORD, s.REGISTRY_KEY_CREATE,
                     s.REGISTRY_KEY_LIST, s.REGISTRY_KEY_REVOKE, s.REGISTRY_KEY_LOOKUP, s.REGISTRY_USAGE_RECORD,
                     s.REGISTRY_USAGE_GET, s.REGISTRY_PROFILE_PUT, s.REGISTRY_PROFILE_GET,
                     s.REGISTRY_WORKER_EXITED,  # from the launcher's supervisor (operator)
                     s.REGISTRY_WORKER_UNREACHABLE)  # from a worker whose data-plane peer went silent
    return {
        "registry": Rights(
            publish=ns(s.EVENT_MODEL, s.EVENT_WORKER_EXPIRED, s.EVENT_CLUSTER_CHANGED, s.EVENT_INSTANCE),
            subscribe=(*ns(*registry_rpcs), events, *own_inbox("registry"))),
        "planner": Rights(
            publish=(*ns(s.REGISTRY_CLUSTER, s.REGISTRY_INSTANCE_CREATE, s.REGISTRY_SCALEOP_RECORD, s.EVENT_INSTANCE,
                         s.worker_command(any_worker), s.worker_plan(any_worker)), *js_stream),
            subscribe=(*ns(s.SCALE_REQUEST, s.METRICS_WORKER), events, *own_inbox("planner"))),
        "load-monitor": Rights(
            publish=ns(s.REGISTRY_CLUSTER, s.SCALE_REQUEST),
            subscribe=(*ns(s.METRICS_GATEWAY), events, *own_inbox("load-monitor"))),
        "gateway": Rights(
            publish=ns(s.REGISTRY_MODEL_DEPLOY, s.REGISTRY_MODEL_GET, s.REGISTRY_MODEL_DELETE, s.REGISTRY_CLUSTER,
                       s.REGISTRY_KEY_CREATE, s.REGISTRY_KEY_LIST, s.REGISTRY_KEY_REVOKE, s.REGISTRY_KEY_LOOKUP,
                       s.REGISTRY_USAGE_RECORD, s.REGISTRY_USAGE_GET, s.REGISTRY_PROFILE_PUT,
                       s.REGISTRY_PROFILE_GET, s.METRICS_GATEWAY, s.worker_generate(any_worker),
                       s.worker_cancel(any_worker)),
            subscribe=(*ns(s.tokens_wildcard("*")), events, *own_inbox("gateway"))),
        "worker": Rights(
            publish=(*ns(s.REGISTRY_WORKER_REGISTER, s.REGISTRY_WORKER_UNREACHABLE, s.REGISTRY_MODEL_LIST, s.REGISTRY_CLUSTER, s.REGISTRY_PROFILE_PUT,
                         s.REGISTRY_PROFILE_GET, s.EVENT_HEARTBEAT, s.EVENT_INSTANCE, s.EVENT_BLOCK, s.EVENT_TRANSFER,
                         s.METRICS_WORKER, s.tokens_wildcard("*"), s.worker_rdma_connect(any_worker),
                         s.worker_peer(any_worker)),
                     # a plan part's answer goes to the planner's inbox named in the part
                     f"{inbox('planner')}.>",
                     *js_stream,
                     f"$JS.API.CONSUMER.CREATE.{stream}", f"$JS.API.CONSUMER.CREATE.{stream}.>",
                     f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.>", f"$JS.API.CONSUMER.INFO.{stream}.>",
                     f"$JS.ACK.{stream}.>", f"$JS.FC.{stream}.>"),
            subscribe=(*ns(s.worker_command(any_worker), s.worker_generate(any_worker), s.worker_cancel(any_worker),
                           s.worker_rdma_connect(any_worker), s.worker_peer(any_worker)),
                       events, *own_inbox("worker"))),
        OPERATOR: None,
    }


def subject_matches(pattern: str, subject: str) -> bool:
    """Whether NATS subject `pattern` (`*`: one token, a final `>`: one or more) covers `subject`."""
    want, have = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return i == len(want) - 1 and len(have) > i
        if i >= len(have) or (token != "*" and token != have[i]):
            return False
    return len(want) == len(have)


def may(user: str, action: str, subject: str, prefix: str = subjects.PREFIX) -> bool:
    """Whether `user` may `action` ("publish" or "subscribe") on `subject` under `prefix`."""
    rights = permissions(prefix)[user]
    return rights is None or any(subject_matches(p, subject) for p in getattr(rights, action))


def new_passwords() -> dict[str, str]:
    """A fresh random password per user (URL-safe, starting with a letter: nats.conf reads it bare)."""
    return {u: "p" + secrets.token_hex(24) for u in USERS}


def _quote(value: str) -> str:
    if not re.fullmatch(r"[^\"\\\n]*", value):
        raise ValueError(f"{value!r} cannot be written into nats.conf")
    return f'"{value}"'


def authorization_block(passwords: Mapping[str, str], prefix: str = subjects.PREFIX, *,
                        from_env: bool = False) -> str:
    """The `authorization { users: [...] }` block for `passwords` (user -> password; with
    `from_env`, user -> the name of the environment variable nats-server reads it from)."""
    rights = permissions(prefix)
    unknown = set(passwords) - set(rights)
    if unknown:
        raise ValueError(f"no rights defined for {sorted(unknown)}")
    lines = ["authorization {", "  users: ["]
    for user, secret in passwords.items():
        password = f"${secret}" if from_env else _quote(secret)
        lines.append(f"    {{user: {_quote(user)}, password: {password}")
        r = rights[user]
        if r is not None:
            lines.append("     permissions: {")
            lines.append(f"       publish: {{allow: [{', '.join(_quote(x) for x in r.publish)}]}}")
            lines.append(f"       subscribe: {{allow: [{', '.join(_quote(x) for x in r.subscribe)}]}}")
            lines.append("       allow_responses: true")
            lines.append("     }")
        lines.append("    }")
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"


def nats_config(passwords: Mapping[str, str], prefix: str = subjects.PREFIX, *, listen: str | None = None,
                store_dir: str | None = None, from_env: bool = False, header: str = "",
                tls: tuple[str, str] | None = None) -> str:
    """A whole nats.conf: where it listens, JetStream, TLS (`tls`: the server's certificate and
    key files; clients must then use TLS), and the users."""
    out = [header.rstrip() + "\n"] if header else []
    if listen:
        out.append(f"listen: {_quote(listen)}\n")
    if store_dir is not None:
        out.append(f"jetstream {{\n  store_dir: {_quote(store_dir)}\n}}\n")
    if tls is not None:
        out.append(f"tls {{\n  cert_file: {_quote(tls[0])}\n  key_file: {_quote(tls[1])}\n}}\n")
    out.append(authorization_block(passwords, prefix, from_env=from_env))
    return "".join(out)


# --- clients -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ClientAuth:
    user: str | None
    password: str | None
    tls: ssl.SSLContext | None

    @property
    def inbox_prefix(self) -> str:
        """Replies come back under the user's own inbox prefix (the only one it may read)."""
        return inbox(self.user) if self.user else INBOX_ROOT


def url_user(url: str) -> str | None:
    """The user named inside a NATS URL (nats://user:password@host:port), if any."""
    first = url.split(",")[0].strip()
    try:
        user = urlsplit(first).username
    except ValueError:
        return None
    return unquote(user) if user else None


def redact(url: str) -> str:
    """`url` with any password replaced by ***: fit for logs and status output."""
    return re.sub(r"(://[^:/@,]+):[^@/,]*@", r"\1:***@", url)


def tls_context(env: Mapping[str, str] | None = None) -> ssl.SSLContext | None:
    """TLS to NATS when LAYERCAST_NATS_TLS_CA (the server's CA) is set; a client certificate
    with LAYERCAST_NATS_TLS_CERT and LAYERCAST_NATS_TLS_KEY (servers that verify clients)."""
    env = os.environ if env is None else env
    ca, cert, key = (env.get(f"LAYERCAST_NATS_TLS_{k}") or None for k in ("CA", "CERT", "KEY"))
    if not (ca or cert):
        return None
    if bool(cert) != bool(key):
        raise NatsAuthError("LAYERCAST_NATS_TLS_CERT and LAYERCAST_NATS_TLS_KEY go together")
    ctx = ssl.create_default_context(cafile=ca)
    if cert:
        ctx.load_cert_chain(cert, key)
    return ctx


def client_auth(url: str, env: Mapping[str, str] | None = None) -> ClientAuth:
    """This process's NATS credentials: LAYERCAST_NATS_USER / LAYERCAST_NATS_PASSWORD, else the
    user inside `url` (its password then travels in the URL); none for a server without auth."""
    env = os.environ if env is None else env
    user, password = env.get("LAYERCAST_NATS_USER") or None, env.get("LAYERCAST_NATS_PASSWORD") or None
    if password and not user:
        raise NatsAuthError("LAYERCAST_NATS_PASSWORD is set but LAYERCAST_NATS_USER is not")
    if user and url_user(url):
        raise NatsAuthError(f"NATS credentials given twice: in NATS_URL ({redact(url)}) and LAYERCAST_NATS_USER")
    if user is None:
        return ClientAuth(url_user(url), None, tls_context(env))
    return ClientAuth(user, password, tls_context(env))


def deployment_config() -> str:
    """The authorization block of the compose and k8s nats.conf (namespace `layercast`, the
    service users, each password from the NATS_PASSWORD_<USER> environment variable)."""
    return authorization_block({u: PASSWORD_VARIABLES[u] for u in SERVICE_USERS}, "layercast", from_env=True)


if __name__ == "__main__":  # python -m libs.bus.auth > block: what deploy/nats/nats.conf and k8s/base/nats.conf hold
    print(deployment_config(), end="")
