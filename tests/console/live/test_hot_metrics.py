"""The gateway's lock-free counters and histograms expose what prometheus_client's own would."""

from __future__ import annotations

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from console.live.hot_metrics import Counter, Histogram

BUCKETS = (0.005, 0.01, 0.1, 1, 2.5)
VALUES = [0.0, 0.005, 0.0050001, 0.01, 0.05, 0.1, 0.7, 1.0, 2.5, 3.0, 1e9]


def _lines(registry: CollectorRegistry) -> list[str]:
    """The exposition's sample lines, without `_created` series (ours has none)."""
    text = generate_latest(registry).decode()
    return sorted(ln for ln in text.splitlines() if ln and not ln.startswith("#") and "_created" not in ln)


def test_histogram_exposition_matches_prometheus_client_bucket_for_bucket() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    h = Histogram("x_seconds", "doc", ["slo_class"], buckets=BUCKETS, registry=ours)
    ref = prometheus_client.Histogram("x_seconds", "doc", ["slo_class"], buckets=BUCKETS, registry=theirs)
    for cls in ("a", "b"):
        for v in VALUES if cls == "a" else VALUES[:3]:
            h.labels(slo_class=cls).observe(v)
            ref.labels(slo_class=cls).observe(v)
    assert _lines(ours) == _lines(theirs)
    # a value equal to a bound counts in that bound's bucket (le), the one just above in the next
    assert 'x_seconds_bucket{le="0.005",slo_class="b"} 2.0' in _lines(ours)


def test_counters_labelled_and_not_match_prometheus_client() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    c = Counter("reqs", "doc", ["outcome"], registry=ours)
    ref = prometheus_client.Counter("reqs", "doc", ["outcome"], registry=theirs)
    u = Counter("plain", "doc", registry=ours)
    uref = prometheus_client.Counter("plain", "doc", registry=theirs)
    c.labels(outcome="failed")  # a series exists at 0 once its child is looked up
    ref.labels(outcome="failed")
    for _ in range(3):
        c.labels(outcome="ok").inc()
        ref.labels(outcome="ok").inc()
    u.inc(2.5)
    uref.inc(2.5)
    assert _lines(ours) == _lines(theirs)
    assert 'reqs_total{outcome="ok"} 3.0' in _lines(ours)


def test_an_unlabelled_histogram_and_bad_declarations() -> None:
    r = CollectorRegistry()
    h = Histogram("d_seconds", "doc", buckets=(1e-5, 1e-4), registry=r)
    h.observe(5e-5)
    assert 'd_seconds_bucket{le="0.0001"} 1.0' in _lines(r) and 'd_seconds_bucket{le="+Inf"} 1.0' in _lines(r)
    with pytest.raises(ValueError, match="strictly increasing"):
        Histogram("bad", "doc", buckets=(1, 1, 2), registry=CollectorRegistry())
    labelled = Counter("l", "doc", ["kind"], registry=CollectorRegistry())
    with pytest.raises(ValueError, match="takes the labels"):
        labelled.labels(other="x")
