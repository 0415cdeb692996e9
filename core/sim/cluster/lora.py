"""LoRA adapters on the simulated instances: residency (core/lora.py), load stalls, per-step cost, max_loras per batch.

It models what the emulator's engine does (adapters/emulator/engine.py, lora.py), which mirrors vLLM 0.32:

* Each instance keeps at most `max_loras` adapters (`InstanceAdapters`), evicting the least recently used
  idle one. A request pins its adapter on an instance from its admission there until it leaves: on a
  prefill instance until its prefill ends, on a decode instance until it finishes.
* A step (prefill) or batch (decode) runs at most `max_loras` distinct adapters. On a prefill instance a
  waiting prompt whose adapter would exceed that (or find no slot to load into) is skipped for the step
  and keeps its place at the head of the queue (vLLM's scheduler skips it); on a decode instance the
  request waits here, outside the decode model, until one of the batch's adapters is free again.
* Admission loads an adapter the instance does not hold, and the load stalls the instance: a prefill
  step starts when the adapters of its prompts are loaded (loads started together overlap, as the
  emulator's `stall` keeps the latest end); a decode instance's next step starts no earlier than the
  load's end, every request on it waiting (`stall` of the decode models).
* Each distinct adapter among a step's sequences adds `lora_per_adapter_step_s` to the step (the decode
  models ask `step_s` for their batch).

The dispatcher's view gets the residency (`ClusterView.lora`), so adapter-aware routing reads it. The
decode side approximates in two places: in iteration mode a request counts in its batch's adapters
from when it reaches the instance (it may wait in the decode model's own queue for a slot or KV), and
a migrated request keeps its adapter pinned on the instance it was admitted to.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Protocol, TypedDict

from core.lora import InstanceAdapters, LoraResidency
from core.perf import PerfProfile

if TYPE_CHECKING:
    from core.prefill_steps import PrefillStepper
    from core.sim.cluster.prefill import SimPrefill
    from core.view import ClusterView

DEFAULT_MAX_LORAS = 4
"""Adapter slots of a simulated instance unless the run says (`--max-loras`): vLLM's default is 1, but
serving many adapters one slot at a time is not a configuration anyone runs; 4 is the issue's setting."""


class LoraCounts(TypedDict, total=False):
    """A run's adapter figures, as ClusterSimResult's fields of the same names."""

    lora_loads: int
    lora_hits: int
    lora_evictions: int


NO_LORA = LoraCounts()


class Stallable(Protocol):
    """A decode model whose next step can be held back (decode_iter.py, decode_ps.py)."""

    lora_step: Callable[[Iterable[int]], float] | None

    def stall(self, now: float, seconds: float) -> None: ...
    def admit(self, req: int, output_tokens: int, prompt_tokens: int, now: float) -> None: ...


class SimLora:
    """The adapters of every simulated instance and of every request, by dispatcher index and row."""

    def __init__(
        self,
        adapters: Sequence[str | None],
        profile: PerfProfile,
        max_loras: int,
        view: ClusterView,
        prompts: list[int],
        outputs: list[int],
    ) -> None:
        self.adapter_of: list[str | None] = list(adapters)
        self.max_loras = max_loras
        self.load_s = profile.lora_load_s
        self.per_adapter_s = profile.lora_per_adapter_step_s
        self.residency = LoraResidency(default_max_loras=max_loras)
        view.lora = self.residency  # adapter-aware routing reads what the instances hold
        self._ids: list[str] = []
        self._prompts, self._outputs = prompts, outputs
        self.batch: list[Counter[str]] = []
        """Per instance: the requests decoding there under each adapter."""
        self.waiting: list[deque[int]] = []
        """Per instance: requests that reached it for decode and wait for a batch slot for their adapter."""
        self.pinned_at: dict[int, int] = {}
        """Request → the instance its adapter is pinned on for decode."""

    @classmethod
    def for_trace(
        cls,
        adapters: Sequence[str | None] | None,
        profile: PerfProfile,
        max_loras: int,
        view: ClusterView,
        prompts: list[int],
        outputs: list[int],
    ) -> SimLora | None:
        """The model when any row names an adapter; None otherwise (nothing changes, nothing is paid)."""
        if adapters is None or not any(adapters):
            return None
        if len(adapters) != len(prompts):
            raise ValueError(f"{len(adapters)} adapters for {len(prompts)} requests")
        if max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {max_loras}")
        return cls(adapters, profile, max_loras, view, prompts, outputs)

    def attach(self, x: int, instance_id: str, prefill: SimPrefill, decoder: Stallable | None) -> None:
        """Instance x (serving what it serves now): tracked, its prefill steps and decode batches under the model."""
        self.add_instance(x, instance_id)
        prefill.lora = self
        if decoder is not None:
            decoder.lora_step = self.step_s

    def add_instance(self, x: int, instance_id: str) -> None:
        while len(self.batch) <= x:
            self.batch.append(Counter())
            self.waiting.append(deque())
            self._ids.append("")
        self._ids[x] = instance_id
        self.residency.add_instance(instance_id, self.max_loras)

    def held(self, x: int) -> InstanceAdapters:
        return self.residency.of(self._ids[x])

    def _fits(self, held: InstanceAdapters, batch: Iterable[str], adapter: str) -> bool:
        """Whether a request under `adapter` may join a step running `batch`'s adapters: the adapter is
        among them, or a batch slot is left and the instance can hold it besides every pinned one."""
        step = set(batch)
        if adapter in step:
            return True
        if len(step) >= self.max_loras:
            return False
        pinned = {a for a, s in held.slots.items() if s.active > 0} | step
        return adapter in pinned or len(pinned) < self.max_loras

    def _acquire(self, held: InstanceAdapters, adapter: str, now: float) -> float:
        """Pin the adapter (loading it when it is not held): when it is usable."""
        return held.acquire(adapter, now, self.load_s).ready_at

    # --- prefill --------------------------------------------------------------------------------
    def hold_back(self, x: int, stepper: PrefillStepper, now: float) -> list[int]:
        """Before instance x forms a step: take out of its waiting queue the prompts the step may not
        admit (their adapter would exceed max_loras, or find no slot), as far as the step could reach
        (its running slots); returned, to go back at the head of the queue after the step (`restore`)."""
        adapter_of = self.adapter_of
        held = self.held(x)
        step = {a for j in stepper.running if (a := adapter_of[j])}
        waiting = stepper.waiting
        room = stepper.terms.max_seqs - len(stepper.running)
        passed: list[int] = []
        skipped: list[int] = []
        while waiting and len(passed) < room:
            j = waiting.popleft()
            a = adapter_of[j]
            if a and not self._fits(held, step, a):
                skipped.append(j)
                continue
            if a:
                step.add(a)
            passed.append(j)
        waiting.extendleft(reversed(passed))
        return skipped

    def step(self, x: int, stepper: PrefillStepper, now: float) -> tuple[float, list[int], list[int]] | None:
        """Instance x's next prefill step as `stepper.step()` forms it, within max_loras adapters (`hold_back`),
        its seconds counting its adapters' loads and per-step cost (`prefill_step`)."""
        ran = list(stepper.running)
        skipped = self.hold_back(x, stepper, now)
        step = stepper.step()
        if step is None:
            stepper.waiting.extendleft(reversed(skipped))
            return None
        seconds, admitted, finishing = step
        return seconds + self.prefill_step(x, stepper, skipped, ran, admitted, now), admitted, finishing

    def prefill_step(
        self, x: int, stepper: PrefillStepper, skipped: list[int], ran: list[int], admitted: list[int], now: float
    ) -> float:
        """Instance x formed a step of `ran` (its running prompts before it) and `admitted`: the skipped prompts
        go back at the head of the queue, the admitted pin their adapters (loading what is not held). Returns
        the seconds the step starts late (the loads) plus what its distinct adapters add to it."""
        stepper.waiting.extendleft(reversed(skipped))
        adapter_of = self.adapter_of
        held = self.held(x)
        ready = now
        for j in admitted:
            a = adapter_of[j]
            if a:
                ready = max(ready, self._acquire(held, a, now))
        distinct = {a for j in ran for a in (adapter_of[j],) if a} | {a for j in admitted if (a := adapter_of[j])}
        return (ready - now) + self.per_adapter_s * len(distinct)

    def prefill_end(self, x: int, done: Iterable[int], now: float) -> None:
        """Prompts finished their prefill on instance x: their adapters there are free to evict."""
        held = self.held(x)
        for j in done:
            a = self.adapter_of[j]
            if a:
                held.release(a, now)

    # --- decode ---------------------------------------------------------------------------------
    def decode_arrive(self, x: int, i: int, now: float, dec: Stallable) -> bool:
        """Request i reached decode instance x: whether it joins the decode model now (its adapter is in
        the batch, or fits: pinned, loaded with a stall when it is not held); else it waits here, and
        later requests that fit pass it (vLLM's scheduler skips it)."""
        a = self.adapter_of[i]
        if not a:
            return True
        if not self._fits(self.held(x), self.batch[x], a):
            self.waiting[x].append(i)
            return False
        self._join(x, i, a, now, dec)
        return True

    def _join(self, x: int, i: int, a: str, now: float, dec: Stallable) -> None:
        ready = self._acquire(self.held(x), a, now)
        if ready > now:
            dec.stall(now, ready - now)
        self.batch[x][a] += 1
        self.pinned_at[i] = x

    def decode_end(self, done: Iterable[int], now: float, decoders: Sequence[Stallable | None]) -> list[int]:
        """Requests finished (or failed) on their decode instances: their adapters are unpinned there, and
        requests waiting for a batch slot join in arrival order, skipping ones that still do not fit (as
        vLLM's scheduler skips them). The decode instances that admitted requests."""
        touched: set[int] = set()
        for i in done:
            x = self.pinned_at.pop(i, -1)
            if x < 0:
                continue
            a = self.adapter_of[i]
            assert a
            self.held(x).release(a, now)
            batch = self.batch[x]
            batch[a] -= 1
            if batch[a] <= 0:
                del batch[a]
            touched.add(x)
        admitted: list[int] = []
        for x in sorted(touched):
            dec = decoders[x]
            if dec is not None and self.waiting[x] and self._admit_waiting(x, now, dec):
                admitted.append(x)
        return admitted

    def _admit_waiting(self, x: int, now: float, dec: Stallable) -> bool:
        queue = self.waiting[x]
        held, batch = self.held(x), self.batch[x]
        left: deque[int] = deque()
        joined = False
        while queue:
            i = queue.popleft()
            a = self.adapter_of[i]
            assert a
            if self._fits(held, batch, a):
                self._join(x, i, a, now, dec)
                dec.admit(i, self._outputs[i], self._prompts[i], now)
                joined = True
            else:
                left.append(i)
        self.waiting[x] = left
        return joined

    def drop(self, i: int, now: float, decoders: Sequence[Stallable | None]) -> list[int]:
        """Request i failed: out of any wait, its decode pin released (`decode_end`, whose instances it returns)."""
        for queue in self.waiting:
            if i in queue:
                queue.remove(i)
        return self.decode_end((i,), now, decoders)

    def step_s(self, requests: Iterable[int]) -> float:
        """What the distinct adapters among a decode step's sequences add to it."""
        adapter_of = self.adapter_of
        return self.per_adapter_s * len({a for i in requests if (a := adapter_of[i])})

    # --- the run's figures ----------------------------------------------------------------------
    def results(self) -> LoraCounts:
        """Counts for ClusterSimResult: adapter loads, hits and evictions over every instance."""
        c = self.residency.counters()
        return LoraCounts(lora_loads=c.loads, lora_hits=c.hits, lora_evictions=c.evictions)


# --- a decode batch's steps with its adapters' cost (decode_iter.py) ------------------------------
def steps_time_plus(profile: PerfProfile, n: int, batch: int, kv_tokens: float, extra_s: float) -> float:
    """`profile.steps_time` with `extra_s` added to every step."""
    return profile.steps_time(n, batch, kv_tokens) + n * extra_s if n > 0 else 0.0


def steps_within_plus(profile: PerfProfile, dt: float, batch: int, kv_tokens: float, extra_s: float) -> int:
    """`profile.steps_within` with `extra_s` added to every step: whole steps done within `dt` (closed form,
    then corrected by one-step moves as the profile's own)."""
    if dt <= 0:
        return 0
    first = profile.step_time(batch, kv_tokens) + extra_s
    g = profile.decode_step_per_kv_token_s * batch / 2
    if g <= 0:
        n = int(dt / first)
    else:  # g·n² + (first − g)·n − dt ≤ 0
        b = first - g
        n = int((-b + math.sqrt(b * b + 4 * g * dt)) / (2 * g))
    while n > 0 and steps_time_plus(profile, n, batch, kv_tokens, extra_s) > dt + 1e-12:
        n -= 1
    while steps_time_plus(profile, n + 1, batch, kv_tokens, extra_s) <= dt + 1e-12:
        n += 1
    return n
