"""A simulated prefill instance: its waiting and running prompts, stepped with the dispatcher's own prefill model.

Each instance steps a core/prefill_steps.py `PrefillStepper`, the model `core.prefill.project` and
the dispatcher's projection (core/prefill.py `PrefillQueues`) step, with the terms of the mode:

* iteration mode: vLLM 0.32's scheduler (`StepTerms.of(profile)`): running prompts' next chunks
  first, then waiting prompts FIFO while the step's token budget (`max_num_batched_tokens`) and
  running slots (`max_num_seqs`) last, a prompt that does not fit the budget left chunked into
  later steps; a step costs `step_time(seqs, KV)` plus, carrying prefill, `prefill_base_s` once
  and each chunk's own tokens, as the emulator's steps do (adapters/emulator/engine.py);
* ps mode: SIBYL App. I's serial prefill (`StepTerms.of(profile, serial=True)`): one prompt at a
  time, for exactly `prefill_time(l)`.

In both, each prompt reaching the instance brings `prefill_host_per_request_s` (h) of host work,
its intake: one arriving during a step adds h after it, one arriving with no step under way puts
the next step h after it (or after the host work pending); the next step forms when the host
work ends, from what waits then (as the projection assumes, core/prefill.py). One arriving during a
step also makes that step `prefill_arrival_stretch_s` longer (`arrival_stretch`), as the emulator's
engine does; the projection does not (docs/admission.md). A prompt's first
token, and its prefill end, come out at the end of the step computing its last chunk. With a KV
cache (core/sim/cluster/cache.py) a prompt computes only its tokens not cached on the instance
when it is admitted. The first step after the instance idled for g seconds costs the profile's
`wake_time(g)` more, as the emulator's engine pays it; a step run while the cluster's decode
instances stream R tokens/s takes `host_stretch(R)` times its compute (the host's per-token work on
the instance's core, as the emulator's engine reads it from its host board).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from core.perf import PerfProfile
from core.prefill import StepTerms
from core.prefill_steps import PrefillStepper
from core.sim.cluster.cache import SimCache
from core.sim.cluster.lora import SimLora
from core.sim.cluster.result import Mode


def step_terms(profile: PerfProfile, mode: Mode) -> StepTerms:
    """The prefill instances' step terms in `mode` (the dispatcher projects with the same)."""
    return StepTerms.of(profile, serial=mode == "ps")


class SimPrefill:
    """One instance's prefill engine: `stepper` holds its prompts (request indices)."""

    __slots__ = (
        "stepper", "busy", "stepping", "intakes", "host_free", "finishing", "x", "lora", "idle_from", "idled", "wake",
        "stretch", "arrival_stretch", "stretch_due",
    )

    def __init__(self, x: int, terms: StepTerms, prompts: list[int], cache: SimCache | None) -> None:
        if cache is None:
            self.stepper = PrefillStepper(terms, prompts.__getitem__)
        else:  # a prompt computes its tokens not cached here, counted when it is admitted
            self.stepper = PrefillStepper(
                terms,
                lambda i: cache.would_compute(x, i, prompts[i]),
                lambda i: cache.prefill(x, i, prompts[i]),
            )
        self.busy = False
        """A step is under way, or the host work the next one waits for."""
        self.stepping = False
        """A step is under way."""
        self.intakes = 0
        """Prompts that arrived during the step under way (their intake follows it)."""
        self.host_free = 0.0
        """When the host work pending (intakes) ends."""
        self.finishing: list[int] = []
        """The prompts the step under way finishes."""
        self.x = x
        self.lora: SimLora | None = None
        """LoRA adapters (core/sim/cluster/lora.py): steps within max_loras, paying loads and per-adapter cost."""
        self.idle_from = -math.inf
        """When it last ran out of prompts (an instance starts having idled long)."""
        self.idled = True
        """Its next step is the first after idling (it pays `wake`)."""
        self.wake: Callable[[float], float] | None = None
        """The profile's `wake_time`: what the first step after idling costs more (None: nothing)."""
        self.stretch: Callable[[], float] | None = None
        """How much longer what the cluster streams now makes a step (`PerfProfile.host_stretch`; None: 1)."""
        self.arrival_stretch = 0.0
        """What a prompt arriving during a step adds to it (`prefill_arrival_stretch_s`)."""
        self.stretch_due = 0.0
        """What the prompts that arrived during the step under way add to it, not yet waited for."""

    def arrive(self, now: float) -> None:
        """A prompt reached the instance now: the step under way runs longer and its intake follows it, or,
        with none under way, its intake starts now."""
        if self.stepping:
            self.stretch_due += self.arrival_stretch
        host = self.stepper.terms.host
        if not host:
            return
        if self.stepping:
            self.intakes += 1
        else:
            self.host_free = max(self.host_free, now) + host

    @property
    def idle(self) -> bool:
        """Nothing runs, waits or is under way."""
        return not self.busy and not self.stepper

    def start(self, now: float) -> tuple[float, list[int]] | None:
        """Start the next step now (the caller has waited for `host_free`): when it ends and the
        prompts it admits; None when nothing waits or runs."""
        step = self.stepper.step() if self.lora is None else self.lora.step(self.x, self.stepper, now)
        if step is None:
            self.busy = False
            return None
        seconds, admitted, self.finishing = step
        if self.stretch is not None:
            seconds *= self.stretch()
        if self.idled:
            self.idled = False
            if self.wake is not None:
                seconds += self.wake(now - self.idle_from)
        self.busy = self.stepping = True
        return now + seconds, admitted

    def went_idle(self, now: float) -> None:
        """Its last step (and that step's host work) ended at `now` with no prompt left to run."""
        self.idle_from = now
        self.idled = True

    def stretched(self) -> float:
        """What the step reaching its end still runs on for the prompts that arrived during it (0: it ends)."""
        due, self.stretch_due = self.stretch_due, 0.0
        return due

    def end(self, now: float) -> list[int]:
        """The step under way ended now: the prompts it finished (the intake of the prompts that came
        meanwhile starts). It stays busy until the caller starts the next step."""
        done = self.finishing
        self.finishing = []
        self.stepping = False
        if self.intakes:
            self.host_free = max(self.host_free, now) + self.stepper.terms.host * self.intakes
            self.intakes = 0
        if self.lora is not None:
            self.lora.prefill_end(self.x, done, now)
        return done
