"""The advisor's pool: which requests are its (`on_pool`, by their base model) and the pools a stored run recorded."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


def on_pool(model: str | None, pool_model: str | None) -> bool:
    """Whether a request whose base model is `model` (as the run store records it, or the gateway holds it) is one of
    the pool serving `pool_model`: its model is the pool's, or it has none recorded (a row stored before schema 9).
    `pool_model` None: every request is. The live advisor keeps its window's rows and in-flight requests by it."""
    return pool_model is None or not model or model == pool_model


@dataclass(frozen=True, slots=True)
class RecordedPool:
    """One pool of a stored run, as its configuration recorded it."""

    name: str
    model: str | None
    """Its base model, which its requests record (None: every request of the run is the pool's)."""
    shape: str | None
    """Its configured instances ("1P2D"; None: the run's recorded cluster is the pool's)."""


def recorded_pools(config: Mapping[str, Any]) -> list[RecordedPool]:
    """The pools a live run's configuration (`ConsoleConfig` as the run store keeps it) recorded, first one first.

    Several `[[pools]]`: each by its name (default its model), with its model and its configured counts. One pool:
    one entry named as the console named it, holding every request of the run, on the run's cluster. A run that
    recorded no pool (a simulation, a replay): none."""
    pools = [p for p in config.get("pools") or [] if isinstance(p, Mapping) and p.get("model")]
    if len(pools) > 1:
        return [
            RecordedPool(
                str(p.get("name") or p["model"]), str(p["model"]), f"{int(p['prefill'])}P{int(p['decode'])}D"
            )
            for p in pools
        ]
    if pools:
        return [RecordedPool(str(pools[0].get("name") or pools[0]["model"]), None, None)]
    served = config.get("served_model_name")
    return [RecordedPool(str(served), None, None)] if served else []
