"""The instances a console routes to: role, URL, health, latest sample and one pooled HTTP client each."""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field

import aiohttp

from adapters.http.upstream import UpstreamPool
from adapters.vllm.scrape import MetricsSample
from core.types import InstanceState, Role

CACHE_WINDOW_S = 30.0
"""The trailing window of an instance's prefix hit rate and cached share."""


@dataclass
class Instance:
    """One upstream vLLM (or emulated) server."""

    id: str
    role: Role
    url: str
    healthy: bool = True
    consecutive_failures: int = 0
    sample: MetricsSample = field(default_factory=MetricsSample)
    tokens_per_s: float = 0.0
    last_scrape: float = 0.0
    routed: int = 0
    failed: int = 0
    session: aiohttp.ClientSession | None = None
    """For probes and discovery (/health, /metrics, /v1/models)."""
    upstream: UpstreamPool | None = None
    """For the P/D legs: the gateway's lean hot-path client (adapters/http/upstream.py)."""
    pid: int | None = None
    """Local process id when the console started this instance."""
    managed: bool = True
    """Started by this console's backend (False: attached, never stopped by the console)."""
    dp_size: int = 1
    """Data-parallel ranks behind this endpoint (> 1: the rank is chosen per request with
    vLLM's X-data-parallel-rank header)."""
    node: str | None = None
    """Where it runs when a backend places instances across machines (the Ray backend: node IP and
    id); None: on this host or unknown."""
    _cache_window: deque[tuple[float, float, float, float]] = field(default_factory=deque, repr=False)
    """(scrape time, Δ prefix hits, Δ prefix queries, Δ prompt tokens) over the last CACHE_WINDOW_S."""
    kv_events_endpoint: str | None = None
    """Where this instance publishes its KV events (ZMQ PUB, vLLM's --kv-events-config), if it does."""
    kv_events_replay: str | None = None
    """Its replay socket for missed event batches (ZMQ ROUTER), if any."""
    metrics_page: str = field(default="", repr=False)
    """The text of its latest /metrics page (the live calibration reads its histograms)."""
    health_rtt_s: deque[float] = field(default_factory=lambda: deque(maxlen=256))
    """Round trips of the latest /health probes: the HTTP cost of one request to this instance
    as the gateway sees it (calibration takes it out of the prefill legs it measured)."""

    def health_rtt_median(self) -> float | None:
        """The median of the latest /health round trips (None before the first probe)."""
        return float(statistics.median(self.health_rtt_s)) if self.health_rtt_s else None

    def open(self, limit: int = 1024, connect_timeout_s: float = 30.0) -> None:
        """Create the pooled clients (inside the running event loop)."""
        self.upstream = UpstreamPool(self.url, connect_timeout_s=connect_timeout_s)
        # Idle pooled connections are dropped after 4 s: vLLM's uvicorn closes them after 5 s, and a
        # request written to a connection the server is closing fails ("Can not write request body").
        connector = aiohttp.TCPConnector(limit=limit, keepalive_timeout=4, ttl_dns_cache=300)
        self.session = aiohttp.ClientSession(
            base_url=self.url,
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s),
            auto_decompress=False,
        )

    async def close(self) -> None:
        if self.upstream is not None:
            self.upstream.close()
            self.upstream = None
        if self.session is not None:
            await self.session.close()
            self.session = None

    def update(self, sample: MetricsSample, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self.last_scrape > 0 and now > self.last_scrape:
            delta = sample.generation_tokens_total - self.sample.generation_tokens_total
            self.tokens_per_s = max(delta, 0.0) / (now - self.last_scrape)
            prev = self.sample
            self._cache_window.append(
                (
                    now,
                    max(0.0, sample.prefix_cache_hits_total - prev.prefix_cache_hits_total),
                    max(0.0, sample.prefix_cache_queries_total - prev.prefix_cache_queries_total),
                    max(0.0, sample.prompt_tokens_total - prev.prompt_tokens_total),
                )
            )
            while self._cache_window and self._cache_window[0][0] < now - CACHE_WINDOW_S:
                self._cache_window.popleft()
        self.sample = sample
        self.last_scrape = now

    @property
    def prefix_hit_rate(self) -> float | None:
        """Prompt tokens found in its prefix cache ÷ tokens looked up, over the last CACHE_WINDOW_S
        (None: nothing looked up)."""
        queries = sum(q for _, _, q, _ in self._cache_window)
        return sum(h for _, h, _, _ in self._cache_window) / queries if queries else None

    @property
    def cached_share(self) -> float | None:
        """Prompt tokens found in its own cache ÷ prompt tokens it took in, over the last
        CACHE_WINDOW_S (on a decode instance the rest was pulled or computed; None: no prompts)."""
        prompts = sum(p for _, _, _, p in self._cache_window)
        return min(1.0, sum(h for _, h, _, _ in self._cache_window) / prompts) if prompts else None

    def state(self) -> InstanceState:
        s = self.sample
        return InstanceState(
            id=self.id,
            role=self.role,
            healthy=self.healthy,
            running=int(s.running),
            waiting=int(s.waiting),
            kv_usage=s.kv_usage,
            tokens_per_s=self.tokens_per_s,
            url=self.url,
            observed_at=self.last_scrape or None,
        )
