"""libs.checkpoint.crc: combining CRC-32s of pieces gives zlib's CRC-32 of the whole."""

from __future__ import annotations

import os
import random
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libs.checkpoint.crc import crc32_combine, crc32_of_pieces

MiB = 1 << 20


@settings(deadline=None)
@given(st.binary(max_size=4096), st.binary(max_size=4096))
def test_combine_matches_zlib(a, b):
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_combine_with_empty_pieces():
    data = b"serverless"
    assert crc32_combine(zlib.crc32(data), zlib.crc32(b""), 0) == zlib.crc32(data)
    assert crc32_combine(zlib.crc32(b""), zlib.crc32(data), len(data)) == zlib.crc32(data)
    assert crc32_combine(0, 0, 0) == zlib.crc32(b"") == 0


@settings(deadline=None)
@given(
    st.binary(max_size=2048),
    st.integers(min_value=MiB, max_value=3 * MiB),
    st.sampled_from([0x00, 0xFF, 0x5A]),
)
def test_combine_large_second_piece(a, n, fill):
    """Lengths of 1-3 MiB exercise the high bits of len2 (many squared zero operators)."""
    b = bytes([fill]) * n
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), n) == zlib.crc32(a + b)


@pytest.mark.parametrize("n", [MiB, MiB + 1, 2 * MiB + 12345, 3 * MiB - 1, 3 * MiB])
def test_combine_large_random(n):
    rng = random.Random(n)
    a = rng.randbytes(rng.randrange(0, 5000))
    b = rng.randbytes(n)
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), n) == zlib.crc32(a + b)
    # And the other way round: a large first piece, a small second one.
    assert crc32_combine(zlib.crc32(b), zlib.crc32(a), len(a)) == zlib.crc32(b + a)


@settings(deadline=None)
@given(st.data())
def test_pieces_of_any_split(data):
    whole = data.draw(st.binary(max_size=8192), label="whole")
    cuts = sorted(data.draw(st.lists(st.integers(0, len(whole)), max_size=12), label="cuts"))
    bounds = [0, *cuts, len(whole)]
    pieces = [whole[s:e] for s, e in zip(bounds, bounds[1:])]  # empty pieces included
    assert b"".join(pieces) == whole
    assert crc32_of_pieces([(zlib.crc32(p), len(p)) for p in pieces]) == zlib.crc32(whole)


def test_pieces_like_loader_chunks():
    """A block split into 4 KiB chunks with a short tail, as the loader's readers see it."""
    whole = os.urandom(3 * MiB + 777)
    chunk = 4096
    pieces = [whole[s : s + chunk] for s in range(0, len(whole), chunk)]
    assert crc32_of_pieces([(zlib.crc32(p), len(p)) for p in pieces]) == zlib.crc32(whole)
    # One wrong piece CRC changes the result.
    bad = [(zlib.crc32(p), len(p)) for p in pieces]
    bad[5] = (bad[5][0] ^ 1, bad[5][1])
    assert crc32_of_pieces(bad) != zlib.crc32(whole)


def test_pieces_empty_list_and_bad_length():
    assert crc32_of_pieces([]) == zlib.crc32(b"") == 0
    assert crc32_of_pieces([(0, 0), (0, 0)]) == 0
    with pytest.raises(ValueError):
        crc32_combine(1, 2, -1)
