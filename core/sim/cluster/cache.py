"""The simulated cluster's KV caches: one prefix-cached block pool per instance, what each request found cached,
what moved.

Each instance (prefill and decode alike) holds a ``core.cache.PrefixBlockPool`` of the profile's
KV capacity in blocks (vLLM 0.32's block pool: longest cached prefix of full blocks, capped at
prompt − 1 tokens; freed blocks stay cached and are evicted LRU). The engine calls it at these
points of a request's life:

- prefill start on instance P: ``prefill`` allocates the prompt there; the prefill computes only
  the uncached tokens. The blocks are held until the decode side has pulled them (``handoff``).
- prefill end, decode instance D known: ``pull`` allocates the prompt on D first from D's own
  cache (what D holds locally is not pulled again, as vLLM's NIXL decode side counts local hits
  before it asks the remote), and D pulls the rest: the KV transfer moves only the missing tokens.
  The pulled blocks are cached on D when they have arrived (``handoff``: vLLM delays caching a
  receiving request's blocks until its transfer ends).
- decode-only (no prefill leg): ``local`` allocates the prompt on D, which computes the uncached
  part itself.
- finish: ``finish`` grows the request by its output tokens (taking free blocks, so evicting LRU
  cached ones as its decode would have; done at once at the end, not token by token) and frees it.
  Failures free what the request holds.

Approximations (the decode model keeps its own KV accounting in tokens; the pools model what is
cached, not admission): a pool that has too few free blocks for a request caches nothing for it
(it computes, or pulls, the whole prompt); a migrated request's blocks stay on its first decode
instance until it finishes. Everything is keyed by request index, and nothing is random.

With keys given beforehand, a key that only one request's chain holds is cached but left out of the
pools' lookup maps (``listed_lengths``, ``PrefixBlockPool.allocate(listed=...)``): no other request asks
for it and its own request is looked up on an instance only before it allocates there, so every answer
is the same and half the upkeep of a long conversation window is saved.

A request under a LoRA adapter keys its blocks with the adapter's name, as vLLM 0.32 does
(``_gen_lora_extra_hash_keys`` in ``v1/core/kv_cache_utils.py``) and the emulator and the live gateway
do (``core.cache.keys.prompt_keys``): keys derived from its hash ids carry the adapter, so a prefix
cached under one adapter is never found by a request under another adapter or the base model. Keys
given beforehand (a live run's, console/advisor) are used as they are: the gateway already keyed them
under the request's adapter.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from core.cache.block_pool import PrefixBlockPool
from core.cache.index import InstanceId
from core.cache.keys import BlockKey
from core.cache.trace_keys import TraceKeys
from core.perf import PerfProfile


@dataclass(frozen=True)
class CacheParams:
    """How a simulation models the KV cache (it is on only for traces with prefix structure)."""

    enabled: bool = True
    """False: no pools, every prompt computed and transferred in full (as before the cache)."""
    block_size: int | None = None
    """Tokens per KV block (None: the profile's, 16 as vLLM and the emulator)."""
    capacity_blocks: int | None = None
    """Blocks per instance (None: the profile's KV capacity in tokens // block size)."""
    hash_block_tokens: int = 512
    """Tokens per trace hash block, as the replay sends them (Mooncake's own 512)."""
    prompt_seed: int = 0
    """The replay's prompt seed (keys equal a replay's with ``--prompt-seed`` this, lap 0)."""


_LISTED: list[tuple[Sequence[Sequence[int]], list[int]] | None] = [None]
"""The last chains `listed_lengths` answered for, and its answer (the advisor runs every candidate on one window)."""


def listed_lengths(chains: Sequence[Sequence[BlockKey]]) -> list[int]:
    """Per chain, the length of its prefix that ends with its last key held anywhere else (by another chain, or
    twice by this one): the keys after it belong to this chain alone. Remembered for the same `chains` object."""
    last = _LISTED[0]  # read once: another thread may replace it
    if last is not None and last[0] is chains:
        return last[1]
    counts = Counter(itertools.chain.from_iterable(chains))
    out = []
    for keys in chains:
        n = len(keys)
        while n and counts[keys[n - 1]] == 1:
            n -= 1
        out.append(n)
    _LISTED[0] = (chains, out)
    return out


class SimCache:
    """The pools of one simulation, per instance index, and the exact prefix lookup routing reads."""

    def __init__(self, n_requests: int, block_size: int, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self.pools: list[PrefixBlockPool | None] = []
        self.ids: list[str] = []
        self._cached_keys: list[Container[BlockKey]] = []
        """Per instance index, the keys its pool caches now (a live view; empty for an index without a pool)."""
        self.keys: list[tuple[BlockKey, ...]] = [()] * n_requests
        """Each request's block keys, set at arrival and dropped when it leaves."""
        self.prefill_cached = np.zeros(n_requests, dtype=np.int64)
        """Prompt tokens found cached on the prefill instance (on the decode instance for a
        decode-only request): not computed."""
        self.decode_cached = np.zeros(n_requests, dtype=np.int64)
        """Prompt tokens the decode instance already held (not pulled)."""
        self.transferred = np.zeros(n_requests, dtype=np.int64)
        """KV tokens pulled from the prefill instance to the decode instance."""
        self._pre: dict[int, int] = {}
        """Request → the prefill instance whose pool holds its blocks (until the handoff)."""
        self._dec: dict[int, int] = {}
        """Request → the decode instance whose pool holds its blocks."""
        self._pending_commit: dict[int, int] = {}
        """Request → decode instance whose pulled blocks are cached when the transfer ends."""
        self._given: Sequence[Sequence[int]] | None = None
        self._listed: Sequence[int] | None = None
        """Per request, how many leading keys of its given chain its pools list for lookups (``listed_lengths``)."""
        self._cached_on: dict[int, list[int]] = {}
        """Request → the instances where it has cached blocks under keys only it holds (no lookup for it there)."""
        self._hash_ids: Sequence[Sequence[int]] | None = None
        self._derive: TraceKeys | None = None

    @classmethod
    def for_trace(
        cls,
        n_requests: int,
        profile: PerfProfile,
        params: CacheParams,
        hash_ids: Sequence[Sequence[int]] | None,
        prefix_keys: Sequence[Sequence[int]] | None,
    ) -> SimCache | None:
        """The caches of a run, or None when it does not model them (turned off, or no row has
        prefix structure: then nothing could be shared and the run costs what it did before)."""
        if not params.enabled or (hash_ids is None and prefix_keys is None):
            return None
        bs = params.block_size or profile.block_size
        cache = cls(n_requests, bs, params.capacity_blocks or max(1, profile.kv_capacity_tokens // bs))
        cache._given, cache._hash_ids = prefix_keys, hash_ids
        if prefix_keys is not None:
            cache._listed = listed_lengths(prefix_keys)
        else:
            # One line to change if the replay's prompts change: the keys an engine computes on them.
            cache._derive = TraceKeys(bs, hash_block_tokens=params.hash_block_tokens, seed=(params.prompt_seed, 0))
        return cache

    def arrive(self, i: int, prompt: int, lora: str | None = None) -> tuple[BlockKey, ...]:
        """Request i arrives (under LoRA adapter `lora`, None: the base model): its block keys (given, or
        derived from its trace hash ids under its adapter)."""
        if self._given is not None:
            keys = tuple(self._given[i])
        else:
            assert self._derive is not None and self._hash_ids is not None
            keys = self._derive.keys(self._hash_ids[i], prompt, i, lora)
        self.keys[i] = keys
        return keys

    # --- instances ----------------------------------------------------------------------------
    def add_instance(self, x: int, iid: str) -> None:
        while len(self.pools) <= x:
            self.pools.append(None)
            self.ids.append("")
            self._cached_keys.append(frozenset())
        if self.pools[x] is None:
            pool = PrefixBlockPool(self.capacity_blocks + 1, self.block_size, enable_events=False)
            self.pools[x], self.ids[x] = pool, iid
            self._cached_keys[x] = pool.cached_keys

    def pool(self, x: int) -> PrefixBlockPool:
        p = self.pools[x]
        assert p is not None
        return p

    # --- the lookup routing reads -------------------------------------------------------------
    def match(self, keys: Sequence[BlockKey], now: float | None = None) -> dict[InstanceId, int]:
        """Leading ``keys`` cached per instance (those holding the first one), exactly as the pools
        hold them. A pool's cached blocks are prefix-closed (a block's parent is used with it and
        freed after it, so LRU never evicts the parent first), so the depth is found by bisection,
        after trying the depth the previous pool had (often the same: a prefix many requests share)."""
        out: dict[InstanceId, int] = {}
        if not keys:
            return out
        first, n = keys[0], len(keys)
        depth = 0  # the previous pool's
        for x, cached in enumerate(self._cached_keys):
            if first not in cached:
                continue
            if not depth:
                lo, hi = 1, n  # keys[:lo] cached; find the largest such lo
            elif keys[depth - 1] in cached:
                if depth == n or keys[depth] not in cached:
                    out[self.ids[x]] = depth
                    continue
                lo, hi = depth + 1, n
            else:
                lo, hi = 1, depth - 1
            while lo < hi:
                mid = (lo + hi + 1) >> 1
                if keys[mid - 1] in cached:
                    lo = mid
                else:
                    hi = mid - 1
            out[self.ids[x]] = depth = lo
        return out

    # --- one request's life -------------------------------------------------------------------
    def prefill(self, x: int, i: int, prompt: int) -> int:
        """Request i's prefill starts on instance x: the tokens it computes there."""
        alloc = self.pool(x).allocate(i, self.keys[i], prompt, listed=self._listing(x, i))
        if alloc is None:
            return prompt
        self._pre[i] = x
        self.prefill_cached[i] = alloc.cached_tokens
        return prompt - alloc.cached_tokens

    def would_compute(self, x: int, i: int, prompt: int) -> int:
        """The tokens request i's prefill would compute on instance x now (nothing changes)."""
        assert x not in self._cached_on.get(i, ()), "a request looked up where its own unlisted keys are cached"
        return prompt - self.pool(x).cached_tokens(self.keys[i], prompt)

    def pull(self, x: int, i: int, prompt: int) -> int:
        """Request i's KV is about to move to decode instance x: the tokens it pulls."""
        if self._pre.get(i) == x:
            return 0  # it was prefilled here (an instance serving both roles): nothing moves
        alloc = self.pool(x).allocate(i, self.keys[i], prompt, commit=False, listed=self._listing(x, i))
        if alloc is None:
            self.transferred[i] = prompt
            return prompt
        self._dec[i] = x
        self._pending_commit[i] = x
        self.decode_cached[i] = alloc.cached_tokens
        self.transferred[i] = prompt - alloc.cached_tokens
        return prompt - alloc.cached_tokens

    def local(self, x: int, i: int, prompt: int) -> int:
        """Request i is served by decode instance x alone: the prompt tokens x computes."""
        alloc = self.pool(x).allocate(i, self.keys[i], prompt, listed=self._listing(x, i))
        if alloc is None:
            return prompt
        self._dec[i] = x
        self.prefill_cached[i] = self.decode_cached[i] = alloc.cached_tokens
        return prompt - alloc.cached_tokens

    def handoff(self, i: int) -> None:
        """Request i's KV has arrived on its decode instance: cache the pulled blocks there and
        free its blocks on the prefill instance (they stay cached)."""
        d = self._pending_commit.pop(i, None)
        if d is not None:
            self.pool(d).commit_full_blocks(i, self.keys[i])
        p = self._pre.get(i)
        if p is not None and p != self._dec.get(i, p):
            del self._pre[i]
            self.pool(p).free(i)

    def finish(self, i: int, output_tokens: int) -> None:
        """Request i finished: its decode grew by its output (evicting LRU blocks if it must), then
        everything it holds is freed."""
        x = self._dec.get(i, self._pre.get(i))
        if x is not None:
            self.pool(x).append_tokens(i, output_tokens)
        self.release(i)

    def release(self, i: int) -> None:
        """Free whatever request i holds (finished, failed, rejected)."""
        for x in {self._pre.pop(i, -1), self._dec.pop(i, -1)} - {-1}:
            self.pool(x).free(i)
        self._pending_commit.pop(i, None)
        self.keys[i] = ()

    def _listing(self, x: int, i: int) -> int | None:
        """How many of request i's keys instance x's pool lists (None: all). A key only request i holds is
        never asked for by another request, nor by request i once cached (the engine looks a request up on an
        instance only before it allocates there, and allocates there once), so it is left out of the map."""
        if self._listed is None:
            return None
        n = self._listed[i]
        if n < len(self.keys[i]):
            held = self._cached_on.setdefault(i, [])
            assert x not in held, "a request allocated twice where its own unlisted keys are cached"
            held.append(x)
        return n

    # --- results ------------------------------------------------------------------------------
    def results(self) -> dict[str, Any]:
        """The cache's fields of ClusterSimResult."""
        return {
            "cached_tokens": self.prefill_cached.copy(),
            "decode_cached_tokens": self.decode_cached.copy(),
            "kv_transferred_tokens": self.transferred.copy(),
            "cache_hit_rates": self.hit_rates(),
            "cache_lookups": self.lookups(),
            "cache_block_size": self.block_size,
        }

    @staticmethod
    def no_results(prompt: np.ndarray, decode_start: np.ndarray, prefill_pos: np.ndarray) -> dict[str, Any]:
        """The same fields for a run without the cache: nothing cached, every prompt that reached
        decode after a prefill moved in full."""
        moved = np.where(~np.isnan(decode_start) & (prefill_pos >= 0), prompt, 0)
        zeros = np.zeros(len(prompt), dtype=np.int64)
        return {"cached_tokens": zeros, "decode_cached_tokens": zeros.copy(), "kv_transferred_tokens": moved}

    def hit_rates(self) -> dict[str, float]:
        """Per instance id: prompt tokens found cached / prompt tokens looked up (vLLM's prefix
        cache hit rate; decode instances count their local hits on pulled prompts)."""
        return {self.ids[x]: p.stats.hit_rate for x, p in enumerate(self.pools) if p is not None}

    def lookups(self) -> dict[str, tuple[int, int]]:
        """Per instance id: (prompt tokens looked up, tokens found cached)."""
        return {self.ids[x]: (p.stats.queries, p.stats.hits) for x, p in enumerate(self.pools) if p is not None}
