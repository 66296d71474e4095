"""The cluster's sharing settings (libs/planning/sharing.py): the one list of names, and what
each one means to the gateway's routing order."""

import pytest

from libs.planning.sharing import SHARINGS, sharing_setting


def test_an_unknown_sharing_name_names_the_known_ones():
    with pytest.raises(ValueError, match="sharing must be one of exclusive, mesh, dedicated, got 'spread'"):
        sharing_setting("spread")


def test_each_setting_is_registered_under_its_own_name():
    assert all(sharing_setting(name).name == name for name in SHARINGS)


def _first(name: str, routes: list[tuple[str, int, str]]) -> str:
    return min(routes, key=lambda r: sharing_setting(name).route_key(*r))[2]


def test_exclusive_spreads_the_load_and_mesh_packs_it_cpu_first():
    routes = [("cuda", 0, "idle-gpu"), ("cpu", 1, "busy-cpu"), ("cpu", 3, "busier-cpu")]
    assert _first("exclusive", routes) == "idle-gpu"  # the fewest in flight, whatever the device
    assert _first("mesh", routes) == "busier-cpu"  # CPU before CUDA, then the largest batch (§7.2)
