"""The gateway's own Prometheus metrics (prometheus_client, a registry per console)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 20, 40, 80)
_TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
_DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2)


class GatewayMetrics:
    """Requests per instance and outcome, decision latency, active policies, SLO gauges, TTFT/TPOT."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "sibyl_gateway_requests", "requests by prefill/decode instance and outcome",
            ["prefill", "decode", "outcome"], registry=r,
        )
        self.decision = Histogram(
            "sibyl_routing_decision_seconds", "time to take one routing decision",
            buckets=_DECISION_BUCKETS, registry=r,
        )
        self.policy = Info("sibyl_policy", "active policy of each kind", ["kind"], registry=r)
        self.attainment = Gauge("sibyl_slo_attainment", "share of requests meeting their SLO", ["window"], registry=r)
        self.ttft = Histogram("sibyl_ttft_seconds", "time to first token seen by the gateway", buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("sibyl_tpot_seconds", "time per output token seen by the gateway", buckets=_TPOT_BUCKETS, registry=r)
        self.migration_stall = Histogram("sibyl_migration_stall_seconds", "gap between tokens a client saw across a live migration",
                                         buckets=_TPOT_BUCKETS, registry=r)
        self.in_flight = Gauge("sibyl_gateway_in_flight", "requests being proxied", registry=r)
        self.queue_depth = Gauge("sibyl_gateway_queue_depth", "requests held by the queue policy", registry=r)
        self._request_counters: dict[tuple[str, str, bool], Counter] = {}
        self.instance_up = Gauge("sibyl_instance_up", "1 when the instance is routable", ["instance", "role"], registry=r)

    def count_request(self, prefill: str, decode: str, ok: bool) -> None:
        """One finished request (the labelled child is looked up once per instance pair)."""
        key = (prefill, decode, ok)
        child = self._request_counters.get(key)
        if child is None:
            child = self._request_counters[key] = self.requests.labels(prefill=prefill, decode=decode, outcome="ok" if ok else "failed")
        child.inc()
