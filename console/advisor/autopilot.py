"""The advisor's autopilot (`[advisor] apply`): what it does with each advice, and whether a canary may promote.

- **suggest**: nothing; the advice is shown.
- **canary**: a canary of the best candidate starts when its predicted gain has cleared the advisor's own
  error bound (simulate.py `clears`) for `periods` advices in a row, no canary runs, and the cool-down
  since the last swap or canary end has passed. A promote verdict is reported, not applied.
- **auto**: as canary, and a promote verdict swaps the candidate in, unless `max_swaps_per_hour`
  promotions were already made in the last hour.

Hysteresis: a candidate must lead for `periods` advices in a row (a single lucky window starts
nothing), and nothing automatic happens within `cooldown_s` of a swap or a canary's end. Only routing
candidates can be canaried; a queue candidate is only suggested. Every decision comes back with a
sentence that gives the figures it acted on.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Literal

from console.advisor.simulate import Advice, Errors, Ranked

Apply = Literal["suggest", "canary", "auto"]
HOUR_S = 3600.0


def _pct(x: float | None, signed: bool = True) -> str:
    if x is None or not math.isfinite(x):
        return "?"
    return f"{x:+.1%}" if signed else f"{x:.1%}"


def figures(best: Ranked, bound: Errors) -> str:
    """A candidate's predicted gain over the active policies beside the error it had to clear."""
    g = best.gain
    return (
        f"{best.label} predicted {_pct(g.ttft_p99)} on P99 TTFT and {_pct(g.attainment)} on attainment over the "
        f"active policies; the advisor's error bound is {_pct(bound.ttft_p99, False)} on P99 TTFT and "
        f"{_pct(bound.attainment, False)} on attainment"
    )


@dataclass(frozen=True)
class CanaryAction:
    """Start a canary of `name` (a routing policy) on `share` of the traffic for `duration_s`, because `why`."""

    kind: str
    name: str
    params: dict[str, Any]
    share: float
    duration_s: float
    why: str


class Autopilot:
    """Keeps the streak of the best candidate, the cool-down and the swaps of the last hour."""

    def __init__(
        self,
        apply: Apply,
        *,
        share: float,
        duration_s: float,
        cooldown_s: float,
        max_swaps_per_hour: int,
        periods: int = 2,
    ) -> None:
        self.apply, self.share, self.duration_s = apply, share, duration_s
        self.cooldown_s, self.max_swaps_per_hour, self.periods = cooldown_s, max_swaps_per_hour, periods
        self.leader: str | None = None
        self.streak = 0
        """Advices in a row whose best candidate was `leader`."""
        self.quiet_until = float("-inf")
        self.swaps: deque[float] = deque()

    def consider(self, advice: Advice, now: float, canary_running: bool) -> tuple[CanaryAction | None, str]:
        """What to do with a new advice, and why, in words."""
        best = advice.best
        if best is None:
            self.leader, self.streak = None, 0
            bound = advice.bound
            return None, (
                "keep the active policies: no candidate's predicted gain clears the advisor's error bound "
                f"({_pct(bound.ttft_p99, False)} on P99 TTFT, {_pct(bound.attainment, False)} on attainment)"
            )
        self.streak = self.streak + 1 if best.label == self.leader else 1
        self.leader = best.label
        said = figures(best, advice.bound)
        if self.apply == "suggest":
            return None, f"suggest {best.label}: {said}"
        if self.streak < self.periods:
            return None, f"{said}; {self.streak} of {self.periods} advices in a row before a canary"
        kind, name = best.label.split(":", 1)
        if kind != "routing":
            return None, f"{said}; a {kind} policy cannot be canaried: swap it by hand if you agree"
        if canary_running:
            return None, f"{said}; a canary is already running"
        if now < self.quiet_until:
            return None, f"{said}; cooling down for {self.quiet_until - now:.0f} s more"
        self.streak = 0
        why = f"{said}, {self.periods} advices in a row"
        return CanaryAction(kind, name, dict(best.routing[1]), self.share, self.duration_s, why), f"canary: {why}"

    def may_promote(self, now: float) -> str | None:
        """None when a promote verdict of the autopilot's canary may swap now (the swap is counted), else why not."""
        if self.apply != "auto":
            return f"apply = {self.apply}: the swap is left to the operator"
        while self.swaps and now - self.swaps[0] >= HOUR_S:
            self.swaps.popleft()
        if len(self.swaps) >= self.max_swaps_per_hour:
            n, most = len(self.swaps), self.max_swaps_per_hour
            return f"{n} automatic swaps in the last hour (max_swaps_per_hour = {most})"
        self.swaps.append(now)
        return None

    def quiet(self, now: float) -> None:
        """A swap happened or a canary ended: nothing automatic for `cooldown_s`."""
        self.quiet_until = max(self.quiet_until, now + self.cooldown_s)
