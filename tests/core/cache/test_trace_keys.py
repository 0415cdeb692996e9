"""Trace rows' block keys equal the ones an engine computes on the replayed prompt (hash_prompt + chain_keys)."""

from __future__ import annotations

import random

import pytest

from core.cache.keys import chain_keys, prompt_keys
from core.cache.trace_keys import TraceKeys
from core.traces.prompts import hash_prompt


@pytest.mark.parametrize(("hash_block_tokens", "block_size"), [(512, 16), (16, 16), (32, 16), (24, 16), (64, 32)])
def test_keys_equal_the_replayed_prompts_keys_over_the_hash_blocks(hash_block_tokens: int, block_size: int) -> None:
    rng = random.Random(hash_block_tokens)
    tk = TraceKeys(block_size, hash_block_tokens=hash_block_tokens, seed=(11, 0), memo_blocks=8)
    for row in range(60):
        ids = [rng.randrange(12) for _ in range(rng.randrange(0, 6))]
        n = rng.randrange(1, 7 * hash_block_tokens)
        want = chain_keys(
            hash_prompt(ids, n, seed=(11, 0), row=row, block_tokens=hash_block_tokens).tolist(), block_size
        )
        got = tk.keys(ids, n, row)
        assert len(got) == len(want) == n // block_size
        shared = min(len(ids) * hash_block_tokens, n) // block_size
        assert got[:shared] == tuple(want[:shared])
        if hash_block_tokens % block_size:
            assert got == tuple(want)  # built from the whole prompt
    assert len(tk._memo) <= 8


def test_rows_share_keys_exactly_as_far_as_their_hash_ids_agree() -> None:
    tk = TraceKeys(16, hash_block_tokens=32)
    a, b, c = tk.keys([1, 2, 3], 96, 0), tk.keys([1, 2, 4], 96, 1), tk.keys([], 96, 2)
    assert a[:4] == b[:4] and a[4] != b[4]
    assert not set(c) & (set(a) | set(b))
    assert tk.keys([1, 2, 3], 96, 0) == a  # deterministic; another seed shares nothing
    assert not set(TraceKeys(16, hash_block_tokens=32, seed=(1, 0)).keys([1, 2, 3], 96, 0)) & set(a)


@pytest.mark.parametrize(("hash_block_tokens", "block_size"), [(32, 16), (24, 16)])
def test_a_rows_keys_under_an_adapter_are_the_engines_under_it_and_shared_with_no_other(
    hash_block_tokens: int, block_size: int
) -> None:
    """The same row under adapter a1, a2 and the base model: each equals what an engine keys the replayed prompt
    with under that adapter (prompt_keys: vLLM 0.32's LoRA extra key in every block); no two share a block, and
    the memo of one adapter's blocks never answers for another's."""
    tk = TraceKeys(block_size, hash_block_tokens=hash_block_tokens, seed=(3, 0))
    ids, n = [1, 2, 3], 3 * hash_block_tokens
    prompt = hash_prompt(ids, n, seed=(3, 0), row=0, block_tokens=hash_block_tokens).tolist()
    got = {lora: tk.keys(ids, n, 0, lora) for lora in ("a1", None, "a2")}
    for lora, keys in got.items():
        assert keys == tuple(prompt_keys(prompt, block_size, lora))
        assert len(keys) == n // block_size
    assert got[None] == tuple(chain_keys(prompt, block_size)) == tk.keys(ids, n, 0, "")
    assert not set(got["a1"]) & set(got[None])
    assert not set(got["a1"]) & set(got["a2"])
    assert not set(got["a2"]) & set(got[None])
    assert tk.keys(ids, n, 1, "a1") == got["a1"]  # another row, same adapter: shared
