"""Micro-batches kept in flight across steps (libs/planning/microbatches.py, λScale Fig. 6a).

A discrete-event run drives the schedule as the engine does (start micro-batches while a slot
is free, each stage computes the first of its queue, a micro-batch that leaves the last stage
frees its rows for their next step) with random stages, rows and costs; its timeline shows:
every row's steps in order, at most s micro-batches in flight, no stage computing two at once,
every step done; and with equal micro-batches, every stage busy from the pipeline's fill to its
drain (throughput s times one stage doing all layers)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libs.planning.microbatches import MicroBatchSchedule


def simulate(stages: int, rows: dict[str, tuple[int, int]], cost, arrivals: dict[str, float] | None = None):
    """Rows `key -> (prefill chunks, decode steps)`; `cost(stage, micro-batch) -> seconds`; a row
    joins at `arrivals[key]` (default 0). Returns (timeline, in-flight counts seen, end time):
    timeline entries (stage, mb id, rows, start, end)."""
    arrivals = arrivals or {}
    left = {k: list(v) for k, v in rows.items()}
    sched = MicroBatchSchedule(stages)
    timeline: list[tuple[int, int, tuple, float, float]] = []
    computing: dict[int, tuple[object, float]] = {}  # stage -> (micro-batch, its end)
    flights: list[int] = []
    t = 0.0
    while True:
        here = [k for k in rows if arrivals.get(k, 0.0) <= t]
        decodes = [k for k in here if left[k][0] == 0 and left[k][1] > 0]
        prefills = [k for k in here if left[k][0] > 0]
        while (group := sched.next_group(decodes, prefills)) is not None:
            assert not set(group[0] + group[1]) & sched.busy()
            sched.start(*group)
        flights.append(len(sched.in_flight))
        for s in range(stages):
            queue = sched.queue(s)
            if s not in computing and queue:
                computing[s] = (queue[0], t + cost(s, queue[0]))
                timeline.append((s, queue[0].id, queue[0].rows, t, computing[s][1]))
        later = [a for a in arrivals.values() if a > t]
        if not computing:
            if later:
                t = min(later)
                continue
            return timeline, flights, t
        t = min([end for _, end in computing.values()] + later)
        for s in sorted(computing, reverse=True):  # the last stage first: its rows go again at once
            mb, end = computing[s]
            if end <= t:
                del computing[s]
                if sched.passed(mb.id):
                    for k in mb.decodes:
                        left[k][1] -= 1
                    for k in mb.prefills:
                        left[k][0] -= 1


def check(stages, rows, timeline, flights):
    assert max(flights) <= stages
    for s in range(stages):  # a stage computes one micro-batch at a time
        spans = sorted((a, b) for st_, _, _, a, b in timeline if st_ == s)
        assert all(b0 <= a1 + 1e-9 for (_, b0), (a1, _) in zip(spans, spans[1:]))
    by_mb: dict[int, list] = {}
    for s, mb, mb_rows, a, b in timeline:
        by_mb.setdefault(mb, []).append((s, a, b, mb_rows))
    for visits in by_mb.values():  # stage 0, 1, ..., s-1, each after the one before
        assert [v[0] for v in visits] == list(range(stages))
        assert all(x[2] <= y[1] + 1e-9 for x, y in zip(visits, visits[1:]))
    for key, (chunks, decodes) in rows.items():  # a row's steps: one at a time, all of them
        steps = sorted((v[0][1], v[-1][2]) for v in by_mb.values() if key in v[0][3])
        assert len(steps) == chunks + decodes
        assert all(end <= start + 1e-9 for (_, end), (start, _) in zip(steps, steps[1:]))


@settings(max_examples=80, deadline=None)
@given(stages=st.integers(1, 5),
       rows=st.dictionaries(st.sampled_from("abcdefghijkl"), st.tuples(st.integers(0, 3), st.integers(0, 6)),
                            min_size=1, max_size=12),
       costs=st.lists(st.floats(0.1, 3.0), min_size=5, max_size=5),
       per_row=st.booleans(),
       late=st.dictionaries(st.sampled_from("abcdefghijkl"), st.floats(0.0, 20.0)))
def test_steps_in_order_at_most_s_in_flight_no_stage_runs_two(stages, rows, costs, per_row, late):
    rows = {k: v for k, v in rows.items() if sum(v)} or {"a": (1, 1)}

    def cost(s, mb):
        return costs[s] * (len(mb.rows) if per_row else 1)

    timeline, flights, _ = simulate(stages, rows, cost, {k: a for k, a in late.items() if k in rows})
    check(stages, rows, timeline, flights)


@settings(max_examples=40, deadline=None)
@given(stages=st.integers(1, 4), groups=st.integers(1, 4), steps=st.integers(1, 8))
def test_equal_micro_batches_keep_every_stage_busy(stages, groups, steps):
    """R = s * g rows decoding together, a stage costing c per row: after the fill, no stage ever
    waits, so the run takes N*R*c + (s-1)*g*c, where one stage holding every layer (cost s*c per
    row) would take N*R*s*c: s times the throughput."""
    rows = {f"r{i}": (0, steps) for i in range(stages * groups)}
    c = 1.0
    timeline, flights, end = simulate(stages, rows, lambda s, mb: c * len(mb.rows))
    check(stages, rows, timeline, flights)
    assert {len(mb_rows) for _, _, mb_rows, _, _ in timeline} == {groups}
    assert end == pytest.approx(steps * len(rows) * c + (stages - 1) * groups * c)
    if steps > 1 and stages > 1:  # a micro-batch's next step entered stage 0 while another was still at a later stage
        assert any(s0 == 0 and any(s1 > 0 and m1 != m0 and a1 <= a0 < b1 for s1, m1, _, a1, b1 in timeline)
                   for s0, m0, _, a0, _ in timeline[stages:])


def test_a_micro_batch_takes_its_share_and_busy_rows_never_go_again():
    sched = MicroBatchSchedule(2)
    assert sched.next_group(list("abcde"), []) == (list("abc"), [])
    a = sched.start(list("abc"))
    assert sched.next_group(list("abcde"), ["x"]) == (list("de"), ["x"])  # 5 decoding over 2: at most 3 each
    b = sched.start(list("de"), ["x"])
    assert sched.free() == 0 and sched.next_group(list("abcde"), []) is None
    with pytest.raises(ValueError, match="in flight"):
        sched.start(["a"])
    assert [mb.id for mb in sched.queue(0)] == [a.id, b.id]
    with pytest.raises(ValueError, match="first"):
        sched.passed(b.id)  # stage 0 computes a first
    assert sched.passed(a.id) is False and sched.at(a.id) == 1
    with pytest.raises(ValueError, match="in flight"):
        sched.start(["f"])  # still two in flight
    assert sched.passed(a.id) is True and sched.busy() == {"d", "e", "x"}
    assert sched.next_group(list("abcde"), []) == (list("abc"), [])  # a's rows go again at once
    with pytest.raises(ValueError):
        sched.start([])
    with pytest.raises(ValueError):
        sched.start(["q", "q"])
    with pytest.raises(ValueError):
        MicroBatchSchedule(0)
    assert [mb.id for mb in sched.drop()] == [b.id] and sched.free() == 2 and not sched.busy()
