"""Block keys: one per full block, a chain over the prefix, the same in every process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from core.cache.keys import ROOT_KEY, chain_keys, extra_int, num_full_blocks

TOKENS = list(range(100, 140))  # 40 tokens: 2.5 blocks of 16


def test_one_key_per_full_block_and_none_for_the_partial_tail() -> None:
    assert len(chain_keys(TOKENS, 16)) == 2 == num_full_blocks(40, 16)
    assert chain_keys(TOKENS[:15], 16) == []
    assert len(chain_keys(TOKENS[:32], 16)) == 2


def test_keys_chain_over_the_prefix() -> None:
    keys = chain_keys(TOKENS, 8)
    assert chain_keys(TOKENS[:24], 8) == keys[:3]  # a prefix's keys are a prefix of the keys
    changed = list(TOKENS)
    changed[20] = 7  # in block 2
    other = chain_keys(changed, 8)
    assert other[:2] == keys[:2]
    assert all(a != b for a, b in zip(other[2:], keys[2:], strict=True))  # and every later one


def test_same_block_under_another_parent_has_another_key() -> None:
    block = TOKENS[:8]
    a = chain_keys(block + block, 8)
    assert a[0] != a[1]


def test_parent_continues_a_chain() -> None:
    keys = chain_keys(TOKENS[:32], 8)
    assert chain_keys(TOKENS[16:32], 8, parent=keys[1]) == keys[2:]
    assert chain_keys(TOKENS[:8], 8, parent=ROOT_KEY) == keys[:1]


def test_tuple_list_and_numpy_give_the_same_keys() -> None:
    assert chain_keys(tuple(TOKENS), 16) == chain_keys(TOKENS, 16)
    assert chain_keys(np.array(TOKENS, dtype=np.int32), 16) == chain_keys(TOKENS, 16)


def test_extra_enters_every_key() -> None:
    plain = chain_keys(TOKENS, 16)
    salted = chain_keys(TOKENS, 16, extra="tenant-a")
    assert all(a != b for a, b in zip(plain, salted, strict=True))
    assert salted == chain_keys(TOKENS, 16, extra="tenant-a")
    assert salted != chain_keys(TOKENS, 16, extra="tenant-b")
    assert chain_keys(TOKENS, 16, extra=("lora", 3)) != chain_keys(TOKENS, 16, extra=("lora", 4))


def test_bad_block_size_is_an_error() -> None:
    with pytest.raises(ValueError, match="block_size"):
        chain_keys(TOKENS, 0)


_CHILD = (
    "import json; from core.cache.keys import chain_keys, extra_int; "
    "print(json.dumps([chain_keys(list(range(100, 140)), 16), "
    "chain_keys(list(range(100, 140)), 16, extra=('lora-x', 7)), extra_int('salt')]))"
)


@pytest.mark.parametrize("seed", ["0", "12345", "random"])
def test_keys_do_not_depend_on_pythonhashseed(seed: str) -> None:
    here = [chain_keys(TOKENS, 16), chain_keys(TOKENS, 16, extra=("lora-x", 7)), extra_int("salt")]
    env = {**os.environ, "PYTHONHASHSEED": seed}
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == here
