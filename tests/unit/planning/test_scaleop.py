"""The scale-operation lifecycle (libs.planning.scaleop): examples per transition, then a
stateful property: every operation ends whatever the order and loss of answers and events,
and a restarted planner resumes exactly what the registry's record says is still on its way."""

import dataclasses

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from libs.planning import scaleop as so
from libs.planning.scaleout import plan_scale_in, plan_scale_out
from libs.protocol import messages as m

N_BLOCKS = 4
T0 = 1000.0


def _worker(wid: str) -> m.WorkerInfo:
    return m.WorkerInfo(worker_id=wid, data_address=f"{wid}:7000", topology=m.Topology(host=wid, link_gbps=10.0),
                        capacities={m.Tier.host: 1 << 30}, state="alive", last_heartbeat=0.0)


def _model(mode: str) -> m.ModelInfo:
    blocks = [m.BlockInfo(block_id=b, nbytes=1 << 20, checksum="", layer_start=b, layer_end=b + 1)
              for b in range(N_BLOCKS)]
    return m.ModelInfo(name="m", path="/models/m", arch="toy", n_layers=N_BLOCKS, blocks=blocks, min_instances=0,
                       max_instances=4, scaling_mode=mode, state=m.ModelState.deployed, created_at=0.0)


def _instance(iid: str, wid: str, state=m.InstanceState.ready, op: str | None = None, loaded_at=None,
              mode="local") -> m.InstanceInfo:
    return m.InstanceInfo(instance_id=iid, model="m", mode=mode, state=state, created_at=0.0, scale_op_id=op,
                          loaded_at=loaded_at, stages=[m.Stage(worker_id=wid, block_start=0, block_end=N_BLOCKS)])


def _view(mode: str, instances=(), scale_ops=()) -> m.ClusterView:
    """w0 runs the only instance and holds the host copy; w1..w3 are free."""
    copy = [m.ReplicaInfo(model="m", block_id=b, worker_id="w0", tier=m.Tier.host, state=m.ReplicaState.ready)
            for b in range(N_BLOCKS)]
    return m.ClusterView(workers=[_worker(f"w{i}") for i in range(4)], models=[_model(mode)], replicas=copy,
                         instances=[_instance("i0", "w0"), *instances], scale_ops=list(scale_ops))


def _info(scale, op_id: str = "op-1") -> m.ScaleOpInfo:
    return m.ScaleOpInfo(scale_op_id=op_id, model="m", direction="up", reason="test",
                         from_instances=scale.from_instances, to_instances=scale.to_instances, state="running",
                         timings={"decided": T0 - 1, "planned": T0}, plan=scale.record())


def _open(mode: str = "binomial", desired: int = 3, pipelines: bool = False):
    scale = plan_scale_out(_view(mode), m.ScaleRequest(model="m", desired_instances=desired, reason="test"))
    if pipelines:  # Alg. 2's one group over the receivers (as layercast plans it for a binomial multicast)
        scale = dataclasses.replace(scale, pipelines=(tuple(scale.receivers),))
    ids = {t.worker_id: f"i-{t.worker_id}" for t in scale.loads}
    addresses = {f"w{i}": f"w{i}:7000" for i in range(4)}
    op, effects = so.open_scale_up(_info(scale), scale, ids, addresses, T0)
    return op, effects


def _of(effects, kind) -> list:
    return [e for e in effects if isinstance(e, kind)]


def _feed(op, *events, now=T0 + 1):
    out = []
    for ev in events:
        op, effects = so.step(op, ev, now)
        out += effects
    return op, out


def _loaded(iid: str, wid: str, at: float = T0 + 2) -> so.InstanceReported:
    return so.InstanceReported(_instance(iid, wid, op="op-1", loaded_at=at))


def _through_loads(op, effects):
    """Answer the parts (accepted), the creates and the loads: every target is loading."""
    op, more = _feed(op, so.PartsAnswered(tuple(effects[-1].addresses)))
    op, loads = _feed(op, *(so.InstanceCreated(e.load.instance_id) for e in _of(more, so.CreateInstance)))
    op, acks = _feed(op, *(so.LoadAnswered(e.load.instance_id) for e in _of(loads, so.SendLoad)))
    return op, more + loads + acks


# --- a scale-out, step by step ---------------------------------------------------------------------------
def test_a_multicast_sends_the_parts_first_then_creates_and_loads_every_target_and_ends_done():
    op, effects = _open()
    assert [type(e) for e in effects] == [so.Record, so.SendParts]
    assert effects[0].background and effects[0].info.state == "running"
    assert op.phase == "sending" and "first_send" in op.timings and set(op.waiting()) == {"i-w1", "i-w2"}

    op, more = _feed(op, so.PartsAnswered(("w0", "w1", "w2")))
    creates = _of(more, so.CreateInstance)
    assert {c.load.instance_id for c in creates} == {"i-w1", "i-w2"} and op.phase == "loading"
    assert all(c.load.incoming_transfer == "op-1-binomial" for c in creates)  # receivers wait for the bytes

    op, loads = _feed(op, *(so.InstanceCreated(c.load.instance_id) for c in creates))
    assert sorted(e.part_id for e in _of(loads, so.SendLoad)) == ["i-w1:load", "i-w2:load"]
    op, _ = _feed(op, so.LoadAnswered("i-w1"), so.LoadAnswered("i-w2"))

    op, out = _feed(op, so.InstanceReported(_instance("i-w1", "w1", op="op-1", loaded_at=None)))
    assert not op.ended and "ready:i-w1" in op.timings and "loaded:i-w1" not in op.timings
    op, out = _feed(op, _loaded("i-w1", "w1"), _loaded("i-w2", "w2"), now=T0 + 3)
    (record,) = _of(out, so.Record)
    assert record.info.state == "done" and record.info.timings["done"] == T0 + 3
    assert {"loaded:i-w1", "loaded:i-w2"} <= set(record.info.timings)
    assert _of(out, so.Ended) == [so.Ended(record.info, "done", 2)]
    assert op.phase == "done" and op.settled


def test_a_refused_part_cancels_the_others_and_every_target_loads_on_its_own():
    op, effects = _open()
    op, out = _feed(op, so.PartsAnswered(("w0", "w1", "w2"), {"w1": "busy"}))
    (cancel,) = _of(out, so.CancelParts)
    assert cancel.workers == ("w0", "w2") and cancel.cancel.transfer_id == "op-1-binomial"
    assert op.plan["kind"] == "local-load" and "first_send" not in op.timings and op.transfer_id is None
    assert all(c.load.incoming_transfer is None for c in _of(out, so.CreateInstance))
    assert op.record().plan["kind"] == "local-load"


def test_without_a_multicast_the_instances_are_created_at_once():
    op, effects = _open("serverlessllm", desired=2)
    assert [type(e) for e in effects] == [so.Record, so.CreateInstance] and op.phase == "loading"


def test_a_refused_or_lost_load_fails_its_target_and_the_operation_ends_partial_or_failed():
    op, effects = _open()
    op, _ = _feed(op, so.PartsAnswered(("w0", "w1", "w2")), so.InstanceCreated("i-w1"),
                  so.InstanceCreated("i-w2", error="registry: timeout"))
    assert op.targets["i-w2"].state == "failed"
    op, out = _feed(op, so.LoadAnswered("i-w1", error="no answer from w1 within 5.0s"))
    (announce,) = _of(out, so.Announce)
    assert announce.instance.state == m.InstanceState.failed and announce.instance.scale_op_id == "op-1"
    assert _of(out, so.Ended)[0].outcome == "failed"

    op, effects = _open()
    op, _ = _through_loads(op, effects)
    op, out = _feed(op, _loaded("i-w1", "w1"), so.InstanceReported(_instance("i-w2", "w2", m.InstanceState.failed,
                                                                            op="op-1")))
    assert _of(out, so.Ended)[0].outcome == "partial" and "failed:i-w2" in op.timings


def test_a_late_or_repeated_report_changes_nothing():
    op, effects = _open()
    op, _ = _through_loads(op, effects)
    op, _ = _feed(op, _loaded("i-w1", "w1"), _loaded("i-w2", "w2"))
    assert op.ended
    for late in (_loaded("i-w1", "w1"), so.LoadAnswered("i-w1", "late"), so.Tick(), so.InstanceCreated("i-w2")):
        again, out = so.step(op, late, T0 + 50)
        assert again == op and out == []


# --- execution pipelines ------------------------------------------------------------------------------------
def _gpu(worker: str, block: int) -> so.BlockReported:
    return so.BlockReported(m.BlockEvent(model="m", block_id=block, worker_id=worker, tier=m.Tier.gpu,
                                         state=m.ReplicaState.ready, scale_op_id="op-1"))


def _serving_pipeline():
    op, effects = _open(pipelines=True)
    op, _ = _through_loads(op, effects)
    op, out = _feed(op, _gpu("w1", 0), _gpu("w1", 1), _gpu("w2", 2))
    assert out == []  # block 3 is held by nobody yet
    op, out = _feed(op, _gpu("w2", 3))
    (form,) = _of(out, so.FormPipeline)
    pid = form.instance.instance_id
    assert form.instance.mode == "pipeline" and [s.worker_id for s in form.instance.stages] == ["w1", "w2"]
    op, out = _feed(op, so.PipelineRegistered(pid))
    (start,) = _of(out, so.StartPipeline)
    assert start.workers == ("w1", "w2") and start.start.peers == {"w1": "w1:7000", "w2": "w2:7000"}
    op, out = _feed(op, so.PipelineStartAnswered(pid))
    assert f"pipeline_ready:{pid}" in op.timings and pid in op.serving
    return op, pid


def test_a_pipeline_forms_once_its_receivers_jointly_hold_the_model_and_retires_when_they_are_loaded():
    op, pid = _serving_pipeline()
    op, out = _feed(op, _loaded("i-w1", "w1"))
    assert pid in op.serving  # w2 does not hold every block yet
    op, out = _feed(op, _loaded("i-w2", "w2"))
    (announce,) = [a for a in _of(out, so.Announce) if a.instance.instance_id == pid]
    assert announce.instance.state == m.InstanceState.draining and announce.switched_to == ("i-w1", "i-w2")
    (switch,) = _of(out, so.SwitchPipeline)
    assert switch.entry == "w1" and switch.unload.switched_to == ["i-w1", "i-w2"]
    assert op.ended and not op.settled and f"switched:{pid}" in op.timings  # its stages still run
    # The entry stops after its step: the later stages stop now.
    op, out = _feed(op, so.InstanceReported(_instance(pid, "w1", m.InstanceState.stopped, mode="pipeline")))
    assert _of(out, so.UnloadStages)[0].workers == ("w2",) and op.settled


def test_an_ended_operation_lets_go_of_a_retiring_pipeline_whose_end_never_came():
    timers = so.Timers(give_up_s=60.0)
    op, pid = _serving_pipeline()
    op, _ = _feed(op, _loaded("i-w1", "w1"), _loaded("i-w2", "w2"), now=T0 + 10)
    assert op.ended and not op.settled
    op, out = so.step(op, so.Tick(), T0 + 69, timers)
    assert out == [] and not op.settled
    op, out = so.step(op, so.Tick(), T0 + 70, timers)
    assert [(e.workers, e.unload.instance_id) for e in out] == [(("w1", "w2"), pid)] and op.settled


def test_a_stage_worker_lost_fails_its_pipeline_and_its_stages_stop():
    op, pid = _serving_pipeline()
    op, out = _feed(op, so.WorkerLost("w2"))
    (announce,) = _of(out, so.Announce)
    assert announce.instance.state == m.InstanceState.failed and announce.reason == "worker w2 expired"
    assert _of(out, so.UnloadStages)[0].workers == ("w1", "w2") and pid not in op.serving


def test_a_pipeline_that_did_not_start_fails_and_no_other_forms_from_its_group():
    op, effects = _open(pipelines=True)
    op, _ = _through_loads(op, effects)
    op, out = _feed(op, _gpu("w1", 0), _gpu("w1", 1), _gpu("w2", 2), _gpu("w2", 3))
    pid = _of(out, so.FormPipeline)[0].instance.instance_id
    op, _ = _feed(op, so.PipelineRegistered(pid))
    op, out = _feed(op, so.PipelineStartAnswered(pid, "w2 refused"))
    assert _of(out, so.Announce)[0].instance.state == m.InstanceState.failed and pid not in op.serving
    op, out = _feed(op, _gpu("w1", 2))
    assert _of(out, so.FormPipeline) == []


# --- the periodic check -------------------------------------------------------------------------------------
def test_a_tick_asks_the_registry_for_lost_events_and_gives_up_at_the_deadline():
    timers = so.Timers(check_instances_s=5.0, give_up_s=60.0)
    op, effects = _open()
    op, _ = _through_loads(op, effects)
    op, out = so.step(op, so.Tick(), T0 + 1, timers)
    assert out == []
    op, out = so.step(op, so.Tick(), T0 + 6, timers)
    assert out == [so.CheckInstances(("i-w1", "i-w2"))]
    op, out = so.step(op, so.InstanceReported(_instance("i-w1", "w1", op="op-1", loaded_at=T0 + 5)), T0 + 7, timers)
    op, out = so.step(op, so.Tick(), T0 + 60, timers)
    assert op.ended and op.targets["i-w2"].state == "given_up" and _of(out, so.Ended)[0].outcome == "partial"


# --- a scale-in -----------------------------------------------------------------------------------------------
def test_a_scale_in_drains_each_victim_and_a_worker_that_does_not_answer_stops_it_anyway():
    view = _view("binomial", [_instance("i1", "w1")])
    scale_in = plan_scale_in(view, m.ScaleRequest(model="m", desired_instances=0, reason="idle"))
    info = m.ScaleOpInfo(scale_op_id="op-2", model="m", direction="down", reason="idle", from_instances=2,
                         to_instances=0, state="running", timings={"planned": T0}, plan=scale_in.record())
    op, effects = so.open_scale_down(info, scale_in, 30.0, "idle", T0)
    assert [type(e) for e in effects] == [so.Record, so.Announce, so.Drain, so.Announce, so.Drain]
    assert all(a.instance.state == m.InstanceState.draining for a in _of(effects, so.Announce))
    op, out = _feed(op, so.DrainAnswered("i0"))
    assert not op.ended and out == []
    op, out = _feed(op, so.DrainAnswered("i1", "no responders"))
    stopped = _of(out, so.Announce)[0].instance
    assert stopped.state == m.InstanceState.stopped and stopped.instance_id == "i1"
    assert op.ended and _of(out, so.Record)[0].info.state == "done" and _of(out, so.Ended)[0].outcome == "done"


# --- after a restart ------------------------------------------------------------------------------------------
def _op_record(op_id: str, state: str = "running", direction: str = "up", model: str = "m") -> m.ScaleOpInfo:
    return m.ScaleOpInfo(scale_op_id=op_id, model=model, direction=direction, reason="test", from_instances=1,
                         to_instances=2, state=state, timings={"decided": 1.0})


def test_a_restarted_planner_resumes_scale_outs_with_instances_on_their_way_and_aborts_the_rest():
    instances = [_instance("a", "w1", m.InstanceState.loading, op="op-a"),
                 _instance("b", "w2", m.InstanceState.ready, op="op-b", loaded_at=5.0),
                 _instance("c", "w3", m.InstanceState.ready, op="op-c")]  # serving while loading
    ops = [_op_record("op-a"), _op_record("op-b"), _op_record("op-c", "planned"), _op_record("op-d", "done"),
           _op_record("op-e", direction="down"), _op_record("op-f", model="gone")]
    view = _view("binomial", instances, ops)
    plan = {info.scale_op_id: [i.instance_id for i in pending] for info, pending in so.resume_plan(view)}
    assert plan == {"op-a": ["a"], "op-b": [], "op-c": ["c"], "op-e": [], "op-f": []}
    assert "op-a" not in {i.scale_op_id for i, _ in so.resume_plan(view, open_ids={"op-a"})}

    info, pending = so.resume_plan(view)[0]
    op, effects = so.resume(info, pending, _model("binomial"), T0)
    assert op.waiting() == ["a"]
    assert [(e.worker_id, e.part_id) for e in _of(effects, so.SendLoad)] == [("w1", "a:resume")]
    op, effects = so.resume(*so.resume_plan(view)[1], _model("binomial"), T0)
    (record,) = effects
    assert op.state == "aborted" and record.info.state == "aborted" and record.info.error == "the planner restarted"
    assert record.info.timings == {"decided": 1.0, "done": T0}


# --- the pool's throttle and the command's way --------------------------------------------------------------
def test_a_pool_fill_is_not_repeated_within_its_grace_nor_sent_while_a_scale_out_is_open():
    timers = so.Timers(pool_fill_grace_s=120.0)
    fills, send = so.admit_pool_fill({}, "m", "w1", (), T0, timers)
    assert send and fills == {("m", "w1"): T0}
    assert so.admit_pool_fill(fills, "m", "w1", (), T0 + 119, timers)[1] is False
    assert so.admit_pool_fill(fills, "m", "w2", (), T0 + 1, timers)[1] is True
    assert so.admit_pool_fill(fills, "m", "w1", (), T0 + 120, timers)[1] is True
    assert so.admit_pool_fill({}, "m", "w1", {"m"}, T0, timers) == ({}, False)
    assert so.admit_pool_fill(so.forget_pool_model(fills, "m"), "m", "w1", (), T0 + 1, timers)[1] is True


def test_parts_of_a_plan_go_by_the_plan_stream_and_other_commands_as_rpcs():
    load = m.LoadModel(instance_id="i1", model="m", path="/p", block_start=0, block_end=1)
    assert so.plan_part_id("w1", load) == "i1:load"
    part = m.TransferPart(transfer_id="t1", model="m", algorithm="chain", blocks=_model("chain").blocks, peers={})
    assert so.plan_part_id("w1", part) == "t1:w1"
    assert so.plan_part_id("w1", m.UnloadModel(instance_id="i1")) is None
    assert so.plan_part_id("w1", m.FetchBlocks(model="m", path="/p", blocks=[0])) is None


# --- stateful: any order, any loss -----------------------------------------------------------------------------
class ScaleOpMachine(RuleBasedStateMachine):
    """A scale-out with an execution pipeline, its answers and events delivered in any order,
    repeated or lost, beside a registry that sees every instance event (the planner may not) and
    a planner that may restart.

    Invariants: an operation closes once and only when no target waits; once the deadline's
    tick has come, it has ended; a restarted planner follows exactly the targets the registry
    has on their way, and resuming is the same decision for any planner."""

    timers = so.Timers(check_instances_s=5.0, give_up_s=100.0)

    @initialize(refuse=st.booleans(), pipelines=st.booleans())
    def start(self, refuse, pipelines):
        self.op, effects = _open(pipelines=pipelines)
        self.now = T0
        self.pending: list = []  # answers the workers and registry owe the planner
        self.registry: dict[str, m.InstanceInfo] = {}  # instance -> as the registry has it
        self.records: list[m.ScaleOpInfo] = []
        self.closings = 0
        self.refuse = refuse
        self._apply(effects)

    def _apply(self, effects):
        for e in effects:
            if isinstance(e, so.Record):
                self.records.append(e.info)
            elif isinstance(e, so.Ended):
                self.closings += 1
            elif isinstance(e, so.SendParts):
                self.pending.append(so.PartsAnswered(tuple(e.addresses), {"w1": "busy"} if self.refuse else {}))
            elif isinstance(e, so.CreateInstance):
                self.pending.append(so.InstanceCreated(e.load.instance_id))
                self.registry[e.load.instance_id] = _instance(e.load.instance_id, e.worker_id,
                                                              m.InstanceState.loading, op="op-1")
            elif isinstance(e, so.SendLoad):
                self.pending.append(so.LoadAnswered(e.load.instance_id))
            elif isinstance(e, so.FormPipeline):
                self.pending.append(so.PipelineRegistered(e.instance.instance_id))
            elif isinstance(e, so.StartPipeline):
                self.pending.append(so.PipelineStartAnswered(e.start.instance_id))
            elif isinstance(e, so.SwitchPipeline):
                self.pending.append(so.SwitchAnswered(e.unload.instance_id))
            elif isinstance(e, so.Announce) and e.instance.instance_id in self.registry:
                self.registry[e.instance.instance_id] = e.instance
            elif isinstance(e, so.CheckInstances):
                self.pending += [so.InstanceReported(self.registry[i]) for i in e.instance_ids if i in self.registry]

    def _step(self, event):
        self.op, effects = so.step(self.op, event, self.now, self.timers)
        self._apply(effects)

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def deliver(self, data):
        i = data.draw(st.integers(0, len(self.pending) - 1))
        self._step(self.pending.pop(i))

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def lose(self, data):
        self.pending.pop(data.draw(st.integers(0, len(self.pending) - 1)))

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def repeat(self, data):
        self._step(self.pending[data.draw(st.integers(0, len(self.pending) - 1))])

    @rule(worker=st.sampled_from(["w1", "w2"]), block=st.integers(0, N_BLOCKS - 1))
    def block_arrives(self, worker, block):
        self._step(_gpu(worker, block))

    @rule(worker=st.sampled_from(["w1", "w2"]), state=st.sampled_from(["ready", "loaded", "failed"]),
          heard=st.booleans())
    def instance_reports(self, worker, state, heard):
        """The worker reports its instance: the registry hears it; the planner only if `heard`."""
        iid = f"i-{worker}"
        known = self.registry.get(iid)
        if known is None or known.state in (m.InstanceState.failed, m.InstanceState.stopped) or known.loaded_at:
            return
        inst = _instance(iid, worker, m.InstanceState.failed if state == "failed" else m.InstanceState.ready,
                         op="op-1", loaded_at=self.now if state == "loaded" else None)
        self.registry[iid] = inst
        if heard:
            self._step(so.InstanceReported(inst))

    @rule(worker=st.sampled_from(["w1", "w2"]))
    def worker_lost(self, worker):
        self._step(so.WorkerLost(worker))

    @rule(dt=st.floats(0.5, 30.0))
    def tick(self, dt):
        self.now += dt
        self._step(so.Tick())

    @rule()
    def restart(self):
        """A new planner takes over from the registry's record."""
        record = self.records[-1] if self.records else None
        if record is None:
            return
        view = _view("binomial", self.registry.values(), [record])
        plan = so.resume_plan(view)
        assert plan == so.resume_plan(view) and so.resume_plan(view, {"op-1"}) == []
        if record.state != "running":
            assert plan == []
            return
        ((info, pending),) = plan
        on_their_way = {i for i, inst in self.registry.items()
                        if inst.state == m.InstanceState.loading or
                        inst.state == m.InstanceState.ready and inst.loaded_at is None}
        assert {i.instance_id for i in pending} == on_their_way
        self.pending = []  # the old planner's answers go to nobody
        self.op, effects = so.resume(info, pending, _model("binomial"), self.now)
        assert set(self.op.waiting()) == on_their_way
        self.closings = 0  # the new planner's operation
        self._apply(effects)

    @invariant()
    def closes_once_and_only_when_nothing_waits(self):
        assert self.closings <= 1
        assert self.op.ended == (not self.op.waiting())
        assert not set(self.op.serving) & set(self.op.retiring)
        assert not (self.op.ended and self.op.serving)  # no pipeline serves past its operation

    @rule()
    def the_deadline_passes(self):
        self.now = max(self.now, self.op.opened_at + self.timers.give_up_s + 1e-6)
        self._step(so.Tick())
        assert self.op.ended
        # and, as long again after it ended, it has let go of the pipelines it started
        self.now = max(self.now, self.op.timings.get("done", self.now) + self.timers.give_up_s + 1e-6)
        self._step(so.Tick())
        assert self.op.settled


ScaleOpMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestScaleOpLifecycle = ScaleOpMachine.TestCase
