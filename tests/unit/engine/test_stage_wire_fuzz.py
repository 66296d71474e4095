"""Fuzzing the pipeline stages' wire format (activations, KV and their replies between workers, live
pairs' front calls included; libs/engine/stages.py): any bytes are unpacked or refused with a
StageMessageError, never another exception, and a tensor's shape accounts for exactly the bytes sent
(a shape of 2^63 elements is refused, not allocated)."""

import json
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libs.engine.stages import WIRE_DTYPES, StageMessageError, pack, unpack

FUZZ = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])

sizes = st.one_of(st.integers(0, 6), st.integers(-3, -1), st.just(1 << 63), st.integers(0, 1 << 64))
headers = st.fixed_dictionaries({}, optional={
    "dtype": st.one_of(st.sampled_from(sorted(WIRE_DTYPES) + ["qint8", "complex64", "float8_e4m3fn", "Tensor",
                                                              "__class__"]), st.integers(), st.none()),
    "shape": st.one_of(st.lists(st.one_of(sizes, st.booleans(), st.floats(), st.text(max_size=2)), max_size=10),
                       st.integers(), st.text(max_size=4), st.none()),
    "call_id": st.text(max_size=8), "ok": st.booleans()})


@st.composite
def stage_message(draw) -> bytes:
    head = draw(st.one_of(headers.map(lambda h: json.dumps(h).encode()), st.binary(max_size=32),
                          st.integers(1, 3000).map(lambda depth: b"[" * depth + b"]" * depth)))
    declared = draw(st.one_of(st.just(len(head)), st.integers(0, (1 << 32) - 1)))
    return struct.pack("!I", declared) + head + draw(st.binary(max_size=48))


@FUZZ
@given(st.one_of(st.binary(max_size=64), stage_message()))
def test_any_stage_message_unpacks_to_a_tensor_of_its_bytes_or_raises_a_stage_message_error(payload):
    try:
        header, tensor = unpack(payload)
    except StageMessageError:
        return
    assert isinstance(header, dict)
    if tensor is not None:
        n = struct.unpack_from("!I", payload)[0]
        assert tensor.numel() * tensor.element_size() == len(payload) - 4 - n


@FUZZ
@given(st.sampled_from(sorted(WIRE_DTYPES)), st.lists(st.integers(0, 4), max_size=4))
def test_what_pack_writes_unpack_reads_back(dtype, shape):
    t = torch.zeros(shape, dtype=WIRE_DTYPES[dtype])
    header, back = unpack(pack({"call_id": "c"}, t))
    assert header["call_id"] == "c" and back.dtype == t.dtype and list(back.shape) == shape


@pytest.mark.parametrize("header,data", [
    ({"dtype": "float32", "shape": [1 << 62, 1 << 62]}, b"\0" * 4),  # elements the bytes do not hold
    ({"dtype": "float32", "shape": [True]}, b"\0" * 4),
    ({"dtype": "qint8", "shape": [4]}, b"\0" * 4),  # a torch dtype no stage sends
    ({"dtype": "float32"}, b""),  # no shape
])
def test_a_tensor_the_bytes_do_not_make_is_refused(header, data):
    head = json.dumps(header).encode()
    with pytest.raises(StageMessageError):
        unpack(struct.pack("!I", len(head)) + head + data)
