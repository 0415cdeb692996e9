"""Our own block keys: a hash chain over full blocks of token ids, stable across processes and fast on the hot path."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import TypeAlias

BlockKey: TypeAlias = int
"""Key of one full block: a signed 64-bit int, a function of the whole prefix up to that block."""

ExtraKey: TypeAlias = int | str | tuple[int | str, ...] | None
"""What else a block's content depends on (LoRA name, cache salt, ...); None when nothing."""

ROOT_KEY: BlockKey = 0x5EB1_C0DE_0000_0001
"""The parent of a prompt's first block (our stand-in for vLLM's ``NONE_HASH``)."""

# Why Python's ``hash``: a tuple of ints hashes with CPython's xxHash-style tuple combiner over each
# int's own hash (its value mod 2**61 - 1), and neither is salted by PYTHONHASHSEED (only str and
# bytes are), so the same tokens give the same key in every 64-bit CPython >= 3.8 process. Nothing
# else may enter the tuple: ``hash(None)`` is its address before 3.12 and str is salted, hence
# ROOT_KEY and ``extra_int``. It is not a cryptographic hash; a collision (about n**2 / 2**65 for n
# distinct blocks) only misleads a routing estimate, it never corrupts data.


def _stable_int(part: int | str) -> int:
    if isinstance(part, int):
        return part
    digest = hashlib.blake2b(part.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


def extra_int(extra: ExtraKey) -> int | None:
    """The process-independent int that stands for ``extra`` inside a block key (None: none)."""
    if extra is None:
        return None
    if isinstance(extra, tuple):
        return hash(tuple(_stable_int(p) for p in extra))
    return _stable_int(extra)


def adapter_extra(lora: str | None) -> ExtraKey:
    """The extra key of every block of a prompt run under LoRA adapter `lora` (None or "": the base
    model, no extra key, so base-model keys are those of ``chain_keys`` without one).

    vLLM 0.32 puts the adapter's name into every block's hash (``_gen_lora_extra_hash_keys`` in
    ``v1/core/kv_cache_utils.py``) and our KV-event translation does the same (adapters/vllm/
    kv_events.py), so a prefix cached under one adapter never matches another adapter's nor the
    base model's: the first block's key differs, hence the whole chain."""
    return lora or None


def prompt_keys(token_ids: Iterable[int], block_size: int, lora: str | None = None) -> list[BlockKey]:
    """The chain keys of a prompt's full blocks as a request under adapter `lora` caches them."""
    return chain_keys(token_ids, block_size, extra=adapter_extra(lora))


def num_full_blocks(num_tokens: int, block_size: int) -> int:
    """How many full blocks ``num_tokens`` tokens fill."""
    return num_tokens // block_size


def chain_keys(
    token_ids: Iterable[int],
    block_size: int,
    parent: BlockKey | None = None,
    extra: ExtraKey = None,
) -> list[BlockKey]:
    """One key per full block of ``token_ids``; a trailing partial block gets no key.

    ``parent`` continues a chain (the key of the block before ``token_ids[0]``; None starts at the
    root), so ``chain_keys(a + b, bs) == chain_keys(a, bs) + chain_keys(b, bs, parent=last_of_a)``
    when ``len(a)`` is a multiple of ``bs``. ``extra`` enters every block's key.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    key = ROOT_KEY if parent is None else parent
    keys: list[BlockKey] = []
    append = keys.append
    x = extra_int(extra)
    # zip over one iterator, block_size times: full blocks as tuples, built in C; the tail is dropped
    blocks = zip(*([iter(token_ids)] * block_size), strict=False)
    if x is None:
        for block in blocks:
            key = hash((key, block))
            append(key)
    else:
        for block in blocks:
            key = hash((key, x, block))
            append(key)
    return keys
