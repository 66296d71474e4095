"""CRC-32 (zlib's) of a byte range from the CRCs of its pieces.

Reader threads checksum their chunks in parallel, in whatever order the chunks
arrive; the block's CRC is then combined from the chunk CRCs without touching the
bytes again. This is zlib's crc32_combine: appending n zero bytes to a message
is a linear map on its CRC over GF(2), and the maps for 2**k zero bytes are
squares of each other, so combining costs one 32x32 bit-matrix product per set
bit of the second piece's length.
"""

from __future__ import annotations

from functools import cache

_POLY = 0xEDB88320  # CRC-32, reflected


def _times(matrix: tuple[int, ...], vector: int) -> int:
    result, i = 0, 0
    while vector:
        if vector & 1:
            result ^= matrix[i]
        vector >>= 1
        i += 1
    return result


def _square(matrix: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(_times(matrix, matrix[n]) for n in range(32))


@cache
def _zeros_operator(k: int) -> tuple[int, ...]:
    """The map that appends 2**k zero bytes to a message, acting on its CRC register."""
    if k == 0:
        one_bit = (_POLY, *(1 << n for n in range(31)))
        return _square(_square(_square(one_bit)))  # 8 zero bits
    return _square(_zeros_operator(k - 1))


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """crc32(a + b) from crc1 = crc32(a), crc2 = crc32(b) and len2 = len(b)."""
    if len2 < 0:
        raise ValueError("len2 must be >= 0")
    k = 0
    while len2:
        if len2 & 1:
            crc1 = _times(_zeros_operator(k), crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2


def crc32_of_pieces(pieces: list[tuple[int, int]]) -> int:
    """CRC of the concatenation of pieces given as (crc, length), in order."""
    crc = 0
    for piece_crc, length in pieces:
        crc = crc32_combine(crc, piece_crc, length)
    return crc
