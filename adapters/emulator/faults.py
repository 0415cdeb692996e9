"""Fault injection: fail a share of requests, slow down, hang, report unhealthy, exit.

Set at start with `emulate` flags, changed at run time with `PUT /admin/faults` (a partial
update, validated as a whole before it applies) and `POST /admin/exit`.
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

EXIT_CODE = 3
"""Exit status of an injected exit (any non-zero status looks like a crash to a supervisor)."""


class FaultConfig(BaseModel):
    """The faults of one instance."""

    model_config = ConfigDict(extra="forbid")

    fail_rate: float = Field(0.0, ge=0.0, le=1.0, description="share of generation requests answered with fail_status")
    fail_status: int = Field(503, ge=400, le=599, description="HTTP status of injected failures")
    slowdown: float = Field(1.0, ge=0.01, le=1000.0, description="multiplies every step and KV-transfer time")
    hang: bool = Field(False, description="accept requests but answer none (the engine pauses) until cleared")
    kv_pull_hang: bool = Field(
        False,
        description=(
            "the KV side channel takes pulls but answers none until cleared (a "
            "peer whose network died: vLLM's NIXL read to it never completes)"
        ),
    )
    unhealthy: bool = Field(False, description="/health answers 503")
    exit_after_requests: int | None = Field(
        None, ge=1, description="exit when this many generation requests have arrived"
    )
    exit_after_s: float | None = Field(
        None, gt=0, description="exit this many seconds after start (or after being set)"
    )
    exit_after_tokens: int | None = Field(
        None,
        ge=1,
        description=(
            "exit once this many more output tokens were generated (counted "
            "from when it is set): a crash mid-answer at an exact point"
        ),
    )


class Faults:
    """The live fault state: a FaultConfig plus what the engine and handlers wait on."""

    def __init__(self, config: FaultConfig | None = None, seed: int = 0) -> None:
        self.config = config or FaultConfig()
        self.rng = random.Random(seed)
        self.requests = 0
        self.tokens = 0
        """Output tokens generated since exit_after_tokens was last set."""
        self._unhung = asyncio.Event()
        self._pulls_flow = asyncio.Event()
        self._exit_timer: asyncio.TimerHandle | None = None
        self._set_events()

    # the engine reads these on every step
    @property
    def slowdown(self) -> float:
        return self.config.slowdown

    @property
    def hang(self) -> bool:
        return self.config.hang

    async def wait_unhung(self) -> None:
        await self._unhung.wait()

    async def wait_pulls_flow(self) -> None:
        """Return once KV pulls may be answered (at once unless kv_pull_hang is set)."""
        await self._pulls_flow.wait()

    def _set_events(self) -> None:
        for event, held in ((self._unhung, self.config.hang), (self._pulls_flow, self.config.kv_pull_hang)):
            if held:
                event.clear()
            else:
                event.set()

    def arm(self) -> None:
        """Start the exit timer, if any (needs the running loop)."""
        if self._exit_timer is not None:
            self._exit_timer.cancel()
            self._exit_timer = None
        if self.config.exit_after_s is not None:
            self._exit_timer = asyncio.get_running_loop().call_later(self.config.exit_after_s, exit_now, EXIT_CODE)

    def update(self, changes: dict[str, Any]) -> FaultConfig:
        """Apply a partial update; raises pydantic.ValidationError and changes nothing if invalid."""
        new = FaultConfig.model_validate({**self.config.model_dump(), **changes})
        timer_changed = new.exit_after_s != self.config.exit_after_s
        if "exit_after_tokens" in changes:
            self.tokens = 0
        self.config = new
        self._set_events()
        if timer_changed:
            self.arm()
        return new

    def on_request(self) -> bool:
        """Count a generation request; True if it must fail (the exit fault ends the process)."""
        self.requests += 1
        c = self.config
        if c.exit_after_requests is not None and self.requests >= c.exit_after_requests:
            exit_now(EXIT_CODE)
        return c.fail_rate > 0 and self.rng.random() < c.fail_rate

    def on_tokens(self, n: int) -> None:
        """Count output tokens written to clients; the exit fault ends the process."""
        if self.config.exit_after_tokens is None or not n:
            return
        self.tokens += n
        if self.tokens >= self.config.exit_after_tokens:
            exit_now(EXIT_CODE)


def exit_now(code: int = EXIT_CODE) -> None:
    """End the whole process at once, like a crash: no graceful shutdown, connections drop."""
    sys.stderr.write(f"sibyl-console emulate: injected exit with status {code}\n")
    sys.stderr.flush()
    os._exit(code)
