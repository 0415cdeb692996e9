"""Fault injection: fail a share of requests with a status, slow down, hang, report unhealthy."""

from __future__ import annotations

import random

from pydantic import BaseModel, ConfigDict, Field


class Faults(BaseModel):
    """Current faults of one instance; changed with flags or `PUT /admin/faults`."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    fail_rate: float = Field(0.0, ge=0.0, le=1.0, description="share of requests answered with fail_status")
    fail_status: int = Field(503, ge=400, le=599)
    slowdown: float = Field(1.0, ge=0.01, le=1000.0, description="multiplies every step and prefill time")
    hang: bool = Field(False, description="accept requests but never answer them")
    unhealthy: bool = Field(False, description="/health answers 503")

    def should_fail(self, rng: random.Random) -> bool:
        return self.fail_rate > 0 and rng.random() < self.fail_rate
