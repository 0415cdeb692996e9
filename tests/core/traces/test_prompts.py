"""Prompts that keep a trace's prefix structure: the same hash id → the same tokens, seeds apart."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from core.traces.prompts import DEFAULT_VOCAB, FIRST_ID, block_ids, hash_prompt, scaled_length
from tests.procs import ROOT


def test_the_same_hash_id_gives_the_same_block_in_any_row_and_any_call() -> None:
    a = block_ids([7, 8, 9], seed=1, block_tokens=32)
    b = block_ids([9, 7], seed=1, block_tokens=32)
    assert a.shape == (3, 32) and a.dtype == np.int64
    assert np.array_equal(a[2], b[0]) and np.array_equal(a[0], b[1])
    assert np.array_equal(a, block_ids([7, 8, 9], seed=1, block_tokens=32))
    # a block's first tokens do not depend on the block size (a scaled trace keeps its blocks' heads)
    assert np.array_equal(block_ids([7], seed=1, block_tokens=16)[0], a[0][:16])
    # different ids are different blocks; huge and negative ids are reduced modulo 2^64, not refused
    assert len({tuple(r) for r in block_ids(range(200), seed=1, block_tokens=16).tolist()}) == 200
    assert block_ids([2**70 + 5, -1], seed=1).shape == (2, 512)


def test_the_same_tokens_in_another_process() -> None:
    code = (
        "from core.traces.prompts import hash_prompt; "
        "print(hash_prompt([0, 5, 123456789], 1100, seed=(42, 0), row=3, block_tokens=512).tolist())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    here = hash_prompt([0, 5, 123456789], 1100, seed=(42, 0), row=3, block_tokens=512).tolist()
    assert eval(out.stdout) == here  # noqa: S307 - our own subprocess's list literal


def test_different_seeds_share_nothing() -> None:
    ids = list(range(50))
    a = hash_prompt(ids, 50 * 16, seed=1, row=0, block_tokens=16)
    for other in (2, (1, 1), (1, 0)):
        b = hash_prompt(ids, 50 * 16, seed=other, row=0, block_tokens=16)
        assert not np.array_equal(a[:16], b[:16])
        # no 16-token block of one replay is a block of the other
        assert not {tuple(r) for r in a.reshape(-1, 16).tolist()} & {tuple(r) for r in b.reshape(-1, 16).tolist()}
        # and position by position they agree about as often as chance (1 / 2044)
        assert np.mean(a == b) < 0.01


def test_rows_sharing_leading_hash_ids_share_exactly_those_tokens() -> None:
    bs = 512
    first = hash_prompt([0, 1, 2], 1100, seed=9, row=0, block_tokens=bs)  # 2 full blocks + 76 tokens
    later = hash_prompt([0, 1, 2, 3, 4], 2300, seed=9, row=1, block_tokens=bs)  # the next turn
    other = hash_prompt([0, 1, 5, 6], 1800, seed=9, row=2, block_tokens=bs)  # branches after block 1
    assert len(first) == 1100 and len(later) == 2300 and len(other) == 1800
    # the partial last block of `first` is a prefix of the same block in full
    assert np.array_equal(later[:1100], first)
    assert np.array_equal(other[:1024], first[:1024])
    assert other[1024] != later[1024] or other[1025] != later[1025]
    assert not np.array_equal(other[1024:1100], first[1024:1100])


def test_rows_longer_than_their_blocks_and_rows_without_blocks_get_fresh_ids_of_their_own() -> None:
    a = hash_prompt([3], 40, seed=1, row=0, block_tokens=16)
    b = hash_prompt([3], 40, seed=1, row=1, block_tokens=16)
    assert np.array_equal(a[:16], b[:16]) and not np.array_equal(a[16:], b[16:])
    assert np.array_equal(a, hash_prompt([3], 40, seed=1, row=0, block_tokens=16))
    c = hash_prompt([], 30, seed=1, row=0, block_tokens=16)
    assert len(c) == 30 and not np.array_equal(c[:16], a[:16])
    assert len(hash_prompt([1, 2], 0, seed=1, row=0)) == 0


def test_ids_stay_inside_the_vocabulary_and_clear_of_special_tokens() -> None:
    ids = hash_prompt(list(range(100)), 100 * 512, seed=5, row=0)
    assert ids.min() >= FIRST_ID and ids.max() < DEFAULT_VOCAB
    assert len(np.unique(ids)) > 0.95 * (DEFAULT_VOCAB - FIRST_ID)  # the whole range is used
    small = hash_prompt(list(range(10)), 5000, seed=5, row=0, vocab_size=10)
    assert set(small.tolist()) == set(range(FIRST_ID, 10))
    with pytest.raises(ValueError):
        hash_prompt([1], 10, seed=1, row=0, vocab_size=FIRST_ID)
    with pytest.raises(ValueError):
        hash_prompt([1], 10, seed=1, row=0, block_tokens=0)


def test_scaled_lengths_keep_the_number_of_blocks() -> None:
    assert scaled_length(6758, 512) == 6758
    for p in (1, 511, 512, 513, 1100, 6758, 126195):
        blocks = -(-p // 512)
        scaled = scaled_length(p, 16)
        assert -(-scaled // 16) == blocks, p
    assert scaled_length(6758, 16) == 212 and scaled_length(1, 16) == 1
