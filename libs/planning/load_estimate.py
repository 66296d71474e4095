"""ServerlessLLM §6.2's load-time estimate for scale-out targets, from the registry's view.

libs.planning.estimate holds the estimator; this module feeds it what the registry knows:
each worker's measured per-link bandwidths (`WorkerInfo.bandwidths_gbps`, defaults until a link
is measured), where the model's blocks are on that worker (the nearest ready replica: engine
memory, host memory, its local disk; elsewhere: the network), and its loading queue q, the
work still left in the loads running there (instances loading, or serving while they load).

Pure functions of the view; the planner ranks targets by the result (placement.pick_targets).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

from libs.planning.estimate import Bandwidths, ModelSpec, Tier, WorkerView, load_time
from libs.protocol import messages as m

# Until a worker has measured a link: a PCIe 4.0 x16 host-to-device copy, an NVMe SSD read.
# The network link defaults to the worker's advertised link speed (Topology.link_gbps).
DEFAULT_HOST_TO_DEVICE_GBPS = 25.0
DEFAULT_SSD_TO_HOST_GBPS = 3.0

# The registry's tiers as the estimator names them.
_TIERS = {m.Tier.gpu: Tier.DEVICE, m.Tier.host: Tier.HOST, m.Tier.ssd: Tier.SSD}
_RANK = (Tier.DEVICE, Tier.HOST, Tier.SSD, Tier.NETWORK)


def worker_bandwidths(worker: m.WorkerInfo) -> Bandwidths:
    """The worker's measured bandwidths (GB/s in the registry) as the estimator's bytes/s."""
    gbps = worker.bandwidths_gbps
    return Bandwidths(
        host_to_device=gbps.get("host_to_device", DEFAULT_HOST_TO_DEVICE_GBPS) * 1e9,
        ssd_to_host=gbps.get("ssd_to_host", DEFAULT_SSD_TO_HOST_GBPS) * 1e9,
        network_to_host=gbps.get("network_to_host", worker.topology.link_gbps / 8) * 1e9,
    )


def model_spec(model: m.ModelInfo, block_start: int = 0, block_end: int | None = None) -> ModelSpec:
    """The model's blocks (by block id) as the estimator sees them; blocks outside
    [block_start, block_end) weigh nothing (a stage that loads only its range)."""
    n = max((b.block_id for b in model.blocks), default=-1) + 1
    sizes = [0] * n
    end = n if block_end is None else block_end
    for b in model.blocks:
        if block_start <= b.block_id < end:
            sizes[b.block_id] = b.nbytes
    return ModelSpec(name=model.name, block_bytes=tuple(sizes))


def nearest_tiers(replicas: Iterable[m.ReplicaInfo]) -> dict[str, dict[str, dict[int, Tier]]]:
    """worker -> model -> block -> the nearest tier a ready replica of it is in there."""
    out: dict[str, dict[str, dict[int, Tier]]] = {}
    ready = m.ReplicaState.ready  # looked up once: the view holds every worker's replicas
    for r in replicas:
        tier = _TIERS.get(r.tier)
        if tier is None or r.state != ready:
            continue
        blocks = out.setdefault(r.worker_id, {}).setdefault(r.model, {})
        held = blocks.get(r.block_id)
        if held is None or _RANK.index(tier) < _RANK.index(held):
            blocks[r.block_id] = tier
    return out


def loading_here(instance: m.InstanceInfo) -> bool:
    """Whether the instance's load still runs: loading, or serving while it loads."""
    return instance.mode == "local" and (
        instance.state == m.InstanceState.loading
        or (instance.state == m.InstanceState.ready and instance.loaded_at is None))


def running_loads(view: m.ClusterView) -> dict[str, list[ModelSpec]]:
    """worker -> the loads running there (each the blocks of its stage)."""
    models = {x.name: x for x in view.models}
    out: dict[str, list[ModelSpec]] = {}
    for inst in view.instances:
        model = models.get(inst.model)
        if model is None or not loading_here(inst):
            continue
        for stage in inst.stages:
            out.setdefault(stage.worker_id, []).append(model_spec(model, stage.block_start, stage.block_end))
    return out


def queue_s(worker: WorkerView, loads: Iterable[ModelSpec]) -> float:
    """q (§6.2): the time the loads running on the worker still take. Loads on one worker
    are sequential (§6.2 (i)), so a new one waits for them: each one's blocks not yet in engine
    memory there, from the tier each sits in."""
    return sum(load_time(worker, spec) for spec in loads)


def worker_views(view: m.ClusterView, workers: Iterable[str]) -> dict[str, WorkerView]:
    """The estimator's view of each of `workers` in the registry's view: its bandwidths, where
    blocks are, its queue."""
    by_id: Mapping[str, m.WorkerInfo] = {w.worker_id: w for w in view.workers}
    tiers, loads = nearest_tiers(view.replicas), running_loads(view)
    out: dict[str, WorkerView] = {}
    for w in workers:
        if w not in by_id:
            continue
        # free_gpus: not the planner's concern here (it passes only workers free for the model).
        bare = WorkerView(id=w, bandwidth=worker_bandwidths(by_id[w]), free_gpus=1, blocks=tiers.get(w, {}))
        out[w] = replace(bare, queue_s=queue_s(bare, loads.get(w, ())))
    return out


def estimated_load_s(view: m.ClusterView, model: m.ModelInfo, workers: Iterable[str]) -> dict[str, float]:
    """worker -> estimated seconds until the whole model is in its engine memory (§6.2:
    q + the bytes from each block's nearest tier over that path's slowest link)."""
    spec = model_spec(model)
    return {w: load_time(wv, spec) for w, wv in worker_views(view, workers).items()}
