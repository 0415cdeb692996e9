"""Which blocks each instance caches, from KV events (precise) or routing decisions (approximate),
with longest-prefix lookup."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Protocol

from core.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from core.cache.keys import BlockKey
from core.cache.lookup import ChainLookups, InstanceId

__all__ = ["CacheIndex", "InstanceId", "PrefixLookup"]


class PrefixLookup(Protocol):
    """What instances cache, as routing sees it (a CacheIndex, or the simulator's own pools): for
    each instance holding a prompt's first block, how many leading blocks it holds."""

    def match(self, keys: Sequence[BlockKey], now: float | None = None) -> dict[InstanceId, int]: ...


_MAX_MASKS = 1 << 16
"""The intern table of holder masks is emptied when it grows past this many (masks stay correct)."""

# Layout (as llm-d's indexer and Dynamo's radix index: key -> holders, walk until none is left):
# ``_holders`` maps a block key to a bitmask of instance slots; each instance owns one bit and its
# own record of keys (precise: key -> how many of its blocks hold it, since vLLM does not
# de-duplicate identical blocks; approximate: key -> expiry, in LRU order). Masks are interned
# (equal masks are one int object: a few hundred distinct ones serve millions of keys), which
# saves an int per shared key and keeps the masks a lookup reads in the CPU cache. ``match``
# reads a grid of the chain's keys in one pass of dict.get in C, then finds each depth inside a
# stretch where the mask changed by one bisect_left in C (a mask is an int that only decreases
# along a prefix-closed chain), so its Python work is per depth, not per key read;
# ``exact=True`` ANDs every mask along the chain (map/accumulate/takewhile) until nobody is left.
# Lookups also leave *run hints* behind (``_runs``: key -> how many keys above it along its chain
# share its mask), so the next lookup of a chain they saw walks it back run by run, two dict
# lookups a depth; a hint is checked against the masks before it is used, so a stale one costs
# time, never a wrong answer.
# Memory (CPython 3.11, tracemalloc; `python -m benchmarks.prefix_index`): about 140 B per key
# with its first holder (the index holding the only reference to the key's int), about 90 B per
# further holder of the same key (its entry in that instance's own dict; the mask is shared); an
# approximate instance's LRU entry about 70 B more.


class _Precise:
    __slots__ = ("blocks",)

    def __init__(self) -> None:
        self.blocks: dict[BlockKey, int] = {}


class _Approx:
    __slots__ = ("blocks", "capacity")

    def __init__(self, capacity: int | None) -> None:
        self.blocks: OrderedDict[BlockKey, float] = OrderedDict()
        self.capacity = capacity


class CacheIndex(ChainLookups):
    """Per-instance cached block keys of many instances, for prefix-aware routing.

    An instance is *precise* (fed by ``apply`` with its KV events) or *approximate* (fed by
    ``record_routed``: the router assumes what it sent there is cached, for ``ttl_s`` seconds and
    up to ``capacity_blocks`` blocks, least recently routed evicted first); the first call decides
    and mixing the two on one instance is an error. Times are the caller's clock (monotonic).
    """

    def __init__(self, ttl_s: float | None = 300.0, capacity_blocks: int | None = None) -> None:
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive or None, got {ttl_s}")
        if capacity_blocks is not None and capacity_blocks <= 0:
            raise ValueError(f"capacity_blocks must be positive or None, got {capacity_blocks}")
        self.ttl_s = ttl_s
        self.capacity_blocks = capacity_blocks
        self._holders: dict[BlockKey, int] = {}
        self._slot: dict[InstanceId, int] = {}
        self._ids: list[InstanceId | None] = []
        self._inst: dict[InstanceId, _Precise | _Approx] = {}
        self._bits: list[int] = []  # each slot's single-bit mask
        self._owner: dict[int, InstanceId] = {}  # single-bit mask -> the instance in that slot
        self._masks: dict[int, int] = {}  # the intern table of holder masks
        self._runs: dict[BlockKey, int] = {}  # run hints learned by lookups (only held keys)

    # ---- instances ---------------------------------------------------------------------------
    @property
    def instances(self) -> list[InstanceId]:
        return list(self._slot)

    def num_blocks(self, instance: InstanceId) -> int:
        """Distinct keys the index holds for ``instance`` (0 when unknown)."""
        inst = self._inst.get(instance)
        return 0 if inst is None else len(inst.blocks)

    def __len__(self) -> int:
        """Distinct keys held by any instance."""
        return len(self._holders)

    def holds(self, instance: InstanceId, key: BlockKey) -> bool:
        inst = self._inst.get(instance)
        return inst is not None and key in inst.blocks

    def set_capacity(self, instance: InstanceId, capacity_blocks: int | None) -> None:
        """Capacity of one approximate instance (e.g. its KV blocks); trims it at once."""
        inst = self._approx(instance)
        inst.capacity = capacity_blocks
        self._trim(instance, inst)

    def clear(self, instance: InstanceId) -> None:
        """Forget every block of ``instance`` (AllBlocksCleared, restart, lost events); keeps its slot."""
        inst = self._inst.get(instance)
        if inst is None:
            return
        bit = self._bits[self._slot[instance]]
        self._interner()
        for k in inst.blocks:
            self._drop_bit(k, bit)
        inst.blocks.clear()

    def remove_instance(self, instance: InstanceId) -> None:
        """Forget ``instance`` altogether (gone, scaled down); its slot is reused."""
        if instance not in self._slot:
            return
        self.clear(instance)
        slot = self._slot.pop(instance)
        del self._inst[instance]
        del self._owner[self._bits[slot]]
        self._ids[slot] = None

    # ---- precise: KV events ------------------------------------------------------------------
    def apply(self, instance: InstanceId, event: KVEvent) -> None:
        """Ingest one KV event of ``instance`` (keys already translated to ours)."""
        if isinstance(event, BlockStored):
            self._store(instance, event.keys)
        elif isinstance(event, BlockRemoved):
            self._remove(instance, event.keys)
        elif isinstance(event, AllBlocksCleared):
            self._precise(instance)
            self.clear(instance)
        else:  # pragma: no cover - the union is closed
            raise TypeError(f"not a KV event: {event!r}")

    def apply_all(self, instance: InstanceId, events: Iterable[KVEvent]) -> None:
        for e in events:
            self.apply(instance, e)

    def _store(self, instance: InstanceId, keys: Sequence[BlockKey]) -> None:
        blocks = self._precise(instance).blocks
        bit = self._bits[self._slot[instance]]
        holders = self._holders
        intern = self._interner().setdefault
        for k in keys:
            n = blocks.get(k)
            if n is None:
                blocks[k] = 1
                m = holders.get(k)
                if m is None:
                    holders[k] = bit
                else:
                    m |= bit
                    holders[k] = intern(m, m)
            else:
                blocks[k] = n + 1

    def _remove(self, instance: InstanceId, keys: Sequence[BlockKey]) -> None:
        blocks = self._precise(instance).blocks
        bit = self._bits[self._slot[instance]]
        self._interner()
        for k in keys:
            n = blocks.get(k)
            if n is None:
                continue  # never seen (joined late, or purged): nothing to undo
            if n > 1:
                blocks[k] = n - 1
            else:
                del blocks[k]
                self._drop_bit(k, bit)

    # ---- approximate: routing decisions ------------------------------------------------------
    def record_routed(self, instance: InstanceId, keys: Sequence[BlockKey], now: float) -> None:
        """Assume ``instance`` caches ``keys`` (a prompt's full blocks, in chain order) from ``now``."""
        inst = self._approx(instance)
        self._expire(instance, inst, now)
        blocks = inst.blocks
        bit = self._bits[self._slot[instance]]
        holders = self._holders
        intern = self._interner().setdefault
        expiry = now + self.ttl_s if self.ttl_s is not None else float("inf")
        # Tail first, so within one prompt the tail is the least recent (evicted first, as vLLM).
        for k in reversed(keys):
            if k in blocks:
                blocks.move_to_end(k)
            else:
                m = holders.get(k)
                if m is None:
                    holders[k] = bit
                else:
                    m |= bit
                    holders[k] = intern(m, m)
            blocks[k] = expiry
        self._trim(instance, inst)

    def expire(self, now: float) -> int:
        """Drop approximate entries older than the TTL; returns how many were dropped."""
        n = 0
        for instance, inst in self._inst.items():
            if isinstance(inst, _Approx):
                n += self._expire(instance, inst, now)
        return n

    # ---- lookup ------------------------------------------------------------------------------
    def match(self, keys: Sequence[BlockKey], now: float | None = None, exact: bool = False) -> dict[InstanceId, int]:
        """For each instance holding the first block, how many leading ``keys`` it holds.

        Instances without the first block are absent (read it with ``.get(i, 0)``). With ``now``,
        approximate entries past their TTL are dropped first.

        By default the lookup relies on each instance's blocks being prefix-closed (holding a
        block means holding its parent), which vLLM keeps: every use of a block uses its parent
        too, and a request's blocks are freed tail first, so a parent is never less recently used
        than its child and LRU never evicts it first; record_routed keeps it the same way. The
        holders of ``keys[j]`` then shrink as j grows, so their masks (ints) decrease, and the
        depths are where they change. A lookup walks the chain back from its last held key run
        by run (a run: keys with the same holders) where earlier lookups left hints of where the
        runs start, checking each against the masks (two dict lookups a depth); it bisects for a
        run whose hint is stale, up to four times (twice for one without a hint), then reads the
        keys above by the grid and learns their runs. The grid reads every stride-th key (about h/2 of them for
        h holders of the first block: every 64th of a 32k-token prompt's 2,048 keys for 64), then
        in each stretch between two of them where the mask changed it bisects (bisect_left, in C)
        for the last key still holding the stretch's start mask, reads the next key's mask, and
        repeats from there until that is the stretch's end mask: for n keys and d distinct depths
        about h/2 + d·(log2(2n/h) + 2) dict lookups (2,048 keys, 64 depths: ~500), and Python
        work per depth rather than per key read. A hole (a parent missing under a held child: a
        subscriber that joined late) reads as held at least when the instance holds a grid key
        past it: its depth is one past a key it holds, and at least that of its first missing
        key; an instance without holes gets its exact depth, whatever holes others have.
        ``exact=True`` walks every key instead and stops each instance at its first missing block.
        """
        if now is not None and self.ttl_s is not None:
            self.expire(now)
        if exact:
            return self._match_walk(keys)
        n = len(keys)
        holders = self._holders
        get = holders.get
        first = get(keys[0], 0) if n else 0
        if not first:
            return {}
        last = get(keys[n - 1], 0)
        if last == first:  # every holder of the first block holds them all
            out: dict[InstanceId, int] = {}
            self._emit(first, n, self._ids, out)
            return out
        return self._match_runs(keys, n, first, last)

    def forget_run_hints(self) -> None:
        """Drop the run hints lookups learned: the next lookup of every chain reads it by the grid."""
        self._runs.clear()

    def best(self, keys: Sequence[BlockKey], now: float | None = None) -> tuple[InstanceId | None, int]:
        """The instance with the longest match and its matched blocks ((None, 0) if nobody)."""
        m = self.match(keys, now)
        if not m:
            return None, 0
        inst = max(m, key=m.__getitem__)
        return inst, m[inst]

    # ---- internals ---------------------------------------------------------------------------
    def _slot_of(self, instance: InstanceId) -> int:
        slot = self._slot.get(instance)
        if slot is not None:
            return slot
        try:
            slot = self._ids.index(None)
            self._ids[slot] = instance
        except ValueError:
            slot = len(self._ids)
            self._ids.append(instance)
            self._bits.append(1 << slot)
        self._slot[instance] = slot
        self._owner[self._bits[slot]] = instance
        return slot

    def _precise(self, instance: InstanceId) -> _Precise:
        inst = self._inst.get(instance)
        if inst is None:
            self._slot_of(instance)
            inst = self._inst[instance] = _Precise()
        elif not isinstance(inst, _Precise):
            raise ValueError(f"instance {instance!r} is approximate; it takes no KV events")
        return inst

    def _approx(self, instance: InstanceId) -> _Approx:
        inst = self._inst.get(instance)
        if inst is None:
            self._slot_of(instance)
            inst = self._inst[instance] = _Approx(self.capacity_blocks)
        elif not isinstance(inst, _Approx):
            raise ValueError(f"instance {instance!r} is precise (KV events); it takes no routes")
        return inst

    def _interner(self) -> dict[int, int]:
        """The intern table of masks, emptied first when it grew past _MAX_MASKS (called once per
        event or route, so it may overshoot by one event's keys)."""
        masks = self._masks
        if len(masks) > _MAX_MASKS:
            masks.clear()
        return masks

    def _drop_bit(self, k: BlockKey, bit: int) -> None:
        m = self._holders[k] & ~bit
        if m:
            self._holders[k] = self._masks.setdefault(m, m)
        else:
            del self._holders[k]
            self._runs.pop(k, None)

    def _expire(self, instance: InstanceId, inst: _Approx, now: float) -> int:
        blocks = inst.blocks
        if not blocks or self.ttl_s is None:
            return 0
        bit = self._bits[self._slot[instance]]
        self._interner()
        n = 0
        # Entries are in expiry order (a route sets now + ttl, never earlier than the last one).
        while blocks:
            k, exp = next(iter(blocks.items()))
            if exp > now:
                break
            blocks.popitem(last=False)
            self._drop_bit(k, bit)
            n += 1
        return n

    def _trim(self, instance: InstanceId, inst: _Approx) -> None:
        cap = inst.capacity
        if cap is None:
            return
        blocks = inst.blocks
        if len(blocks) <= cap:
            return
        bit = self._bits[self._slot[instance]]
        self._interner()
        while len(blocks) > cap:
            k, _ = blocks.popitem(last=False)
            self._drop_bit(k, bit)
