"""Fuzzing the checkpoint index (layercast_index.json; libs/checkpoint/format.py): any bytes, or a
real index with any field changed, parse to an index whose blocks and tensors are consistent, or
raise a CheckpointFormatError; never another exception, and no block larger than its data file
(a size of 2^63 is refused before anything allocates it)."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libs.checkpoint import DATA_FILE, INDEX_FILE, CheckpointFormatError, CheckpointIndex
from libs.checkpoint.loader import load_block

FUZZ = settings(max_examples=80, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

values = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 64), 1 << 64), st.just(1 << 63), st.floats(),
                   st.text(max_size=10), st.lists(st.integers(-2, 1 << 40), max_size=3),
                   st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))


@pytest.fixture(scope="module")
def real(tiny_checkpoint) -> dict:
    return json.loads((tiny_checkpoint / INDEX_FILE).read_text())


def _consistent(index: CheckpointIndex) -> None:
    assert [b.id for b in index.blocks] == list(range(index.n_blocks))
    for b in index.blocks:
        assert 0 <= b.layer_start <= b.layer_end <= index.n_layers and b.offset >= 0 and b.nbytes >= 0
    for t in index.tensors:
        assert 0 <= t.offset_in_block and t.offset_in_block + t.nbytes <= index.block(t.block).nbytes


@st.composite
def mutated(draw, real: dict) -> dict:
    """The real index with a few fields of it, its blocks or its tensors replaced or removed."""
    d = json.loads(json.dumps(real))
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from(["top", "block", "tensor"]))
        # an earlier change may have removed the list or replaced it (or its items) by another type
        items = [x for x in d.get(where + "s") or [] if isinstance(x, dict)] if isinstance(d.get(where + "s"), list) else []
        target = d if where == "top" or not items else draw(st.sampled_from(items))
        key = draw(st.sampled_from(sorted(target) + ["extra"]))
        if draw(st.integers(0, 5)) == 0:
            target.pop(key, None)
        else:
            target[key] = draw(values)
    return d


@FUZZ
@given(data=st.data())
def test_a_real_index_with_any_field_changed_parses_consistently_or_raises_a_format_error(real, data):
    d = data.draw(mutated(real))
    try:
        index = CheckpointIndex.from_dict(d)
    except CheckpointFormatError:
        return
    _consistent(index)


@FUZZ
@given(st.one_of(st.binary(max_size=200), st.lists(values, max_size=3).map(lambda v: json.dumps(v).encode()),
                 st.integers(1, 3000).map(lambda depth: b"[" * depth + b"]" * depth)))
def test_any_bytes_as_the_index_file_load_or_raise_a_format_error(tmp_path_factory, raw):
    folder = tmp_path_factory.mktemp("index")
    (folder / INDEX_FILE).write_bytes(raw)
    try:
        CheckpointIndex.load(folder)
    except CheckpointFormatError:
        pass


def test_a_block_past_the_end_of_the_data_file_is_refused_before_any_buffer(tiny_checkpoint, real, tmp_path):
    d = json.loads(json.dumps(real))
    d["blocks"][-1]["nbytes"] = 1 << 63  # the tensors still fit inside it: only the data file says no
    (tmp_path / INDEX_FILE).write_text(json.dumps(d))
    (tmp_path / DATA_FILE).write_bytes((tiny_checkpoint / DATA_FILE).read_bytes())
    with pytest.raises(CheckpointFormatError, match="past the end"):
        CheckpointIndex.load(tmp_path)
    CheckpointIndex.load(tiny_checkpoint)  # the real one loads
    load_block(tiny_checkpoint, CheckpointIndex.load(tiny_checkpoint), 0)


@pytest.mark.parametrize("change", [
    {"data_file": "../../etc/passwd"},  # outside the checkpoint folder
    {"blocks": [{"id": 0}]},
    {"n_layers": True},
    {"tensors": [None]},
])
def test_an_index_with_a_wrong_field_names_it(real, change):
    with pytest.raises(CheckpointFormatError):
        CheckpointIndex.from_dict({**real, **change})
