"""The multicast algorithm registry (libs.planning.multicast): one vocabulary of names, each
algorithm registered once, and execution pipelines read off the schedule, not the name."""

import typing

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libs.planning.multicast import (
    ALGORITHM_ALIASES,
    MULTICAST_ALGORITHMS,
    MulticastAlgorithm,
    build_plan,
    holds_jointly_before_alone,
    kway_chain_schedule,
    kway_schedule,
    multicast_algorithm,
    plan_bound_s,
    plan_pipeline_groups,
    schedule_steps,
    validate_schedule,
)
from libs.planning.multicast_choice import CHOICE_ORDER, choose_multicast
from libs.planning.pipelines import plan_pipelines
from libs.protocol import messages as m

# --- one vocabulary ---------------------------------------------------------------------------


def test_the_registry_names_are_the_protocols_multicast_algorithm_names_in_its_order():
    assert typing.get_args(m.MulticastAlgorithmName) == tuple(MULTICAST_ALGORITHMS)
    assert all(alg.name == name for name, alg in MULTICAST_ALGORITHMS.items())


def test_every_alias_and_every_choice_label_resolves_to_a_registered_algorithm():
    assert set(ALGORITHM_ALIASES.values()) <= set(MULTICAST_ALGORITHMS)
    assert not set(ALGORITHM_ALIASES) & set(MULTICAST_ALGORITHMS)  # an alias never shadows a name
    for alg in MULTICAST_ALGORITHMS.values():
        for candidate in alg.candidates:
            assert multicast_algorithm(candidate.label) is alg, candidate
    # The choice's tie-break order is the registered candidates' `prefer` order.
    candidates = sorted((c for alg in MULTICAST_ALGORITHMS.values() for c in alg.candidates), key=lambda c: c.prefer)
    assert CHOICE_ORDER == tuple(c.label for c in candidates) == ("binomial", "kway", "chain")


@pytest.mark.parametrize("alias,name", [("kway", "binomial"), ("k-way", "binomial"), ("binary_tree", "binary-tree")])
def test_a_plan_built_under_an_alias_carries_the_registered_name(alias, name):
    plan = build_plan(alias, 7, 5, 2)
    assert plan == build_plan(name, 7, 5, 2) and plan.algorithm == name


def test_an_unknown_name_is_refused_with_the_registered_ones():
    with pytest.raises(ValueError, match="unknown algorithm 'smoke-signals'; choose from star, binary-tree"):
        multicast_algorithm("smoke-signals")


@settings(max_examples=80, deadline=None)
@given(name=st.sampled_from(list(MULTICAST_ALGORITHMS)), k=st.integers(1, 3), extra=st.integers(0, 8),
       n_blocks=st.integers(1, 9))
def test_every_registered_algorithm_plans_a_complete_schedule_no_faster_than_its_bound(name, k, extra, n_blocks):
    n_nodes = 2 * k + extra  # at least one target per source (k-way sub-groups, chains)
    plan = build_plan(name, n_nodes, n_blocks, k)
    assert plan.k == (k if MULTICAST_ALGORITHMS[name].multi_source else 1)
    steps = validate_schedule(plan.schedule, n_nodes, n_blocks, sources=range(plan.k))
    total, rate = n_blocks << 20, 1e8
    assert plan_bound_s(plan, n_blocks, total, rate, 1 << 20) >= total / rate  # never below M/R
    # The cost model's time for the last step is the whole schedule's, never less than one block step.
    done = MULTICAST_ALGORITHMS[name].cost.done_s(steps - 1, n_blocks, total, rate, 1 << 20, 0.0)
    assert done >= total / rate - 1e-12


@settings(max_examples=60, deadline=None)
@given(n_sources=st.integers(1, 4), n_targets=st.integers(1, 12), n_blocks=st.integers(1, 12))
def test_the_choice_weighs_every_registered_candidate_on_its_own_schedule(n_sources, n_targets, n_blocks):
    choice = choose_multicast(n_sources, n_targets, 1 << 30, n_blocks, 10.0, live=True, chunk_bytes=None)
    assert set(choice.predictions) == set(CHOICE_ORDER)
    for alg in MULTICAST_ALGORITHMS.values():
        for c in alg.candidates:
            p = choice.predictions[c.label]
            k = min(n_sources, n_targets) if c.every_source else 1
            assert p.k == k
            assert p.steps == schedule_steps(build_plan(c.label, k + n_targets, n_blocks, k).schedule)
            assert (p.first_pipeline_s is not None) == alg.forms_pipelines
            # A plan of the candidate's algorithm and k finds the candidate's prediction back.
            found = choice.prediction_for(alg.name, k)
            assert found is not None and found.k == k and multicast_algorithm(found.algorithm) is alg


# --- execution pipelines: a property of the schedule ------------------------------------------


@settings(max_examples=150, deadline=None)
@given(k=st.integers(1, 4), extra=st.integers(0, 10), n_blocks=st.integers(1, 12))
def test_binomial_and_kway_receivers_hold_the_model_jointly_before_alone_with_two_blocks_and_three_receivers_or_two_sources(
        k, extra, n_blocks):
    """1→2 binomial is a chain in disguise (the second receiver gets exactly what the first
    forwards), and one block is held whole or not at all; otherwise the window opens."""
    n_targets = k + extra
    n = k + n_targets
    schedule = kway_schedule(n, n_blocks, k)
    expected = n_blocks >= 2 and (k >= 2 or n_targets >= 3)
    assert holds_jointly_before_alone(schedule, n, n_blocks, range(k, n), range(k)) == expected


@settings(max_examples=150, deadline=None)
@given(name=st.sampled_from(["chain", "star", "binary-tree"]), k=st.integers(1, 3), extra=st.integers(0, 9),
       n_blocks=st.integers(1, 10), data=st.data())
def test_no_group_of_chain_star_or_tree_receivers_ever_holds_the_model_jointly_before_alone(name, k, extra, n_blocks,
                                                                                               data):
    """Each of their receivers holds a prefix of its sender's blocks: the union is one member's."""
    n = 2 * k + extra
    plan = build_plan(name, n, n_blocks, k)
    group = data.draw(st.sets(st.integers(plan.k, n - 1), min_size=1))
    assert not holds_jointly_before_alone(plan.schedule, n, n_blocks, group, range(plan.k))


def test_a_group_with_a_source_or_without_members_needs_no_pipeline():
    schedule = kway_schedule(6, 4, 2)
    assert holds_jointly_before_alone(schedule, 6, 4, [2, 4], range(2))
    assert not holds_jointly_before_alone(schedule, 6, 4, [0, 2, 4], range(2))
    assert not holds_jointly_before_alone(schedule, 6, 4, [], range(2))


def test_which_registered_algorithms_form_pipelines_is_read_off_their_schedules():
    assert {name: alg.forms_pipelines for name, alg in MULTICAST_ALGORITHMS.items()} == {
        "star": False, "binary-tree": False, "chain": False, "chain-blind": False, "binomial": True}


def test_a_new_algorithm_gets_pipelines_by_its_schedule_whatever_its_name(monkeypatch):
    # One function (here an existing schedule) and one registry line; no name anywhere else.
    monkeypatch.setitem(MULTICAST_ALGORITHMS, "shifted", MulticastAlgorithm("shifted", kway_schedule, multi_source=True))
    monkeypatch.setitem(MULTICAST_ALGORITHMS, "relay", MulticastAlgorithm("relay", kway_chain_schedule,
                                                                          multi_source=True))
    nodes = ["s0", "a", "b", "c", "d"]
    # Receivers as one group: the default of an algorithm that names no groups of its own.
    assert plan_pipelines(build_plan("shifted", 5, 4, 1), nodes) == [("a", "b", "c", "d")]
    assert plan_pipelines(build_plan("relay", 5, 4, 1), nodes) == []
    # The registered binomial keeps Alg. 2's groups, of two receivers or more.
    assert plan_pipelines(build_plan("binomial", 8, 4, 2), ["s0", "s1", *"abcdef"]) == [
        ("a", "d"), ("b", "e"), ("c", "f")]
    assert plan_pipeline_groups(build_plan("binomial", 5, 4, 2), 5) == [[2, 4]]  # Alg. 2: [2, 4] and [3]
