"""The dispatcher's request lifecycle: route, bind late, prefill and decode events, finish (core/dispatch/)."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

import numpy as np

from core.decision_records import Explain, Record
from core.dispatch import recording
from core.dispatch.admitting import AdmittingMixin
from core.dispatch.base import _Tracked
from core.dispatch.canary import CANARY
from core.errors import NoCapacityError
from core.request_table import RUNNING
from core.types import (
    Assignment,
    PolicyKind,
    Request,
    Role,
)


class LifecycleMixin(AdmittingMixin):
    """A routed request's life as the dispatcher tracks it."""

    # --- request lifecycle ----------------------------------------------------------------------
    def route(self, request: Request, now: float) -> Assignment:
        """Choose prefill (and, unless bound late, decode) instances; start tracking the request."""
        v = self.view
        v.now = now
        if request.tpot_s is None or request.ttft_s is None:
            self.set_targets(request)
        canary = self.canary
        arm = canary.arm(request) if canary is not None else None
        router = self.routing
        if arm == CANARY and canary is not None and canary.kind is PolicyKind.ROUTING:
            router = canary.policy
        log = self.decisions
        ex = v.explain = Explain() if log is not None and log.want(request.id, now) else None
        local = self.gate.take_local(request, v, now) if self.gate is not None else None
        try:
            # admission may send it to a decode instance alone (`local_prefill`)
            a = Assignment(None, v.instance_ids[local[0]], local[1]) if local is not None else router.route(request, v)
            if ex is not None and log is not None:
                name = "admission:local_prefill" if local is not None else router.name
                log.add(ex.records("route", name, request, v, now, recording.made(v, a)))
            if request.prefix_keys and v.prefix is not None:
                recording.count_prefix_hit(self.prefix_hits, v, request, a)
            if a.prefill is None:
                if a.decode is None:
                    raise ValueError(f"{router.name}: a decode-only assignment needs a decode instance")
                p = -1
                computed = request.prompt_tokens - int(v.cached_tokens(request)[self._index[a.decode]])
                est = 0.0
                due = now
            else:
                p = self._index[a.prefill]
                computed = request.prompt_tokens - int(v.cached_tokens(request)[p])
                due = v.queues.push(p, request.id, computed, now)
                est = due - now
                v.prefill_n[p] += 1
        except BaseException:
            if ex is not None and log is not None:
                log.forget(request.id)
            raise
        finally:
            v.explain = None
            v.forget_cached()
        self.prefix.routed((a.prefill, a.decode), request.prefix_keys, now)
        t = v.table
        i = t.add(request.id)
        t.prefill[i] = p
        t.l_in[i] = request.prompt_tokens
        t.max_out[i] = request.max_tokens
        t.arrival[i] = request.arrival
        t.ttft_slo[i] = request.ttft_s
        t.tpot_slo[i] = request.tpot_s
        t.tau[i] = a.projected_handoff or due
        if a.decode is not None:
            d = t.inst[i] = self._index[a.decode]
            v.pending_n[d] += 1
        tracked = _Tracked(
            request,
            router,
            est,
            float(due),
            in_prefill=p >= 0,
            routed_at=now,
            computed=computed,
            sampled=ex is not None,
            arm=arm,
            canary_policy=canary.policy if arm == CANARY and canary is not None else None,
        )
        if (gate := self.gate) is not None and p >= 0:  # what admission projected (its drifts' feedback)
            tracked.handoff_est = gate.handoff_s(request.prompt_tokens, v, int(t.inst[i]))
            tracked.own_est = v.queues.terms_of(p).alone_s(max(computed, 1)) + tracked.handoff_est
            tracked.alone = int(v.prefill_n[p]) == 1  # itself
            tracked.joining_est = gate.routed(p, max(computed, 1), v.queues.first_step_start(request.id), now)
        if gate is not None and request.ttft_s is not None:  # a miss is heard once it is certain
            gate.margin.watch(request.id, request.arrival + request.ttft_s)
        for _, shadow in self.shadows:
            try:
                choice = shadow.route(request, v).decode
            except NoCapacityError:
                choice = None
            tracked.shadow_choices.append(self._index[choice] if choice is not None else -1)
        self._tracked[request.id] = tracked
        return a

    def bind_late(self, request_id: Hashable, now: float) -> str:
        """Choose the decode instance of a request routed without one (call at prefill end).

        Asked of the policy that routed the request, even if another is active now.
        Raises NoCapacityError when no decode instance is routable.
        """
        v = self.view
        v.now = now
        t = v.table
        i = t.row[request_id]
        if t.inst[i] >= 0:
            raise ValueError(f"request {request_id!r} is already bound to a decode instance")
        tracked = self._tracked[request_id]
        log = self.decisions
        ex = v.explain = Explain() if log is not None and tracked.sampled and log.sampled(request_id) else None
        try:
            d = tracked.router.choose_decode(tracked.request, v)
            if ex is not None and log is not None:
                log.add(ex.records("bind", tracked.router.name, tracked.request, v, now, {"decode": d}))
        finally:
            v.explain = None
            v.forget_cached()
        t.inst[i] = d
        v.pending_n[d] += 1
        self.prefix.routed((v.instance_ids[d],), tracked.request.prefix_keys, now)
        return v.instance_ids[d]

    def decode_of(self, request_id: Hashable) -> str | None:
        """The decode instance a tracked request is bound to, if any."""
        t = self.view.table
        d = int(t.inst[t.row[request_id]])
        return self.view.instance_ids[d] if d >= 0 else None

    def on_prefill_start(self, rid: Hashable, now: float) -> None:
        v = self.view
        t = v.table
        i = t.row[rid]
        try:
            due = v.queues.due(rid)
        except KeyError:  # not projected (a decode-only assignment, or its prefill already left the projection)
            due = now + self._tracked[rid].prefill_est
        t.tau[i] = max(due, now) + v.profile.kv_transfer_time(t.l_in[i])

    def _end_prefill(self, tracked: _Tracked, p: int, now: float, completed: bool = True) -> None:
        """Settle the projection (core/prefill.py PrefillQueues): a prefill that ends settles the
        steps up to its own and moves the ones after by how late (or early) it ended; one that
        leaves unfinished is taken out of the steps that have not started."""
        v = self.view
        if tracked.in_prefill:
            tracked.in_prefill = False
            v.prefill_n[p] -= 1
            if completed:
                v.queues.end(tracked.request.id, now)
            else:
                v.queues.leave(tracked.request.id, now)

    def on_prefill_end(self, rid: Hashable, now: float, seconds: float | None = None) -> None:
        """Prefill finished (KV transfer may follow); `seconds` is the measured prefill duration.

        Only a prefill that ran alone (an idle instance, no other prompt in its steps) teaches the
        prefill-time estimator, less the step costs the batching model adds itself: any other
        measured duration includes waiting behind or beside other prompts, which the projection
        already counts (see PrefillTimeEstimator)."""
        v = self.view
        t = v.table
        i = t.row[rid]
        tracked = self._tracked[rid]
        q = v.queues
        if seconds is not None and seconds > 0 and tracked.in_prefill and q.ran_alone(rid):
            terms = q.terms
            computed = max(tracked.computed, 1)
            if q.estimator is v.prefill_time:  # the terms hold its coefficients: its t(l) without NumPy scalars
                alone = terms.prefill_s(float(computed))
            else:
                alone = float(v.prefill_time(float(computed)))
            overhead = terms.alone_s(computed) - alone
            if seconds > overhead:
                v.prefill_time.observe(computed, seconds - overhead)
        self._end_prefill(tracked, int(t.prefill[i]), now)
        t.tau[i] = now + v.profile.kv_transfer_time(t.l_in[i])

    def retry_prefill(self, rid: Hashable, tried: Sequence[str], now: float) -> str | None:
        """Move a request whose prefill failed to the least-queued healthy prefill instance not tried."""
        v = self.view
        t = v.table
        i = t.row[rid]
        mask = v.prefill_mask().copy()
        for iid in tried:
            mask[self._index[iid]] = False
        if not mask.any():
            return None
        tracked = self._tracked[rid]
        old = int(t.prefill[i])
        self._end_prefill(tracked, old, now, completed=False)
        v.now = now
        first = np.where(mask, v.first_token_at(max(tracked.computed, 1)), np.inf)
        p = int(np.argmin(first))
        if self.decisions is not None and self.decisions.sampled(rid):
            self.decisions.add([Record.of(recording.retry_record(v, "prefill", rid, first - now, mask, p))])
        tracked.prefill_due = v.queues.push(p, rid, tracked.computed, now)
        tracked.prefill_est = tracked.prefill_due - now
        v.prefill_n[p] += 1
        tracked.in_prefill = True
        t.prefill[i] = p
        return v.instance_ids[p]

    def retry_decode(self, rid: Hashable, tried: Sequence[str], now: float) -> str | None:
        """Rebind a request whose decode instance could not be reached (nothing streamed yet) to the
        routable decode instance not tried with the fewest requests on it; None if there is none."""
        v = self.view
        mask = v.decode_mask().copy()
        for iid in tried:
            mask[self._index[iid]] = False
        if not mask.any():
            return None
        load = np.where(mask, v.running_n + v.pending_n, np.iinfo(np.int64).max)
        target = v.instance_ids[int(np.argmin(load))]
        if self.decisions is not None and self.decisions.sampled(rid):
            rec = recording.retry_record(v, "decode", rid, v.running_n + v.pending_n, mask, int(np.argmin(load)))
            self.decisions.add([Record.of(rec)])
        self._rebind(rid, target)
        return target

    def on_decode_start(self, rid: Hashable, now: float) -> None:
        """The handoff: decoding starts. Scores the routing against the real state right now."""
        v = self.view
        v.now = now
        t = v.table
        i = t.row[rid]
        tracked = self._tracked[rid]
        if tracked.in_prefill:  # the caller skipped on_prefill_end
            self._end_prefill(tracked, int(t.prefill[i]), now)
        gate, late = self.gate, now - tracked.request.arrival
        if gate is not None and late > float(t.ttft_slo[i]) and not tracked.miss_heard:  # a certain miss
            gate.observe_attainment(late, float(t.ttft_slo[i]))
            tracked.miss_heard = True
        d = int(t.inst[i])
        if d >= 0:
            self._score_handoff(d, tracked, rid)
            v.pending_n[d] -= 1
            v.running_n[d] += 1
        t.state[i] = RUNNING
        t.decode_start[i] = now
        t.t_obs[i] = now
        t.l_obs[i] = 0.0
        t.v[i] = v.decode_rate.value

    def _score_handoff(self, chosen: int, tracked: _Tracked, rid: Hashable) -> None:
        v = self.view
        if not v.routable_count(Role.DECODE):
            return
        mask = v.decode_mask()
        load = v.running_counts() if self.ratio_load == "requests" else v.physical_load()
        best = float(load[mask].min()) + 1e-6

        def hit(j: int) -> bool:
            return j >= 0 and bool(mask[j]) and float(load[j]) <= best

        self.score.total += 1
        self.score.hits += hit(chosen)
        log = self.decisions
        if log is not None and tracked.sampled and log.sampled(rid):
            router = tracked.router.name
            log.add([recording.handoff(v, router, rid, chosen, load, mask, hit(chosen), self.ratio_load)])
        for (label, _), j in zip(self.shadows, tracked.shadow_choices, strict=True):
            s = self.scores[label]
            s.total += 1
            s.hits += hit(j)

    def on_progress(self, rid: Hashable, generated: float, now: float) -> None:
        """`generated` output tokens so far for a decoding request (e.g. per streamed chunk)."""
        t = self.view.table
        i = t.row.get(rid)
        if i is None or t.state[i] != RUNNING:
            return
        dt = now - t.t_obs[i]
        if dt > 0:
            t.v[i] = (generated - t.l_obs[i]) / dt
        t.l_obs[i] = generated
        t.t_obs[i] = now

    def on_progress_bulk(self, rids: Iterable[Hashable], generated: np.ndarray, now: float) -> None:
        """Vectorised on_progress for many requests observed at the same moment."""
        t = self.view.table
        if len(generated) == 0:
            return
        rows = np.fromiter(map(t.row.__getitem__, rids), dtype=np.int64, count=len(generated))
        dt = now - t.t_obs[rows]
        ok = dt > 0
        t.v[rows[ok]] = (generated[ok] - t.l_obs[rows[ok]]) / dt[ok]
        t.l_obs[rows] = generated
        t.t_obs[rows] = now

    def on_finish(self, rid: Hashable, now: float, output_tokens: int, first_token_at: float | None = None) -> None:
        """A request finished; `first_token_at` (when known) lets the routing policy learn its latencies."""
        v = self.view
        t = v.table
        i = t.row[rid]
        if t.state[i] == RUNNING:
            v.decode_rate.observe(output_tokens, now - t.decode_start[i])
        v.survival.observe(output_tokens)
        self.completions += 1
        tracked = self._tracked.get(rid)
        if tracked is not None:
            req = tracked.request
            self.queue.observe_completion(req, now - req.arrival, output_tokens)
            if self.gate is not None:
                self.gate.observe_output(output_tokens)
            tpot: float | None = None
            if first_token_at is not None:
                tpot = (now - first_token_at) / (output_tokens - 1) if output_tokens > 1 else 0.0
                gate = self.gate
                if gate is not None:
                    p = int(t.prefill[i])
                    if p >= 0:  # the feedback that corrects admission's projection
                        projected = tracked.prefill_due + tracked.joining_est + tracked.handoff_est - tracked.routed_at
                        measured = first_token_at - tracked.routed_at
                        gate.observe_ttft(p, projected, measured, tracked.own_est, tracked.alone)
                    if not tracked.miss_heard:
                        gate.observe_attainment(first_token_at - req.arrival, float(t.ttft_slo[i]))
                    if output_tokens > 1:  # and the decode slots' measured TPOT
                        gate.observe_tpot(tpot, float(t.tpot_slo[i]), v, now)
                learner = tracked.router if tracked.arm == CANARY else self.routing  # each arm's router learns its own
                learner.observe_completion(req, first_token_at - req.arrival, tpot, tracked.routed_at - req.arrival)
            # a whole reply has no first-token time: its TTFT is taken at the handoff, its TPOT is unknown
            first = (
                first_token_at
                if first_token_at is not None
                else (float(t.decode_start[i]) if t.state[i] == RUNNING else None)
            )
            self.slo_window.add(
                now,
                None if first is None else first - req.arrival,
                float(t.ttft_slo[i]),
                tpot if output_tokens > 1 else None,
                float(t.tpot_slo[i]),
            )
        self._forget(rid, now)

    def on_fail(self, rid: Hashable, now: float) -> None:
        """A request failed: stop tracking it (no estimator learns from it)."""
        if rid in self.view.table:
            self._forget(rid, now)

    def on_migrated(self, rid: Hashable, target: str, now: float) -> None:
        """A request now decodes on `target` (its KV moved there); its progress carries over."""
        if self._rebind(rid, target):
            self.migrations += 1

    def _rebind(self, rid: Hashable, target: str) -> bool:
        """Move a tracked request's decode binding (and its count) to `target`; False if untracked."""
        v = self.view
        t = v.table
        i = t.row.get(rid)
        if i is None:
            return False
        old, new = int(t.inst[i]), self._index[target]
        counts = v.running_n if t.state[i] == RUNNING else v.pending_n
        if old >= 0:
            counts[old] -= 1
        counts[new] += 1
        t.inst[i] = new
        t.rank[i] = -1  # a rank belongs to the old instance; the new one's is chosen with its leg
        return True

    def _forget(self, rid: Hashable, now: float) -> None:
        v = self.view
        t = v.table
        i = t.row[rid]
        tracked = self._tracked.pop(rid, None)
        if self.decisions is not None and (tracked is None or tracked.sampled):
            self.decisions.forget(rid)
        if tracked is not None and tracked.in_prefill:
            self._end_prefill(tracked, int(t.prefill[i]), now, completed=False)
        d = t.inst[i]
        if d >= 0:
            counts = v.running_n if t.state[i] == RUNNING else v.pending_n
            counts[d] -= 1
        t.remove(rid)
