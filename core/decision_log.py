"""Which decisions leave a record and where records go (the log), the prefix hits routing achieved, settings."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from core.decision_records import Decision, Info, Record


class DecisionLog:
    """Which requests get records, and where records go: a bounded ring of the latest (the control
    API reads it) and an optional sink (the console's run store).

    A request is sampled, or not, at its first decision, and then every decision on it is recorded
    (so a sampled request's story is whole). `sample_rate` keeps that share of requests
    (deterministically: every 1/rate-th); `max_per_s` caps the requests sampled per second of the
    dispatcher's clock. Periodic decisions (scale, reschedule) are always recorded while the rate is
    above zero."""

    def __init__(
        self,
        sample_rate: float = 1.0,
        max_per_s: int = 50,
        keep: int = 2000,
        sink: Callable[[list[Record]], None] | None = None,
    ) -> None:
        if not 0.0 <= sample_rate <= 1.0:
            raise ValueError("sample_rate must be within [0, 1]")
        self.sample_rate = sample_rate
        self.max_per_s = max_per_s
        self.ring: deque[Record] = deque(maxlen=keep)
        """The latest records, oldest first."""
        self.sink = sink
        self._sampled: dict[Hashable, None] = {}
        self._acc = 0.0
        self._second = -1
        self._this_second = 0
        self.requests_sampled = 0
        """Requests whose decisions are recorded."""
        self.skipped_rate = 0
        """Requests left out by the sample rate."""
        self.skipped_bound = 0
        """Requests left out because `max_per_s` requests were already sampled in that second."""
        self.recorded = 0
        """Decision records made."""

    @property
    def enabled(self) -> bool:
        return self.sample_rate > 0.0

    def sampled(self, rid: Hashable) -> bool:
        return rid in self._sampled

    def want(self, rid: Hashable, now: float) -> bool:
        """Whether `rid`'s decisions are recorded (decided at its first decision, then remembered)."""
        if rid in self._sampled:
            return True
        self._acc += self.sample_rate
        if self._acc < 1.0:
            self.skipped_rate += 1
            return False
        self._acc -= 1.0
        second = int(now)
        if second != self._second:
            self._second, self._this_second = second, 0
        if self._this_second >= self.max_per_s:
            self.skipped_bound += 1
            return False
        self._this_second += 1
        self.requests_sampled += 1
        self._sampled[rid] = None
        if len(self._sampled) > 8 * max(self.ring.maxlen or 0, 1024):  # ids of requests that never finished
            for old in list(self._sampled)[: len(self._sampled) // 2]:
                del self._sampled[old]
        return True

    def forget(self, rid: Hashable) -> None:
        """`rid` left the dispatcher (finished, failed, expired)."""
        self._sampled.pop(rid, None)

    def add(self, records: Sequence[Record]) -> None:
        if not records:
            return
        self.recorded += len(records)
        self.ring.extend(records)
        if self.sink is not None:
            self.sink(list(records))

    def of_request(self, request_id: str) -> list[Decision]:
        """The request's records still in the ring, oldest first."""
        return [r.get() for r in list(self.ring) if r.request_id == request_id]

    def counts(self) -> dict[str, float]:
        """The sampling settings and counts (a run's summary keeps them)."""
        return {
            "sample_rate": self.sample_rate,
            "max_per_s": self.max_per_s,
            "requests_sampled": self.requests_sampled,
            "skipped_by_rate": self.skipped_rate,
            "skipped_by_bound": self.skipped_bound,
            "records": self.recorded,
        }


@dataclass(slots=True)
class PrefixHits:
    """Achieved against achievable prefix-cache hits of routing decisions, in prompt tokens:
    achievable is the best overlap any routable prefill instance had when the request was routed
    (or the decode instance that served it alone, if more), achieved the overlap where its prompt
    was computed. Counted for every request with prefix keys while a prefix source is on."""

    decisions: int = 0
    achieved_tokens: int = 0
    achievable_tokens: int = 0
    best: int = 0
    """Decisions that achieved the achievable (a full share, including 0 of 0)."""

    def add(self, achieved: int, achievable: int) -> None:
        self.decisions += 1
        self.achieved_tokens += achieved
        self.achievable_tokens += achievable
        self.best += achieved >= achievable

    @property
    def share(self) -> float:
        """Achieved over achievable tokens (NaN while nothing was achievable)."""
        return self.achieved_tokens / self.achievable_tokens if self.achievable_tokens else float("nan")


def periodic_records(kind: str, policy: str, t: float, actions: Iterable[Any]) -> list[Record]:
    """Scale actions or migrations as records (they carry their policy's own reason)."""
    out = []
    for a in actions:
        if kind == "scale":
            chosen = a.instance_id or f"new {a.role.value}"
            info: Info = {"action": a.action, "role": a.role.value, "reason": a.reason}
            out.append(Record.of(Decision("scale", "scaling", policy, t, chosen=chosen, info=info)))
        else:
            info = {"source": a.source, "target": a.target, "reason": a.reason}
            d = Decision(
                "reschedule", "reschedule", policy, t, request_id=str(a.request_id), chosen=a.target, info=info
            )
            out.append(Record.of(d))
    return out


class DecisionSettings(BaseModel):
    """`[decisions]`: which decisions leave a record (core/decision_records.py) and how many are kept in memory."""

    model_config = ConfigDict(extra="forbid")

    sample_rate: float = Field(
        1.0, ge=0.0, le=1.0, description="share of requests whose decisions are recorded (0: no records at all)"
    )
    max_per_s: int = Field(50, ge=1, description="at most this many requests get records per second")
    keep: int = Field(5000, ge=10, description="latest records kept in memory for the dashboard's request inspector")
