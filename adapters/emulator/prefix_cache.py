"""An emulated engine's KV blocks: core.cache's PrefixBlockPool, as vLLM 0.32 uses its BlockPool.

Every block the engine hands out goes through here, so capacity, eviction and the prefix cache are
one thing (`Engine.free_blocks` counts free blocks, evictable cached ones included, like vLLM):

* a sequence's full blocks are keyed by our hash chain (core.cache.keys.chain_keys) over its
  prompt ids and then its generated ids (`Sequence.output_base + i`); a sequence without ids
  (`prompt_ids` None) takes blocks without keys and never hits;
* a sequence under a LoRA adapter keys every block with the adapter's name as extra key
  (core.cache.keys.prompt_keys, as vLLM 0.32 hashes the LoRA name into each block), so its cached
  prefix never serves the base model or another adapter; its BlockStored events carry the
  adapter's `lora_name` and `lora_id`, as vLLM's do;
* a fresh or preempted sequence reuses its longest cached prefix of full blocks, at most
  `context - 1` tokens (vLLM recomputes the last token to sample), and computes only the rest;
* blocks are cached as soon as they are allocated full (vLLM's `cache_full_blocks` at
  `allocate_slots`), freed blocks stay cached in LRU order and are evicted when taken;
* the prefill side of P/D keeps a finished sequence's blocks until they are pulled or expire
  (`hold`/`release`); a migration target reserves blocks for a sequence under its request id.

The pool's events (BlockStored/BlockRemoved/AllBlocksCleared) are drained after each engine step
and published when --kv-events-config asks (adapters/emulator/kv_publisher.py).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

from adapters.emulator.sequence import Sequence
from core.cache.block_pool import PrefixBlockPool
from core.cache.events import BlockStored, KVEvent
from core.cache.keys import adapter_extra, chain_keys, prompt_keys

EventsHook = Callable[[list[KVEvent]], None]


class KVBlocks:
    """The block pool of one engine (or one data-parallel rank)."""

    def __init__(
        self, total_blocks: int, block_size: int, *, enable_caching: bool = True, enable_events: bool = False
    ) -> None:
        self.block_size = block_size
        self.total_blocks = total_blocks
        self.enable_caching = enable_caching
        self.pool = PrefixBlockPool(total_blocks + 1, block_size, enable_caching, enable_events)  # + vLLM's null block
        self._ids = itertools.count()
        self.held: dict[int, int] = {}
        """Prefill-side holds: pool id → blocks, oldest first."""
        self.reserved: dict[str, tuple[int, int]] = {}
        """Migration reservations: request id → (pool id, blocks)."""
        self.on_events: EventsHook | None = None
        self._pending: list[KVEvent] = []
        """Events drained early around a LoRA sequence's allocation (its BlockStored tagged), oldest first."""

    @property
    def free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    # --- keys and ids ---------------------------------------------------------------------------
    def token_ids(self, s: Sequence, start: int, end: int) -> list[int]:
        """Ids of positions [start, end) of `s` (prompt, then generated tokens)."""
        ids = s.prompt_ids or []
        p = len(ids)
        out = list(ids[start : min(end, p)])
        if end > p:
            base = s.output_base - p
            out.extend(range(base + max(start, p), base + end))
        return out

    def keys(self, s: Sequence, blocks: int) -> list[int]:
        """The keys of the first `blocks` full blocks of `s` (computed on demand, kept on `s`)."""
        if s.prompt_ids is None or not self.enable_caching:
            return []
        have = len(s.keys)
        if have < blocks:
            bs = self.block_size
            parent = s.keys[-1] if have else None
            s.keys.extend(chain_keys(self.token_ids(s, have * bs, blocks * bs), bs, parent, adapter_extra(s.lora)))
        return s.keys

    def lookup(self, s: Sequence) -> int:
        """Tokens of `s` the cache holds now, as an admission would reuse them (whole blocks, < context)."""
        if s.prompt_ids is None or not self.enable_caching:
            return 0
        limit = self.pool.max_hit_blocks(s.context)
        return self.pool.cached_prefix_blocks(self.keys(s, limit)[:limit]) * self.block_size

    def lookup_ids(self, ids: list[int], lora: str | None = None) -> int:
        """Tokens of a prompt with these ids (under adapter `lora`) the cache holds now (whole blocks, < its length)."""
        if not self.enable_caching or not ids:
            return 0
        limit = self.pool.max_hit_blocks(len(ids))
        keys = prompt_keys(ids[: limit * self.block_size], self.block_size, lora)
        return self.pool.cached_prefix_blocks(keys) * self.block_size

    # --- a sequence's blocks --------------------------------------------------------------------
    def need(self, s: Sequence, total: int) -> int:
        """Free blocks `s` takes to hold `total` tokens (hits on free cached blocks count as taken)."""
        if s.blocks:
            return self.blocks_for(total) - s.blocks
        keys = self.keys(s, self.pool.max_hit_blocks(total))
        return self.pool.blocks_needed(keys, total)

    def ensure(self, s: Sequence, total: int, preempted: bool = False) -> int:
        """Give `s` slots for `total` tokens and cache its full blocks; returns the tokens it found
        cached when this is its allocation (0 otherwise). The caller checked `need` first."""
        pool = self.pool
        full = total // self.block_size
        caching = s.prompt_ids is not None and self.enable_caching
        if s.blocks and -(-total // self.block_size) <= s.blocks and (not caching or full <= s.kv_full):
            return 0  # the hot path of a decode step: no new block, none filled (the pool catches up later)
        tag = s.lora is not None and pool.enable_events
        if tag:  # what came before belongs to other sequences: set it aside untagged
            self._pending.extend(pool.drain_events())
        hit = 0
        if not s.blocks:
            if s.kv_id < 0:
                s.kv_id = next(self._ids)
            ids = self.token_ids(s, 0, total) if pool.enable_events and s.prompt_ids is not None else None
            alloc = pool.allocate(s.kv_id, self.keys(s, full), total, token_ids=ids, preempted=preempted)
            if alloc is None:
                raise RuntimeError(f"no room for {total} tokens of {s.id} ({self.free_blocks} free blocks)")
            hit = alloc.cached_tokens
        else:
            have = pool.num_tokens(s.kv_id)
            if total > have:
                ids = self.token_ids(s, have, total) if pool.enable_events and s.prompt_ids is not None else None
                if not pool.append_tokens(s.kv_id, total - have, ids):
                    raise RuntimeError(f"no room for {total} tokens of {s.id}")
            if caching:
                pool.commit_full_blocks(s.kv_id, self.keys(s, full))
        s.blocks = max(s.blocks, self.blocks_for(total))
        s.kv_full = full
        if tag:
            self._pending.extend(self._tagged(pool.drain_events(), s))
        return hit

    @staticmethod
    def _tagged(events: list[KVEvent], s: Sequence) -> list[KVEvent]:
        """`s`'s events with its adapter on each BlockStored (vLLM's lora_name, and lora_id its lora_int_id)."""
        return [
            dataclasses.replace(e, lora_name=s.lora, lora_id=s.lora_int_id or None) if isinstance(e, BlockStored) else e
            for e in events
        ]

    def free(self, s: Sequence) -> None:
        """`s` gives its blocks back (cached ones stay cached)."""
        if s.kv_id >= 0:
            self.pool.free(s.kv_id)
        s.blocks = 0

    def hold(self, s: Sequence) -> None:
        """A finished prefill keeps its blocks for the decode instance's pull."""
        self.held[s.kv_id] = s.blocks

    def release(self, kv_id: int = -1) -> int:
        """Free a hold (the oldest when `kv_id` is -1); returns its blocks (0 if unknown)."""
        if kv_id < 0:
            if not self.held:
                return 0
            kv_id = next(iter(self.held))
        blocks = self.held.pop(kv_id, 0)
        self.pool.free(kv_id)
        return blocks

    # --- migration reservations -----------------------------------------------------------------
    def reserve(self, owner: str, blocks: int) -> bool:
        if blocks > self.free_blocks:
            return False
        pid, have = self.reserved.get(owner, (-1, 0))
        if pid < 0:
            pid = next(self._ids)
            ok = self.pool.allocate(pid, [], blocks * self.block_size, commit=False) is not None
        else:
            ok = self.pool.append_tokens(pid, blocks * self.block_size)
        if ok:
            self.reserved[owner] = (pid, have + blocks)
        return ok

    def unreserve(self, owner: str) -> int:
        pid, blocks = self.reserved.pop(owner, (-1, 0))
        if pid >= 0:
            self.pool.free(pid)
        return blocks

    def adopt(self, owner: str, s: Sequence) -> None:
        """A migrated-in sequence takes over the blocks reserved for it."""
        pid, blocks = self.reserved.pop(owner, (-1, 0))
        if pid >= 0:
            s.kv_id, s.blocks = pid, blocks

    # --- cache-wide -----------------------------------------------------------------------------
    def reset(self) -> bool:
        """vLLM's reset_prefix_cache: only when no block is in use; AllBlocksCleared goes out at once."""
        ok = self.pool.reset()
        self.flush()
        return ok

    def flush(self) -> None:
        """Hand the pool's events since the last flush to the hook (or drop them)."""
        events = self.pool.drain_events()
        if self._pending:
            events, self._pending = self._pending + events, []
        if events and self.on_events is not None:
            self.on_events(events)
