"""The worker's sharing strategy: chosen once by name, and what each one does through the
`Sharing` protocol (services/worker/sharing.py), with fake ports instead of a worker."""

from dataclasses import dataclass, field

import pytest

from libs.planning.mesh import Profile
from libs.planning.sharing import SHARINGS
from libs.protocol import messages as m
from services.worker.loading import Instance
from services.worker.service import WorkerConfig, WorkerService
from services.worker.sharing import (
    EVICT_DRAIN_TIMEOUT_S,
    STRATEGIES,
    DedicatedSharing,
    EngineSizing,
    ExclusiveSharing,
    MeshSharing,
    WorkerPorts,
    make_sharing,
)


@dataclass
class _Config:
    sharing: str = "exclusive"
    worker_id: str = "w1"
    device: str = "cpu"
    max_batch_size: int = 8
    max_seq_len: int = 256
    kv_cache_bytes: int = 1 << 20
    kv_min_slots: int = 0
    kv_watermark: float = 0.2
    profile_max_len: int = 64
    shadow_validation: bool = True
    preemption: bool = True
    profile_refresh_s: float = 0.0


@dataclass
class _Ports:
    instances: dict = field(default_factory=dict)
    requests: dict = field(default_factory=dict)
    capacity_asked: int = 0

    def ports(self) -> WorkerPorts:
        def capacity() -> int:
            self.capacity_asked += 1
            return 1 << 30

        return WorkerPorts(broker=None, instances=self.instances, requests=self.requests,
                           engine_thread=lambda: None, blocks_in_engine=lambda model: {}, memory_capacity=capacity)


def _instance(iid: str = "i1", model: str = "m") -> Instance:
    info = m.InstanceInfo(instance_id=iid, model=model, stages=[m.Stage(worker_id="w1", block_start=0, block_end=1)],
                          state=m.InstanceState.ready, created_at=0.0)
    return Instance(info=info, path="/nowhere", keys=[])


def _request(iid: str = "i1", queued_s: float = 0.0, generated: list[int] = ()) -> m.GenerateRequest:
    return m.GenerateRequest(request_id="r1", instance_id=iid, model="m", prompt_ids=[1, 2, 3],
                             sampling=m.SamplingSpec(max_tokens=4), reply_subject="reply", ttft_slo_s=1.0,
                             tpot_slo_s=0.5, queued_s=queued_s, generated_ids=list(generated))


class _Detach:
    def __init__(self):
        self.calls = 0

    async def __call__(self) -> None:
        self.calls += 1


def test_every_sharing_setting_has_a_worker_strategy():
    assert set(STRATEGIES) == set(SHARINGS)


def test_an_unknown_sharing_name_is_a_clear_error():
    with pytest.raises(ValueError, match="sharing must be one of exclusive, mesh, dedicated, got 'spread'"):
        make_sharing(_Config(sharing="spread"), _Ports().ports())


def test_the_strategy_is_chosen_by_name():
    fake = _Ports()
    exclusive = make_sharing(_Config(sharing="exclusive"), fake.ports())
    assert isinstance(exclusive, ExclusiveSharing) and exclusive.schedule == "turns"
    assert fake.capacity_asked == 0  # exclusive budgets nothing: it never measures the memory
    mesh = make_sharing(_Config(sharing="mesh"), fake.ports())
    assert isinstance(mesh, MeshSharing) and mesh.schedule == "headroom"
    assert fake.capacity_asked == 1 and mesh.memory.capacity == 1 << 30


async def test_exclusive_admits_everything_and_charges_nothing():
    config = _Config()
    sharing = make_sharing(config, _Ports().ports())
    inst = _instance()
    admission = sharing.admit(inst, _request(), {0: []}, now=0.0)
    assert admission.ok and admission.preempt == () and admission.admitted is None
    assert await sharing.fit_kv(inst)
    assert await sharing.charge_load("i1", index=None) == EngineSizing(config.max_batch_size, config.kv_cache_bytes)
    assert sharing.periodic() == []
    detach = _Detach()
    await sharing.release(inst, detach)
    assert detach.calls == 1


def _slow_profile() -> Profile:
    # A prefill of 10 s: no request with a TTFT SLO of 1 s is on time here.
    return Profile(prefill_lengths=(1, 512), prefill_s=(10.0, 10.0), batches=(1, 8), lengths=(1, 512),
                   decode_s=((0.001, 0.001), (0.001, 0.001)))


async def test_mesh_refuses_by_shadow_validation_and_admits_an_overdue_request():
    fake = _Ports()
    sharing = make_sharing(_Config(sharing="mesh"), fake.ports())
    inst = _instance()
    fake.instances["i1"] = inst
    assert sharing.admit(inst, _request(), {0: []}, now=0.0).admitted is not None  # no profile yet: unvalidated
    sharing.node.profiles["m"] = _slow_profile()
    refused = sharing.admit(inst, _request(), {0: []}, now=0.0)
    assert not refused.ok and refused.why.startswith("new_prefill_late: ")
    # Past its TTFT SLO already at the gateway: refusing it for its own lateness would only make it later.
    overdue = sharing.admit(inst, _request(queued_s=2.0), {0: []}, now=5.0)
    assert overdue.ok and overdue.admitted.start == 5.0 and overdue.admitted.slo.ttft_s == 1.0


async def test_mesh_admission_records_whether_a_request_may_be_moved_again():
    sharing = make_sharing(_Config(sharing="mesh", shadow_validation=False), _Ports().ports())
    inst = _instance()
    fresh = sharing.admit(inst, _request(), {0: []}, now=0.0)
    resumed = sharing.admit(inst, _request(generated=[7]), {0: [7]}, now=0.0)
    assert fresh.admitted.movable and not resumed.admitted.movable


def test_mesh_runs_the_refreshes_its_settings_ask_for():
    whats = lambda config: [what for _, _, what in make_sharing(config, _Ports().ports()).periodic()]  # noqa: E731
    assert whats(_Config(sharing="mesh")) == ["models served elsewhere"]
    assert whats(_Config(sharing="mesh", preemption=False)) == []
    assert whats(_Config(sharing="mesh", shadow_validation=False, profile_refresh_s=3.0)) == ["profile refresh"]


async def test_mesh_releases_a_charged_instance_with_its_engine_and_only_detaches_the_others():
    sharing = make_sharing(_Config(sharing="mesh"), _Ports().ports())
    pipeline = _instance("p1")  # nothing charged: no engine of the mesh's
    detach = _Detach()
    await sharing.release(pipeline, detach)
    assert detach.calls == 1
    charged = _instance("i1")
    await sharing.memory.change("i1:weights", 1000)
    await sharing.memory.change("i1:kv", 500)
    charged.engine = object()  # the mesh's hold on it (set by `attached`)
    detach = _Detach()
    await sharing.release(charged, detach)
    assert detach.calls == 1 and charged.engine is None
    assert sharing.memory.available == sharing.memory.capacity


def test_the_worker_takes_the_strategy_of_its_sharing_setting():
    with pytest.raises(ValueError, match="sharing must be one of exclusive, mesh, dedicated, got 'spread'"):
        WorkerService(WorkerConfig("w-spread", sharing="spread"))
    assert isinstance(WorkerService(WorkerConfig("w-exclusive")).sharing, ExclusiveSharing)
    mesh = WorkerService(WorkerConfig("w-mesh", sharing="mesh", memory_capacity_bytes=1 << 30)).sharing
    assert isinstance(mesh, MeshSharing) and mesh.memory.capacity == 1 << 30


async def test_dedicated_unloads_every_other_model_before_a_load_and_nothing_else():
    unloaded: list[tuple[str, str, float]] = []
    residents = {"i-a": "a", "i-c": "c", "i-b-old": "b", "i-b": "b", "i-d": "d"}
    stopping = {"i-d"}

    def unload(iid: str, reason: str, drain_s: float):
        unloaded.append((iid, reason, drain_s))  # it stops serving now; the stop is awaited

        async def stopped() -> None:
            residents.pop(iid)
        return stopped()

    ports = WorkerPorts(broker=None, instances={}, requests={}, engine_thread=lambda: None,
                        blocks_in_engine=lambda model: {}, memory_capacity=lambda: 1 << 30,
                        residents=lambda: dict(residents), stopping=lambda: set(stopping), unload=unload)
    dedicated = make_sharing(_Config(sharing="dedicated"), ports)
    assert isinstance(dedicated, DedicatedSharing) and dedicated.schedule == "turns"
    await dedicated.make_room("i-b", "b")
    # a, c and d go (drained first, within the planner's drain timeout); b's own instances stay
    # (d's unload was asked already: waited for all the same)
    assert sorted(iid for iid, _, _ in unloaded) == ["i-a", "i-c", "i-d"]
    assert all("sharing=dedicated" in why and drain == EVICT_DRAIN_TIMEOUT_S for _, why, drain in unloaded)
    assert set(residents.values()) == {"b"}
    residents["i-b2"] = "b"
    await dedicated.make_room("i-b2", "b")  # the worker holds b only: nothing more to unload
    assert len(unloaded) == 3
    # a load that another model's load unloaded (cancelled) while it waited to make room unloads nothing
    residents.update({"i-c2": "c", "i-d": "d"})
    await dedicated.make_room("i-d", "d")
    assert len(unloaded) == 3
    # exclusive and mesh never unload to make room
    for name in ("exclusive", "mesh"):
        await make_sharing(_Config(sharing=name), ports).make_room("i-x", "x")
    assert len(unloaded) == 3
