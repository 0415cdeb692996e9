"""Where the dispatcher's knowledge of every instance's prefix cache comes from: exact, approximate or precise."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal

from core.cache.events import KVEvent
from core.cache.index import CacheIndex, PrefixLookup
from core.cache.keys import BlockKey

PrefixSource = Literal["off", "exact", "approximate", "precise"]
"""off: nothing known (every prompt uncached everywhere); exact: the world's own caches (the
simulator's pools); approximate: the router's own decisions (what it sent somewhere is assumed
cached there for a TTL, up to a capacity); precise: the instances' KV events."""


class PrefixTracker:
    """One source of prefix-cache knowledge and the lookup routing reads (``lookup``)."""

    def __init__(self) -> None:
        self.source: PrefixSource = "off"
        self.index: CacheIndex | None = None
        """The index of the approximate and precise sources (None otherwise)."""
        self.lookup: PrefixLookup | None = None

    def exact(self, lookup: PrefixLookup) -> None:
        """Read the world's own caches (the simulator hands its pools' view)."""
        self.source, self.index, self.lookup = "exact", None, lookup

    def approximate(self, ttl_s: float | None, capacity_blocks: int | None) -> None:
        """Assume what was routed to an instance is cached there for ``ttl_s`` seconds, at most
        ``capacity_blocks`` blocks per instance (least recently routed dropped first)."""
        self.index = CacheIndex(ttl_s=ttl_s, capacity_blocks=capacity_blocks)
        self.source, self.lookup = "approximate", self.index

    def precise(self) -> None:
        """Take each instance's cache from its KV events (``apply``), which never expire."""
        self.index = CacheIndex(ttl_s=None)
        self.source, self.lookup = "precise", self.index

    def off(self) -> None:
        self.source, self.index, self.lookup = "off", None, None

    def routed(self, instances: Iterable[str], keys: Sequence[BlockKey], now: float) -> None:
        """A request with these keys was sent to ``instances`` (approximate source only)."""
        if self.source == "approximate" and keys:
            assert self.index is not None
            for iid in instances:
                self.index.record_routed(iid, keys, now)

    def apply(self, instance: str, events: Iterable[KVEvent]) -> None:
        """Ingest an instance's KV events (keys already ours); an error unless the source is precise."""
        if self.source != "precise" or self.index is None:
            raise ValueError(f"KV events need the precise prefix source; this dispatcher's is {self.source}")
        self.index.apply_all(instance, events)

    def clear(self, instance: str) -> None:
        """Forget an instance's blocks (its cache was reset, it restarted, or it went away)."""
        if self.index is not None:
            self.index.clear(instance)
