"""Message schemas exchanged over NATS (subjects in `subjects.py`).

Every message carries `version` so a service can reject a schema it does not
understand instead of misreading it. Unknown fields are ignored (forward
compatibility); missing or mistyped required fields are a validation error.
"""

import re
import time
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel, model_validator

PROTOCOL_VERSION = 1


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=False)
    version: Literal[1] = PROTOCOL_VERSION


class Tier(StrEnum):
    """Where a block replica lives. `gpu` is engine memory (device memory, or
    the CPU engine's own memory on CPU-only workers)."""

    gpu = "gpu"
    host = "host"
    ssd = "ssd"


class ReplicaState(StrEnum):
    loading = "loading"
    ready = "ready"
    evicted = "evicted"


class InstanceState(StrEnum):
    loading = "loading"
    ready = "ready"
    draining = "draining"
    stopped = "stopped"
    failed = "failed"


class ModelState(StrEnum):
    deployed = "deployed"
    deleted = "deleted"


# --- RPC envelope -------------------------------------------------------------------


class ErrorReply(Message):
    """Any RPC may answer this instead of its reply model."""

    error: str
    # "busy": a worker with sharing=mesh refuses a generate request that would push a request past
    # its SLO (shadow validation); the gateway keeps the route and tries another or waits.
    code: Literal["invalid", "not_found", "conflict", "unavailable", "internal", "busy"] = "invalid"


# --- workers --------------------------------------------------------------------------


BandwidthLink = Literal["ssd_to_host", "host_to_device", "network_to_host"]


class Topology(BaseModel):
    host: str
    leaf: str = "leaf-0"
    scaleup_group: str = ""
    link_gbps: float = Field(default=10.0, gt=0)


class RegisterWorker(Message):
    worker_id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_\-]+$")
    data_address: str  # host:port of the data plane
    topology: Topology
    # tier name -> capacity in bytes
    capacities: dict[Tier, int]
    # Measured load bandwidth per link, GB/s (ServerlessLLM §6.2 estimator input); names follow
    # libs.planning.estimate.Bandwidths. A link not measured yet is absent.
    bandwidths_gbps: dict[BandwidthLink, float] = {}


class WorkerInfo(Message):
    worker_id: str
    data_address: str
    topology: Topology
    capacities: dict[Tier, int]
    bandwidths_gbps: dict[BandwidthLink, float] = {}
    state: Literal["alive", "dead"]
    last_heartbeat: float


class Heartbeat(RegisterWorker):
    """Sent every heartbeat interval; carries the registration so a registry
    that lost (or expired) the worker re-admits it without a round trip."""

    sent_at: float = Field(default_factory=time.time)
    instances: list[str] = []
    running_requests: int = 0


class WorkerExpired(Message):
    worker_id: str
    last_heartbeat: float


class WorkerExited(Message):
    """The process of a worker exited (its supervisor saw it): dead now, without waiting for
    its heartbeats to expire."""

    worker_id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_\-]+$")
    reason: str = ""


class WorkerUnreachable(Message):
    """A peer's data-plane connection to `worker_id` broke (it closed, reset, or refused a
    connect): the worker may be dead. The registry verifies before it declares the death
    (libs/planning/liveness.py): one peer's word alone never kills a live worker."""

    worker_id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_\-]+$")
    reporter: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_\-]+$")
    reason: str = Field(default="", max_length=500)


# --- models -----------------------------------------------------------------------------


class BlockInfo(BaseModel):
    block_id: int = Field(ge=0)
    nbytes: int = Field(ge=0)
    checksum: str
    layer_start: int
    layer_end: int


# How a deployment scales out (libs.planning.scaleout): layercast's own choice, or a
# baseline run in the same system.
ScalingMode = Literal["layercast", "chain", "chain-blind", "blitzscale", "blitzscale-fixed", "blitzscale-nopairs",
                      "binomial", "faasnet", "serverlessllm", "static", "ideal"]
# The multicast algorithms' names (libs.planning.multicast.MULTICAST_ALGORITHMS), as plans,
# scale-operation records (plan.algorithm) and TransferParts carry them; the registry also
# reads the aliases it lists ("kway" for binomial from k sources).
MulticastAlgorithmName = Literal["star", "binary-tree", "chain", "chain-blind", "binomial"]
# The load-monitor's scaling policies (libs.planning.autoscale.POLICIES).
ScalingPolicy = Literal["threshold", "concurrency", "slo"]
INT32_MAX = 2**31 - 1  # the registry's integer columns
# A deployment's name: what DeployModel takes, so no stored model (nor its profile) has another.
_MODEL_NAME_CHARS = r"[A-Za-z0-9_.:\-/]"
ModelName = Annotated[str, Field(min_length=1, max_length=128, pattern=rf"^{_MODEL_NAME_CHARS}+$")]
MODEL_NAME = re.compile(rf"{_MODEL_NAME_CHARS}{{1,128}}")  # ModelName's rule, for a name not in a message


def is_model_name(name: str) -> bool:
    return MODEL_NAME.fullmatch(name) is not None


class DeployModel(Message):
    name: ModelName
    path: str
    arch: str
    n_layers: int = Field(ge=1)
    blocks: list[BlockInfo] = Field(min_length=1)
    # (The registry stores these counts as 32-bit integers: a larger one would overflow there.)
    min_instances: int = Field(default=0, ge=0, le=INT32_MAX)
    max_instances: int = Field(default=4, ge=1, le=INT32_MAX)
    keep_alive_s: float = Field(default=60.0, ge=0)
    max_queue: int = Field(default=256, ge=1, le=INT32_MAX)
    scaling_mode: ScalingMode = "layercast"
    policy: ScalingPolicy = "concurrency"
    # Checked against the policy (libs.planning.autoscale.check_policy) by the gateway and the registry.
    policy_params: dict[str, float] = Field(default_factory=dict)
    # LLM-Mesh SLOs of the deployment (headroom scheduling, shadow validation): the first token
    # within ttft_slo_s (None: the paper's max(2, prompt tokens / 512) s), each next one within
    # tpot_slo_s on average (ST + TTFT_SLO + TPOT_SLO * O, eq. 1).
    ttft_slo_s: float | None = Field(default=None, gt=0)
    tpot_slo_s: float = Field(default=0.25, gt=0)


class ModelInfo(DeployModel):
    state: ModelState
    created_at: float

    @property
    def total_bytes(self) -> int:
        return sum(b.nbytes for b in self.blocks)


class ModelRef(Message):
    name: str


class ListModels(Message):
    include_deleted: bool = False


class ModelList(Message):
    models: list[ModelInfo]


class ModelEvent(Message):
    kind: Literal["deployed", "deleted"]
    model: ModelInfo


# --- replicas, instances, scale operations -----------------------------------------------------


class ReplicaInfo(BaseModel):
    model: str
    block_id: int
    worker_id: str
    tier: Tier
    state: ReplicaState


class BlockEvent(Message):
    """A worker's block replica changed: arrived (ready), started loading, or evicted.

    `tier: ssd` (ready): the model's checkpoint is on the worker's local disk (a deployed model's
    path it can read, under its --local-checkpoints directories when given), so a load there
    reads it locally: the planner's load-time estimate (ServerlessLLM §6.2) tells such a worker
    from one that has nothing."""

    model: str
    block_id: int
    worker_id: str
    tier: Tier
    state: ReplicaState
    nbytes: int = 0
    seconds: float = 0.0  # time the load/transfer of this block took
    scale_op_id: str | None = None
    # A block made ready in engine memory (tier gpu): the tier it was loaded from (host or ssd).
    from_tier: Tier | None = None


class Stage(BaseModel):
    """One stage of an instance: a worker running blocks [block_start, block_end)."""

    worker_id: str
    block_start: int
    block_end: int


class InstanceInfo(Message):
    instance_id: str
    model: str
    mode: Literal["local", "pipeline"] = "local"
    stages: list[Stage]
    state: InstanceState
    created_at: float
    ready_at: float | None = None  # serving (with serve-while-loading: from its first block)
    loaded_at: float | None = None  # every block in engine memory
    scale_op_id: str | None = None
    # Requests its engine runs at once (its KV slots); the gateway sends it no more, so a burst
    # waits at the gateway for the first free slot anywhere, not in one engine's queue.
    max_batch: int | None = Field(default=None, ge=1)
    # The device kind its entry worker runs it on: "cpu" or "cuda" (LLM-Mesh: profiles are per
    # kind, and with sharing=mesh the gateway tries CPU instances first).
    device: Literal["cpu", "cuda"] = "cpu"

    @property
    def entry_worker(self) -> str:
        return self.stages[0].worker_id


class CreateInstance(Message):
    instance_id: str
    model: str
    stages: list[Stage] = Field(min_length=1)
    scale_op_id: str | None = None
    # Its entry worker's device kind, when the creator knows it (the worker's events say it anyway).
    device: Literal["cpu", "cuda"] = "cpu"


class InstanceEvent(Message):
    instance: InstanceInfo
    reason: str = ""
    # A retiring execution pipeline (λScale §4.4 mode switch): the local instances its requests
    # move to. The gateway hands them over (KV recompute) without counting it as a failure.
    switched_to: list[str] = []


class ScaleOpInfo(Message):
    scale_op_id: str
    model: str
    direction: Literal["up", "down"]
    reason: str
    from_instances: int
    to_instances: int
    state: Literal["planned", "running", "done", "failed", "aborted"]
    plan: dict = {}
    # event name -> unix time: decided, first_byte, block:<worker>:<id>, ready:<instance>, done
    timings: dict[str, float] = {}
    error: str | None = None


class RecordScaleOp(ScaleOpInfo):
    pass


class GetCluster(Message):
    include_dead: bool = False
    recent_scale_ops: int = Field(default=20, ge=0, le=1000)


class LivePairInfo(BaseModel):
    """A live pair the planner formed: `source_instance` on `source_worker` offloads its prefills'
    first blocks to `target_instance` on `target_worker`, which is still receiving the model."""

    source_instance: str
    source_worker: str
    target_instance: str
    target_worker: str
    scale_op_id: str | None = None


class ClusterView(Message):
    workers: list[WorkerInfo]
    models: list[ModelInfo]
    replicas: list[ReplicaInfo]
    instances: list[InstanceInfo]
    scale_ops: list[ScaleOpInfo]
    # Live pairs open now (BlitzScale §5.2). The registry leaves this empty: the planner adds the
    # pairs its own open scale operations formed (the only sender of FormLivePair) to the view it
    # decides on, so a pair's workers are pruned as chain sources (scaleout.live_pair_workers).
    live_pairs: list[LivePairInfo] = []
    # The registry's change count when the view was read (see ClusterChanged): the view holds at
    # least every change up to it. `epoch` names the registry process that counted.
    epoch: str = ""
    changes: int = Field(default=0, ge=0)


class ClusterChanged(Message):
    """Registry -> planner: workers, models, replicas or instances changed (scale-op records and
    heartbeat times are not counted). A ClusterView with the same epoch and at least these
    changes is current; a planner keeps one between decisions instead of asking each time."""

    epoch: str
    changes: int = Field(ge=0)


# --- API keys and usage (tenants) ------------------------------------------------------------

# The gateway's keys from its environment (LAYERCAST_API_KEYS): every model, no limits; their
# usage is accounted under this key id and name.
STATIC_KEY_ID = "static"
KeyName = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:@\-]+$")]
# A key's per-minute limit: the registry stores it as a 32-bit integer (a larger one would overflow there).
PerMinuteLimit = Annotated[int, Field(ge=1, le=INT32_MAX)]


class CreateApiKey(Message):
    """Gateway -> registry. The gateway makes the secret and sends only its SHA-256: the secret
    is shown to the admin once and stored nowhere."""

    name: KeyName
    key_hash: str = Field(pattern=r"^[0-9a-f]{64}$")
    prefix: str = Field(max_length=16)  # the secret's first characters, to tell keys apart
    models: list[str] | None = None  # None: every model
    requests_per_minute: PerMinuteLimit | None = None  # None: unlimited
    tokens_per_minute: PerMinuteLimit | None = None


class ApiKeyInfo(Message):
    """A key as the registry holds it: never the secret, and only the gateway sees its hash."""

    key_id: str
    name: str
    prefix: str
    models: list[str] | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    created_at: float
    revoked_at: float | None = None


class ListApiKeys(Message):
    include_revoked: bool = False


class ApiKeyList(Message):
    keys: list[ApiKeyInfo]


class ApiKeyRef(Message):
    key_id: str = Field(min_length=1, max_length=64)


class LookupApiKey(Message):
    key_hash: str = Field(pattern=r"^[0-9a-f]{64}$")


class UsageEntry(BaseModel):
    """Tokens used by one key on one model: a batch's increments, or a running total."""

    key_id: str = Field(min_length=1, max_length=64)  # "static" for the gateway's static keys
    model: str = Field(min_length=1, max_length=128)
    requests: int = Field(default=0, ge=0)
    prompt_tokens: int = Field(default=0, ge=0)
    completion_tokens: int = Field(default=0, ge=0)
    key_name: str = ""  # in reports


class RecordUsage(Message):
    entries: list[UsageEntry] = Field(max_length=10_000)


class UsageRecorded(Message):
    entries: int = Field(ge=0)


class GetUsage(Message):
    key: str | None = None  # a key id or name; None: every key
    model: str | None = None


class UsageReport(Message):
    usage: list[UsageEntry]


# --- worker commands --------------------------------------------------------------------------


# --- LLM-Mesh performance profiles (§5.2) -------------------------------------------------------


class ModelProfile(Message):
    """One model's measured iteration times on one device kind (libs.planning.mesh.Profile):
    prefill seconds per prompt length, decode-iteration seconds per batch size x mean sequence
    length, sampled at powers of two."""

    model: str
    device: Literal["cpu", "cuda"]
    prefill_lengths: list[int] = Field(min_length=1)
    prefill_s: list[float] = Field(min_length=1)
    batches: list[int] = Field(min_length=1)
    lengths: list[int] = Field(min_length=1)
    decode_s: list[list[float]] = Field(min_length=1)
    measured_at: float = Field(default_factory=time.time)
    source: str = ""  # who measured it: a worker id, or "cli"


class ProfileRef(Message):
    model: str
    device: Literal["cpu", "cuda"]


class LoadModel(Message):
    """Planner -> worker: become (part of) an instance by loading blocks from
    the nearest tier the worker has them in (gpu > host > ssd)."""

    op: Literal["load"] = "load"
    instance_id: str
    model: str
    path: str
    block_start: int
    block_end: int
    scale_op_id: str | None = None
    # Blocks a running transfer is bringing: wait for them instead of reading them from disk
    # (a failed transfer leaves the rest to the disk).
    incoming_transfer: str | None = None
    # The `ideal` scaling mode's lower bound: the blocks count as already in engine memory, so
    # no host-to-device copy is paced (emulation) for them.
    preheld: bool = False
    # Serve from the first block on (the forward pass waits for blocks still on their way);
    # False: stop-the-world, ready only once every block is loaded (the serverlessllm baseline).
    serve_while_loading: bool = True


class StartPipeline(Message):
    """Planner -> each stage worker of an execution pipeline (λScale §4.3): serve blocks
    [block_start, block_end) of the blocks already in engine memory as stage i of
    `instance_id`. Stage 0 (the entry) runs the engine, batching and sampling and calls the
    others over the data plane (their addresses in `peers`); it is sent last, once the
    others host their stages."""

    op: Literal["pipeline"] = "pipeline"
    instance_id: str
    model: str
    path: str
    stages: list[Stage] = Field(min_length=2)
    peers: dict[str, str]  # stage worker -> data-plane address
    scale_op_id: str | None = None

    @model_validator(mode="after")
    def _consistent(self) -> "StartPipeline":
        workers = [s.worker_id for s in self.stages]
        if len(set(workers)) != len(workers):
            raise ValueError("a worker runs one stage of a pipeline")
        if self.stages[0].block_start != 0 or any(a.block_end != b.block_start
                                                  for a, b in zip(self.stages, self.stages[1:])):
            raise ValueError("stages must cover the blocks from 0 in order, without gaps")
        if any(s.block_start >= s.block_end for s in self.stages):
            raise ValueError("a stage runs at least one block")
        if missing := set(workers) - set(self.peers):
            raise ValueError(f"no data-plane address for {sorted(missing)}")
        return self


class FetchBlocks(Message):
    """Planner -> worker: read blocks from disk into the host tier (the parameter pool, or an
    `ideal` deployment's pre-held copy). `keep` pins them there until a ReleaseBlocks."""

    op: Literal["fetch"] = "fetch"
    model: str
    path: str
    blocks: list[int] = Field(min_length=1)
    keep: bool = True


class ReleaseBlocks(Message):
    """Planner -> worker: blocks kept by a FetchBlocks may be evicted again."""

    op: Literal["release"] = "release"
    model: str
    blocks: list[int] = Field(min_length=1)


class CancelTransfer(Message):
    """Planner -> worker: stop a transfer part now (another worker refused its part, so the
    multicast cannot complete). Its receivers read from disk what did not arrive; the part, if it
    arrives later, is refused."""

    op: Literal["cancel_transfer"] = "cancel_transfer"
    transfer_id: str
    reason: str = ""


class UnloadModel(Message):
    """Planner -> worker: stop serving an instance once in-flight requests end (of a pipeline:
    stop hosting its stage). Blocks stay in the host tier (bounded cache) so a later start is warm."""

    op: Literal["unload"] = "unload"
    instance_id: str
    drain_timeout_s: float = 30.0
    scale_op_id: str | None = None
    # The blocks leave the host tier this long after the instance stops, unless in use again
    # (the `serverlessllm` mode's host-cache keep-alive); None: only the LRU bound evicts them.
    host_keep_alive_s: float | None = Field(default=None, ge=0)
    # A pipeline's mode switch (λScale §4.4) to these local instances: the step in flight
    # finishes and its tokens go out (work done is not thrown away), then the pipeline stops and
    # its unfinished requests move on. Empty: a stop that waits for no stage (one may be gone).
    switched_to: list[str] = Field(default_factory=list)


class TransferHop(BaseModel):
    """One line of a worker's part of a multicast: in `step`, `block` goes to / comes from `peer`."""

    step: int = Field(ge=0)
    peer: str = Field(min_length=1)
    block: int = Field(ge=0)


class TransferPart(Message):
    """Planner -> worker: this worker's part of one block multicast (libs/transfer executes it).

    Sends are done in order, each as soon as the worker holds the block (data-driven, no
    barrier per step); every received block is verified against its checksum and
    announced with a BlockEvent the moment it is complete. A TransferReport ends the part.
    The worker acks once it is ready to receive, so a planner that sends parts to
    receivers before sources times the multicast from the first byte.
    """

    op: Literal["transfer"] = "transfer"
    transfer_id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_\-.:]+$")
    model: str
    algorithm: str = ""  # a MulticastAlgorithmName, or "gather" (blocks collected from their holders); a label
    blocks: list[BlockInfo] = Field(min_length=1)  # every block the part touches: sizes and checksums
    peers: dict[str, str]  # worker id -> data-plane address, for every peer named in sends/receives
    sends: list[TransferHop] = []
    receives: list[TransferHop] = []
    chunk_bytes: int = Field(default=1 << 20, ge=4096, le=64 << 20)
    stall_timeout_s: float = Field(default=30.0, gt=0)
    scale_op_id: str | None = None

    @model_validator(mode="after")
    def _consistent(self) -> "TransferPart":
        known = {b.block_id for b in self.blocks}
        for hop in [*self.sends, *self.receives]:
            if hop.block not in known:
                raise ValueError(f"hop names block {hop.block}, which is not in blocks")
            if hop.peer not in self.peers:
                raise ValueError(f"hop names peer {hop.peer!r}, which has no address in peers")
        received = [h.block for h in self.receives]
        if len(received) != len(set(received)):
            raise ValueError("a block is received more than once")
        return self


class FormLivePair(Message):
    """Planner -> both workers of a live pair (BlitzScale §5.2): `source_instance` (serving every
    block, overloaded) offloads the first blocks of its prefills to `target_instance` (still
    loading the model, stop-the-world) over the data plane (`peers`: both workers' addresses);
    the split is chosen per batch (ZigZag), the KV of the target's blocks comes back with the
    hidden state, and the source decodes alone. Sent to the target first, then the source (as
    StartPipeline's stages). The pair dissolves by itself once the target holds every block."""

    op: Literal["live_pair"] = "live_pair"
    model: str
    path: str
    source_instance: str
    source_worker: str
    target_instance: str
    target_worker: str
    peers: dict[str, str]  # both workers -> data-plane address
    # Blocks a batch may run on the target at most (None: half the model, BlitzScale's best-effort cap).
    max_target_blocks: int | None = Field(default=None, ge=1)
    scale_op_id: str | None = None
    # How the source splits each prefill batch (libs.planning.livepair.SPLIT_POLICIES): "zigzag"
    # at run time, or "fixed" (the first split the target allows, kept: the comparison).
    split: Literal["zigzag", "fixed"] = "zigzag"

    @model_validator(mode="after")
    def _two_workers(self) -> "FormLivePair":
        if self.source_worker == self.target_worker:
            raise ValueError("a live pair's two instances are on two workers")
        if missing := {self.source_worker, self.target_worker} - set(self.peers):
            raise ValueError(f"no data-plane address for {sorted(missing)}")
        return self


class EndLivePair(Message):
    """Worker -> the other worker of a live pair: the pair of `instance_id` (the receiver's) is over
    (the target holds every block, or the sender's instance stopped or failed)."""

    op: Literal["end_live_pair"] = "end_live_pair"
    instance_id: str
    reason: str = ""


class WorkerCommand(RootModel[Annotated[LoadModel | UnloadModel | TransferPart | CancelTransfer | FetchBlocks
                                         | ReleaseBlocks | StartPipeline | FormLivePair | EndLivePair,
                                         Field(discriminator="op")]]):
    """What arrives on subjects.worker_command(...): a LoadModel, an UnloadModel, a TransferPart,
    a CancelTransfer, a FetchBlocks, a ReleaseBlocks, a StartPipeline, a FormLivePair or an
    EndLivePair."""


class CommandAck(Message):
    accepted: bool
    detail: str = ""


class RdmaConnect(Message):
    """Worker -> worker: RDMA queue-pair connection data (libs/transfer/rdma/codec.py ConnectionInfo).

    The reply is another RdmaConnect carrying the answering worker's data.
    """

    node_id: str
    info: dict


class TransferReport(Message):
    """Worker -> planner (and benchmarks): how a worker's part of a multicast ended.

    Times are wall-clock (time.time()), so parts reported by workers on one host, or on
    hosts with synchronised clocks, line up.
    """

    transfer_id: str
    worker_id: str
    model: str
    ok: bool
    error: str | None = None
    started_at: float
    finished_at: float
    block_arrived_at: dict[int, float] = {}
    first_byte_at: float | None = None  # the first received byte landed
    bytes_sent: int = 0
    bytes_received: int = 0
    scale_op_id: str | None = None


# --- generation ---------------------------------------------------------------------------------


# Numbers as JSON has them: a boolean or a numeric string is refused, not read as 1 or 0; and
# finite (1e999 parses as inf: a repetition penalty of inf made the sampler's logits NaN).
_Int = Annotated[int, Field(strict=True)]
_Float = Annotated[float, Field(strict=True, allow_inf_nan=False)]


GREEDY_BELOW = 1e-5  # a temperature: vLLM's _SAMPLING_EPS


class SamplingParameters(BaseModel):
    """How each next token is chosen: the OpenAI (and vLLM) sampling parameters, declared and
    validated here once. The gateway's request bodies are made of them (services/gateway/schemas.py:
    a value out of range is a 400 naming it), the engine's sampler reads them as they are
    (libs/engine/sampling.py)."""

    temperature: _Float = Field(default=1.0, ge=0.0, le=2.0)  # 0: greedy
    top_p: _Float = Field(default=1.0, gt=0.0, le=1.0)  # nucleus: the smallest prefix with this mass
    # vLLM's: only the tokens at least min_p times as likely as the likeliest one (0: off).
    min_p: _Float = Field(default=0.0, ge=0.0, le=1.0)
    seed: _Int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)  # same seed, prompt, model: same tokens
    presence_penalty: _Float = Field(default=0.0, ge=-2.0, le=2.0)  # OpenAI: logit -= p * (count > 0), output
    frequency_penalty: _Float = Field(default=0.0, ge=-2.0, le=2.0)  # OpenAI: logit -= f * count, output
    # vLLM's extension (HF's definition): over prompt and output, logit / r if > 0 else logit * r.
    repetition_penalty: _Float = Field(default=1.0, gt=0.0)
    # Completions of the prompt, each its own stream of TokenEvents (`choice`); the prompt is
    # prefilled once. Each choice takes a KV slot: the gateway bounds n.
    n: _Int = Field(default=1, ge=1)


class SamplingSpec(SamplingParameters):
    """A request's sampling as the engine runs it: the parameters as the client gave them, and
    what the gateway resolved for it (`to_sampling_spec` of its request bodies)."""

    max_tokens: _Int = Field(default=16, ge=1)  # fitted to the model's context by the gateway
    stop_token_ids: tuple[Annotated[_Int, Field(ge=0)], ...] = ()  # the model's end-of-sequence ids
    # None: no logprobs; k: each token's logprob and its k most likely alternatives.
    logprobs: _Int | None = Field(default=None, ge=0, le=20)
    # Constrained decoding (response_format, tools): an llguidance grammar, built and validated by
    # the gateway; the entry worker masks each step's logits with it. None: unconstrained.
    grammar: Annotated[str, Field(min_length=1)] | None = None

    @property
    def greedy(self) -> bool:
        # vLLM's: a temperature below 1e-5 is greedy (a smaller one is 0 in float32: no sampler could divide by it).
        return self.temperature < GREEDY_BELOW


class GenerateRequest(Message):
    request_id: str
    instance_id: str
    model: str
    prompt_ids: list[int] = Field(min_length=1)
    sampling: SamplingSpec
    reply_subject: str
    # Hand-over (KV recompute): tokens this request already generated elsewhere. The worker
    # rebuilds the KV cache with one prefill and streams from token index len(generated_ids).
    generated_ids: list[int] = []
    # The hand-over of an n > 1 request (generated_ids is for n = 1): the choices still running
    # and the tokens each generated already. Empty: all n choices from the start.
    choices: dict[int, list[int]] = {}
    # The deployment's SLOs (DeployModel.ttft_slo_s, tpot_slo_s), for the worker's headroom
    # scheduler and shadow validation. None: the paper's defaults. A worker with sharing=mesh
    # that cannot take the request within them answers the RPC with code "busy" (the gateway
    # tries another instance, or waits).
    ttft_slo_s: float | None = Field(default=None, gt=0)
    tpot_slo_s: float | None = Field(default=None, gt=0)
    # Seconds the request has waited at the gateway before this attempt (refusals included). Past
    # its TTFT SLO it cannot be on time anywhere: a mesh worker then refuses it only to keep the
    # other requests on time, not for its own lateness.
    queued_s: float = Field(default=0.0, ge=0)
    # This hand-off's id among the request's attempts (the gateway numbers them): a CancelRequest
    # naming it stops exactly this attempt, even one whose generate reaches the worker after
    # the cancel (the gateway gave up waiting for its answer and tried elsewhere).
    attempt: int = Field(default=0, ge=0)


class GenerateAccepted(Message):
    request_id: str
    queued: int = 0


class CancelRequest(Message):
    request_id: str
    # The instance it ran on (a hand-over may move it to another instance of the same worker);
    # None: wherever it runs on this worker.
    instance_id: str | None = None
    # GenerateRequest.attempt: cancel that attempt only, and refuse its generate if it has not
    # come yet. None: whichever attempt runs here.
    attempt: int | None = Field(default=None, ge=0)


class TokenEvent(Message):
    request_id: str
    index: int  # 0-based position in the completion; lets the gateway detect loss
    token_id: int | None = None
    finished: bool = False
    finish_reason: Literal["stop", "length", "cancelled", "error"] | None = None
    prompt_tokens: int = 0
    error: str | None = None
    # With `error`: the worker moved the request out (sharing=mesh preemption, LLM-Mesh §7.1), a
    # planned hand-over rather than a failure.
    preempted: bool = False
    # The instance that sent it: after a hand-over the gateway drops whatever the instance it
    # left still sends (a late token, or the error of the failure it already handled).
    instance_id: str | None = None
    # GenerateRequest.attempt of the run that sent it: after a hand-over back to the same
    # instance, the old run's late tokens carry the old attempt and are dropped. None: not
    # said (a worker from before attempts were echoed; the gateway then goes by instance_id).
    attempt: int | None = Field(default=None, ge=0)
    # With SamplingSpec.logprobs: the token's logprob (the model's log-softmax) and the top
    # (token id, logprob) pairs, most likely first.
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = []
    # Which of the request's n choices this token is of (`index` counts per choice; each choice
    # ends with its own finished event, the request once all have).
    choice: int = Field(default=0, ge=0)


# --- metrics and scaling -------------------------------------------------------------------------


class ModelLoad(BaseModel):
    model: str
    queued: int = Field(ge=0)  # waiting at the gateway for an instance slot
    in_flight: int = Field(ge=0)  # dispatched to an instance, not finished
    arrivals: int = Field(ge=0)  # new requests since the previous report
    ready_instances: int = Field(ge=0)
    last_request_at: float | None = None
    ttft_s: list[float] = []  # samples since the previous report
    # The load-monitor's demand in tokens/s (libs.planning.demand): completion tokens streamed
    # since the previous report, over GatewayMetrics.interval_s, plus the output tokens
    # (max_tokens x n) the queued requests asked for.
    tokens_generated: int = Field(0, ge=0)
    queued_tokens: int = Field(0, ge=0)
    # Per request finished since the previous report: (last token - first token) / (tokens - 1).
    tpot_s: list[float] = []


class GatewayMetrics(Message):
    gateway_id: str
    sent_at: float = Field(default_factory=time.time)
    models: list[ModelLoad]
    # Seconds since this gateway's previous report: what the per-report deltas cover (None:
    # an old sender, or the first report; no served rate then).
    interval_s: float | None = Field(default=None, ge=0)


class WorkerMetrics(Message):
    worker_id: str
    sent_at: float = Field(default_factory=time.time)
    running_requests: int = 0
    tokens_per_s: float = 0.0
    instances: list[str] = []
    # Requests it refused as busy since its last report (sharing=mesh: shadow validation, or no
    # memory for their KV); the planner puts no more instances on a worker that refuses.
    busy_refusals: int = Field(0, ge=0)


class ScaleRequest(Message):
    """Desired state, not a delta: repeating it is harmless, the planner reconciles."""

    model: str
    desired_instances: int = Field(ge=0)
    reason: str
    sent_at: float = Field(default_factory=time.time)
