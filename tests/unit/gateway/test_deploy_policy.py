"""A deployment that names no scaling policy gets its mode's: BlitzScale's threshold policy for
`blitzscale` (capacity_tps defaulted, BLITZSCALE_CAPACITY_TPS), concurrency for the others."""

import pydantic
import pytest

from libs.planning.scaleout import BLITZSCALE_CAPACITY_TPS, deploy_policy
from services.gateway.schemas import DeployRequest


@pytest.mark.parametrize("mode", ["blitzscale", "blitzscale-nopairs"])
def test_a_blitzscale_deployment_without_a_policy_gets_the_threshold_policy(mode):
    body = DeployRequest(name="m", path="/p", scaling_mode=mode)
    assert body.policy == "threshold" and body.policy_params == {"capacity_tps": BLITZSCALE_CAPACITY_TPS}
    given = DeployRequest(name="m", path="/p", scaling_mode=mode, policy_params={"capacity_tps": 40, "upper": 0.9})
    assert given.policy == "threshold" and given.policy_params == {"capacity_tps": 40, "upper": 0.9}
    # A policy named is kept, and then its own parameters are required.
    assert DeployRequest(name="m", path="/p", scaling_mode=mode, policy="concurrency").policy == "concurrency"
    with pytest.raises(pydantic.ValidationError, match="capacity_tps"):
        DeployRequest(name="m", path="/p", scaling_mode=mode, policy="threshold")


def test_other_modes_keep_the_concurrency_default():
    for mode in ("layercast", "chain", None):
        body = DeployRequest(name="m", path="/p", **({"scaling_mode": mode} if mode else {}))
        assert body.policy == "concurrency" and body.policy_params == {}
    assert deploy_policy("chain", None, {"target": 2}) == ("concurrency", {"target": 2})
    with pytest.raises(pydantic.ValidationError):
        DeployRequest(name="m", path="/p", scaling_mode="blitz")  # an unknown mode is still refused
