"""The dispatcher's prefix tracker: where its knowledge of every instance's prefix cache comes from (exact,
approximate or precise), installed into the cluster view the policies read."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal

from core.cache.events import KVEvent
from core.cache.index import CacheIndex, PrefixLookup
from core.cache.keys import BlockKey
from core.view import ClusterView

APPROXIMATE_TTL_S = 1800.0
"""How long the approximate source counts a routed prefix as cached, at most (each instance's KV capacity,
least recently routed dropped first, is the other bound). A backstop for evictions the router cannot see, so it
must outlast a conversation's pause between turns: in Mooncake's conversation trace the time since a request's
prefix was last sent is 255 s at the 90th percentile, 426 s at the 95th and 882 s at the 99th; a replay at half
speed doubles them. The earlier 300 s dropped 10% of reuses at full speed (more at the demo's 0.3x, where
approximate routing then hit less than least_load: 12.3% against 12.9%, precise 17.1%; with 1,800 s, 17.1%)."""

PrefixSource = Literal["off", "exact", "approximate", "precise"]
"""off: nothing known (every prompt uncached everywhere); exact: the world's own caches (the
simulator's pools); approximate: the router's own decisions (what it sent somewhere is assumed
cached there for a TTL, up to a capacity); precise: the instances' KV events."""


class PrefixTracker:
    """One source of prefix-cache knowledge, installed as `view.prefix` (with the block size and
    whether decode-only service is possible) for the policies to read."""

    def __init__(self, view: ClusterView) -> None:
        self.view = view
        self.source: PrefixSource = "off"
        self.index: CacheIndex | None = None
        """The index of the approximate and precise sources (None otherwise)."""

    def _install(self, source: PrefixSource, lookup: PrefixLookup | None, block_size: int, decode_only: bool) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        v = self.view
        self.source = source
        v.prefix, v.block_size, v.decode_only = lookup, block_size, decode_only
        v.forget_cached()

    def exact(self, lookup: PrefixLookup, block_size: int, decode_only: bool = True) -> None:
        """Read the world's own caches (the simulator hands its pools' view)."""
        self.index = None
        self._install("exact", lookup, block_size, decode_only)

    def approximate(
        self,
        block_size: int,
        ttl_s: float | None = APPROXIMATE_TTL_S,
        capacity_blocks: int | None = None,
        decode_only: bool = False,
    ) -> None:
        """Assume what was routed to an instance is cached there for ``ttl_s`` seconds, at most
        ``capacity_blocks`` blocks per instance (None: the profile's KV capacity), least recently
        routed dropped first."""
        cap = capacity_blocks or max(1, self.view.profile.kv_capacity_tokens // block_size)
        self.index = CacheIndex(ttl_s=ttl_s, capacity_blocks=cap)
        self._install("approximate", self.index, block_size, decode_only)

    def precise(self, block_size: int, decode_only: bool = False) -> None:
        """Take each instance's cache from its KV events (``apply``), which never expire."""
        self.index = CacheIndex(ttl_s=None)
        self._install("precise", self.index, block_size, decode_only)

    def off(self) -> None:
        self.index = None
        self._install("off", None, self.view.block_size, False)

    def routed(self, instances: Iterable[str | None], keys: Sequence[BlockKey], now: float) -> None:
        """A request with these keys was sent to ``instances`` (None: no such leg); approximate only."""
        if self.source == "approximate" and keys:
            assert self.index is not None
            for iid in instances:
                if iid is not None:
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
