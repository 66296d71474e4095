"""Profiles between libs.planning.mesh.Profile and the registry's ModelProfile message: a valid
profile survives the round trip (through JSON too), a broken one is refused naming its field."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from libs.planning.mesh import Profile
from libs.planning.mesh_profiles import InvalidProfile, device_kind, profile_from_message, profile_to_message
from libs.protocol import messages as m

ascending = st.lists(st.integers(1, 4096), min_size=1, max_size=6, unique=True).map(sorted)
seconds = st.floats(0, 10, allow_nan=False)


@st.composite
def profiles(draw) -> Profile:
    prefill_lengths, batches, lengths = draw(ascending), draw(ascending), draw(ascending)
    prefill_s = draw(st.lists(seconds, min_size=len(prefill_lengths), max_size=len(prefill_lengths)))
    decode_s = [draw(st.lists(seconds, min_size=len(lengths), max_size=len(lengths))) for _ in batches]
    return Profile(tuple(prefill_lengths), tuple(prefill_s), tuple(batches), tuple(lengths),
                   tuple(tuple(r) for r in decode_s))


@given(profiles(), st.sampled_from(["cpu", "cuda", "cuda:1"]))
def test_a_profile_survives_the_message_and_its_json(profile, device):
    msg = profile_to_message("demo", device, profile, source="w1")
    assert (msg.model, msg.device, msg.source) == ("demo", device_kind(device), "w1")
    assert profile_from_message(msg) == profile
    assert profile_from_message(m.ModelProfile.model_validate_json(msg.model_dump_json())) == profile


def good(**update) -> m.ModelProfile:
    base = m.ModelProfile(model="demo", device="cpu", prefill_lengths=[1, 2, 4], prefill_s=[0.1, 0.2, 0.4],
                          batches=[1, 2], lengths=[1, 8], decode_s=[[0.01, 0.02], [0.02, 0.03]])
    return base.model_copy(update=update)


@pytest.mark.parametrize("update, field", [
    ({"prefill_s": [0.1, 0.2]}, "prefill_s"),
    ({"decode_s": [[0.01, 0.02]]}, "decode_s"),
    ({"decode_s": [[0.01, 0.02], [0.02]]}, "decode_s[1]"),
    ({"prefill_lengths": [1, 4, 2]}, "prefill_lengths"),
    ({"batches": [2, 2]}, "batches"),
    ({"lengths": [0, 8]}, "lengths"),
    ({"prefill_s": [0.1, -0.2, 0.4]}, "prefill_s"),
    ({"prefill_s": [0.1, math.nan, 0.4]}, "prefill_s"),
    ({"decode_s": [[0.01, 0.02], [math.inf, 0.03]]}, "decode_s[1]"),
])
def test_a_broken_profile_is_refused_naming_its_field(update, field):
    with pytest.raises(InvalidProfile) as e:
        profile_from_message(good(**update))
    assert e.value.field == field and str(e.value).startswith(f"{field}: ")


def test_device_kinds():
    assert [device_kind(d) for d in ("cpu", "cuda", "cuda:0", "CUDA:3")] == ["cpu", "cuda", "cuda", "cuda"]
    with pytest.raises(ValueError, match="neither cpu nor cuda"):
        device_kind("mps")
