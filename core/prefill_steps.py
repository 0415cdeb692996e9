"""One prefill instance's scheduler state, stepped as vLLM 0.32's scheduler steps it (core/prefill.py's model).

Each step runs the admitted prompts still prefilling first (the next chunk of each, in admission
order), then admits waiting prompts first come first served while the step's token budget and the
running slots last; under chunked prefill a prompt that does not fit the budget left takes what is
left and finishes in a later step, unchunked it waits for a step with room for all of it (one
longer than the whole budget runs alone). The step costs `StepTerms.step_s`. `core.prefill.project`
steps a queue of known prompts with it; the simulator's prefill instances
(core/sim/cluster/prefill.py) step theirs, sizing each prompt when it is admitted (its uncached
tokens there).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from core.step_terms import StepTerms


class PrefillStepper:
    """The prompts an instance runs and the ones waiting, keyed by the caller's ints."""

    __slots__ = ("terms", "waiting", "running", "done", "total", "decoding", "decoding_kv", "_peek", "_take")

    def __init__(
        self, terms: StepTerms, peek: Callable[[int], int], take: Callable[[int], int] | None = None
    ) -> None:
        """`peek(key)`: the tokens a waiting prompt would compute if admitted now; `take(key)`: the
        same when it is admitted (it may commit, e.g. the prompt's blocks to a cache; default `peek`)."""
        self.terms = terms
        self.waiting: deque[int] = deque()
        self.running: list[int] = []
        """Admitted prompts still prefilling, in admission order."""
        self.done: dict[int, int] = {}
        """Tokens each running prompt has computed."""
        self.total: dict[int, int] = {}
        """Tokens each running prompt computes in all."""
        self.decoding = 0
        """Sequences decoding on the instance (one token a step each; they never finish here)."""
        self.decoding_kv = 0.0
        """KV tokens those hold."""
        self._peek = peek
        self._take = take or peek

    def __bool__(self) -> bool:
        """Whether a prompt waits or runs."""
        return bool(self.waiting) or bool(self.running)

    def resume(self, key: int, done: int, total: int) -> None:
        """A prompt admitted earlier, `done` of its `total` tokens computed, runs again first."""
        self.running.append(key)
        self.done[key] = done
        self.total[key] = total

    def step(self) -> tuple[float, list[int], list[int]] | None:
        """Form the next step from what runs and waits now: its seconds, the prompts it admits and
        the prompts whose last chunk it computes (their first token comes out at its end); None when
        it would carry no prefill (nothing left, or the decodes take the whole budget)."""
        t = self.terms
        dec = self.decoding
        budget = t.budget - dec
        seqs = dec
        kv = self.decoding_kv + dec
        chunk = 0.0
        per_token, per_token2 = t.per_token, t.per_token2  # `chunk_s`, inlined (the same arithmetic)
        running = self.running
        finished: list[int] = []
        if running:
            done, total = self.done, self.total
            for j in running:
                if budget <= 0:
                    break
                lo = done[j]
                hi = min(total[j], lo + budget)
                chunk += per_token * (hi - lo) + per_token2 * (hi * hi - lo * lo)
                kv += hi
                seqs += 1
                budget -= hi - lo
                done[j] = hi
                if hi >= total[j]:
                    finished.append(j)
            if finished:  # the prompts that finish leave the running ones
                fin = set(finished)
                self.running = running = [j for j in running if j not in fin]
                for j in finished:
                    del done[j], total[j]
        carried = seqs > dec
        admitted: list[int] = []
        waiting = self.waiting
        slots = t.max_seqs - dec - len(running)
        chunked = t.chunked
        # unchunked, a prompt is sized before it is admitted only if it may not fit: something else
        # takes part of the budget (a prompt longer than the whole budget runs alone)
        check = not chunked and (carried or budget < t.budget)
        while waiting and budget > 0 and len(admitted) < slots:
            j = waiting[0]
            if check:
                size = self._peek(j)
                if size > budget and (carried or size <= t.budget):
                    break  # it waits for a step with room for all of it (one longer than the budget runs alone)
            waiting.popleft()
            size = self._take(j)
            m = size if not chunked else min(size, budget)
            chunk += per_token * m + per_token2 * (m * m)  # chunk_s(0, m)
            kv += m
            seqs += 1
            budget -= m
            carried = True
            check = not chunked
            admitted.append(j)
            if m >= size:
                finished.append(j)
            else:  # chunked, the rest in later steps (it used up the budget: the last one admitted)
                self.done[j] = m
                self.total[j] = size
                running.append(j)
        if not carried:
            return None
        self.decoding_kv += dec
        seconds = t.step_base + t.per_seq * seqs + t.per_kv * kv + t.base + chunk  # step_s(seqs, kv, chunk)
        return seconds, admitted, finished
