"""Tests for a worker's instance lifecycle (libs/planning/instance.py): one test per race the
worker meets, and a stateful test over every order of events."""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from libs.planning.instance import (
    ADMITTED,
    LOAD_ENDED_EARLY,
    NOT_HERE,
    NOT_PAIRABLE,
    NOT_SERVING,
    PAIR_DISSOLVED,
    PAIRED,
    UNLOADED_WHILE_LOADING,
    Answer,
    AnnounceBlock,
    Attach,
    BlockInEngine,
    BlockInHost,
    CancelRead,
    Detach,
    DiskNeeded,
    DiskReadDone,
    DiskReadStarted,
    Drain,
    Drained,
    EndLoad,
    EndPair,
    EngineBuilt,
    EvictFromEngine,
    Lifecycle,
    LoadAsked,
    LoadFailed,
    LoadFinished,
    PairEnded,
    PairFormed,
    PairLost,
    Phase,
    Pin,
    PipelineStarted,
    ReadFromDisk,
    ReannounceLoaded,
    Refuse,
    ReleasePins,
    ReportLoaded,
    ReportStopped,
    RequestAdmitted,
    RequestEnded,
    StagePeerLost,
    StartLoad,
    StartPair,
    StopHosting,
    UnloadAsked,
    step,
)

BLOCKS = (0, 1, 2)


def run(s: Lifecycle, *events) -> tuple[Lifecycle, list]:
    out = []
    for ev in events:
        s, effects = step(s, ev)
        out += effects
    return s, out


def loading(serve_early: bool = True) -> Lifecycle:
    s, _ = step(Lifecycle("i"), LoadAsked(BLOCKS, serve_while_loading=serve_early))
    return s


def of(effects, kind) -> list:
    return [e for e in effects if isinstance(e, kind)]


# --- the load ------------------------------------------------------------------------------------


def test_a_load_model_starts_one_load_and_is_answered():
    s, effects = step(Lifecycle("i"), LoadAsked(BLOCKS))
    assert s.phase is Phase.loading and s.load_running and s.blocks == frozenset(BLOCKS)
    assert effects == [StartLoad(), Answer(True, "loading")]


def test_an_unreadable_checkpoint_is_refused_and_nothing_starts():
    s, effects = step(Lifecycle("i"), LoadAsked(BLOCKS, readable=False))
    assert s.phase is Phase.absent and effects == [Refuse("checkpoint path is not readable", code="not_found")]


def test_serving_while_loading_attaches_at_the_first_block_after_the_engine_is_built_and_reports_loaded_at_the_last():
    s, effects = run(loading(), BlockInEngine(0), EngineBuilt())
    assert effects == [AnnounceBlock(0), Attach("serving, rest loading")]
    assert s.phase is Phase.serving_while_loading and s.serving
    s, effects = run(s, BlockInEngine(1), BlockInEngine(2))
    assert effects == [AnnounceBlock(1), AnnounceBlock(2), ReportLoaded()]
    assert s.phase is Phase.serving and s.loaded_reported


def test_a_stop_the_world_load_attaches_only_once_every_block_is_in():
    s, effects = run(loading(serve_early=False), BlockInEngine(0), EngineBuilt(), BlockInEngine(1))
    assert not of(effects, Attach) and s.phase is Phase.loading and not s.serving
    s, effects = run(s, BlockInEngine(2))
    assert effects == [AnnounceBlock(2), Attach("loaded"), ReportLoaded()]
    assert s.phase is Phase.serving


def test_an_engine_built_after_the_last_block_attaches_as_loaded():
    s, effects = run(loading(), *(BlockInEngine(b) for b in BLOCKS))
    assert not of(effects, Attach)
    s, effects = step(s, EngineBuilt())
    assert effects == [Attach("loaded"), ReportLoaded()]


def test_host_blocks_are_pinned_once_and_disk_reads_get_ids():
    s, effects = run(loading(), BlockInHost(0), BlockInHost(0), DiskNeeded((1, 2)), DiskNeeded((2,)))
    assert effects == [Pin(0), ReadFromDisk(1, (1, 2)), ReadFromDisk(2, (2,))]
    assert s.pins == {0} and s.disk_jobs == {1, 2}
    s, _ = run(s, DiskReadDone(1))
    assert s.disk_jobs == {2}


def test_a_block_not_of_the_load_is_not_pinned():
    s, effects = step(loading(), BlockInHost(7))
    assert effects == [] and s.pins == frozenset()


def test_a_failed_load_releases_everything_and_reports_failed():
    s, _ = run(loading(), BlockInHost(0), DiskNeeded((1, 2)), BlockInEngine(0), EngineBuilt())
    s, effects = step(s, LoadFailed("checksum mismatch"))
    assert effects == [CancelRead(1), Detach(), EvictFromEngine((0,)), ReleasePins((0,)),
                       ReportStopped(True, "checksum mismatch")]
    assert s.phase is Phase.failed and s.forgettable and not s.pins and not s.disk_jobs


# --- races ---------------------------------------------------------------------------------------


def test_an_unload_while_loading_cancels_the_reads_at_once_and_the_load_ends_stopped():
    s, _ = run(loading(serve_early=False), BlockInHost(0), DiskNeeded((1, 2)))
    s, effects = step(s, UnloadAsked())
    assert effects == [CancelRead(1), Answer(True, "load cancelled")]
    assert s.phase is Phase.cancelling and not s.serving and s.load_running
    # The cancelled read fails the load task: its failure is the stop, not an error.
    s, effects = step(s, LoadFailed("read cancelled"))
    assert effects == [ReleasePins((0,)), ReportStopped(False, "read cancelled")]
    assert s.phase is Phase.stopped and s.forgettable


def test_a_block_landing_after_the_unload_is_not_announced_and_ends_the_load():
    s, _ = run(loading(), UnloadAsked())
    s, effects = step(s, BlockInEngine(0))
    assert effects == [EndLoad(UNLOADED_WHILE_LOADING)] and s.in_engine == frozenset()
    s, effects = step(s, BlockInHost(1))
    assert effects == [] and not s.pins  # nothing would release it


def test_an_engine_built_after_the_unload_is_never_attached():
    s, _ = run(loading(), BlockInEngine(0), UnloadAsked())
    s, effects = step(s, EngineBuilt())
    assert effects == [EndLoad(UNLOADED_WHILE_LOADING)] and not s.attached


def test_a_disk_read_whose_start_outlived_the_unload_is_cancelled_as_it_starts():
    s, effects = run(loading(), DiskNeeded((0, 1, 2)))
    assert effects == [ReadFromDisk(1, (0, 1, 2))]
    s, effects = step(s, UnloadAsked())  # the read's start is still under way: nothing to cancel yet
    assert CancelRead(1) in effects
    s, effects = step(s, DiskReadStarted(1))
    assert effects == [CancelRead(1)]
    # A read that started before the unload is not cancelled twice.
    s2, _ = run(loading(), DiskNeeded((0,)))
    assert step(s2, DiskReadStarted(1))[1] == []


def test_no_disk_read_starts_after_the_unload():
    s, _ = run(loading(), UnloadAsked())
    s, effects = step(s, DiskNeeded((1,)))
    assert effects == [EndLoad(UNLOADED_WHILE_LOADING)] and not s.disk_jobs


def test_an_unload_while_serving_early_drains_and_the_stop_is_reported_once():
    s, _ = run(loading(), BlockInHost(0), BlockInEngine(0), EngineBuilt(), DiskNeeded((1, 2)))
    s, effects = step(s, UnloadAsked(switched_to=("p",), drain_timeout_s=5.0, keep_alive_s=30.0))
    assert effects == [CancelRead(1), Drain(5.0, False, "unloaded by planner"), Answer(True, "draining")]
    assert s.phase is Phase.draining and not s.serving
    s, effects = step(s, Drained())
    assert effects == [Detach(), EvictFromEngine((0,)), ReleasePins((0,), 30.0),
                       ReportStopped(False, "unloaded by planner", ("p",))]
    assert s.phase is Phase.stopped and not s.forgettable  # its load task is still running
    # The load task notices at its next block, and its end reports nothing again.
    s, effects = run(s, BlockInEngine(1), LoadFailed(UNLOADED_WHILE_LOADING))
    assert effects == [EndLoad(UNLOADED_WHILE_LOADING)] and s.forgettable


def test_the_load_ending_before_the_drain_leaves_the_teardown_to_the_drain():
    s, _ = run(loading(), BlockInHost(0), BlockInEngine(0), EngineBuilt(), UnloadAsked())
    s, effects = step(s, LoadFailed("cancelled"))
    assert effects == [] and s.phase is Phase.draining
    s, effects = step(s, Drained())
    assert of(effects, ReportStopped) == [ReportStopped(False, "unloaded by planner")]
    assert of(effects, ReleasePins) == [ReleasePins((0,))] and s.forgettable


def test_an_unload_asked_twice_stops_once():
    s, _ = run(loading(), BlockInEngine(0), EngineBuilt())
    s, first = step(s, UnloadAsked())
    s, again = step(s, UnloadAsked())
    assert of(first, Drain) and again == [Answer(True, "draining")]
    s, _ = step(loading(), UnloadAsked())
    assert step(s, UnloadAsked())[1] == [Answer(True, "load cancelled")]


def test_an_unload_of_an_instance_not_here_or_ended_is_not_accepted():
    assert step(Lifecycle("i"), UnloadAsked())[1] == [Answer(False, NOT_HERE)]
    s, _ = run(loading(), UnloadAsked(), LoadFailed("stopped"))
    assert step(s, UnloadAsked())[1] == [Answer(False, NOT_HERE)]


def test_a_load_model_sent_again_is_answered_without_a_second_load_or_loaded_report():
    s = loading()
    assert step(s, LoadAsked(BLOCKS))[1] == [Answer(True, "already loaded or loading")]
    s, _ = run(s, *(BlockInEngine(b) for b in BLOCKS), EngineBuilt(), LoadFinished())
    s2, effects = step(s, LoadAsked(BLOCKS))
    assert effects == [ReannounceLoaded(), Answer(True, "already loaded")] and s2 == s
    # Stopped while its load task still runs: still one load at a time.
    s, _ = run(loading(), BlockInEngine(0), EngineBuilt(), UnloadAsked(), Drained())
    assert step(s, LoadAsked(BLOCKS))[1] == [Answer(True, "already loaded or loading")]
    # Once forgotten, a LoadModel of the same id is a fresh load.
    s, _ = step(s, LoadFailed("stopped"))
    assert step(s, LoadAsked(BLOCKS))[1] == [StartLoad(), Answer(True, "loading")]


def test_a_pipeline_entry_that_loses_a_stage_fails_without_waiting_on_it():
    s, _ = step(Lifecycle("p"), PipelineStarted(entry=True))
    assert s.serving and s.kind == "pipeline" and s.loaded_reported
    s, effects = step(s, StagePeerLost("timed out"))
    assert effects == [Drain(0.0, True, "a stage failed: timed out")]
    s, effects = step(s, Drained())
    assert effects == [Detach(), ReportStopped(True, "a stage failed: timed out")] and s.phase is Phase.failed
    # Lost again while draining (another step failed): nothing more.
    s, _ = run(Lifecycle("p"), PipelineStarted(entry=True), StagePeerLost("x"))
    assert step(s, StagePeerLost("y"))[1] == []


def test_a_load_that_ends_before_serving_fails_instead_of_staying_loading():
    s, _ = run(loading(), BlockInHost(0), BlockInEngine(0))
    s, effects = step(s, LoadFinished())
    assert effects == [EvictFromEngine((0,)), ReleasePins((0,)), ReportStopped(True, LOAD_ENDED_EARLY)]
    assert s.forgettable
    s, _ = run(loading(), UnloadAsked())
    assert step(s, LoadFinished())[1] == [ReportStopped(False, LOAD_ENDED_EARLY)]


def test_a_late_event_of_a_loaded_instance_does_not_end_anything():
    s, _ = run(loading(), *(BlockInEngine(b) for b in BLOCKS), EngineBuilt())
    assert s.phase is Phase.serving and s.load_running
    for ev in (EngineBuilt(), BlockInEngine(1), DiskNeeded((1,))):
        assert step(s, ev) == (s, [])


def test_a_local_engine_failure_is_not_a_stage_lost():
    s, _ = run(loading(), BlockInEngine(0), EngineBuilt())
    assert step(s, StagePeerLost("oom"))[1] == []


def test_a_pipeline_switch_lets_the_step_in_flight_finish_but_an_unload_for_failure_aborts_it():
    s, _ = step(Lifecycle("p"), PipelineStarted(entry=True))
    assert of(step(s, UnloadAsked(switched_to=("i",)))[1], Drain) == [Drain(0.0, False, "unloaded by planner")]
    assert of(step(s, UnloadAsked())[1], Drain) == [Drain(0.0, True, "unloaded by planner")]


def test_a_hosted_stage_stops_hosting_without_a_report():
    s, _ = step(Lifecycle("p"), PipelineStarted(entry=False))
    assert s.phase is Phase.stage and not s.serving
    s, effects = step(s, UnloadAsked())
    assert effects == [StopHosting(), Answer(True, "stage stopped")] and s.forgettable


# --- requests ------------------------------------------------------------------------------------


def serving(serve_early: bool = True) -> Lifecycle:
    s, _ = run(loading(serve_early), *(BlockInEngine(b) for b in BLOCKS), EngineBuilt())
    assert s.phase is Phase.serving
    return s


def test_a_request_is_admitted_while_the_instance_serves_and_leaves_when_it_ends():
    s, effects = step(serving(), RequestAdmitted("r1"))
    assert effects == [Answer(True, ADMITTED)] and s.requests == {"r1"}
    s, effects = step(s, RequestAdmitted("r2"))
    assert effects == [Answer(True, ADMITTED)] and s.requests == {"r1", "r2"}
    s, effects = step(s, RequestEnded("r1"))
    assert effects == [] and s.requests == {"r2"} and s.phase is Phase.serving
    # One not running here (never admitted, or already ended) changes nothing.
    assert step(s, RequestEnded("r1")) == (s, []) and step(s, RequestEnded("other")) == (s, [])


def test_a_request_is_admitted_while_serving_early_and_by_a_pipelines_entry():
    s, _ = run(loading(), BlockInEngine(0), EngineBuilt())
    assert s.phase is Phase.serving_while_loading
    s, effects = step(s, RequestAdmitted("r"))
    assert effects == [Answer(True, ADMITTED)] and s.requests == {"r"}
    s, _ = step(Lifecycle("p"), PipelineStarted(entry=True))
    s, effects = step(s, RequestAdmitted("r"))
    assert effects == [Answer(True, ADMITTED)] and s.requests == {"r"}


def test_a_request_is_refused_by_an_instance_that_does_not_serve():
    refused = [Refuse(NOT_SERVING, code="unavailable")]
    not_serving = {
        "absent": Lifecycle("i"),
        "loading": loading(),
        "cancelling": run(loading(), UnloadAsked())[0],
        "draining": run(serving(), RequestAdmitted("r0"), UnloadAsked())[0],
        "stopped": run(loading(), BlockInEngine(0), EngineBuilt(), UnloadAsked(), Drained())[0],
        "failed": run(loading(), BlockInEngine(0), EngineBuilt(), LoadFailed("boom"))[0],
        "stage": step(Lifecycle("p"), PipelineStarted(entry=False))[0],
    }
    for phase, s in not_serving.items():
        assert s.phase.value == phase
        s2, effects = step(s, RequestAdmitted("r"))
        assert effects == refused and "r" not in s2.requests, phase
        assert s2 == s, phase


def test_a_drain_ends_when_its_last_request_ends_with_the_drained_effects():
    s, _ = run(loading(), BlockInHost(0), *(BlockInEngine(b) for b in BLOCKS), EngineBuilt(),
               RequestAdmitted("r1"), RequestAdmitted("r2"))
    s, effects = step(s, UnloadAsked(switched_to=("p",), drain_timeout_s=30.0, keep_alive_s=5.0))
    assert effects == [Drain(30.0, False, "unloaded by planner"), Answer(True, "draining")]
    assert s.phase is Phase.draining and s.requests == {"r1", "r2"}
    s, effects = step(s, RequestEnded("r1"))
    assert effects == [] and s.phase is Phase.draining  # one still runs
    _, by_deadline = step(s, Drained())
    s, effects = step(s, RequestEnded("r2"))
    assert effects == by_deadline == [Detach(), EvictFromEngine(BLOCKS), ReleasePins((0,), 5.0),
                                      ReportStopped(False, "unloaded by planner", ("p",))]
    assert s.phase is Phase.stopped and not s.requests
    # Its deadline passing afterwards (the worker's timer) does nothing more.
    assert step(s, Drained()) == (s, [])


def test_a_drain_s_deadline_ends_it_with_requests_running_and_forgets_them():
    s, _ = run(serving(), RequestAdmitted("r1"), UnloadAsked(drain_timeout_s=1.0))
    s, effects = step(s, Drained())
    assert of(effects, Detach) == [Detach()] and of(effects, ReportStopped)
    assert s.phase is Phase.stopped and not s.requests  # the detach ended them
    # Their end, reported afterwards, reports nothing again.
    assert step(s, RequestEnded("r1")) == (s, [])


def test_a_failed_load_of_an_instance_serving_early_ends_its_requests():
    s, _ = run(loading(), BlockInEngine(0), EngineBuilt(), RequestAdmitted("r"))
    s, effects = step(s, LoadFailed("checksum mismatch"))
    assert of(effects, Detach) == [Detach()] and s.phase is Phase.failed and not s.requests


def test_a_pipeline_that_lost_a_stage_drains_its_requests_and_fails_at_the_last():
    s, _ = run(Lifecycle("p"), PipelineStarted(entry=True), RequestAdmitted("r"), StagePeerLost("timed out"))
    assert s.phase is Phase.draining and s.requests == {"r"}
    s, effects = step(s, RequestEnded("r"))
    assert effects == [Detach(), ReportStopped(True, "a stage failed: timed out")] and s.phase is Phase.failed


# --- live pairs (BlitzScale §5.2) ---------------------------------------------------------------------


def test_a_serving_instance_pairs_as_source_keeps_serving_and_unpairs_when_told():
    s, effects = run(serving(), PairFormed("source", "w2/i"))
    assert s.phase is Phase.pair_source and s.pair_peer == "w2/i" and s.serving
    assert effects == [StartPair("source", "w2/i"), Answer(True, PAIRED)]
    s, effects = run(s, RequestAdmitted("r1"), PairEnded(PAIR_DISSOLVED))
    assert s.phase is Phase.serving and s.pair_peer == "" and s.requests == {"r1"}
    assert of(effects, EndPair) == [EndPair("w2/i", PAIR_DISSOLVED, notify_peer=False)]


def test_a_loading_target_lends_its_blocks_without_serving_and_dissolves_at_its_last_block():
    s, effects = run(loading(serve_early=True), PairFormed("target", "w1/i"), EngineBuilt(), BlockInEngine(0),
                     BlockInEngine(1))
    # Serving early would attach at the first block: a paired target lends its blocks instead.
    assert s.phase is Phase.pair_target and not s.attached and not of(effects, Attach)
    assert effects[:2] == [StartPair("target", "w1/i"), Answer(True, PAIRED)]
    s, effects = step(s, RequestAdmitted("r1"))
    assert of(effects, Refuse)
    s, effects = step(s, BlockInEngine(2))
    assert s.phase is Phase.serving and s.pair_peer == "" and s.attached and s.loaded_reported
    # Step 3 of the protocol: the pair dissolves (the source told) before the target attaches.
    assert effects == [AnnounceBlock(2), EndPair("w1/i", PAIR_DISSOLVED, notify_peer=True), Attach("loaded"),
                       ReportLoaded()]


def test_a_target_whose_source_left_goes_on_loading_and_may_serve_early_then():
    s, _ = run(loading(serve_early=True), PairFormed("target", "w1/i"), EngineBuilt(), BlockInEngine(0))
    s, effects = step(s, PairEnded("w1/i unloaded"))
    assert of(effects, EndPair) == [EndPair("w1/i", "w1/i unloaded", notify_peer=False)]
    assert s.phase is Phase.serving_while_loading and of(effects, Attach)


def test_an_unload_of_either_side_breaks_the_pair_and_tells_the_peer():
    src, effects = run(serving(), PairFormed("source", "w2/i"), UnloadAsked())
    assert src.phase is Phase.draining and of(effects, Drain)
    assert [e.notify_peer and e.peer for e in of(effects, EndPair)] == ["w2/i"]
    tgt, effects = run(loading(), PairFormed("target", "w1/i"), UnloadAsked())
    assert tgt.phase is Phase.cancelling
    assert [e.notify_peer and e.peer for e in of(effects, EndPair)] == ["w1/i"]


def test_a_failed_target_load_breaks_the_pair_before_it_reports_failed():
    s, effects = run(loading(), PairFormed("target", "w1/i"), BlockInEngine(0), LoadFailed("disk gone"))
    assert s.phase is Phase.failed
    ends = [i for i, e in enumerate(effects) if isinstance(e, EndPair)]
    stops = [i for i, e in enumerate(effects) if isinstance(e, ReportStopped)]
    assert len(ends) == 1 and effects[ends[0]].notify_peer and ends[0] < stops[0]


def test_only_a_serving_source_and_an_unattached_loading_target_pair():
    for s, role in [(loading(), "source"), (serving(), "target"), (run(loading(), EngineBuilt(), BlockInEngine(0))[0],
                                                                   "target"),
                    (Lifecycle("i"), "source"), (Lifecycle("i"), "target")]:
        after, effects = step(s, PairFormed(role, "p"))
        assert after == s and effects == [Refuse(f"{NOT_PAIRABLE} as {role} while {s.phase}", code="unavailable")]
    entry, _ = step(Lifecycle("i"), PipelineStarted(entry=True))
    assert of(step(entry, PairFormed("source", "p"))[1], Refuse)


def test_a_pair_formed_again_is_answered_without_a_second_start():
    s, _ = run(serving(), PairFormed("source", "p"))
    again, effects = step(s, PairFormed("source", "p"))
    assert again == s and effects == [Answer(True, "already paired")]


def test_a_side_that_finds_its_peer_failing_goes_on_alone_and_tells_it():
    src, effects = run(serving(), PairFormed("source", "w2/i"), RequestAdmitted("r1"), PairLost("timeout"))
    assert src.phase is Phase.serving and src.requests == {"r1"}
    assert [(e.peer, e.notify_peer) for e in of(effects, EndPair)] == [("w2/i", True)]
    tgt, effects = run(loading(serve_early=False), PairFormed("target", "w1/i"), PairLost("reset"))
    assert tgt.phase is Phase.loading and [(e.peer, e.notify_peer) for e in of(effects, EndPair)] == [("w1/i", True)]
    assert step(serving(), PairLost("late")) == (serving(), [])


def test_a_pair_ended_notice_for_an_unpaired_instance_does_nothing():
    s = serving()
    assert step(s, PairEnded("late")) == (s, [])


# --- every order of events ---------------------------------------------------------------------------


class InstanceLifecycle(RuleBasedStateMachine):
    """Drives one instance id with any order of events, as a worker's shell would (it drops an
    ended instance once nothing of it runs, and a load task ends only after its disk starts
    came back), and checks what the effects do to a model of the worker."""

    @initialize()
    def fresh(self):
        self.s = Lifecycle("i")
        self.pinned: set[int] = set()  # host-tier pins the effects hold
        self.unstarted: set[int] = set()  # disk reads issued whose start has not come back
        self.reading: set[int] = set()  # disk reads started and neither done nor cancelled
        self.cancelled: set[int] = set()
        self.new_life()

    def new_life(self):
        self.loaded_reports = 0
        self.attaches = 0
        self.stop_reports = 0
        self.unloaded = False  # an unload was accepted in this life
        self.running: set[str] = set()  # requests admitted and not ended (the worker's table)
        self.paired = ""  # the side of a live pair the worker runs for it ("" when none)

    def feed(self, ev):
        self.s, effects = step(self.s, ev)
        for e in effects:
            match e:
                case Answer(accepted=True) if isinstance(ev, UnloadAsked):
                    self.unloaded = True
                case Answer(accepted=True) if isinstance(ev, RequestAdmitted):
                    assert not self.unloaded, "a request admitted once the instance was unloaded"
                    assert not self.stop_reports, "a request admitted once its stop was reported"
                    self.running.add(ev.request_id)
                case Refuse() if isinstance(ev, RequestAdmitted):
                    assert not self.s.serving, "a serving instance refused a request"
                case Pin(block=b):
                    assert b not in self.pinned, f"block {b} pinned twice"
                    self.pinned.add(b)
                case ReleasePins(blocks=bs):
                    assert set(bs) <= self.pinned, "released a pin it did not hold"
                    self.pinned -= set(bs)
                case ReadFromDisk(job=j):
                    self.unstarted.add(j)
                case CancelRead(job=j):
                    self.cancelled.add(j)
                    self.reading.discard(j)
                case Attach():
                    self.attaches += 1
                    assert not self.unloaded, "attached after an unload"
                case ReportLoaded():
                    assert not self.paired, "reported loaded while still lending its blocks"
                    self.loaded_reports += 1
                    assert self.s.in_engine >= self.s.blocks, "loaded before every block was in"
                case ReportStopped():
                    self.stop_reports += 1
                case Detach():
                    self.running.clear()  # its requests end with an error
                case StartPair(role=role):
                    assert not self.paired, "a second pair started before the first ended"
                    self.paired = role
                case EndPair(notify_peer=notify):
                    assert self.paired, "ended a pair it did not run"
                    assert notify != isinstance(ev, PairEnded), "the peer told of its own end, or not told of ours"
                    self.paired = ""
        if isinstance(ev, RequestEnded):
            self.running.discard(ev.request_id)
        if of(effects, Drain) and self.s.phase is Phase.draining and not self.s.requests:
            # The worker's drain: no request to wait for, so it ends at once.
            effects += self.feed(Drained())
        if self.s.forgettable:  # the shell forgets it: the next of this id is a new life
            self.s = Lifecycle("i")
            self.new_life()
        return effects

    @rule(serve=st.booleans(), readable=st.booleans())
    def load_asked(self, serve, readable):
        self.feed(LoadAsked((0, 1, 2), serve_while_loading=serve, readable=readable))

    @rule(entry=st.booleans())
    def pipeline_started(self, entry):
        self.feed(PipelineStarted(entry))

    @rule(block=st.integers(0, 3))
    def block_in_host(self, block):
        self.feed(BlockInHost(block))

    @precondition(lambda self: self.s.load_running)
    @rule(blocks=st.sets(st.integers(0, 2), min_size=1))
    def disk_needed(self, blocks):
        self.feed(DiskNeeded(tuple(sorted(blocks))))

    @precondition(lambda self: self.unstarted)
    @rule(data=st.data())
    def disk_read_started(self, data):
        job = data.draw(st.sampled_from(sorted(self.unstarted)))
        self.unstarted.discard(job)
        if job in self.cancelled:
            self.cancelled.discard(job)  # the shell's cancel found nothing to cancel yet
        self.reading.add(job)
        self.feed(DiskReadStarted(job))

    @precondition(lambda self: self.reading)
    @rule(data=st.data())
    def disk_read_done(self, data):
        job = data.draw(st.sampled_from(sorted(self.reading)))
        self.reading.discard(job)
        self.feed(DiskReadDone(job))

    @precondition(lambda self: self.s.load_running)
    @rule(block=st.integers(0, 2))
    def block_in_engine(self, block):
        self.feed(BlockInEngine(block))

    @precondition(lambda self: self.s.load_running)
    @rule()
    def engine_built(self):
        self.feed(EngineBuilt())

    @precondition(lambda self: self.s.load_running and not self.unstarted)
    @rule()
    def load_finished(self):
        # Its reads are done with its last block (the shell feeds their ends first).
        for job in sorted(self.reading):
            self.reading.discard(job)
            self.feed(DiskReadDone(job))
        self.feed(LoadFinished())

    @precondition(lambda self: self.s.load_running and not self.unstarted)
    @rule()
    def load_failed(self):
        self.feed(LoadFailed("boom"))

    @rule(switched=st.booleans(), keep=st.none() | st.floats(0, 60))
    def unload_asked(self, switched, keep):
        self.feed(UnloadAsked(switched_to=("other",) if switched else (), keep_alive_s=keep))

    @rule()
    def drained(self):
        self.feed(Drained())

    @rule()
    def stage_peer_lost(self):
        self.feed(StagePeerLost("gone"))

    @rule(request=st.sampled_from(["r1", "r2", "r3"]))
    def request_admitted(self, request):
        self.feed(RequestAdmitted(request))

    @rule(request=st.sampled_from(["r1", "r2", "r3"]))
    def request_ended(self, request):
        self.feed(RequestEnded(request))

    @rule(role=st.sampled_from(["source", "target"]))
    def pair_formed(self, role):
        self.feed(PairFormed(role, "peer"))

    @rule()
    def pair_ended(self):
        self.feed(PairEnded("the peer ended it"))

    @rule()
    def pair_lost(self):
        self.feed(PairLost("the peer timed out"))

    @invariant()
    def a_pair_runs_exactly_while_the_instance_is_paired(self):
        assert bool(self.paired) == (self.s.phase in (Phase.pair_source, Phase.pair_target))
        if self.s.phase is Phase.pair_target:
            assert not self.s.attached and self.s.load_running

    @invariant()
    def requests_are_the_ones_admitted_and_not_ended(self):
        assert self.s.requests == self.running
        if not (self.s.serving or self.s.phase is Phase.draining):
            assert not self.s.requests, f"requests {set(self.s.requests)} outlive the instance"

    @invariant()
    def a_drain_with_no_running_request_ends_at_once(self):
        assert not (self.s.phase is Phase.draining and not self.s.requests)

    @invariant()
    def never_serving_once_unloaded(self):
        assert not (self.s.serving and self.unloaded)
        assert not (self.s.serving and self.stop_reports), "serving after its stop was reported"

    @invariant()
    def pins_are_the_lifecycles_and_none_outlive_it(self):
        assert self.pinned == set(self.s.pins)
        if self.s.phase in (Phase.absent, Phase.stopped, Phase.failed):
            assert not self.pinned, f"pins {self.pinned} leaked"

    @invariant()
    def no_disk_read_outlives_the_load(self):
        if not self.s.load_running:
            assert not self.reading, f"disk reads {self.reading} leaked"
        # Every read running is one the lifecycle would cancel on an unload.
        assert self.reading <= set(self.s.disk_jobs) | self.cancelled

    @invariant()
    def loaded_and_stopped_reported_at_most_once_a_life(self):
        assert self.loaded_reports <= 1 and self.attaches <= 1 and self.stop_reports <= 1

    @invariant()
    def a_serving_instance_is_attached(self):
        if self.s.serving:
            assert self.s.attached
        if self.s.attached:
            assert self.s.phase in (Phase.serving_while_loading, Phase.serving, Phase.pair_source, Phase.draining)


    def teardown(self):
        """Whatever came last, once its reads' starts come back, its drain and its load task end,
        nothing is held and an unloaded instance has said it stopped, exactly once."""
        unloaded, kind, reports = self.unloaded, self.s.kind, self.stop_reports
        effects = []
        for job in sorted(self.unstarted):
            self.unstarted.discard(job)
            self.reading.add(job)
            effects += self.feed(DiskReadStarted(job))
        if self.s.phase is Phase.draining:
            effects += self.feed(Drained())
        if self.s.load_running:
            effects += self.feed(LoadFailed("ended"))
        if self.s.phase is Phase.draining:
            effects += self.feed(Drained())
        assert not self.pinned and not self.reading
        assert not self.paired or self.s.phase in (Phase.pair_source, Phase.pair_target)
        if unloaded and kind != "stage":
            assert reports + len(of(effects, ReportStopped)) == 1


InstanceLifecycle.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
test_instance_lifecycle = InstanceLifecycle.TestCase
