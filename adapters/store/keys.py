"""A request's prefix block keys as the run store keeps them: one BLOB of little-endian signed 64-bit ints."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

_SWAP = sys.byteorder != "little"
_WRAP = 2**64
_HALF = 2**63


def pack_keys(keys: Sequence[int] | bytes | None) -> bytes | None:
    """`keys` packed 8 bytes a key, in order (None stays None: not recorded; () is b"": no full block).

    Bytes are taken as already packed. A key outside the signed 64-bit range (core.cache.keys makes
    none) is wrapped into it, as a 64-bit hash would be."""
    if keys is None or isinstance(keys, bytes):
        return keys
    try:
        packed = array("q", keys)
    except OverflowError:
        packed = array("q", [(int(k) + _HALF) % _WRAP - _HALF for k in keys])
    if _SWAP:
        packed.byteswap()
    return packed.tobytes()


def unpack_keys(blob: bytes | None) -> tuple[int, ...] | None:
    """The keys `pack_keys` packed (None: none were recorded)."""
    if blob is None:
        return None
    if len(blob) % 8:
        raise ValueError(f"a packed prefix-key BLOB is a multiple of 8 bytes long, this one is {len(blob)}")
    keys = array("q")
    keys.frombytes(blob)
    if _SWAP:
        keys.byteswap()
    return tuple(keys)
