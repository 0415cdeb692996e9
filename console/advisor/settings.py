"""`[advisor]`: the live what-if advisor's settings and its autopilot's (docs/advisor.md; console/live/advisor.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from console.advisor.coarse import CoarseRule
from core.errors import PolicyError


class AdvisorSettings(BaseModel):
    """`[advisor]`: the live what-if advisor and its autopilot (docs/advisor.md; console/live/advisor.py)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(
        False,
        description="re-simulate the recent traffic under each candidate policy in a niced worker process; off by "
        "default: the console itself pays < 1% of a core, but the worker simulates every candidate each period "
        "(at 64 instances about 0.4 CPU-second per 100 requests in the window with prefix keys, 0.07 without: "
        "20 req/s over 300 s takes ~21 s of each 30 s period) on the machine that may also run the instances",
    )
    pool: str | None = Field(
        None,
        min_length=1,
        description="the pool to advise on (a [[pools]] entry's name; its traffic, shape and calibration, and where "
        "an automatic canary runs); default: the first pool",
    )
    period_s: float = Field(30.0, gt=0, description="how often a window is advised on")
    window_s: float = Field(300.0, gt=0, description="how much recent traffic each advice re-simulates")
    candidates: list[str] | None = Field(
        None,
        description="[KIND:]NAME of each policy to try (routing or queue; default: every registered one that applies)",
    )
    apply: Literal["suggest", "canary", "auto"] = Field(
        "suggest",
        description="suggest: only advise; canary: start a canary when a candidate's gain clears the advisor's error "
        "two periods in a row; auto: also promote on the canary's verdict (cool-down, max swaps per hour)",
    )
    canary_share: float = Field(0.1, gt=0, le=0.5, description="the share of traffic an automatic canary takes")
    canary_for_s: float = Field(300.0, gt=0, description="how long an automatic canary runs before its verdict")
    max_swaps_per_hour: int = Field(2, ge=0, description="auto: the most promotions in any hour")
    cooldown_s: float = Field(
        600.0, ge=0, description="auto and canary: no automatic canary this long after a swap or a canary's end"
    )
    coarse_blocks: int = Field(
        8,
        ge=1,
        description="engine KV blocks merged into one modelled block when the advisor models the prefix cache "
        "coarsely (\"coarse prefix blocks (×8)\" in the advice; docs/advisor.md gives its error); 1: always exact",
    )
    coarse_above_instances: int | None = Field(
        None, ge=1, description="always model coarse blocks for a cluster of more instances than this (unset: by CPU)"
    )
    coarse_cpu_share: float | None = Field(
        0.8,
        gt=0,
        description="model coarse blocks after an exact advice that took more than this share of period_s in the "
        "worker's CPU seconds, and exact again once an exact one is estimated to fit (unset: never by CPU)",
    )

    def coarse_rule(self) -> CoarseRule:
        """When the worker models the prefix cache in coarse blocks (console/advisor/coarse.py)."""
        budget = None if self.coarse_cpu_share is None else self.coarse_cpu_share * self.period_s
        return CoarseRule(self.coarse_blocks, self.coarse_above_instances, budget)

    @field_validator("candidates")
    @classmethod
    def _known(cls, v: list[str] | None) -> list[str] | None:
        if v is not None:
            from console.advisor.simulate import parse_candidate  # the simulator loads only when candidates are named

            for text in v:
                try:
                    parse_candidate(text)
                except PolicyError as e:
                    raise ValueError(str(e)) from None
        return v
