"""Every NATS subject layercast uses, in one place: read top to bottom to see
the whole conversation between services.

Kinds:
- RPC: core NATS request/reply; the request and reply models are named beside it.
- EVENT: publish/subscribe, fire and forget; every service may listen.
- STREAM: per-request token streams (core NATS, one subject per request).
- JETSTREAM: kept in a JetStream stream until the receiver acks (scale-operation parts).

Bulk bytes (blocks, activations) never travel over NATS: see libs/transfer.
"""

import os
import re


def _namespace() -> str:
    """Subject prefix; LAYERCAST_NAMESPACE lets several clusters (or test runs) share one NATS."""
    ns = os.environ.get("LAYERCAST_NAMESPACE", "layercast")
    if not re.fullmatch(r"[A-Za-z0-9_\-]+", ns):
        raise ValueError(f"LAYERCAST_NAMESPACE={ns!r} must be one NATS token: letters, digits, '_' or '-'")
    return ns


PREFIX = _namespace()

# --- registry (the only service with a database) -----------------------------
# RPC RegisterWorker -> WorkerInfo
REGISTRY_WORKER_REGISTER = f"{PREFIX}.registry.worker.register"
# RPC WorkerExited -> CommandAck (a supervisor saw the worker's process exit: dead now, not at its
# heartbeats' expiry; its instances stop and their requests move at once)
REGISTRY_WORKER_EXITED = f"{PREFIX}.registry.worker.exited"
# RPC WorkerUnreachable -> CommandAck (worker -> registry: its data-plane connection to a peer
# broke; the registry verifies (libs/planning/liveness.py) and, dead, stops it as above;
# accepted=False: not (yet) taken for dead)
REGISTRY_WORKER_UNREACHABLE = f"{PREFIX}.registry.worker.unreachable"
# RPC DeployModel -> ModelInfo
REGISTRY_MODEL_DEPLOY = f"{PREFIX}.registry.model.deploy"
# RPC ModelRef -> ModelInfo
REGISTRY_MODEL_GET = f"{PREFIX}.registry.model.get"
# RPC ListModels -> ModelList
REGISTRY_MODEL_LIST = f"{PREFIX}.registry.model.list"
# RPC ModelRef -> ModelInfo (state "deleted"); planner then scales it to zero
REGISTRY_MODEL_DELETE = f"{PREFIX}.registry.model.delete"
# RPC GetCluster -> ClusterView (workers, replicas, instances, recent scale ops)
REGISTRY_CLUSTER = f"{PREFIX}.registry.cluster"
# RPC CreateInstance -> InstanceInfo (planner records a loading instance)
REGISTRY_INSTANCE_CREATE = f"{PREFIX}.registry.instance.create"
# RPC RecordScaleOp -> ScaleOpInfo (planner records / updates a scale operation)
REGISTRY_SCALEOP_RECORD = f"{PREFIX}.registry.scaleop.record"
# RPC CreateApiKey -> ApiKeyInfo (the secret's hash only; "conflict" for a name in use)
REGISTRY_KEY_CREATE = f"{PREFIX}.registry.key.create"
# RPC ListApiKeys -> ApiKeyList
REGISTRY_KEY_LIST = f"{PREFIX}.registry.key.list"
# RPC ApiKeyRef -> ApiKeyInfo (revoked_at set; "not_found" for an unknown or revoked key)
REGISTRY_KEY_REVOKE = f"{PREFIX}.registry.key.revoke"
# RPC LookupApiKey -> ApiKeyInfo (gateway, on a key it has not cached; "not_found": unknown or revoked)
REGISTRY_KEY_LOOKUP = f"{PREFIX}.registry.key.lookup"
# RPC RecordUsage -> UsageRecorded (gateway, batched about every second: increments per key and model)
REGISTRY_USAGE_RECORD = f"{PREFIX}.registry.usage.record"
# RPC GetUsage -> UsageReport (totals per key and model)
REGISTRY_USAGE_GET = f"{PREFIX}.registry.usage.get"
# RPC ModelProfile -> ModelProfile (a worker or the CLI stores a measured profile; replaces the old)
REGISTRY_PROFILE_PUT = f"{PREFIX}.registry.profile.put"
# RPC ProfileRef -> ModelProfile ("not_found" when none was measured for that model and device kind)
REGISTRY_PROFILE_GET = f"{PREFIX}.registry.profile.get"

# --- events -----------------------------------------------------------------
# EVENT Heartbeat (worker -> registry; also upserts the worker's registration)
EVENT_HEARTBEAT = f"{PREFIX}.events.worker.heartbeat"
# EVENT WorkerExpired (registry -> planner, gateway) when heartbeats stop
EVENT_WORKER_EXPIRED = f"{PREFIX}.events.worker.expired"
# EVENT ModelEvent (registry -> gateway, planner, load-monitor): deployed / deleted
EVENT_MODEL = f"{PREFIX}.events.model"
# EVENT InstanceEvent (worker, planner -> registry, gateway, planner, load-monitor)
EVENT_INSTANCE = f"{PREFIX}.events.instance"
# EVENT BlockEvent (worker -> registry, planner): a block replica changed tier/state
EVENT_BLOCK = f"{PREFIX}.events.block"
# EVENT ClusterChanged (registry -> planner): the cluster view moved on (a change count)
EVENT_CLUSTER_CHANGED = f"{PREFIX}.events.cluster.changed"
# EVENT TransferReport (worker -> planner, benchmarks): a worker's part of a multicast ended
EVENT_TRANSFER = f"{PREFIX}.events.transfer"

# --- metrics and scaling ------------------------------------------------------
# EVENT GatewayMetrics (gateway -> load-monitor), periodic and on demand changes
METRICS_GATEWAY = f"{PREFIX}.metrics.gateway"
# EVENT WorkerMetrics (worker -> load-monitor), periodic
METRICS_WORKER = f"{PREFIX}.metrics.worker"
# EVENT ScaleRequest (load-monitor -> planner): desired instances for a model
SCALE_REQUEST = f"{PREFIX}.scale.request"

# Periodic traffic: a message on one of these that starts a trace is not traced (it would
# bury the request and scale-operation traces); inside a traced operation it still is.
QUIET_SUBJECTS = (EVENT_HEARTBEAT, METRICS_GATEWAY, METRICS_WORKER, REGISTRY_CLUSTER, REGISTRY_MODEL_LIST,
                  REGISTRY_USAGE_RECORD)


def in_namespace(subject: str, namespace: str) -> str:
    """`subject` (one of the above) in another cluster's namespace (a launcher may run clusters
    other than its own process's LAYERCAST_NAMESPACE)."""
    assert subject.startswith(PREFIX + ".")
    return namespace + subject[len(PREFIX):]


# --- per worker ---------------------------------------------------------------
def worker_command(worker_id: str) -> str:
    """RPC LoadModel | UnloadModel -> CommandAck (planner -> worker)."""
    return f"{PREFIX}.worker.{worker_id}.command"


def worker_plan(worker_id: str) -> str:
    """JETSTREAM TransferPart | LoadModel (planner -> worker): a worker's part of a scale-out, kept
    in PLAN_STREAM until the worker acks it; answered with a CommandAck (libs/bus/plans.py)."""
    return f"{PREFIX}.plan.{worker_id}"


# The stream holding scale-operation parts (stream names cannot contain dots).
PLAN_STREAM = f"{PREFIX}-plans"


def worker_generate(worker_id: str) -> str:
    """RPC GenerateRequest -> GenerateAccepted (gateway -> worker); tokens follow on `tokens(...)`."""
    return f"{PREFIX}.worker.{worker_id}.generate"


def worker_rdma_connect(worker_id: str) -> str:
    """RPC RdmaConnect -> RdmaConnect (worker -> worker): set up RDMA queue pairs to this worker."""
    return f"{PREFIX}.worker.{worker_id}.rdma.connect"


def worker_peer(worker_id: str) -> str:
    """RPC EndLivePair -> CommandAck (worker -> worker): the other side of a live pair ended.
    Apart from `worker_command`, which only the planner may publish (libs/bus/auth.py)."""
    return f"{PREFIX}.worker.{worker_id}.peer"


def worker_cancel(worker_id: str) -> str:
    """EVENT CancelRequest (gateway -> worker): client went away or a stop string matched."""
    return f"{PREFIX}.worker.{worker_id}.cancel"


# --- token streams ---------------------------------------------------------------
def tokens(gateway_id: str, request_id: str) -> str:
    """STREAM TokenEvent (worker -> the gateway that owns the request)."""
    return f"{PREFIX}.tokens.{gateway_id}.{request_id}"


def tokens_wildcard(gateway_id: str) -> str:
    return f"{PREFIX}.tokens.{gateway_id}.*"
