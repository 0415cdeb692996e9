"""One instance's paged KV cache with automatic prefix caching, modelled on vLLM 0.32's BlockPool and KVCacheManager."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from core.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from core.cache.keys import BlockKey

RequestId = str | int

# What is modelled (vLLM 0.32, v1/core/block_pool.py, kv_cache_manager.py,
# single_type_kv_cache_manager.py FullAttentionManager, kv_cache_utils.py FreeKVCacheBlockQueue):
# - block 0 is the null block, never allocated: ``num_blocks - 1`` blocks hold KV and usage is
#   measured against them;
# - only full blocks are cached; a prompt hits its longest cached prefix of full blocks, capped at
#   ``(num_prompt_tokens - 1) // block_size`` blocks (the last token is always computed);
# - a hit on a free cached block takes it out of the free queue (touch);
# - new blocks come from the head of the free queue; a cached block taken there loses its key
#   (one BlockRemoved per evicted block);
# - a request's blocks are freed tail first: cached ones go to the tail of the free queue (LRU),
#   uncached ones to its head (reused first);
# - full blocks are cached when allocated (unless the caller delays it, as vLLM does for a P/D
#   receive), one BlockStored per batch; identical blocks are not de-duplicated, so a key can be
#   held by several blocks (and stored and removed once for each);
# - reset succeeds only when no block is in use, and emits AllBlocksCleared;
# - prefix-cache stats are counted at admission: queries += prompt tokens, hits += hit tokens.
# Not modelled: hybrid/sliding-window groups, partial-block hashes, the watermark (0 by default),
# speculative lookahead slots, KV connectors' external hits.


@dataclass(frozen=True, slots=True)
class Allocation:
    """What ``allocate`` did for one request."""

    request_id: RequestId
    num_tokens: int
    """Token slots the request holds after the allocation."""
    cached_blocks: int
    """Leading full blocks reused from the prefix cache."""
    cached_tokens: int
    """``cached_blocks * block_size``: prompt tokens not computed (vLLM's ``num_cached_tokens``)."""
    new_blocks: int
    """Blocks taken from the free queue."""
    evicted_blocks: int
    """Of the new blocks, how many were cached (their keys were evicted)."""

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens the request still computes (prefill work)."""
        return self.num_tokens - self.cached_tokens


@dataclass(slots=True)
class CacheStats:
    """Cumulative prefix-cache counters, counted as vLLM's PrefixCacheStats (tokens, not blocks)."""

    requests: int = 0
    queries: int = 0
    """Prompt tokens looked up by admitted requests (``vllm:prefix_cache_queries``)."""
    hits: int = 0
    """Of those, tokens found cached (``vllm:prefix_cache_hits``)."""
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    evicted_blocks: int = 0
    resets: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass(slots=True)
class _Req:
    blocks: list[int]
    num_tokens: int
    num_committed: int
    token_ids: list[int] | None = field(default=None)


class PrefixBlockPool:
    """The blocks of one instance, their cached keys, the LRU free queue and the requests holding them.

    ``num_blocks`` counts like vLLM's ``num_gpu_blocks``: it includes the null block, so
    ``num_blocks - 1`` blocks are usable. Keys are the caller's (``core.cache.keys.chain_keys``);
    token ids are optional and only fill the events' ``token_ids``. Events pile up until
    ``drain_events``: a caller that never drains them (the simulator) passes ``enable_events=False``.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        enable_events: bool = True,
    ) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.enable_events = enable_events
        self.stats = CacheStats()
        self._ref = [0] * num_blocks
        self._key: list[BlockKey | None] = [None] * num_blocks
        # Free queue, head = next to allocate/evict. OrderedDict: O(1) popleft, remove, both ends.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self._cached: dict[BlockKey, int] = {}
        self._dups: dict[BlockKey, list[int]] = {}
        self._reqs: dict[RequestId, _Req] = {}
        self._events: list[KVEvent] = []

    # ---- read-only views -------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Blocks that can hold KV (the null block excluded)."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks in the free queue (cached or not), i.e. allocatable."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Distinct keys currently cached (in use or free)."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (vLLM's ``kv_cache_usage_perc``)."""
        return 1.0 - len(self._free) / self.capacity

    @property
    def requests(self) -> list[RequestId]:
        return list(self._reqs)

    def __contains__(self, key: object) -> bool:
        return key in self._cached

    def num_tokens(self, request_id: RequestId) -> int:
        return self._reqs[request_id].num_tokens

    def block_ids(self, request_id: RequestId) -> list[int]:
        return list(self._reqs[request_id].blocks)

    def free_queue(self) -> list[int]:
        """Block ids in eviction order (head first); for tests and inspection."""
        return list(self._free)

    def key_of(self, block_id: int) -> BlockKey | None:
        return self._key[block_id]

    def cached_prefix_blocks(self, keys: Sequence[BlockKey]) -> int:
        """How many leading ``keys`` are cached, uncapped, without touching anything."""
        if not self.enable_caching:
            return 0
        cached = self._cached
        n = 0
        for k in keys:
            if k not in cached:
                break
            n += 1
        return n

    def max_hit_blocks(self, num_prompt_tokens: int) -> int:
        """vLLM's cap on a hit: at most ``num_prompt_tokens - 1`` tokens, in whole blocks."""
        return max(num_prompt_tokens - 1, 0) // self.block_size

    def cached_tokens(self, keys: Sequence[BlockKey], num_prompt_tokens: int) -> int:
        """Tokens a prompt would find cached if admitted now (capped as vLLM caps them)."""
        limit = self.max_hit_blocks(num_prompt_tokens)
        return self.cached_prefix_blocks(keys[:limit]) * self.block_size

    def blocks_needed(self, keys: Sequence[BlockKey], num_tokens: int) -> int:
        """Free blocks an ``allocate`` of this prompt would take now (hits on free blocks count)."""
        hits = self._hit_blocks(keys, num_tokens)
        ref = self._ref
        return -(-num_tokens // self.block_size) - len(hits) + sum(1 for b in hits if ref[b] == 0)

    # ---- mutations ---------------------------------------------------------------------------
    def allocate(
        self,
        request_id: RequestId,
        keys: Sequence[BlockKey],
        num_tokens: int,
        *,
        token_ids: Sequence[int] | None = None,
        commit: bool = True,
        preempted: bool = False,
    ) -> Allocation | None:
        """Admit a request of ``num_tokens`` prompt tokens whose full blocks have ``keys``.

        Reuses the longest cached prefix (capped), allocates the rest, and with ``commit`` caches
        its full blocks at once (vLLM caches at allocation; ``commit=False`` is its
        ``delay_cache_blocks`` for a KV transfer still in flight: call ``commit_full_blocks``
        later). None, with nothing changed and nothing counted, when too few blocks are free.
        ``preempted`` counts the lookup in the preempted stats, as vLLM does for a resumed request.
        """
        if request_id in self._reqs:
            raise ValueError(f"request {request_id!r} already holds blocks")
        if num_tokens <= 0:
            raise ValueError(f"num_tokens must be positive, got {num_tokens}")
        hits = self._hit_blocks(keys, num_tokens)
        ref = self._ref
        num_new = -(-num_tokens // self.block_size) - len(hits)
        if num_new + sum(1 for b in hits if ref[b] == 0) > len(self._free):
            return None
        free = self._free
        for b in hits:  # touch
            if ref[b] == 0:
                del free[b]
            ref[b] += 1
        new_blocks, evicted = self._take(num_new)
        req = _Req(hits + new_blocks, num_tokens, len(hits))
        if token_ids is not None and self.enable_events:
            req.token_ids = list(token_ids)
        self._reqs[request_id] = req
        cached_tokens = len(hits) * self.block_size
        st = self.stats
        if self.enable_caching:
            if preempted:
                st.preempted_requests += 1
                st.preempted_queries += num_tokens
                st.preempted_hits += cached_tokens
            else:
                st.requests += 1
                st.queries += num_tokens
                st.hits += cached_tokens
        if commit:
            self._commit(req, keys)
        return Allocation(request_id, num_tokens, len(hits), cached_tokens, num_new, evicted)

    def append_tokens(self, request_id: RequestId, num_tokens: int = 1, token_ids: Sequence[int] | None = None) -> bool:
        """Grow a running request by ``num_tokens`` slots (decode); False, unchanged, if blocks run out.

        New full blocks are not cached until ``commit_full_blocks`` gives their keys.
        """
        req = self._reqs[request_id]
        total = req.num_tokens + num_tokens
        need = -(-total // self.block_size) - len(req.blocks)
        if need > len(self._free):
            return False
        if need > 0:
            req.blocks.extend(self._take(need)[0])
        req.num_tokens = total
        if req.token_ids is not None and token_ids is not None:
            req.token_ids.extend(token_ids)
        return True

    def commit_full_blocks(self, request_id: RequestId, keys: Sequence[BlockKey]) -> int:
        """Cache the request's full blocks not cached yet; ``keys`` is its whole chain from block 0.

        Returns how many blocks became cached (one BlockStored event for them).
        """
        return self._commit(self._reqs[request_id], keys)

    def free(self, request_id: RequestId) -> None:
        """Release a finished, aborted or preempted request's blocks (unknown ids are ignored)."""
        req = self._reqs.pop(request_id, None)
        if req is None:
            return
        ref, key, free = self._ref, self._key, self._free
        first: list[int] = []
        for b in reversed(req.blocks):
            ref[b] -= 1
            if ref[b] == 0:
                if key[b] is None or not self.enable_caching:
                    first.append(b)
                else:
                    free[b] = None
        for b in reversed(first):
            free[b] = None
            free.move_to_end(b, last=False)

    def reset(self) -> bool:
        """Drop every cached key, only when no block is in use (vLLM's ``reset_prefix_cache``)."""
        if len(self._free) != self.capacity:
            return False
        self._cached.clear()
        self._dups.clear()
        self._key = [None] * self.num_blocks
        self.stats.resets += 1
        if self.enable_events:
            self._events.append(AllBlocksCleared())
        return True

    def drain_events(self) -> list[KVEvent]:
        """The events since the last drain, oldest first (vLLM's ``take_events``)."""
        events, self._events = self._events, []
        return events

    # ---- internals ---------------------------------------------------------------------------
    def _hit_blocks(self, keys: Sequence[BlockKey], num_tokens: int) -> list[int]:
        if not self.enable_caching:
            return []
        cached = self._cached
        hits: list[int] = []
        for k in keys[: self.max_hit_blocks(num_tokens)]:
            b = cached.get(k)
            if b is None:
                break
            hits.append(b)
        return hits

    def _take(self, n: int) -> tuple[list[int], int]:
        free, ref, key = self._free, self._ref, self._key
        cached, dups, events = self._cached, self._dups, self._events if self.enable_events else None
        popitem = free.popitem
        out: list[int] = []
        append = out.append
        evicted = 0
        for _ in range(n):
            b = popitem(last=False)[0]
            k = key[b]
            if k is not None:
                if k in dups:
                    self._uncache(k, b)
                else:  # held by this block alone
                    del cached[k]
                key[b] = None
                evicted += 1
                if events is not None:
                    events.append(BlockRemoved((k,)))
            ref[b] = 1
            append(b)
        self.stats.evicted_blocks += evicted
        return out, evicted

    def _uncache(self, k: BlockKey, b: int) -> None:
        dups = self._dups.get(k)
        if self._cached[k] == b:
            if dups:
                self._cached[k] = dups.pop()
                if not dups:
                    del self._dups[k]
            else:
                del self._cached[k]
        elif dups is not None:
            dups.remove(b)
            if not dups:
                del self._dups[k]

    def _commit(self, req: _Req, keys: Sequence[BlockKey]) -> int:
        if not self.enable_caching:
            return 0
        start = req.num_committed
        end = min(len(keys), req.num_tokens // self.block_size, len(req.blocks))
        if end <= start:
            return 0
        key, setdefault = self._key, self._cached.setdefault
        for b, k in zip(req.blocks[start:end], keys[start:end], strict=True):
            key[b] = k
            if setdefault(k, b) != b:  # another block holds the key already: a duplicate
                self._dups.setdefault(k, []).append(b)
        req.num_committed = end
        if self.enable_events:
            bs = self.block_size
            toks = tuple(req.token_ids[start * bs : end * bs]) if req.token_ids is not None else ()
            parent = keys[start - 1] if start > 0 else None
            self._events.append(BlockStored(tuple(keys[start:end]), parent, toks, bs))
        return end - start
