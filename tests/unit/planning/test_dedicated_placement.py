"""sharing=dedicated's placement (libs.planning.placement.pick_dedicated_targets, and
plan_scale_out with `dedicated`): one model per worker at a time. Idle workers first; for a
model's first instance with none idle, one worker is taken from another model (the cheapest by
eviction_key); never a second model on a worker."""

from hypothesis import given, settings
from hypothesis import strategies as st

from libs.planning.placement import DedicatedPick, Resident, eviction_key, pick_dedicated_targets
from libs.planning.scaleout import plan_scale_out
from libs.protocol import messages as m
from test_scaleout import _copy, _instance, _model, _request, _view, _worker

MODELS = ("a", "b", "c", "d")


@st.composite
def clusters(draw):
    """Workers w0..w(n-1), each holding nothing or instances of one or two models (a cluster in
    the middle of a switch may hold two: a draining one and a new one), the model to place, n."""
    n_workers = draw(st.integers(1, 6))
    workers = [f"w{i}" for i in range(n_workers)]
    residents: dict[str, list[Resident]] = {}
    held_by: dict[str, int] = {}
    for w in workers:
        for j in range(draw(st.integers(0, 2))):
            model = draw(st.sampled_from(MODELS))
            held_by[model] = held_by.get(model, 0) + 1
            residents.setdefault(w, []).append(Resident(f"{w}-i{j}", model,
                                                        draw(st.sampled_from(["loading", "ready", "draining"])),
                                                        draw(st.integers(0, 5))))
    # model_instances: how many live instances each model has in this cluster
    residents = {w: [Resident(r.instance_id, r.model, r.state, r.in_flight, held_by[r.model]) for r in rs]
                 for w, rs in residents.items()}
    model = draw(st.sampled_from(MODELS))
    ranked = [w for w in draw(st.permutations(workers)) if not any(r.model == model for r in residents.get(w, ()))]
    return model, ranked, residents, draw(st.integers(0, 4)), draw(st.booleans())


def _staying(residents, w):
    return [r for r in residents.get(w, ()) if r.state != "draining"]


@settings(max_examples=200, deadline=None)
@given(clusters())
def test_never_a_second_model_on_a_worker(case):
    model, ranked, residents, n, first = case
    pick = pick_dedicated_targets(model, ranked, residents, n, first=first)
    assert isinstance(pick, DedicatedPick)
    assert len(pick.targets) == len(set(pick.targets)) <= max(0, n)
    assert set(pick.targets) <= set(ranked)
    for w in pick.targets:
        # Once the worker unloaded what the pick evicts (draining ones leave anyway), it holds
        # `model` alone.
        left = [r for r in _staying(residents, w) if r.instance_id not in pick.evicts.get(w, ())]
        assert left == []
    assert set(pick.evicts) <= set(pick.targets)


@settings(max_examples=200, deadline=None)
@given(clusters())
def test_idle_workers_first_in_rank_order_and_evictions_only_for_a_first_instance(case):
    model, ranked, residents, n, first = case
    pick = pick_dedicated_targets(model, ranked, residents, n, first=first)
    idle = [w for w in ranked if not _staying(residents, w)]
    if idle and n > 0:
        assert pick.targets == tuple(idle[:n]) and not pick.evicts  # nothing unloaded while a worker is idle
    elif pick.evicts:
        assert first and len(pick.targets) == 1  # one worker, taken only for a model with no instance
    elif not first or n <= 0:
        assert pick.targets == ()


@settings(max_examples=200, deadline=None)
@given(clusters())
def test_the_worker_taken_is_the_cheapest_and_never_one_still_loading(case):
    model, ranked, residents, n, first = case
    pick = pick_dedicated_targets(model, ranked, residents, n, first=first)
    if not pick.evicts:
        return
    (victim,) = pick.evicts
    assert all(r.state == "ready" for r in _staying(residents, victim))  # a loading instance is never taken
    takeable = [w for w in ranked if all(r.state == "ready" for r in _staying(residents, w))]
    assert all(eviction_key(_staying(residents, victim)) <= eviction_key(_staying(residents, w)) for w in takeable)
    # a first instance with nothing idle gets a worker whenever one can be taken
    assert takeable and pick.targets == (victim,)


def test_a_model_that_keeps_an_instance_elsewhere_gives_its_worker_first():
    residents = {"w0": [Resident("i0", "a", "ready", in_flight=0, model_instances=1)],
                 "w1": [Resident("i1", "b", "ready", in_flight=3, model_instances=2)],
                 "w2": [Resident("i2", "b", "ready", in_flight=1, model_instances=2)]}
    pick = pick_dedicated_targets("c", ["w0", "w1", "w2"], residents, 1, first=True)
    assert pick == DedicatedPick(("w2",), {"w2": ("i2",)})  # b keeps w1; w2 has fewer in flight than w1
    assert pick_dedicated_targets("c", ["w0", "w1", "w2"], residents, 1, first=False) == DedicatedPick((), {})


# --- plan_scale_out with dedicated ------------------------------------------------------------------


def _busy_view(with_idle: bool) -> m.ClusterView:
    """w0 serves a, w1 serves b (b also on w2 if not idle); c has a host copy on w0 and no instance."""
    workers = [_worker(f"w{i}") for i in range(3)]
    instances = [_instance("ia", "w0", model="a"), _instance("ib", "w1", model="b")]
    if not with_idle:
        instances.append(_instance("ib2", "w2", model="b"))
    return _view(workers, [_model(name=n) for n in "abc"], _copy("w0", model="c"), instances)


def test_dedicated_scale_from_zero_takes_the_cheapest_worker_when_none_is_idle():
    view = _busy_view(with_idle=False)
    plan = plan_scale_out(view, _request(1, model="c"), {"w1": 2, "w2": 0}, dedicated=True)
    assert plan.targets == ("w2",) and plan.evicts == {"w2": ("ib2",)}  # b keeps w1; a's only instance stays
    assert plan.record()["evicts"] == {"w2": ["ib2"]}
    # exclusive puts it beside another model (the worker that holds c's blocks)
    assert plan_scale_out(view, _request(1, model="c"), {"w1": 2, "w2": 0}).targets == ("w0",)


def test_dedicated_scale_out_takes_idle_workers_only():
    view = _busy_view(with_idle=True)
    plan = plan_scale_out(view, _request(3, model="c"), dedicated=True)
    assert plan.targets == ("w2",) and not plan.evicts
    view = _busy_view(with_idle=False)
    grown = view.model_copy(update={"instances": [*view.instances, _instance("ic", "w2", model="c")]})
    # c has an instance already: no worker is taken from another model for a second one
    plan = plan_scale_out(grown, _request(2, model="c"), dedicated=True)
    assert plan.loads == ()
