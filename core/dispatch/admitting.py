"""The dispatcher's admission: the queue policy, SLO admission, release and expiry (core/dispatch/)."""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

from core.admission import SloAdmission, SloGate
from core.dispatch import recording
from core.dispatch.instances import InstancesMixin
from core.request_table import RUNNING
from core.types import (
    Admission,
    Request,
    Role,
)


class AdmittingMixin(InstancesMixin):
    """Who is admitted, held, released and shed."""

    # --- admission (the queue policy) -----------------------------------------------------------
    def use_slo_admission(self, settings: SloAdmission) -> SloGate:
        """Hold and shed by the SLO from now on (core.admission.SloAdmission says how)."""
        self.gate = SloGate(settings, self.view.profile, self.view.slo)
        return self.gate

    def retry_after_s(self, now: float) -> float | None:
        """What a refused client is told to wait, when SLO admission is on (else None)."""
        if self.gate is None:
            return None
        self.view.now = now
        return self.gate.retry_after_s(self.view, now, len(self.admission))

    def _room(self) -> int:
        """Requests that may still enter: max_in_flight_per_instance × routable decode − tracked;
        none while every prefill instance has more than max_prefill_backlog_s of work (if set)."""
        params = self.queue.params
        v = self.view
        room = params.max_in_flight_per_instance * v.routable_count(Role.DECODE) - v.table.n
        if params.max_prefill_backlog_s is not None and room > 0:
            # one request per prefill instance under the limit: each release is routed (and
            # lengthens a backlog) before the next decision
            mask = v.prefill_mask()
            if mask.any():
                room = min(room, int(np.count_nonzero(v.prefill_free_at[mask] - v.now <= params.max_prefill_backlog_s)))
        if self.gate is not None and room > 0:
            room = min(room, self.gate.decode_room(v))
        return room

    @property
    def arrivals_total(self) -> int:
        """Requests seen by admit (routed, queued or shed)."""
        return self.admission.arrivals

    def admit(self, request: Request, now: float) -> Admission:
        """ROUTE if there is room and nothing is held; else hold it (QUEUED) or, if full, SHED.

        Room: tracked requests < max_in_flight_per_instance × routable decode instances. With no
        routable instance of a role it answers ROUTE, so `route` fails at once with
        NoCapacityError instead of holding a request nothing could release. The caller routes
        (calls `route`) only on ROUTE; a QUEUED request comes back from `release`
        or `expire`, or leaves through `cancel`.
        """
        adm = self.admission
        v = self.view
        v.now = now
        gate = self.gate
        if gate is not None:
            gate.observe(request)
            self._hear_late(gate, now)
        if not adm.held_since and self._room() > 0 and (gate is None or gate.fits_now(request, v, now)):
            adm.arrivals += 1  # the common case, without the policy
            return Admission.ROUTE
        if not v.routable_count(Role.DECODE) or not v.routable_count(Role.PREFILL):
            adm.arrivals += 1  # nothing could ever release it: route, and `route` says what is missing
            return Admission.ROUTE
        self.set_targets(request)
        self.shed_reason = f"the gateway queue is full ({len(adm)} requests held); retry later"
        if gate is None:
            return adm.admit(self.queue, request, now, self._room())
        decision, why = gate.hold_or_shed(adm, self.queue, request, v, now)
        self.shed_reason = why or self.shed_reason
        return decision

    def _hear_late(self, gate: SloGate, now: float) -> None:
        """The admitted requests past their TTFT target whose decode has not begun are certain misses:
        the moving margin hears them now, at the next arrival or release, rather than at their hand-off
        (in a burst, the hand-offs come after the burst's arrivals were admitted on the old margin)."""
        t = self.view.table
        for rid in gate.margin.overdue(now):
            tracked = self._tracked.get(rid)
            i = t.row.get(rid)
            if tracked is None or i is None or tracked.miss_heard or t.state[i] == RUNNING:
                continue  # finished, or handed off in time (judged at its first token)
            gate.observe_attainment(now - tracked.request.arrival, float(t.ttft_slo[i]))
            tracked.miss_heard = True

    def release(self, now: float) -> list[Request]:
        """Held requests to route now, in the queue policy's order, while there is room.

        Call after a request finishes or fails, after instances become active, and periodically.
        """
        if self.gate is not None:
            self._hear_late(self.gate, now)
        if not self.admission:
            return []
        v = self.view
        v.now = now
        if self.gate is None:
            out = self.admission.release(self.queue, now, self._room())
        else:
            out = self.gate.release(self.admission, self.queue, v, now, self._room())
        log = self.decisions
        if log is not None and out:
            sampled = {k for k, r in enumerate(out) if log.want(r.id, now)}
            if sampled:
                log.add(recording.release_records(self.queue, out, now, sampled))
        return out

    def expire(self, now: float) -> list[Request]:
        """Held requests queued ttl_s ago or earlier, or (SLO admission) that could no longer start
        within their wait bound, removed from the queue; the caller fails them."""
        out = self.admission.expire(self.queue, now)
        return out if self.gate is None else self.gate.expire(self.admission, self.queue, self.view, now, out)

    def next_expiry_at(self) -> float:
        """When the oldest held request expires, or (SLO admission) one held on the prior's word alone
        is judged again, whichever is sooner (inf when none is held)."""
        at = self.admission.next_expiry_at(self.queue)
        return at if self.gate is None else min(at, self.gate.next_judgement_at())

    def cancel(self, request_id: Hashable) -> bool:
        """Drop a held request (its client went away); False if it was not held."""
        gone = self.admission.cancel(self.queue, request_id)
        if self.gate is not None and not self.admission:
            self.gate.clear_held()
        return gone

    def queue_depth(self) -> int:
        """Requests held by admission."""
        return len(self.admission)

    def queue_depth_by_class(self) -> dict[str, int]:
        """Held requests per priority band or SLO class (as the queue policy classifies them)."""
        return self.queue.depth_by_class()
