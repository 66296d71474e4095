"""Scale-out plans per scaling mode (libs.planning.scaleout) and multicast sources (placement)."""

import typing

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libs.planning.multicast import validate_schedule
from libs.planning.placement import Held, full_copies
from libs.planning.scaleout import MULTICAST_MODES, SCALING_MODES, plan_nodes, scaleout_plan
from libs.protocol import messages as m


@settings(max_examples=150, deadline=None)
@given(mode=st.sampled_from(MULTICAST_MODES), sources=st.integers(1, 4), targets=st.integers(1, 9),
       blocks=st.integers(1, 12), link_gbps=st.sampled_from([0.4, 10.0, 100.0]))
def test_every_multicast_mode_plans_a_valid_schedule_that_reaches_every_target(mode, sources, targets, blocks,
                                                                                link_gbps):
    plan = scaleout_plan(mode, sources, targets, 64 << 20, blocks, link_gbps)
    assert 1 <= plan.k <= min(sources, targets)
    names = plan_nodes(plan, [f"s{i}" for i in range(sources)], [f"t{i}" for i in range(targets)])
    assert len(names) == plan.k + targets and len(set(names)) == len(names)
    # Sources hold every block at the start; every target ends with every block, one port per node.
    validate_schedule(plan.schedule, len(names), blocks, sources=range(plan.k))
    expected = {"chain": "chain", "binomial": "binomial", "faasnet": "binary-tree"}.get(mode)
    assert expected is None or plan.algorithm == expected


@pytest.mark.parametrize("mode", ["serverlessllm", "static", "ideal"])
def test_modes_that_do_not_multicast_plan_nothing(mode):
    assert scaleout_plan(mode, 2, 3, 1 << 20, 4, 10.0) is None


def test_no_source_or_no_target_means_no_multicast():
    assert scaleout_plan("layercast", 0, 3, 1 << 20, 4, 10.0) is None
    assert scaleout_plan("layercast", 2, 0, 1 << 20, 4, 10.0) is None


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="unknown scaling mode"):
        scaleout_plan("teleport", 1, 1, 1 << 20, 4, 10.0)


def test_the_protocol_admits_exactly_the_planners_modes():
    assert set(typing.get_args(m.ScalingMode)) == set(SCALING_MODES)


def test_full_copies_are_workers_with_every_block_in_host_memory():
    held = [Held("a", 0, "host"), Held("a", 1, "host"), Held("b", 0, "host"), Held("b", 1, "gpu"),
            Held("c", 0, "host"), Held("c", 1, "host"), Held("c", 2, "ssd")]
    assert full_copies([0, 1], held, ["c", "b", "a", "d"]) == ["c", "a"]  # in the given order
    assert full_copies([0, 1, 2], held, ["a", "b", "c"]) == []
