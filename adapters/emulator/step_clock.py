"""When an emulated engine's steps start and how it sleeps to their deadlines (adapters/emulator/engine.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

SPIN_S = 0.001
SPIN_MIN_STREAMS = 64
"""When a step releases at least this many streams, busy-wait its last SPIN_S: waking late would
delay every one of them."""


def step_start(prev_end: float | None, now: float, dt: float) -> tuple[float, str]:
    """When a step of `dt` starts and how: at the previous deadline ("chain"), now after idling
    ("idle"), or now when more than a whole step behind ("slip", so lateness never accumulates)."""
    if prev_end is None:
        return now, "idle"
    if now - prev_end < dt:
        return prev_end, "chain"
    return now, "slip"


async def sleep_until(clock: Callable[[], float], deadline: float, spin: float = 0.0) -> None:
    """Sleep to `deadline` on `clock`; the last `spin` seconds busy-wait (timers are only ~1 ms precise)."""
    delay = deadline - clock() - spin
    while delay > 0:
        await asyncio.sleep(delay)  # may return early: uvloop's timers have 1 ms granularity
        delay = deadline - clock() - spin
    while clock() < deadline:
        pass
