"""Decode-to-decode migration of a running request in the simulator (ARES, design/papers/ares.md §2.7, §7.6).

Order of operations (spec §2.7):
1. accept: the request must be running on the proposed source, the target must be an ACTIVE,
   healthy decode instance with KV room for the request's tokens (prompt + generated so far, plus
   the next step of its batch); otherwise the migration is *refused* and counted by reason.
   The target reserves those tokens at once.
   The request's decode binding moves to the target in the dispatcher at once
   (`Dispatcher.on_migrated`), so the next round (and the router) see the move decided even if
   the source is still in a long step.
2. pause: the source takes the request out of its batch at its next step boundary (the step under
   way finishes, so no work is lost); it keeps the KV until the transfer ends.
3. transfer: profile.kv_transfer_time(tokens), the same link model as the P→D handoff. Nothing
   else stalls: the source's other requests keep decoding (and get faster steps without it).
4. resume: the source frees the KV; the request joins the target's batch at the target's next
   step boundary, before any other waiting request, without a recompute.
A request that finishes between 1 and 2 is *cancelled* (its reservation is dropped; it finished
on its source, and the dispatcher forgets it wherever it is bound).

The executor talks to the dispatcher and the decode models; what the engine must change (the
request's binding, which instances to wake or re-read, when a transfer ends) it returns as
effects (core/sim/cluster/effects.py), which the engine applies in order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from core.perf import PerfProfile
from core.sim.cluster.decode import DecodeModel
from core.sim.cluster.dispatcher import SimDispatcher
from core.sim.cluster.effects import Effect, Rebind, Relocate, Stale, TransferDone, Wake
from core.types import Migration

REFUSALS = {
    "unknown_request": "not a request of this run, or no longer tracked by the dispatcher",
    "unknown_instance": "the source or target is not an instance of this cluster",
    "in_transfer": "the request is already migrating",
    "wrong_source": "the request is not bound to the proposed source",
    "same_instance": "source and target are the same instance",
    "target_unavailable": "the target is not an ACTIVE, healthy decode instance",
    "not_running": "the request is not in its source's running batch (preempted or waiting)",
    "no_kv_room": "the target has no KV room for the request's tokens and its batch's next step",
}
"""Why a proposed migration was not accepted."""

CANCELS = {
    "finished": "the request finished before its source reached a step boundary",
}
"""Why an accepted migration was dropped before its transfer started."""


@dataclass(frozen=True, slots=True)
class MigrationEvent:
    """One step of a migration as executed (or refused) by the simulator."""

    time: float
    request: int
    source: str
    target: str
    outcome: str
    """accepted | started (paused, transfer under way) | done | refused | cancelled"""
    detail: str
    """Refusal or cancel key (REFUSALS, CANCELS); empty otherwise."""
    tokens: int
    """KV tokens reserved (accepted) or moved (started, done)."""
    transfer_s: float
    """Transfer time (started, done); 0 otherwise."""
    reason: str
    """The reschedule policy's reason."""


@dataclass
class _Flight:
    request: int
    source: int
    """Dispatcher index of the source."""
    target: int
    reason: str
    tokens: int
    prompt: int = 0
    generated: float = 0.0
    out: int = 0
    transfer_s: float = 0.0
    paused_at: float = math.nan


class MigrationExecutor:
    """Carries out Migrations in a cluster simulation and records every step."""

    def __init__(
        self,
        dispatcher: SimDispatcher,
        profile: PerfProfile,
        decoders: Sequence[DecodeModel | None],
        decode_of: Callable[[int], int],
        n_requests: int,
    ) -> None:
        """`decoders` is the engine's list (per dispatcher index; it grows with the cluster) and
        `decode_of(request)` the dispatcher index a request is bound to for decode (-1: none)."""
        self.dispatcher = dispatcher
        self.profile = profile
        self.decoders = decoders
        self.decode_of = decode_of
        self.events: list[MigrationEvent] = []
        self.refused: dict[str, int] = {}
        """Refusals and cancellations per reason key."""
        self.completed = 0
        self.tokens_moved = 0
        self.per_request = np.zeros(n_requests, dtype=np.int64)
        self.pending: dict[int, _Flight] = {}
        """Accepted, waiting for the source's step boundary."""
        self.transfers: dict[int, _Flight] = {}
        """Paused on the source, KV on the wire."""

    # --- bookkeeping ---------------------------------------------------------------------------
    def _ids(self) -> list[str]:
        return self.dispatcher.view.instance_ids

    def _record(self, now: float, f: _Flight, outcome: str, detail: str = "") -> None:
        ids = self._ids()
        self.events.append(
            MigrationEvent(
                now,
                f.request,
                ids[f.source],
                ids[f.target],
                outcome,
                detail,
                f.tokens,
                f.transfer_s,
                f.reason,
            )
        )

    def _refuse(self, now: float, m: Migration, rid: int, why: str) -> tuple[bool, list[Effect]]:
        self.refused[why] = self.refused.get(why, 0) + 1
        self.events.append(MigrationEvent(now, rid, str(m.source), str(m.target), "refused", why, 0, 0.0, m.reason))
        return False, []

    # --- the steps -----------------------------------------------------------------------------
    def execute(self, m: Migration, now: float) -> tuple[bool, list[Effect]]:
        """Accept (reserve on the target, ask the source to pause the request) or refuse.
        Returns whether it was accepted and the effects for the engine."""
        d = self.dispatcher
        v = d.view
        try:
            rid = int(m.request_id)
        except (TypeError, ValueError):
            rid = -1
        if not 0 <= rid < len(self.per_request) or rid not in v.table:
            return self._refuse(now, m, rid, "unknown_request")
        if rid in self.pending or rid in self.transfers:
            return self._refuse(now, m, rid, "in_transfer")
        try:
            src, tgt = d.index_of(m.source), d.index_of(m.target)
        except KeyError:
            return self._refuse(now, m, rid, "unknown_instance")
        if self.decode_of(rid) != src:
            return self._refuse(now, m, rid, "wrong_source")
        if src == tgt:
            return self._refuse(now, m, rid, "same_instance")
        target = self.decoders[tgt]
        if target is None or not bool(v.decode_mask()[tgt]):
            return self._refuse(now, m, rid, "target_unavailable")
        source = self.decoders[src]
        if source is None or not source.is_running(rid):
            return self._refuse(now, m, rid, "not_running")
        tokens = source.tokens_of(rid, now)
        if not target.can_host(tokens, now):
            return self._refuse(now, m, rid, "no_kv_room")
        target.reserve(rid, tokens, now)
        source.request_detach(rid, now)
        d.on_migrated(rid, m.target, now)
        effects: list[Effect] = [Rebind(rid, tgt)]
        f = _Flight(rid, src, tgt, m.reason, tokens)
        self.pending[rid] = f
        self._record(now, f, "accepted")
        if source.detached:  # processor sharing pauses at once
            effects += self.on_detached(src, now)
        effects += (Wake(src), Wake(tgt))
        return True, effects

    def on_detached(self, x: int, now: float) -> list[Effect]:
        """Source x paused the requests in its `detached` list: start their transfers."""
        dec = self.decoders[x]
        assert dec is not None
        d = self.dispatcher
        effects: list[Effect] = []
        for req, prompt, generated, out in dec.detached:
            f = self.pending.pop(req)
            f.prompt, f.generated, f.out = prompt, generated, out
            f.tokens = prompt + int(generated)
            f.transfer_s = float(self.profile.kv_transfer_time(f.tokens))
            f.paused_at = now
            self.transfers[req] = f
            d.on_progress(req, float(int(generated)), now)
            effects += (Relocate(req, f.target), Stale(f.target))
            self._record(now, f, "started")
            effects.append(TransferDone(req, now + f.transfer_s))
        dec.detached.clear()
        return effects

    def transfer_done(self, req: int, now: float) -> list[Effect]:
        """The KV has arrived: free it on the source, resume the request on the target."""
        f = self.transfers.pop(req)
        source, target = self.decoders[f.source], self.decoders[f.target]
        assert source is not None and target is not None
        source.release_outgoing(req, now)
        target.attach(req, f.prompt, f.generated, f.out, now)
        self.completed += 1
        self.tokens_moved += f.tokens
        self.per_request[req] += 1
        self._record(now, f, "done")
        return [Stale(f.source), Stale(f.target), Wake(f.source), Wake(f.target)]

    def cancel(self, req: int, now: float, why: str) -> list[Effect]:
        """Drop an accepted migration whose request did not reach the pause (e.g. it finished)."""
        f = self.pending.pop(req)
        target = self.decoders[f.target]
        assert target is not None
        target.unreserve(req, now)
        self.refused[why] = self.refused.get(why, 0) + 1
        self._record(now, f, "cancelled", why)
        return [Wake(f.target)]
