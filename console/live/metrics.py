"""The gateway's own Prometheus metrics (prometheus_client, a registry per console).

Names follow Prometheus' conventions: `sibyl_` namespace, base units (`_seconds`), counters end in
`_total`, and per-instance series carry `instance_id` (never `instance`, which Prometheus sets to
the scrape target). The series of what each pool decides (its policies, their swaps, its decisions)
carry `pool`, the pool's name (a console without `[[pools]]` has one, named after its served model).
Every series, its labels and the panel that reads it are listed in demos/grafana/README.md; the
dashboard test checks that list against a live scrape. Counters and histograms are
console.live.hot_metrics' (no lock per increment: a request updates a dozen).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Gauge, Info
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from console.live.hot_metrics import Counter, CounterChild, Histogram

if TYPE_CHECKING:
    from adapters.vllm.instances import Instance

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 20, 40, 80)
_TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
_WAIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
_DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2)

DECISION_OUTCOMES = {
    "routing": ("routed", "prefill_retried", "failed_over", "no_capacity"),
    "queue": ("held", "expired", "abandoned", "shed"),
}
"""The outcomes `sibyl_decisions_total` counts, per policy kind (see console/live/outcomes.py)."""


class _ClassLatency:
    """The latency histograms' children of one SLO class (looked up once per class, not per request)."""

    __slots__ = ("ttft", "tpot", "e2e", "queue_wait", "handoff", "whole", "met", "missed", "failed")

    def __init__(self, m: GatewayMetrics, slo_class: str) -> None:
        self.ttft = m.ttft.labels(slo_class=slo_class)
        self.tpot = m.tpot.labels(slo_class=slo_class)
        self.e2e = m.e2e.labels(slo_class=slo_class)
        self.queue_wait = m.queue_wait.labels(slo_class=slo_class)
        self.handoff = m.handoff.labels(slo_class=slo_class)
        self.whole = m.whole_replies.labels(slo_class=slo_class)
        self.met = m.slo_requests.labels(slo_class=slo_class, result="met")
        self.missed = m.slo_requests.labels(slo_class=slo_class, result="missed")
        self.failed = m.slo_requests.labels(slo_class=slo_class, result="failed")


class _InstanceCollector(Collector):
    """Per-instance counters read at scrape time from the console's instances: nothing on the hot path."""

    def __init__(self) -> None:
        self.instances: Callable[[], Iterable[Instance]] = list

    def describe(self) -> list[CounterMetricFamily]:
        return []  # nothing to check at registration (the families are built per scrape)

    def collect(self) -> Iterator[CounterMetricFamily]:
        routed = CounterMetricFamily(
            "sibyl_instance_routed_requests",
            "legs the gateway sent to the instance (prefill and decode legs; a request "
            "whose two legs ran on one instance counts twice)",
            labels=["instance_id"],
        )
        hits = CounterMetricFamily(
            "sibyl_instance_prefix_cache_hit_tokens",
            "prompt tokens the instance found in its prefix cache "
            "(vllm:prefix_cache_hits_total at the console's last scrape)",
            labels=["instance_id"],
        )
        queries = CounterMetricFamily(
            "sibyl_instance_prefix_cache_query_tokens",
            "prompt tokens the instance looked up in its prefix cache "
            "(vllm:prefix_cache_queries_total at the console's last scrape)",
            labels=["instance_id"],
        )
        for inst in self.instances():
            routed.add_metric([inst.id], inst.routed)
            hits.add_metric([inst.id], inst.sample.prefix_cache_hits_total)
            queries.add_metric([inst.id], inst.sample.prefix_cache_queries_total)
        yield routed
        yield hits
        yield queries


class GatewayMetrics:
    """Requests per instance and outcome, decisions, active policies, SLO gauges and per-class latencies."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "sibyl_gateway_requests",
            "requests by prefill/decode instance and outcome",
            ["prefill", "decode", "outcome"],
            registry=r,
        )
        self.decision = Histogram(
            "sibyl_routing_decision_seconds",
            "time to take one routing decision",
            buckets=_DECISION_BUCKETS,
            registry=r,
        )
        self.decision_time = self.decision.labels()
        """The decision histogram's one series (observed on every request: looked up once)."""
        self.decisions = Counter(
            "sibyl_decisions",
            "decisions taken on requests, by pool, policy kind, the pool's active policy and outcome "
            "(counted when the request leaves the gateway)",
            ["pool", "kind", "policy", "outcome"],
            registry=r,
        )
        self.policy = Info("sibyl_policy", "active policy of each kind in each pool", ["pool", "kind"], registry=r)
        self.policy_swaps = Counter("sibyl_policy_swaps", "policy swaps by pool and kind", ["pool", "kind"], registry=r)
        self.policy_swapped_at = Gauge(
            "sibyl_policy_last_swap_timestamp_seconds",
            "Unix time of the last policy swap of each kind in each pool (0: none yet)",
            ["pool", "kind"],
            registry=r,
        )
        self.attainment = Gauge(
            "sibyl_slo_attainment",
            "share of requests meeting their SLO (NaN until one finished)",
            ["window"],
            registry=r,
        )
        for window in ("60s", "run"):
            self.attainment.labels(window=window).set(float("nan"))
        self.slo_requests = Counter(
            "sibyl_slo_requests",
            "finished requests by SLO class and result (met, missed, failed)",
            ["slo_class", "result"],
            registry=r,
        )
        self.ttft = Histogram(
            "sibyl_ttft_seconds",
            "time to first token seen by the gateway (a whole reply: to the end of its prefill leg)",
            ["slo_class"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "sibyl_tpot_seconds",
            "time per output token seen by the gateway (streamed replies only)",
            ["slo_class"],
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "sibyl_e2e_seconds",
            "arrival to last byte of a successful request",
            ["slo_class"],
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "sibyl_queue_wait_seconds",
            "arrival to the prefill leg being sent (held in the gateway queue, then routed)",
            ["slo_class"],
            buckets=_WAIT_BUCKETS,
            registry=r,
        )
        self.handoff = Histogram(
            "sibyl_pd_handoff_seconds",
            "P/D hand-off: end of the prefill leg to the first decode token (streamed replies only)",
            ["slo_class"],
            buckets=_WAIT_BUCKETS,
            registry=r,
        )
        self.whole_replies = Counter(
            "sibyl_whole_replies",
            "successful non-streamed requests: TTFT taken at the prefill leg's end, TPOT unknown",
            ["slo_class"],
            registry=r,
        )
        self.migration_stall = Histogram(
            "sibyl_migration_stall_seconds",
            "gap between tokens a client saw across a live migration",
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge("sibyl_gateway_in_flight", "requests being proxied", registry=r)
        self.queue_depth = Gauge("sibyl_gateway_queue_depth", "requests held by the queue policy", registry=r)
        self._request_counters: dict[tuple[str, str, bool], CounterChild] = {}
        self._classes: dict[str, _ClassLatency] = {}
        self._decision_counters: dict[tuple[str, str, str, str], CounterChild] = {}
        self.instance_up = Gauge(
            "sibyl_instance_up", "1 when the instance is routable", ["instance_id", "role"], registry=r
        )
        self._instances = _InstanceCollector()
        r.register(self._instances)

    def watch_instances(self, instances: Callable[[], Iterable[Instance]]) -> None:
        """Where the per-instance counters are read from at each scrape."""
        self._instances.instances = instances

    def count_request(self, prefill: str, decode: str, ok: bool) -> None:
        """One finished request (the labelled child is looked up once per instance pair)."""
        key = (prefill, decode, ok)
        child = self._request_counters.get(key)
        if child is None:
            child = self._request_counters[key] = self.requests.labels(
                prefill=prefill, decode=decode, outcome="ok" if ok else "failed"
            )
        child.inc()

    def of_class(self, slo_class: str) -> _ClassLatency:
        """The per-class children of `slo_class`."""
        c = self._classes.get(slo_class)
        if c is None:
            c = self._classes[slo_class] = _ClassLatency(self, slo_class)
        return c

    def count_decision(self, pool: str, kind: str, policy: str, outcome: str) -> None:
        """One decision of pool `pool`'s policy of `kind` on a request."""
        key = (pool, kind, policy, outcome)
        child = self._decision_counters.get(key)
        if child is None:
            child = self._decision_counters[key] = self.decisions.labels(
                pool=pool, kind=kind, policy=policy, outcome=outcome
            )
        child.inc()

    def policy_active(self, pool: str, kind: str, name: str, params: str) -> None:
        """Pool `pool`'s active policy of `kind` (its swap series exist from now on, at zero until a swap)."""
        self.policy.labels(pool=pool, kind=kind).info({"name": name, "params": params})
        self.policy_swaps.labels(pool=pool, kind=kind)
        self.policy_swapped_at.labels(pool=pool, kind=kind)

    def policy_swapped(self, pool: str, kind: str) -> None:
        """Pool `pool`'s policy of `kind` was swapped just now."""
        self.policy_swaps.labels(pool=pool, kind=kind).inc()
        self.policy_swapped_at.labels(pool=pool, kind=kind).set(time.time())
