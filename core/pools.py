"""Pools behind one gateway: a pool is one base model's instances, its dispatcher (with its policies of every kind)
and its LoRA adapters; `Pools` maps a request's `model` (a base model or an adapter) to its pool.

As llm-d's InferencePool (one per base model) and vLLM's `/v1/models` (adapters listed with their `parent`):
a request naming a base model runs on that model's pool as the base model; one naming an adapter runs on
the pool of the adapter's base model, under the adapter (`Request.lora`). Every name is unique across
pools, so the name alone picks the pool.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from core.dispatch import Dispatcher
from core.errors import ConfigError, SibylError
from core.lora import LoraResidency


class UnknownModel(SibylError):
    """A request named a model that is neither a pool's base model nor an adapter of one."""

    def __init__(self, model: str, known: Iterable[str]) -> None:
        self.model = model
        names = sorted(known)
        listed = ", ".join(names[:20]) + (f" and {len(names) - 20} more" if len(names) > 20 else "")
        super().__init__(f"The model `{model}` does not exist. Served models and adapters: {listed}.")


class UnknownPool(ConfigError):
    """A pool was named that the console does not run, or none was named where several run."""


@dataclass(eq=False)
class Pool:
    """One base model's instances, dispatcher and adapters. Its dispatcher's view reads `residency`
    (adapter-aware routing: `ClusterView.lora`)."""

    name: str
    model: str
    """The base model's served name (what clients put in `model`)."""
    dispatcher: Dispatcher
    residency: LoraResidency = field(default_factory=LoraResidency)
    """Which adapters each of its instances holds (core/lora.py)."""
    adapters: dict[str, str] = field(default_factory=dict)
    """Its LoRA adapters: name → path (as the instances load it)."""
    aliases: set[str] = field(default_factory=set)
    """Other names of the base model (the ids its instances report in /v1/models)."""
    instance_ids: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.dispatcher.view.lora = self.residency

    def add_instance(self, instance_id: str, max_loras: int | None = None) -> None:
        self.instance_ids.add(instance_id)
        self.residency.add_instance(instance_id, max_loras)

    def remove_instance(self, instance_id: str) -> None:
        self.instance_ids.discard(instance_id)
        self.residency.remove_instance(instance_id)


@dataclass(frozen=True, slots=True)
class Route:
    """Where a request's `model` runs: its pool, and the adapter it runs under (None: the base model)."""

    pool: Pool
    adapter: str | None


class Pools:
    """Every pool by name, and the table from a model or adapter name to its `Route`."""

    def __init__(self, pools: Sequence[Pool]) -> None:
        if not pools:
            raise ConfigError("a console runs at least one pool")
        self.by_name: dict[str, Pool] = {}
        self.routes: dict[str, Route] = {}
        """Model or adapter name → its route: what the gateway looks a request's `model` up in."""
        for pool in pools:
            if pool.name in self.by_name:
                raise ConfigError(f"two pools are named {pool.name!r}; pool names must be unique")
            self.by_name[pool.name] = pool
            self._claim(pool.model, Route(pool, None))
            for alias in pool.aliases:
                self._claim(alias, Route(pool, None))
            for adapter in pool.adapters:
                self._claim(adapter, Route(pool, adapter))
        self._instances: dict[str, Pool] = {}
        for pool in pools:
            for iid in pool.instance_ids:
                self._instances[iid] = pool
        self.default: Route | None = Route(pools[0], None) if len(pools) == 1 else None
        """The route of a request that names no model: the only pool's base model (None with several)."""

    def _claim(self, name: str, route: Route) -> None:
        have = self.routes.get(name)
        if have is not None and (have.pool is not route.pool or have.adapter != route.adapter):
            what = f"adapter of pool {have.pool.name!r}" if have.adapter else f"base model of pool {have.pool.name!r}"
            raise ConfigError(f"{name!r} is already the {what}; model and adapter names must be unique across pools")
        self.routes[name] = route

    def __iter__(self) -> Iterator[Pool]:
        return iter(self.by_name.values())

    def __len__(self) -> int:
        return len(self.by_name)

    # --- requests ----------------------------------------------------------------------------------
    def resolve(self, model: str | None) -> Route:
        """The route of a request's `model` (None: the only pool's base model). UnknownModel when it
        names nothing served, or names nothing while several models are."""
        if model is None:
            if self.default is not None:
                return self.default
            raise UnknownModel("", self.routes)
        route = self.routes.get(model)
        if route is None:
            raise UnknownModel(model, self.routes)
        return route

    # --- operators ----------------------------------------------------------------------------------
    def pick(self, name: str | None) -> Pool:
        """The pool named (None: the only one). UnknownPool naming the pools otherwise."""
        if name is None:
            if len(self.by_name) == 1:
                return next(iter(self.by_name.values()))
            raise UnknownPool(f"this console runs {len(self.by_name)} pools ({', '.join(self.by_name)}): name one")
        pool = self.by_name.get(name)
        if pool is None:
            raise UnknownPool(f"no pool {name!r}; pools: {', '.join(self.by_name)}")
        return pool

    def add_alias(self, pool: Pool, name: str) -> bool:
        """Another name of the pool's base model (an id its instances report); False when the name is
        taken by something else (it is then left alone)."""
        have = self.routes.get(name)
        if have is not None:
            return have.pool is pool and have.adapter is None
        pool.aliases.add(name)
        self.routes[name] = Route(pool, None)
        return True

    def add_adapter(self, pool: Pool, name: str, path: str) -> None:
        """Register adapter `name` (at `path`) with the pool; ConfigError when the name is taken."""
        if not name:
            raise ConfigError("an adapter needs a name")
        have = self.routes.get(name)
        if have is not None:
            if have.pool is pool and have.adapter == name:
                raise ConfigError(f"adapter {name!r} is already registered with pool {pool.name!r}")
            self._claim(name, Route(pool, name))
        pool.adapters[name] = path
        self.routes[name] = Route(pool, name)

    def remove_adapter(self, name: str) -> Pool:
        """Unregister adapter `name`; the pool it belonged to. UnknownModel when no pool has it."""
        route = self.routes.get(name)
        if route is None or route.adapter is None:
            raise UnknownModel(name, (n for n, r in self.routes.items() if r.adapter))
        del self.routes[name]
        del route.pool.adapters[name]
        return route.pool

    # --- instances ----------------------------------------------------------------------------------
    def add_instance(self, pool: Pool, instance_id: str, max_loras: int | None = None) -> None:
        pool.add_instance(instance_id, max_loras)
        self._instances[instance_id] = pool

    def remove_instance(self, instance_id: str) -> None:
        pool = self._instances.pop(instance_id, None)
        if pool is not None:
            pool.remove_instance(instance_id)

    def of_instance(self, instance_id: str) -> Pool | None:
        """The pool an instance serves (None: none)."""
        return self._instances.get(instance_id)

    # --- what /v1/models shows ----------------------------------------------------------------------
    def cards(self, created: int, max_model_len: int | None = None) -> list[dict[str, Any]]:
        """Every base model (with its aliases) and adapter as OpenAI model cards; adapters carry their
        base model as `parent` and their path as `root`, as vLLM lists them."""
        out: list[dict[str, Any]] = []
        for name in sorted(self.routes):
            route = self.routes[name]
            card: dict[str, Any] = {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "sibyl-console",
                "max_model_len": max_model_len,
            }
            if route.adapter is not None:
                card["root"] = route.pool.adapters[name]
                card["parent"] = route.pool.model
            out.append(card)
        return out
