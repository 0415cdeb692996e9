"""Block keys of a trace row's prompt from its Mooncake hash ids: the keys the emulator computes on a replay of it.

A replay (console/offline/replay.py) sends row ``i`` as ``core.traces.prompts.hash_prompt(ids, length,
seed=(prompt_seed, lap), row=i, block_tokens=hash_block_tokens)``, and the engine (the emulator,
or our KV-event subscriber for vLLM) keys its full blocks with ``chain_keys(tokens, block_size)``.
`TraceKeys` gives the same keys without building whole prompts: when a hash block is a whole
number of KV blocks, the keys of hash block j depend only on the key before it and on its hash
id (and the adapter), so they are computed once per (parent key, hash id, adapter) and remembered (a bounded LRU); a row
then costs one dict lookup per hash block it shares with an earlier row. Tokens past the row's
hash blocks are fresh ids of the row (shared with nothing), so their blocks get keys of their own
that no other row can match (not the engine's: nothing ever looks them up). Otherwise (a hash
block not a multiple of the KV block) the whole prompt is built and keyed. A row run under a LoRA
adapter gets the keys an engine computes under it (``core.cache.keys.prompt_keys``: the adapter's
name in every block's key, as vLLM 0.32 hashes it), so it shares no block with another adapter's rows
nor with the base model's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from core.cache.keys import ROOT_KEY, BlockKey, adapter_extra, chain_keys, extra_int
from core.traces.prompts import DEFAULT_VOCAB, NATIVE_BLOCK_TOKENS, block_ids, hash_prompt

_FRESH = -0x0F5E_5400
"""Mixed into the keys of a row's fresh tail blocks (never produced by ``chain_keys``' tuples)."""


class TraceKeys:
    """Chain keys of trace rows' prompts, as a replay with ``seed`` makes them and an engine keys them."""

    def __init__(
        self,
        block_size: int = 16,
        *,
        hash_block_tokens: int = NATIVE_BLOCK_TOKENS,
        seed: int | Sequence[int] = (0, 0),
        vocab_size: int = DEFAULT_VOCAB,
        memo_blocks: int = 65_536,
    ) -> None:
        if block_size <= 0 or hash_block_tokens <= 0:
            raise ValueError("block_size and hash_block_tokens must be positive")
        self.block_size = block_size
        self.hash_block_tokens = hash_block_tokens
        self.seed = seed
        """The replay's seed: console/offline/replay.py uses (prompt_seed, lap)."""
        self.vocab_size = vocab_size
        self.memo_blocks = memo_blocks
        self._aligned = hash_block_tokens % block_size == 0
        self._memo: OrderedDict[tuple[BlockKey, int, int | None], tuple[BlockKey, ...]] = OrderedDict()
        """(parent key, hash id, the adapter's extra key) → the hash block's keys."""

    def keys(
        self, hash_ids: Sequence[int], prompt_tokens: int, row: int, lora: str | None = None
    ) -> tuple[BlockKey, ...]:
        """Keys of every full block of row ``row``'s prompt of ``prompt_tokens`` tokens, run under LoRA
        adapter ``lora`` (None or "": the base model)."""
        bs = self.block_size
        extra = adapter_extra(lora)
        if not self._aligned:
            prompt = hash_prompt(
                hash_ids,
                prompt_tokens,
                seed=self.seed,
                row=row,
                block_tokens=self.hash_block_tokens,
                vocab_size=self.vocab_size,
            )
            return tuple(chain_keys(prompt.tolist(), bs, extra=extra))
        full = prompt_tokens // bs
        hbt = self.hash_block_tokens
        used = min(len(hash_ids), -(-prompt_tokens // hbt))
        out: list[BlockKey] = []
        parent = ROOT_KEY
        memo = self._memo
        salt = extra_int(extra)
        ids = [int(h) for h in hash_ids[:used]]
        tokens: np.ndarray | None = None  # the token ids of ids[first_miss:], built once on the first miss
        first_miss = 0
        for j, h in enumerate(ids):
            if len(out) >= full:
                break
            key = (parent, h, salt)
            block = memo.get(key)
            if block is None:
                if tokens is None:
                    first_miss = j
                    tokens = block_ids(ids[j:], seed=self.seed, block_tokens=hbt, vocab_size=self.vocab_size)
                block = tuple(chain_keys(tokens[j - first_miss].tolist(), bs, parent=parent, extra=extra))
                memo[key] = block
                if len(memo) > self.memo_blocks:
                    memo.popitem(last=False)
            else:
                memo.move_to_end(key)
            out.extend(block)
            parent = block[-1]
        del out[full:]
        if len(out) < full:  # the row's fresh remainder: its own keys, matched by nothing
            parent = out[-1] if out else ROOT_KEY
            for j in range(len(out), full):
                parent = hash((parent, _FRESH, row, j))
                out.append(parent)
        return tuple(out)
