"""vLLM 0.32's block pool block by block, the plain way: the oracle `PrefixBlockPool` must match exactly.

Every block is moved one at a time in an ordered dict (head = next to take), each key's holders are a list
(the first is the block a lookup finds, the others duplicates), exactly as vLLM's BlockPool does it. It is
slow on long prompts, which is why the pool itself moves a request's blocks in bulk.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from core.cache.block_pool import Allocation, CacheStats
from core.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


class ReferencePool:
    """The same calls and answers as `PrefixBlockPool` (``listed`` is accepted and ignored: every key is listed)."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, enable_events: bool = True):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_caching, self.enable_events = enable_caching, enable_events
        self.stats = CacheStats()
        self.refs = [0] * num_blocks
        self.keys: list[Any] = [None] * num_blocks
        self.queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self.holders: dict[Any, list[int]] = {}
        self.held: dict[Any, dict[str, Any]] = {}
        self.events: list[KVEvent] = []

    # ---- views ----
    @property
    def num_free_blocks(self) -> int:
        return len(self.queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.holders)

    @property
    def cached_keys(self) -> Any:
        return self.holders.keys()

    def __contains__(self, key: object) -> bool:
        return key in self.holders

    def free_queue(self) -> list[int]:
        return list(self.queue)

    def block_ids(self, rid: Any) -> list[int]:
        return list(self.held[rid]["blocks"])

    def num_tokens(self, rid: Any) -> int:
        return int(self.held[rid]["tokens"])

    def key_of(self, block: int) -> Any:
        return self.keys[block]

    def max_hit_blocks(self, tokens: int) -> int:
        return max(tokens - 1, 0) // self.block_size

    def cached_prefix_blocks(self, keys: Sequence[Any]) -> int:
        return len(self._found(keys, len(keys)))

    def cached_tokens(self, keys: Sequence[Any], tokens: int) -> int:
        return len(self._found(keys, self.max_hit_blocks(tokens))) * self.block_size

    def blocks_needed(self, keys: Sequence[Any], tokens: int) -> int:
        found = self._found(keys, self.max_hit_blocks(tokens))
        idle = [b for b in found if self.refs[b] == 0]
        return -(-tokens // self.block_size) - len(found) + len(idle)

    # ---- calls ----
    def allocate(
        self,
        rid: Any,
        keys: Sequence[Any],
        tokens: int,
        *,
        token_ids: Sequence[int] | None = None,
        commit: bool = True,
        preempted: bool = False,
        listed: int | None = None,
    ) -> Allocation | None:
        found = self._found(keys, self.max_hit_blocks(tokens))
        fresh = -(-tokens // self.block_size) - len(found)
        if fresh + len([b for b in found if self.refs[b] == 0]) > len(self.queue):
            return None
        for b in found:
            if self.refs[b] == 0:
                self.queue.pop(b)
            self.refs[b] += 1
        before = self.stats.evicted_blocks
        blocks = found + [self._take_one() for _ in range(fresh)]
        ids = list(token_ids) if token_ids is not None and self.enable_events else None
        self.held[rid] = {"blocks": blocks, "tokens": tokens, "committed": len(found), "ids": ids}
        if self.enable_caching:
            prefix = "preempted_" if preempted else ""
            for name, add in (("requests", 1), ("queries", tokens), ("hits", len(found) * self.block_size)):
                setattr(self.stats, prefix + name, getattr(self.stats, prefix + name) + add)
        if commit:
            self.commit_full_blocks(rid, keys)
        evicted = self.stats.evicted_blocks - before
        return Allocation(rid, tokens, len(found), len(found) * self.block_size, fresh, evicted)

    def append_tokens(self, rid: Any, n: int = 1, token_ids: Sequence[int] | None = None) -> bool:
        req = self.held[rid]
        total = req["tokens"] + n
        more = -(-total // self.block_size) - len(req["blocks"])
        if more > len(self.queue):
            return False
        for _ in range(max(more, 0)):
            req["blocks"].append(self._take_one())
        req["tokens"] = total
        if req["ids"] is not None and token_ids is not None:
            req["ids"].extend(token_ids)
        return True

    def commit_full_blocks(self, rid: Any, keys: Sequence[Any]) -> int:
        if not self.enable_caching:
            return 0
        req = self.held[rid]
        start = req["committed"]
        end = min(len(keys), req["tokens"] // self.block_size, len(req["blocks"]))
        if end <= start:
            return 0
        for b, k in zip(req["blocks"][start:end], keys[start:end], strict=True):
            self.keys[b] = k
            self.holders.setdefault(k, []).append(b)
        req["committed"] = end
        if self.enable_events:
            bs = self.block_size
            toks = tuple(req["ids"][start * bs : end * bs]) if req["ids"] is not None else ()
            self.events.append(BlockStored(tuple(keys[start:end]), keys[start - 1] if start else None, toks, bs))
        return end - start

    def free(self, rid: Any) -> None:
        req = self.held.pop(rid, None)
        if req is None:
            return
        to_head = []
        for b in reversed(req["blocks"]):
            self.refs[b] -= 1
            if self.refs[b] > 0:
                continue
            if self.keys[b] is not None and self.enable_caching:
                self.queue[b] = None
            else:
                to_head.append(b)
        for b in reversed(to_head):
            self.queue[b] = None
            self.queue.move_to_end(b, last=False)

    def reset(self) -> bool:
        if len(self.queue) != self.num_blocks - 1:
            return False
        self.holders.clear()
        self.keys = [None] * self.num_blocks
        self.stats.resets += 1
        if self.enable_events:
            self.events.append(AllBlocksCleared())
        return True

    def drain_events(self) -> list[KVEvent]:
        out, self.events = self.events, []
        return out

    # ---- internals ----
    def _found(self, keys: Sequence[Any], limit: int) -> list[int]:
        out: list[int] = []
        if not self.enable_caching:
            return out
        for k in keys[:limit]:
            if k not in self.holders:
                break
            out.append(self.holders[k][0])
        return out

    def _take_one(self) -> int:
        b, _ = self.queue.popitem(last=False)
        k = self.keys[b]
        if k is not None:
            holders = self.holders[k]
            if holders[0] == b:  # the block lookups find goes: the newest duplicate takes its place
                last = holders.pop()
                if holders:
                    holders[0] = last
                else:
                    del self.holders[k]
            else:
                holders.remove(b)
            self.keys[b] = None
            self.stats.evicted_blocks += 1
            if self.enable_events:
                self.events.append(BlockRemoved((k,)))
        self.refs[b] = 1
        return b
