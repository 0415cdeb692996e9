"""Admission's refusals by cause, seen by an operator: `/metrics` series and one event line per cause per window.

SLO admission (core/admission.py `SloGate`) counts every refusal by the limit it hit, with the
last one's projected start against its bound; the gateway's tenant limits are counted there too.
`RefusalCollector` exports those counts at scrape time (nothing on the hot path), per pool (each pool's
dispatcher has its own gate). `RefusalLines` turns a pool's counts into event-log lines naming the pool: at
most one per cause per `window_s`, with the count since the previous line, where a saturated cluster used
to log one line per refused request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from console.live.admission import WAIT_BOUND_EXPIRY
from console.live.record import Outcome

if TYPE_CHECKING:
    from console.live.events import EventBus
    from console.live.record import RequestRecord
    from core.admission import SloGate

LINE_WINDOW_S = 5.0
"""At most one event line per cause this often."""
CAUSE_LABELS = {
    "prefill_backlog": "prefill backlog",
    "decode_slots": "decode slots",
    "kv": "KV cache full",
    "queue_full": "queue full",
    "tenant_limit": "tenant limit",
}
"""How an event line names each cause (core/admission_signals.py RefusalCause)."""


def refusal_line(cause: str, count: int, window_s: float, projected_s: float | None, bound_s: float | None) -> str:
    """One event line: "prefill backlog: 37 refused in the last 5 s, projected 2.9 s against 1.6 s"."""
    head = f"{CAUSE_LABELS.get(cause, cause)}: {count} refused in the last {max(window_s, 1.0):.0f} s"
    if cause == "tenant_limit":
        return head + (f", retry after ~{projected_s:.0f} s" if projected_s else "") + " (the tenant's own limits)"
    if projected_s is None or bound_s is None:
        return head
    return head + f", projected {projected_s:.1f} s against {bound_s:.1f} s"


def counted_by_admission(live: RequestRecord) -> bool:
    """Whether SLO admission counted this request's refusal (so a refusal line tells it, not a
    failure event of its own): shed at arrival, refused by its tenant's limits, or expired past
    its wait bound (an expiry past the queue policy's ttl_s is not admission's and keeps its line)."""
    outcome = live.outcome
    if outcome is Outcome.SHED or outcome is Outcome.TENANT_LIMIT:
        return True
    return outcome is Outcome.EXPIRED and (live.reason or "").startswith(WAIT_BOUND_EXPIRY)


class RefusalLines:
    """Publishes a `refusals` event per cause at most every `window_s`, counting the refusals since the last one."""

    def __init__(
        self,
        events: EventBus,
        gate: Callable[[], SloGate | None],
        window_s: float = LINE_WINDOW_S,
        pool: str | None = None,
    ) -> None:
        self.events = events
        self.gate = gate
        """The dispatcher's gate now (None: admission is off, nothing is counted)."""
        self.pool = pool
        """The pool whose gate it reads: each line carries it as `pool` (None: no such key)."""
        self.window_s = window_s
        self._counted: dict[str, int] = {}
        """Per cause, the gate's count at the last look."""
        self._pending: dict[str, int] = {}
        """Per cause, refusals not in a line yet."""
        self._since: dict[str, float] = {}
        """Per cause, when its pending refusals began to be counted."""
        self._line_at: dict[str, float] = {}
        """Per cause, when its last line went out."""

    def tick(self, now: float) -> list[dict[str, Any]]:
        """Look at the gate's counts; publish the lines that are due (returned too)."""
        gate = self.gate()
        if gate is None:
            return []
        out = []
        for cause, r in gate.refusals_by_cause().items():
            count = int(r["count"])
            new = count - self._counted.get(cause, 0)
            self._counted[cause] = count
            if new > 0:
                if not self._pending.get(cause):
                    self._since[cause] = max(self._line_at.get(cause, now - self.window_s), now - self.window_s)
                self._pending[cause] = self._pending.get(cause, 0) + new
            pending = self._pending.get(cause, 0)
            if pending <= 0 or now - self._line_at.get(cause, -float("inf")) < self.window_s:
                continue
            window = now - self._since[cause]
            projected, bound = float(r["last_projected_s"]), float(r["bound_s"])
            out.append(
                self.events.publish(
                    "refusals",
                    **({} if self.pool is None else {"pool": self.pool}),
                    cause=cause,
                    count=pending,
                    window_s=round(window, 1),
                    projected_s=round(projected, 3),
                    bound_s=round(bound, 3),
                    total=count,
                    detail=refusal_line(cause, pending, window, projected, bound),
                )
            )
            self._pending[cause] = 0
            self._line_at[cause] = now
        return out


class RefusalCollector(Collector):
    """`sibyl_admission_refusals_total{pool,cause}` and the last refusal's projected start and bound per pool and
    cause, read from each pool's gate at scrape time (no series for a pool whose admission is off)."""

    def __init__(self, gates: Callable[[], Iterable[tuple[str, SloGate | None]]]) -> None:
        self.gates = gates
        """Each pool's name and its dispatcher's gate now."""

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        gates = [(pool, gate) for pool, gate in self.gates() if gate is not None]
        if not gates:
            return
        total = CounterMetricFamily(
            "sibyl_admission_refusals",
            "requests SLO admission refused (429 at arrival, 503 once held), by the limit they hit "
            "(prefill_backlog, decode_slots, kv, queue_full, tenant_limit), per pool",
            labels=["pool", "cause"],
        )
        projected = GaugeMetricFamily(
            "sibyl_admission_refusal_projected_seconds",
            "the last refused request's projected start after its arrival, by cause "
            "(tenant_limit: the wait its tenant's limit asked), per pool",
            labels=["pool", "cause"],
        )
        bound = GaugeMetricFamily(
            "sibyl_admission_refusal_bound_seconds",
            "the bound the last refused request was held to (seconds after arrival), by cause, per pool",
            labels=["pool", "cause"],
        )
        on_decode = CounterMetricFamily(
            "sibyl_admission_prefill_on_decode",
            "requests the prefill pool would have started past their target that SLO admission sent to a decode "
            "instance alone, which computed their prompt ([admission] local_prefill), per pool",
            labels=["pool"],
        )
        for pool, gate in gates:
            for cause, r in gate.refusals_by_cause().items():
                total.add_metric([pool, cause], float(r["count"]))
                projected.add_metric([pool, cause], float(r["last_projected_s"]))
                bound.add_metric([pool, cause], float(r["bound_s"]))
            on_decode.add_metric([pool], float(gate.local.routed if gate.local is not None else 0))
        yield total
        yield projected
        yield bound
        yield on_decode
