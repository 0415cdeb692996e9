"""LoRA adapter residency per instance: what each instance holds or is loading, its `max_loras` slots,
least-recently-used eviction, and the residency tiers routing prices by load time.

The model follows vLLM 0.32: an instance started with `--enable-lora --max-loras N` keeps at most N
adapters (its LRU adapter cache, `max_cpu_loras` defaulting to `max_loras`); loading one more evicts
the least recently used adapter no running request uses. A request under an adapter the instance
does not hold waits for the load. The tiers are llm-d's residency tiers (its `loraloadstate`
scorer): held, loading, a free slot, a slot to evict, every slot in use.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from core.errors import SibylError


class AdapterSlotsFull(SibylError):
    """Every slot of an instance holds an adapter some request is running under: nothing to evict."""


class Tier(IntEnum):
    """Where an adapter stands on one instance, cheapest first."""

    LOADED = 0
    """Held and usable now."""
    LOADING = 1
    """A load is under way; usable when it completes."""
    FREE_SLOT = 2
    """Not held; a slot is free: one load."""
    EVICT = 3
    """Not held; every slot is taken but one holds an idle adapter: evict it (LRU), then one load."""
    FULL = 4
    """Not held; every slot holds an adapter in use: the request would wait for one to go idle."""


@dataclass(slots=True)
class Slot:
    """One held (or loading) adapter."""

    ready_at: float
    """When its load completes (at or before now: loaded)."""
    last_used: float
    """When a request last started or finished under it, or it was loaded."""
    active: int = 0
    """Requests running under it now; an adapter in use is never evicted."""


@dataclass(frozen=True, slots=True)
class Placement:
    """What making an adapter resident on one instance did."""

    adapter: str
    ready_at: float
    """When it is usable there."""
    loaded: bool
    """Whether a load was started (a miss) rather than the adapter being held already (a hit)."""
    evicted: str | None = None
    """The adapter evicted to make room, if any."""


@dataclass(slots=True)
class AdapterCounters:
    """Cumulative counts for an operator's /metrics: hits, misses, loads and evictions."""

    hits: int = 0
    misses: int = 0
    loads: int = 0
    evictions: int = 0


class InstanceAdapters:
    """The adapters one instance holds, at most `max_loras` of them, evicted least recently used first."""

    __slots__ = ("max_loras", "slots", "counters")

    def __init__(self, max_loras: int) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {max_loras}")
        self.max_loras = max_loras
        self.slots: dict[str, Slot] = {}
        self.counters = AdapterCounters()

    def holds(self, adapter: str) -> bool:
        """Whether the adapter is held or loading."""
        return adapter in self.slots

    def loaded(self, now: float) -> list[str]:
        """The adapters usable now, least recently used first."""
        return [a for a, s in self._by_use() if s.ready_at <= now]

    def victim(self, now: float) -> str | None:
        """The adapter a load would evict: the least recently used one that is loaded and idle
        (a loading adapter is not evictable; neither is one a request runs under)."""
        for name, s in self._by_use():
            if s.active == 0 and s.ready_at <= now:
                return name
        return None

    def tier(self, adapter: str, now: float) -> Tier:
        s = self.slots.get(adapter)
        if s is not None:
            return Tier.LOADED if s.ready_at <= now else Tier.LOADING
        if len(self.slots) < self.max_loras:
            return Tier.FREE_SLOT
        return Tier.EVICT if self.victim(now) is not None else Tier.FULL

    def wait_s(self, adapter: str, now: float, load_s: float) -> float:
        """Seconds until a request under `adapter` could run here: 0 when loaded, the rest of the
        load when loading, one load when a slot is free or can be freed, inf when none can."""
        s = self.slots.get(adapter)
        if s is not None:
            return max(s.ready_at - now, 0.0)
        if len(self.slots) < self.max_loras or self.victim(now) is not None:
            return load_s
        return math.inf

    def load(self, adapter: str, now: float, load_s: float) -> Placement:
        """Make the adapter resident (evicting the least recently used idle one when every slot
        is taken) without starting a request under it. Raises AdapterSlotsFull when no slot can
        be freed."""
        s = self.slots.get(adapter)
        if s is not None:
            s.last_used = max(s.last_used, now)
            self.counters.hits += 1
            return Placement(adapter, s.ready_at, loaded=False)
        evicted = None
        if len(self.slots) >= self.max_loras:
            evicted = self.victim(now)
            if evicted is None:
                raise AdapterSlotsFull(
                    f"all {self.max_loras} adapter slots hold adapters in use ({', '.join(self.slots)}); "
                    f"cannot load {adapter!r}"
                )
            del self.slots[evicted]
            self.counters.evictions += 1
        self.slots[adapter] = Slot(ready_at=now + load_s, last_used=now)
        self.counters.misses += 1
        self.counters.loads += 1
        return Placement(adapter, now + load_s, loaded=True, evicted=evicted)

    def acquire(self, adapter: str, now: float, load_s: float) -> Placement:
        """A request starts under the adapter: make it resident (as `load`) and pin it until `release`."""
        placed = self.load(adapter, now, load_s)
        self.slots[adapter].active += 1
        return placed

    def release(self, adapter: str, now: float) -> None:
        """A request under the adapter ended; it stays held, most recently used."""
        s = self.slots.get(adapter)
        if s is None:
            return
        s.active = max(s.active - 1, 0)
        s.last_used = max(s.last_used, now)

    def unload(self, adapter: str) -> bool:
        """Drop the adapter (the instance unloaded it); whether it was held."""
        return self.slots.pop(adapter, None) is not None

    def observe(self, running: Iterable[str], now: float) -> list[str]:
        """Fold in what the instance reported: the `running_lora_adapters` of vLLM's
        `vllm:lora_requests_info` are loaded and were used now (its `waiting_lora_adapters` say
        nothing about residency: a request may wait for its adapter's slot). Adapters the report
        implies were evicted (more held than slots) are dropped, least recently used first; returned."""
        dropped: list[str] = []
        running = [a for a in running if a]
        for adapter in running:
            s = self.slots.get(adapter)
            if s is None:
                self.slots[adapter] = Slot(ready_at=now, last_used=now)
            else:
                s.ready_at = min(s.ready_at, now)
                s.last_used = max(s.last_used, now)
        keep = set(running)
        while len(self.slots) > self.max_loras:
            old = next((a for a, _ in self._by_use() if a not in keep), None)
            if old is None:
                break
            del self.slots[old]
            dropped.append(old)
        return dropped

    def _by_use(self) -> list[tuple[str, Slot]]:
        return sorted(self.slots.items(), key=lambda kv: kv[1].last_used)


@dataclass
class LoraResidency:
    """Every instance's adapters, by instance id: what adapter-aware routing reads (`ClusterView.lora`)
    and what the console keeps from its own load/unload calls and the instances' reports."""

    default_max_loras: int = 1
    """Slots of an instance added without its own `max_loras` (vLLM's default is 1)."""
    instances: dict[str, InstanceAdapters] = field(default_factory=dict)

    def add_instance(self, instance_id: str, max_loras: int | None = None) -> InstanceAdapters:
        """Track an instance (idempotent: an instance already tracked keeps what it holds)."""
        have = self.instances.get(instance_id)
        if have is None:
            have = self.instances[instance_id] = InstanceAdapters(max_loras or self.default_max_loras)
        return have

    def remove_instance(self, instance_id: str) -> None:
        self.instances.pop(instance_id, None)

    def of(self, instance_id: str) -> InstanceAdapters:
        """An instance's adapters (tracked from now on if it was not)."""
        return self.add_instance(instance_id)

    def holders(self, adapter: str) -> list[str]:
        """The instances holding or loading the adapter."""
        return [i for i, a in self.instances.items() if a.holds(adapter)]

    def counters(self) -> AdapterCounters:
        """The counts summed over every instance tracked now."""
        total = AdapterCounters()
        for a in self.instances.values():
            c = a.counters
            total.hits += c.hits
            total.misses += c.misses
            total.loads += c.loads
            total.evictions += c.evictions
        return total

    def tiers(self, adapter: str, instance_ids: Sequence[str], now: float) -> np.ndarray:
        """The adapter's Tier on each instance, by index (an untracked instance: a free slot)."""
        out = np.full(len(instance_ids), int(Tier.FREE_SLOT), dtype=np.int8)
        get = self.instances.get
        for i, iid in enumerate(instance_ids):
            a = get(iid)
            if a is not None:
                out[i] = a.tier(adapter, now)
        return out

    def wait_s(self, adapter: str, instance_ids: Sequence[str], now: float, load_s: float) -> np.ndarray:
        """Seconds until a request under the adapter could run on each instance, by index (see
        `InstanceAdapters.wait_s`; an untracked instance: one load)."""
        out = np.full(len(instance_ids), load_s, dtype=float)
        get = self.instances.get
        for i, iid in enumerate(instance_ids):
            a = get(iid)
            if a is not None:
                out[i] = a.wait_s(adapter, now, load_s)
        return out
