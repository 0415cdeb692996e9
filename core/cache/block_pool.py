"""One instance's paged KV cache with automatic prefix caching, modelled on vLLM 0.32's BlockPool and KVCacheManager."""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Container, Sequence
from dataclasses import dataclass, field
from itertools import repeat

import numpy as np

from core.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from core.cache.free_queue import EMPTY, BlockIds, FreeQueue
from core.cache.keys import BlockKey

RequestId = str | int
LOOKUP_RUN = 32
"""Keys looked up at once when finding a cached prefix (then twice as many, ...): a hit rarely ends in the first."""

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
    blocks: BlockIds
    num_tokens: int
    num_committed: int
    token_ids: list[int] | None = field(default=None)
    repeats: bool = False
    """Whether ``blocks`` lists a block twice (a chain that repeats a key hits its block twice)."""
    listed: int = sys.maxsize
    """How many leading keys of its chain enter the lookup map (``allocate``'s ``listed``)."""


class PrefixBlockPool:
    """The blocks of one instance, their cached keys, the LRU free queue and the requests holding them.

    ``num_blocks`` counts like vLLM's ``num_gpu_blocks``: it includes the null block, so
    ``num_blocks - 1`` blocks are usable. Keys are the caller's (``core.cache.keys.chain_keys``);
    token ids are optional and only fill the events' ``token_ids``. Events pile up until
    ``drain_events``: a caller that never drains them (the simulator) passes ``enable_events=False``.

    A request's blocks move in bulk (numpy arrays, the free queue in runs: ``core.cache.free_queue``) and
    its keys enter and leave the key map in one C-level pass each, with a per-block path kept for the
    rare cases that need it (a key already cached, a key held by two blocks): the blocks, the queue's
    order, the hits and the events are those of a per-block loop, block for block.
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
        self._ref = np.zeros(num_blocks, dtype=np.int64)
        self._key: np.ndarray = np.full(num_blocks, None, dtype=object)
        """Block → its cached key, or None."""
        self._keyed = np.zeros(num_blocks, dtype=np.bool_)
        """Block → whether it has a key (``_key`` is not None)."""
        self._listed = np.zeros(num_blocks, dtype=np.bool_)
        """Block → whether its key is in the lookup map (``_cached``) on its behalf."""
        self._free = FreeQueue(num_blocks)
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
        """Distinct keys currently cached (in use or free; those a caller asked not to list excluded)."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (vLLM's ``kv_cache_usage_perc``)."""
        return 1.0 - len(self._free) / self.capacity

    @property
    def requests(self) -> list[RequestId]:
        return list(self._reqs)

    @property
    def cached_keys(self) -> Container[BlockKey]:
        """The keys cached now (in use or free; listed ones), a live view for lookups that bypass ``in``."""
        return self._cached.keys()

    def __contains__(self, key: object) -> bool:
        return key in self._cached

    def num_tokens(self, request_id: RequestId) -> int:
        return self._reqs[request_id].num_tokens

    def block_ids(self, request_id: RequestId) -> list[int]:
        ids: list[int] = self._reqs[request_id].blocks.tolist()
        return ids

    def free_queue(self) -> list[int]:
        """Block ids in eviction order (head first); for tests and inspection."""
        return self._free.order()

    def key_of(self, block_id: int) -> BlockKey | None:
        key: BlockKey | None = self._key[block_id]
        return key

    def cached_prefix_blocks(self, keys: Sequence[BlockKey]) -> int:
        """How many leading ``keys`` are cached, uncapped, without touching anything."""
        if not self.enable_caching:
            return 0
        return len(self._leading(keys, len(keys)))

    def max_hit_blocks(self, num_prompt_tokens: int) -> int:
        """vLLM's cap on a hit: at most ``num_prompt_tokens - 1`` tokens, in whole blocks."""
        return max(num_prompt_tokens - 1, 0) // self.block_size

    def cached_tokens(self, keys: Sequence[BlockKey], num_prompt_tokens: int) -> int:
        """Tokens a prompt would find cached if admitted now (capped as vLLM caps them)."""
        return self.cached_prefix_blocks(keys[: self.max_hit_blocks(num_prompt_tokens)]) * self.block_size

    def blocks_needed(self, keys: Sequence[BlockKey], num_tokens: int) -> int:
        """Free blocks an ``allocate`` of this prompt would take now (hits on free blocks count)."""
        hits = self._hit_blocks(keys, num_tokens)
        return -(-num_tokens // self.block_size) - len(hits) + int(np.count_nonzero(self._ref[hits] == 0))

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
        listed: int | None = None,
    ) -> Allocation | None:
        """Admit a request of ``num_tokens`` prompt tokens whose full blocks have ``keys``.

        Reuses the longest cached prefix (capped), allocates the rest, and with ``commit`` caches
        its full blocks at once (vLLM caches at allocation; ``commit=False`` is its
        ``delay_cache_blocks`` for a KV transfer still in flight: call ``commit_full_blocks``
        later). None, with nothing changed and nothing counted, when too few blocks are free.
        ``preempted`` counts the lookup in the preempted stats, as vLLM does for a resumed request.

        ``listed`` (None: all) enters only the first ``listed`` keys of the chain in the lookup map: for a
        caller that knows no lookup will ever ask for the others (the simulator knows every chain of its
        run, and a key no other chain holds is asked for only by its own request, before it is cached).
        Their blocks are cached all the same (kept at the queue's tail when freed, evicted when taken,
        counted in the stats and events); only the map's upkeep, most of the cost of a long prompt, is
        saved, and every lookup of a listed key answers as it would with all listed.
        """
        if request_id in self._reqs:
            raise ValueError(f"request {request_id!r} already holds blocks")
        if num_tokens <= 0:
            raise ValueError(f"num_tokens must be positive, got {num_tokens}")
        hits = self._hit_blocks(keys, num_tokens)
        ref = self._ref
        n_hits = len(hits)
        num_new = -(-num_tokens // self.block_size) - n_hits
        repeats = False
        if n_hits:
            idle = hits[ref[hits] == 0]  # free cached blocks the request touches (a repeated one once per hit)
            if num_new + len(idle) > len(self._free):
                return None
            repeats = len(np.unique(hits)) != n_hits
            if repeats:  # a block hit twice leaves the queue once and is referenced twice
                self._free.remove(np.unique(idle))
                np.add.at(ref, hits, 1)
            else:
                self._free.remove(idle)
                ref[hits] += 1
        elif num_new > len(self._free):
            return None
        new_blocks, evicted = self._take(num_new)
        req = _Req(np.concatenate((hits, new_blocks)) if n_hits else new_blocks, num_tokens, n_hits, repeats=repeats)
        if listed is not None:
            req.listed = listed
        if token_ids is not None and self.enable_events:
            req.token_ids = list(token_ids)
        self._reqs[request_id] = req
        cached_tokens = n_hits * self.block_size
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
        return Allocation(request_id, num_tokens, n_hits, cached_tokens, num_new, evicted)

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
            req.blocks = np.concatenate((req.blocks, self._take(need)[0]))
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
        """Release a finished, aborted or preempted request's blocks (unknown ids are ignored).

        Tail first: a block whose last holder this was goes, if cached, to the queue's tail (so a
        prefix's head is evicted last), else to its head (reused first)."""
        req = self._reqs.pop(request_id, None)
        if req is None:
            return
        ref = self._ref
        tail_first = req.blocks[::-1]
        if req.repeats:
            np.subtract.at(ref, tail_first, 1)
            released = tail_first[ref[tail_first] == 0]
            # a block listed twice is released at its last occurrence tail first: keep that one
            _, last = np.unique(released[::-1], return_index=True)
            released = released[np.sort(len(released) - 1 - last)]
        else:
            ref[tail_first] -= 1
            released = tail_first[ref[tail_first] == 0]
        if not len(released):
            return
        if self.enable_caching:
            keyed = self._keyed[released]
            if keyed.any():
                self._free.push_back(released[keyed])
                released = released[~keyed]
        if len(released):
            self._free.push_front(released)

    def reset(self) -> bool:
        """Drop every cached key, only when no block is in use (vLLM's ``reset_prefix_cache``)."""
        if len(self._free) != self.capacity:
            return False
        self._cached.clear()
        self._dups.clear()
        self._key[:] = None
        self._keyed[:] = False
        self._listed[:] = False
        self.stats.resets += 1
        if self.enable_events:
            self._events.append(AllBlocksCleared())
        return True

    def drain_events(self) -> list[KVEvent]:
        """The events since the last drain, oldest first (vLLM's ``take_events``)."""
        events, self._events = self._events, []
        return events

    # ---- internals ---------------------------------------------------------------------------
    def _leading(self, keys: Sequence[BlockKey], limit: int) -> list[int]:
        """The blocks of the leading cached keys among ``keys[:limit]`` (up to the first one not cached), looked
        up a run at a time (runs doubling from LOOKUP_RUN)."""
        get = self._cached.get
        limit = min(limit, len(keys))
        if not limit or get(keys[0]) is None:
            return []
        found: list[int] = []
        lo, run = 0, LOOKUP_RUN
        while lo < limit:
            hi = min(limit, lo + run)
            got = list(map(get, keys[lo:hi], repeat(0)))  # 0, the null block, marks a key not cached
            if 0 in got:
                found += got[: got.index(0)]
                break
            found += got
            lo, run = hi, 2 * run
        return found

    def _hit_blocks(self, keys: Sequence[BlockKey], num_tokens: int) -> BlockIds:
        if not self.enable_caching:
            return EMPTY
        found = self._leading(keys, self.max_hit_blocks(num_tokens))
        return np.array(found, dtype=np.intp) if found else EMPTY

    def _take(self, n: int) -> tuple[BlockIds, int]:
        """The next n blocks of the free queue, each now referenced once; the cached ones among them lose
        their keys (evicted)."""
        out = self._free.take(n)
        if not n:
            return out, 0
        self._ref[out] = 1
        keyed = self._keyed[out]
        if not keyed.any():
            return out, 0
        lost = out[keyed]
        if self.enable_events:
            self._events.extend(BlockRemoved((k,)) for k in self._key[lost].tolist())
        listed = lost[self._listed[lost]]
        keys: list[BlockKey] = self._key[listed].tolist()
        self._key[lost] = None
        self._keyed[lost] = False
        self._listed[listed] = False
        cached, dups = self._cached, self._dups
        if not dups or dups.keys().isdisjoint(keys):  # each held by its block alone
            deque(map(cached.pop, keys), maxlen=0)
        else:
            for k, b in zip(keys, listed.tolist(), strict=True):
                if k in dups:
                    self._uncache(k, b)
                else:
                    del cached[k]
        self.stats.evicted_blocks += len(lost)
        return out, len(lost)

    def _list(self, blocks: BlockIds, chain: Sequence[BlockKey]) -> None:
        """Enter each key in the lookup map under its block, unless another block holds it already (then the
        block is a duplicate, listed under the key too)."""
        self._listed[blocks] = True
        ids: list[int] = blocks.tolist()
        held = list(map(self._cached.setdefault, chain, ids))
        if held != ids:
            dups = self._dups
            for k, b, h in zip(chain, ids, held, strict=True):
                if h != b:
                    dups.setdefault(k, []).append(b)

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
        blocks = req.blocks[start:end]
        chain = keys[start:end]
        self._key[blocks] = np.fromiter(chain, dtype=object, count=end - start)
        self._keyed[blocks] = True
        cut = min(end, req.listed) - start
        if cut > 0:
            self._list(blocks[:cut], chain[:cut])
        req.num_committed = end
        if self.enable_events:
            bs = self.block_size
            toks = tuple(req.token_ids[start * bs : end * bs]) if req.token_ids is not None else ()
            parent = keys[start - 1] if start > 0 else None
            self._events.append(BlockStored(tuple(chain), parent, toks, bs))
        return end - start
