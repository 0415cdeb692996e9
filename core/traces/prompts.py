"""Token-id prompts that keep a trace's prefix structure (Mooncake ``hash_ids``).

A Mooncake row lists one hash id per 512-token block of its prompt; two rows share KV for as many
leading blocks as their ids agree, and the last block of a row is partial (every row has exactly
ceil(input_length / 512) ids). :func:`hash_prompt` turns a row into token ids with the same
structure:

* every hash id becomes a fixed block of ``block_tokens`` ids (512 for the trace as shipped; a
  smaller number scales the trace down, e.g. 16 so that one hash block is one 16-token KV block
  of a tiny model), a pure function of ``(seed, hash id, position in the block)``. The same id
  always gives the same tokens for a given seed, in any process, so requests that share leading
  ids share exactly that prefix on the engine (a partial last block is a prefix of the full one);
* the prompt is cut to ``length`` tokens; when the blocks are shorter than ``length`` the rest
  are fresh ids of the row (keyed by ``(seed, row)``, shared with nothing);
* the seed goes into every block's tokens, so prompts under another seed share nothing with
  these (a new ``--prompt-seed`` makes a replay fresh against an earlier one).

Ids lie in ``[FIRST_ID, vocab_size)``. The default ``vocab_size`` 2048 is the tiny Llama's
vocabulary (scripts/make_tiny_llama.py; vLLM rejects ids at or above the vocabulary), and ids
0-3 are its special tokens (<unk> <s> </s> <pad>), so they are kept out; every larger model and
the emulator (which takes any id >= 0 and only treats its own output ids >= 1,000,000 specially)
accept these ids too. 2044 ids per position leave no chance of two different blocks colliding
(2044^16 ≈ 10^53 for one 16-token block).

The generator is a counter-based hash (SplitMix64's finaliser over a key derived from seed and
hash id, plus the position times the golden-ratio increment; the top 32 bits scaled into the id
range), vectorised with NumPy: no state, no cache, linear in the tokens produced, and a block's
first n tokens do not depend on ``block_tokens``. Measured on this machine (2 shared cores) over
the whole Mooncake conversation trace at 512 tokens per block (12,031 rows, 288,500 block
references, 144.8 M tokens): 1.0 s for every row as an int64 array, 6.7 ns per token, 80 µs for
a mean row of 12 k tokens; with the JSON body (orjson, NumPy arrays serialised natively) 200 µs
per row. Seeding ``numpy.random.default_rng((seed, id))`` per block and drawing 512 ids took
22 µs per block, 6.3 s over the trace (a per-id cache would need ~180 MB for its 182,790 ids).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

NATIVE_BLOCK_TOKENS = 512
"""Tokens per Mooncake hash block (the trace's own block size)."""

DEFAULT_VOCAB = 2048
"""Exclusive upper bound of the ids (the tiny Llama's vocabulary; every real model's is larger)."""

FIRST_ID = 4
"""Lowest id used: 0-3 are the tiny Llama's special tokens (<unk> <s> </s> <pad>)."""

_MASK = (1 << 64) - 1
_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S32 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(32)
_BLOCK_DOMAIN = 0x426C6F636B  # "Block": keys of hash blocks
_ROW_DOMAIN = 0x526F77  # "Row": keys of a row's fresh remainder


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser, element-wise and in place on a fresh uint64 array (wrapping)."""
    with np.errstate(over="ignore"):
        x ^= x >> _S30
        x *= _M1
        x ^= x >> _S27
        x *= _M2
        x ^= x >> _S31
    return x


def _mix_int(x: int) -> int:
    """The same finaliser on one Python int (kept in 64 bits)."""
    x &= _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _seed_key(seed: int | Sequence[int], domain: int) -> int:
    """One 64-bit key from a seed (an int or a sequence of ints, e.g. (prompt seed, lap)) and a domain."""
    parts = [seed] if isinstance(seed, int) else list(seed)
    key = _mix_int(domain)
    for part in parts:
        key = _mix_int(key ^ _mix_int(int(part) & _MASK) ^ ((int(part) >> 64) & _MASK))
    return key


def _ids(keys: np.ndarray, positions: int, vocab_size: int) -> np.ndarray:
    """A (len(keys), positions) int64 array: token j of key k is mix(k + (j + 1)·γ) mapped into the vocabulary."""
    with np.errstate(over="ignore"):
        steps = np.arange(1, positions + 1, dtype=np.uint64) * _GAMMA
        raw = _mix(keys.reshape(-1, 1) + steps.reshape(1, -1))
        # the top 32 bits scaled to the span (multiply-shift, no division)
        raw >>= _S32
        raw *= np.uint64(vocab_size - FIRST_ID)
        raw >>= _S32
    out = raw.view(np.int64)
    out += FIRST_ID
    return out


def _check(block_tokens: int, vocab_size: int) -> None:
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    if not FIRST_ID < vocab_size <= FIRST_ID + (1 << 32):
        raise ValueError(
            f"vocab_size must be in ({FIRST_ID}, "
            f"2^32 + {FIRST_ID}] (ids 0-{FIRST_ID - 1} are kept out), got {vocab_size}"
        )


def block_ids(
    hash_ids: Sequence[int],
    *,
    seed: int | Sequence[int],
    block_tokens: int = NATIVE_BLOCK_TOKENS,
    vocab_size: int = DEFAULT_VOCAB,
) -> np.ndarray:
    """The token ids of each hash block: a (len(hash_ids), block_tokens) int64 array whose row i
    depends only on (seed, hash_ids[i]) (any int, reduced modulo 2^64)."""
    _check(block_tokens, vocab_size)
    base = _seed_key(seed, _BLOCK_DOMAIN)
    hashed = np.fromiter(((int(h) & _MASK) for h in hash_ids), dtype=np.uint64, count=len(hash_ids))
    keys = _mix(hashed ^ np.uint64(base))
    return _ids(keys, block_tokens, vocab_size)


def hash_prompt(
    hash_ids: Sequence[int],
    length: int,
    *,
    seed: int | Sequence[int],
    row: int,
    block_tokens: int = NATIVE_BLOCK_TOKENS,
    vocab_size: int = DEFAULT_VOCAB,
) -> np.ndarray:
    """The ``length`` token ids (int64 array) of a row whose prompt is the hash blocks ``hash_ids``.

    The blocks' ids (see :func:`block_ids`) are concatenated and cut to ``length``; if they are
    fewer than ``length`` the remainder (and the whole prompt of a row without hash ids) is fresh
    ids keyed by ``(seed, row)``, so give every row of one replay its own ``row``.
    """
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")
    _check(block_tokens, vocab_size)
    needed = min(len(hash_ids), -(-length // block_tokens))
    head = block_ids(hash_ids[:needed], seed=seed, block_tokens=block_tokens, vocab_size=vocab_size).reshape(-1)[
        :length
    ]
    rest = length - len(head)
    if rest <= 0:
        return head
    row_key = np.asarray([_mix_int(_seed_key(seed, _ROW_DOMAIN) ^ _mix_int(int(row) & _MASK))], dtype=np.uint64)
    tail = _ids(row_key, rest, vocab_size).reshape(-1)
    return np.concatenate([head, tail]) if len(head) else tail


def scaled_length(prompt_tokens: int, block_tokens: int, native_block_tokens: int = NATIVE_BLOCK_TOKENS) -> int:
    """A row's prompt length when each ``native_block_tokens`` hash block is replayed as
    ``block_tokens`` tokens: ceil(prompt_tokens · block_tokens / native), at least 1 (so a row of
    ceil(p / native) blocks keeps the same number of blocks, the last one partial)."""
    if block_tokens == native_block_tokens:
        return prompt_tokens
    return max(1, -(-prompt_tokens * block_tokens // native_block_tokens))


__all__ = ["DEFAULT_VOCAB", "FIRST_ID", "NATIVE_BLOCK_TOKENS", "block_ids", "hash_prompt", "scaled_length"]
