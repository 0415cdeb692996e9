"""Prefix keys packed into the run store's BLOB and back: order, sign, empty versus unrecorded, byte layout."""

from __future__ import annotations

import struct

import pytest

from adapters.store.keys import pack_keys, unpack_keys
from core.cache.keys import prompt_keys


def test_keys_round_trip_in_order_with_their_signs() -> None:
    keys = (0, 1, -1, 2**63 - 1, -(2**63), 0x5EB1_C0DE_0000_0001)
    blob = pack_keys(keys)
    assert blob is not None and len(blob) == 8 * len(keys)
    assert blob[:16] == struct.pack("<qq", 0, 1)  # little-endian signed 64-bit, 8 bytes a key
    assert unpack_keys(blob) == keys


def test_real_prompt_keys_round_trip() -> None:
    keys = prompt_keys(range(1000), 16, lora="sql")
    assert len(keys) == 62 and unpack_keys(pack_keys(keys)) == tuple(keys)


def test_none_is_unrecorded_and_empty_is_no_full_block() -> None:
    assert pack_keys(None) is None and unpack_keys(None) is None
    assert pack_keys(()) == b"" and unpack_keys(b"") == ()


def test_packed_bytes_pass_through_and_out_of_range_keys_wrap() -> None:
    blob = struct.pack("<qq", 3, -4)
    assert pack_keys(blob) is blob
    assert unpack_keys(pack_keys([2**64 + 3, 2**63])) == (3, -(2**63))


def test_a_blob_of_the_wrong_length_is_an_error() -> None:
    with pytest.raises(ValueError, match="multiple of 8 bytes"):
        unpack_keys(b"\x00" * 7)
