"""The cluster's sharing settings by name: the one list every service, flag and env reads.

A sharing setting says how models share workers. ``exclusive``: an instance per device, its
engines step in turn, least-loaded routing. ``mesh`` (LLM-Mesh): many models share a worker,
admission by shadow validation, bin-packing routing (§7.2). ``dedicated``: one model per
worker at a time, the baseline LLM-Mesh compares with (ServerlessLLM's allocation): a worker
serving model A that must serve model B unloads A first (after A's requests in flight end);
the planner places by :func:`libs.planning.placement.pick_dedicated_targets`, the gateway
routes least-loaded. What a setting means to the
gateway is here (its routing order, pure); what it means to a worker is the strategy of the
same name in services/worker/sharing.py (a test checks both registries name the same settings).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from libs.planning.mesh import bin_packing_key

# (device kind of the entry worker, slots in flight, instance id) -> the sort key among free routes
RouteKey = Callable[[str, int, str], tuple]


def least_loaded_key(device: str, in_flight: int, instance_id: str) -> tuple:
    """The fewest requests in flight first (one model per device: spread the load)."""
    return in_flight, instance_id


@dataclass(frozen=True)
class SharingSetting:
    name: str
    route_key: RouteKey  # how the gateway orders an instance's free routes (loading ones always last)
    # The planner never places a second model on a worker (pick_dedicated_targets), and a worker
    # unloads what it holds before it loads another model.
    one_model_per_worker: bool = False


SHARINGS: dict[str, SharingSetting] = {
    "exclusive": SharingSetting("exclusive", least_loaded_key),
    "mesh": SharingSetting("mesh", bin_packing_key),
    "dedicated": SharingSetting("dedicated", least_loaded_key, one_model_per_worker=True),
}


def sharing_setting(name: str) -> SharingSetting:
    """The setting of this name (ValueError naming the known ones: the one place they are checked)."""
    try:
        return SHARINGS[name]
    except KeyError:
        raise ValueError(f"sharing must be one of {', '.join(SHARINGS)}, got {name!r}") from None
