"""LoRA adapters on a live console's instances: registered per pool, loaded through vLLM's endpoints where requests
need them (both legs of a P/D request), within each instance's slots, least recently used unloaded first; residency
(core/lora.py, what adapter-aware routing reads) kept from those calls and from `vllm:lora_requests_info`.

The console keeps at most `max_loras` adapters registered on an instance: to load one more it unloads the least
recently used adapter no request runs under (`/v1/unload_lora_adapter`), so what an instance accepts and what
routing believes it holds stay the same set. Loads of one instance are serialised; requests under an adapter
being loaded there wait for that load. `add` checks the adapter's directory before any instance is touched and
loads it on one prefill and one decode instance of its pool, so its first request finds it held.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from adapters.vllm.lora import AdapterCallError, LoraEndpoints, check_adapter_dir
from core.errors import ConfigError
from core.pools import Pool, Pools
from core.types import Role

if TYPE_CHECKING:
    from adapters.vllm.instances import Instance
    from console.live.events import EventBus

ALREADY_LOADED = "has already been loaded"
"""vLLM's 400 for a name already registered on the instance (it is there: the load's goal is met)."""


class AdapterPlacement(Protocol):
    """What a live request (and its DecodeRelay) asks of the adapters: run on an instance under one."""

    async def place(self, request_id: str, inst: Instance, adapter: str) -> float:
        """Make `adapter` usable on `inst` for this request (loading it there if it must) and pin it until
        `release`; the seconds waited for a load (0: it was held). AdapterCallError naming the instance and
        vLLM's message when it cannot be loaded there."""
        ...

    def release(self, request_id: str) -> None:
        """The request ended: every adapter it pinned may be unloaded again."""
        ...

    def holders(self, adapter: str) -> set[str]:
        """The instances the adapter is loaded on now."""
        ...


@dataclass(slots=True)
class PoolAdapterCounts:
    """One pool's cumulative counts (`/metrics`): a placement that found its adapter loaded (hit) or did not
    (miss), loads done, adapters unloaded to make room (evictions), loads that failed."""

    hits: int = 0
    misses: int = 0
    loads: int = 0
    evictions: int = 0
    load_failures: int = 0


class LiveAdapters:
    """Every pool's adapters on its instances (see the module docstring)."""

    def __init__(
        self,
        pools: Pools,
        instances: Mapping[str, Instance],
        max_loras: int,
        endpoints: LoraEndpoints | None = None,
        events: EventBus | None = None,
    ) -> None:
        self.pools = pools
        self.instances = instances
        self.max_loras = max_loras
        self.endpoints = endpoints or LoraEndpoints()
        self.events = events
        self.registered: dict[str, set[str]] = {}
        """Instance → the adapters it accepts requests under (loaded by us, or seen running there)."""
        self.counts: dict[str, PoolAdapterCounts] = {p.name: PoolAdapterCounts() for p in pools}
        self._locks: dict[str, asyncio.Lock] = {}
        self._pins: dict[str, list[tuple[str, str]]] = {}
        """Request id → the (instance, adapter) pairs it runs under."""
        self._seen_step: dict[str, float] = {}
        """Instance → the time of the last vllm:lora_requests_info step folded in."""

    # --- instances ---------------------------------------------------------------------------------------
    def instance_added(self, inst: Instance, pool: Pool | None = None) -> None:
        """Track an instance's slots (in its pool: the one given, the one it is known in, else the only one)."""
        pool = pool or self.pools.of_instance(inst.id) or self.pools.pick(None)
        self.pools.add_instance(pool, inst.id, self.max_loras)
        self.registered.setdefault(inst.id, set())

    def instance_removed(self, instance_id: str) -> None:
        self.pools.remove_instance(instance_id)
        self.registered.pop(instance_id, None)
        self._seen_step.pop(instance_id, None)

    def observe(self, inst: Instance, now: float) -> None:
        """Fold in the adapters the instance's latest step ran under (`vllm:lora_requests_info`): loaded there."""
        sample = inst.sample
        running = sample.lora_running
        if running is None or sample.lora_at <= self._seen_step.get(inst.id, 0.0):
            return
        self._seen_step[inst.id] = sample.lora_at
        pool = self.pools.of_instance(inst.id)
        if pool is None:
            return
        registered = self.registered.setdefault(inst.id, set())
        registered.difference_update(pool.residency.of(inst.id).observe(running, now))  # implied evicted
        registered.update(running)

    # --- requests ----------------------------------------------------------------------------------------
    def holders(self, adapter: str) -> set[str]:
        return {iid for iid, names in self.registered.items() if adapter in names}

    async def place(self, request_id: str, inst: Instance, adapter: str) -> float:
        pool = self.pools.of_instance(inst.id)
        if pool is None or adapter not in pool.adapters:
            where = f"pool {pool.name!r}" if pool is not None else "no pool"
            raise AdapterCallError(inst.id, "load", adapter, None, f"the adapter is not registered with {where}")
        counts = self.counts[pool.name]
        held = pool.residency.of(inst.id)
        start = time.monotonic()
        if adapter in self.registered.get(inst.id, ()):
            held.acquire(adapter, start, 0.0)
            counts.hits += 1
            self._pins.setdefault(request_id, []).append((inst.id, adapter))
            return 0.0
        counts.misses += 1  # it waits for a load: its own, or one under way for another request
        async with self._locks.setdefault(inst.id, asyncio.Lock()):
            if adapter not in self.registered.get(inst.id, ()):  # else: loaded by another request meanwhile
                await self._load(pool, inst, adapter, counts)
        held.acquire(adapter, time.monotonic(), 0.0)
        self._pins.setdefault(request_id, []).append((inst.id, adapter))
        return time.monotonic() - start

    def release(self, request_id: str) -> None:
        now = time.monotonic()
        for iid, adapter in self._pins.pop(request_id, ()):
            pool = self.pools.of_instance(iid)
            held = pool.residency.instances.get(iid) if pool is not None else None
            if held is not None:
                held.release(adapter, now)

    async def _load(self, pool: Pool, inst: Instance, adapter: str, counts: PoolAdapterCounts) -> None:
        """Load `adapter` on `inst` (its lock held), unloading the least recently used idle adapter when every
        slot is taken."""
        held = pool.residency.of(inst.id)
        now = time.monotonic()
        if not held.holds(adapter) and len(held.slots) >= held.max_loras:
            victim = held.victim(now)
            if victim is None:
                counts.load_failures += 1
                raise AdapterCallError(
                    inst.id,
                    "load",
                    adapter,
                    None,
                    f"every one of its {held.max_loras} adapter slots holds an adapter requests run under "
                    f"({', '.join(held.slots)})",
                )
            await self._unload(inst, victim)
            held.unload(victim)
            counts.evictions += 1
            self._publish("lora_evicted", pool, inst.id, victim, f"to make room for {adapter}")
        held.load(adapter, now, pool.dispatcher.view.profile.lora_load_s)  # loading: routing sees the wait
        try:
            await self.endpoints.load(inst.id, inst.url, adapter, pool.adapters[adapter])
        except AdapterCallError as e:
            if not (e.status == 400 and ALREADY_LOADED in e.message):
                held.unload(adapter)
                counts.load_failures += 1
                self._publish("lora_load_failed", pool, inst.id, adapter, str(e))
                raise
        slot = held.slots.get(adapter)
        if slot is not None:
            slot.ready_at = min(slot.ready_at, time.monotonic())
        self.registered.setdefault(inst.id, set()).add(adapter)
        counts.loads += 1
        self._publish("lora_loaded", pool, inst.id, adapter, f"in {time.monotonic() - now:.3f} s")

    async def _unload(self, inst: Instance, adapter: str) -> None:
        """Unload from one instance; an adapter it no longer knows (404) is as good as unloaded."""
        try:
            await self.endpoints.unload(inst.id, inst.url, adapter)
        except AdapterCallError as e:
            if e.status != 404:
                raise
        finally:
            self.registered.get(inst.id, set()).discard(adapter)

    # --- operators ---------------------------------------------------------------------------------------
    async def add(self, name: str, path: str, pool_name: str | None = None) -> dict[str, Any]:
        """Register an adapter with a pool (its directory checked first: nothing is touched when it holds no
        adapter) and load it on one prefill and one decode instance of the pool. When no load succeeds the
        adapter is not kept and the error names each instance and what vLLM answered."""
        try:
            folder = str(check_adapter_dir(path))
        except ValueError as e:
            raise ConfigError(f"LoRA adapter {name!r}: {e}") from None
        pool = self.pools.pick(pool_name)
        self.pools.add_adapter(pool, name, folder)
        loaded, errors = await self._spread(pool, name)
        if not loaded and errors:
            self.pools.remove_adapter(name)
            raise AdapterCallError(errors[0].instance_id, "load", name, errors[0].status, "; ".join(map(str, errors)))
        self._publish("lora_added", pool, None, name, folder)
        errs = [str(e) for e in errors]
        return {"adapter": name, "pool": pool.name, "path": folder, "loaded_on": loaded, "errors": errs}

    async def _spread(self, pool: Pool, adapter: str) -> tuple[list[str], list[AdapterCallError]]:
        """Load the adapter on the healthy instance of each role with the fewest adapters (the next on failure)."""
        loaded: list[str] = []
        errors: list[AdapterCallError] = []
        key = f"lora-add-{adapter}"
        for role in (Role.PREFILL, Role.DECODE):
            candidates = sorted(
                (i for i in self._members(pool) if i.healthy and (i.role == role or i.role == Role.BOTH)),
                key=lambda i: (len(self.registered.get(i.id, ())), i.id),
            )
            for inst in candidates:
                if inst.id in loaded:
                    break
                try:
                    await self.place(key, inst, adapter)
                except AdapterCallError as e:
                    errors.append(e)
                    continue
                loaded.append(inst.id)
                break
        self.release(key)
        return loaded, errors

    async def remove(self, name: str) -> dict[str, Any]:
        """Unregister an adapter (new requests naming it get 404) and unload it from every instance holding it."""
        pool = self.pools.remove_adapter(name)
        unloaded: list[str] = []
        errors: list[str] = []
        for inst in self._members(pool):
            if name not in self.registered.get(inst.id, ()):
                continue
            try:
                await self._unload(inst, name)
                unloaded.append(inst.id)
            except AdapterCallError as e:
                errors.append(str(e))
            pool.residency.of(inst.id).unload(name)
        self._publish("lora_removed", pool, None, name, f"unloaded from {', '.join(unloaded) or 'no instance'}")
        return {"adapter": name, "pool": pool.name, "unloaded_from": unloaded, "errors": errors}

    def snapshot(self) -> dict[str, Any]:
        """Per pool: its adapters (path, the instances holding each, requests running under each) and counts."""
        out: dict[str, Any] = {}
        for pool in self.pools:
            adapters = {}
            for name, path in sorted(pool.adapters.items()):
                holders = sorted(i for i in pool.instance_ids if name in self.registered.get(i, ()))
                active = sum(a.slots[name].active for a in pool.residency.instances.values() if name in a.slots)
                adapters[name] = {"path": path, "instances": holders, "in_flight": active}
            out[pool.name] = {
                "model": pool.model,
                "max_loras": self.max_loras,
                "adapters": adapters,
                "counts": asdict(self.counts.setdefault(pool.name, PoolAdapterCounts())),
            }
        return out

    def adapters_on(self, instance_id: str) -> list[str]:
        """The adapters an instance holds (for its row in the state)."""
        return sorted(self.registered.get(instance_id, ()))

    def _members(self, pool: Pool) -> Iterator[Instance]:
        for iid in sorted(pool.instance_ids):
            inst = self.instances.get(iid)
            if inst is not None:
                yield inst

    def _publish(self, event: str, pool: Pool, instance_id: str | None, adapter: str, detail: str) -> None:
        if self.events is not None:
            self.events.publish(event, pool=pool.name, instance=instance_id, adapter=adapter, detail=detail)

    async def close(self) -> None:
        await self.endpoints.close()


class LoraCollector(Collector):
    """`/metrics`: adapter hits, misses, loads, evictions and load failures per pool."""

    HELP = {
        "hits": "LoRA placements that found their adapter loaded on the instance",
        "misses": "LoRA placements that had to load their adapter on the instance first",
        "loads": "LoRA adapter loads done on instances",
        "evictions": "LoRA adapters unloaded to make room for another (least recently used first)",
        "load_failures": "LoRA adapter loads that failed",
    }

    def __init__(self, counts: Mapping[str, PoolAdapterCounts]) -> None:
        self.counts = counts

    def describe(self) -> Iterable[CounterMetricFamily]:
        return [CounterMetricFamily(f"sibyl_lora_{k}", h, labels=["pool"]) for k, h in self.HELP.items()]

    def collect(self) -> Iterator[CounterMetricFamily]:
        for key, doc in self.HELP.items():
            family = CounterMetricFamily(f"sibyl_lora_{key}", doc, labels=["pool"])
            for pool, c in self.counts.items():
                family.add_metric([pool], float(getattr(c, key)))
            yield family
