"""Deterministic discrete-event simulation of a P/D cluster driving the same Dispatcher as live.

Events are ordered by (time, kind, sequence). Arrivals are merged from the sorted trace rather than heaped. Every
arrival goes through the dispatcher's admission (route now, hold, or shed); held requests are routed when `release`
hands them back (after each finish or failure, when an instance becomes active, after each periodic decision) and
fail when they expire. Prefill instances step their prompts with the dispatcher's own prefill model
(core/sim/cluster/prefill.py). The KV transfer follows vLLM's NIXL pull: it starts at the decode instance's next
step boundary, after the reads under way there (`DecodeModel.read_done`), and the request joins the batch at the
first boundary after it ends; the HTTP legs (`http_rtt_s`: the prefill's answer and the decode leg before, the
pull's round trip with it) add their latency. Decode runs in processor-sharing or iteration-level mode. A request
routed without a decode instance is bound (`bind_late`) at its prefill end. Nothing ticks per token: every instance
jumps from event to event.

Periodic policies run at `dispatcher.next_periodic_at()` (never, for the no-op baselines); their scale actions are
carried out by core/sim/cluster/scaling.py (see it for the rules) and their migrations by
core/sim/cluster/migration.py: the migrating request's KV (prompt + generated tokens) moves in
profile.kv_transfer_time(tokens) while only that request stalls. Both executors return effects
(core/sim/cluster/effects.py) that this engine applies; neither writes its state.

With `instance_profiles` (id → PerfProfile) a listed instance runs on its own profile, and the dispatcher
projects its prefill with it: core/sim/cluster/profiles.py says what stays on `profile`.

With prefix structure (trace hash ids, or block keys given per row) each instance keeps a KV cache
(core/sim/cluster/cache.py): a prefill computes only its prompt's uncached tokens there, the decode instance pulls
only the blocks it lacks, and routing reads the caches exactly. A routing decision without a prefill instance
(decode-only) is served by its decode instance alone: the request starts decoding after that instance's prefill of
its own uncached tokens (counted apart from its running batch: an approximation). Without prefix structure nothing
changes and nothing is paid.

The dispatcher is anything offering `SimDispatcher` (core/sim/cluster/dispatcher.py), usually Dispatcher.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from core.errors import NoCapacityError
from core.perf import PerfProfile
from core.sim.cluster import effects as fx
from core.sim.cluster.cache import CacheParams, SimCache
from core.sim.cluster.decode import DecodeModel
from core.sim.cluster.decode_iter import IterationDecodeInstance
from core.sim.cluster.decode_ps import PSDecodeModel
from core.sim.cluster.dispatcher import SimDispatcher
from core.sim.cluster.lora import DEFAULT_MAX_LORAS, NO_LORA, SimLora
from core.sim.cluster.migration import MigrationExecutor
from core.sim.cluster.prefill import SimPrefill
from core.sim.cluster.profiles import InstanceProfiles
from core.sim.cluster.result import ClusterSimResult, Mode, ScheduledSwap
from core.sim.cluster.rows import TraceRows
from core.sim.cluster.scaling import ScaleExecutor
from core.types import Admission, InstancePhase, Migration, PolicyKind, Request, Role

# Event kinds, in the order they run when times tie.
_DECODE, _PREFILL_DONE, _DECODE_START, _SWAP, _READY, _PERIODIC, _EXPIRE, _MIGRATED, _PREFILL_STEP = range(9)
_INF = float("inf")


class ClusterSimulation:
    """One simulated run of a trace on an nP·mD cluster under the dispatcher's policies."""

    def __init__(
        self,
        *,
        arrivals: np.ndarray,
        prompt_tokens: np.ndarray,
        output_tokens: np.ndarray,
        profile: PerfProfile,
        n_prefill: int,
        n_decode: int,
        dispatcher: SimDispatcher,
        mode: Mode = "ps",
        swaps: Sequence[ScheduledSwap] = (),
        priorities: np.ndarray | None = None,
        tenants: Sequence[str] | None = None,
        slo_classes: Sequence[str] | None = None,
        hash_ids: Sequence[Sequence[int]] | None = None,
        prefix_keys: Sequence[tuple[int, ...]] | None = None,
        cache: CacheParams | None = None,
        sessions: Sequence[str] | None = None,
        lora: Sequence[str | None] | None = None,
        max_loras: int = DEFAULT_MAX_LORAS,
        instance_profiles: Mapping[str, PerfProfile] | None = None,
    ) -> None:
        if n_prefill < 1 or n_decode < 1:
            raise ValueError("a P/D cluster needs at least one prefill and one decode instance")
        self.rows = TraceRows(arrivals, prompt_tokens, output_tokens, priorities, tenants, slo_classes, sessions, lora)
        self.arrival, self.prompt, self.out = self.rows.arrival, self.rows.prompt, self.rows.out
        # the loop reads the rows' Python lists (core/sim/cluster/rows.py)
        self._arr_l, self._prompt_l, self._out_l = self.rows.arr_l, self.rows.prompt_l, self.rows.out_l
        n = len(self.arrival)
        self.profile = profile
        self.mode = mode
        self.dispatcher = dispatcher
        self.swaps = sorted(swaps, key=lambda s: s.time)
        self._make: Callable[[PerfProfile], DecodeModel] = PSDecodeModel if mode == "ps" else IterationDecodeInstance
        # Per dispatcher instance index: prefill engine, decode model, event version, and its
        # positions in prefill_ids / decode_ids (-1 while it never served that role).
        self.prefill_ids: list[str] = []
        self.decode_ids: list[str] = []
        self.decoders: list[DecodeModel | None] = []
        self.profiles = InstanceProfiles(profile, mode, instance_profiles, self.decoders)
        # the dispatcher projects prefill as these instances run it (core/prefill.py PrefillQueues)
        dispatcher.view.queues.serial = mode == "ps"
        self.prefills: list[SimPrefill] = []
        self._version: list[int] = []
        self._pos_p: list[int] = []
        self._pos_d: list[int] = []
        self._heap: list[tuple[float, int, int, int, int]] = []
        self._seq = 0
        self._dirty: set[int] = set()
        # The KV cache (core/sim/cluster/cache.py): on when rows have prefix structure (trace
        # hash ids, or keys computed beforehand) and `cache` does not turn it off.
        self.cache = SimCache.for_trace(n, profile, cache or CacheParams(), hash_ids, prefix_keys)
        if self.cache is not None:
            dispatcher.use_prefix_lookup(self.cache, self.cache.block_size, decode_only=True)
        # LoRA adapters (core/sim/cluster/lora.py): on when rows name adapters
        self.lora = SimLora.for_trace(lora, profile, max_loras, dispatcher.view, self._prompt_l, self._out_l)
        self.scaler = ScaleExecutor(dispatcher, profile, self.idle)
        self.migrator = MigrationExecutor(dispatcher, profile, self.decoders, self.decode_of, n)
        for k in range(n_prefill):
            self.add_instance(f"p{k}", Role.PREFILL, InstancePhase.ACTIVE)
        for k in range(n_decode):
            self.add_instance(f"d{k}", Role.DECODE, InstancePhase.ACTIVE)
        nan = np.full(n, np.nan)
        self.r_prefill = np.full(n, -1, dtype=np.int64)
        self.r_decode = np.full(n, -1, dtype=np.int64)
        self._rx: list[int] = [-1] * n
        """Decode instance (dispatcher index) of each request, -1 while unbound."""
        self.t_pstart, self.t_pend, self.t_dstart, self.t_first, self.t_finish = (nan.copy() for _ in range(5))
        self.ok = np.zeros(n, dtype=bool)
        self.status = np.full(n, "", dtype=object)
        self.events = 0
        self.queued = 0
        self.migrations_proposed = 0
        self._periodic_version = 0
        self._expiry_armed = _INF
        self._next_i = 0

    # --- instances ----------------------------------------------------------------------------
    def add_instance(self, iid: str, role: Role, phase: InstancePhase) -> int:
        """Add an instance to the dispatcher and give it a prefill queue and a decode model."""
        x = self.dispatcher.add_instance(iid, role, phase=phase)
        if self.cache is not None:
            self.cache.add_instance(x, iid)
        while len(self.prefills) <= x:
            pf = self.profiles.prefill(len(self.prefills), self.dispatcher.view, self._prompt_l, self.cache)
            self.prefills.append(pf)
            self.decoders.append(None)
            self._version.append(0)
            self._pos_p.append(-1)
            self._pos_d.append(-1)
        self.serve_role(x, role)
        return x

    def serve_role(self, x: int, role: Role) -> None:
        """Make instance x able to take work of `role` (positions and decode model)."""
        iid = self.dispatcher.view.instance_ids[x]
        if role.serves_prefill() and self._pos_p[x] < 0:
            self._pos_p[x] = len(self.prefill_ids)
            self.prefill_ids.append(iid)
        if role.serves_decode() and self._pos_d[x] < 0:
            self._pos_d[x] = len(self.decode_ids)
            self.decode_ids.append(iid)
        if role.serves_decode() and self.decoders[x] is None:
            self.decoders[x] = self._make(self.profiles.at[x])
        if self.lora is not None:
            self.lora.attach(x, iid, self.prefills[x], self.decoders[x])

    def decode_of(self, i: int) -> int:
        """The decode instance (dispatcher index) request i is bound to, -1 while unbound."""
        return self._rx[i]

    def idle(self, x: int) -> bool:
        """Nothing routed to instance x is left: no prefill queued or running, nothing decoding."""
        iid = self.dispatcher.view.instance_ids[x]
        return self.prefills[x].idle and self.dispatcher.in_flight(iid) == 0

    # --- heap ---------------------------------------------------------------------------------
    def push(self, t: float, kind: int, a: int, b: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, kind, self._seq, a, b))

    def _reschedule(self, x: int) -> None:
        self._version[x] += 1
        dec = self.decoders[x]
        assert dec is not None
        t = dec.next_event_time()
        if t != _INF:
            self.push(t, _DECODE, x, self._version[x])

    def _apply(self, effects: list[fx.Effect]) -> None:
        """Carry out what an executor asked for, in order (see core/sim/cluster/effects.py)."""
        for e in effects:
            if isinstance(e, fx.Wake):
                self._reschedule(e.instance)
            elif isinstance(e, fx.Stale):
                self._dirty.add(e.instance)
            elif isinstance(e, fx.Rebind):
                self._rx[e.request] = e.instance
            elif isinstance(e, fx.Relocate):
                self.r_decode[e.request] = self._pos_d[e.instance]
            elif isinstance(e, fx.TransferDone):
                self.push(e.at, _MIGRATED, e.request)
            elif isinstance(e, fx.StartInstance):
                x = self.add_instance(e.instance_id, e.role, InstancePhase.STARTING)
                self.push(e.ready_at, _READY, x)
            elif isinstance(e, fx.ServeRole):
                self.serve_role(e.instance, e.role)

    def _arm_periodic(self) -> None:
        self._periodic_version += 1
        t = self.dispatcher.next_periodic_at()
        if t != _INF and self._work_left():
            self.push(t, _PERIODIC, self._periodic_version)

    def _arm_expiry(self) -> None:
        t = self.dispatcher.next_expiry_at()
        if t < self._expiry_armed:
            self._expiry_armed = t
            self.push(t, _EXPIRE, 0)

    def _work_left(self) -> bool:
        d = self.dispatcher
        return self._next_i < len(self._arr_l) or d.view.table.n > 0 or d.queue_depth() > 0

    # --- request handlers ---------------------------------------------------------------------
    def _arrive(self, i: int, now: float) -> None:
        req = self.rows.request(i, self.cache)
        verdict = self.dispatcher.admit(req, now)
        if verdict is Admission.ROUTE:
            self._route(req, now)
        elif verdict is Admission.QUEUED:
            self.queued += 1
            self._arm_expiry()
        else:
            self.status[i] = "shed"
            if self.cache is not None:
                self.cache.release(i)

    def _route(self, req: Request, now: float) -> None:
        d = self.dispatcher
        if self._dirty and d.needs_progress:
            self._sync_progress(now)
        i = int(req.id)
        try:
            a = d.route(req, now)
        except NoCapacityError:
            self.status[i] = "no_capacity"
            if self.cache is not None:
                self.cache.release(i)
            return
        if a.prefill is None:  # decode-only: the decode instance computes the uncached prompt itself
            assert a.decode is not None
            y = d.index_of(a.decode)
            self._bind(i, y)
            prompt = self._prompt_l[i]
            computed = prompt if self.cache is None else self.cache.local(y, i, prompt)
            self.t_pstart[i] = now
            self.t_pend[i] = end = now + float(self.profiles.at[y].prefill_time(computed))
            self.push(end, _DECODE_START, i)
            return
        x = d.index_of(a.prefill)
        self.r_prefill[i] = self._pos_p[x]
        if a.decode is not None:
            self._bind(i, d.index_of(a.decode))
        pf = self.prefills[x]
        pf.stepper.waiting.append(i)
        pf.arrive(now)
        if not pf.busy:
            self._start_prefill(x, now)

    def _bind(self, i: int, x: int) -> None:
        self._rx[i] = x
        self.r_decode[i] = self._pos_d[x]

    def _fail(self, i: int, now: float, status: str) -> None:
        self.status[i] = status
        if self.lora is not None:
            self._apply([fx.Wake(y) for y in self.lora.drop(i, now, self.decoders)])
        if self.cache is not None:
            self.cache.release(i)
        self.dispatcher.on_fail(i, now)

    def _release(self, now: float) -> None:
        """Route the held requests admission lets go now."""
        d = self.dispatcher
        if d.queue_depth():
            for req in d.release(now):
                self._route(req, now)

    def _start_prefill(self, x: int, now: float) -> None:
        """Start instance x's next prefill step (prefill.py), once its last step's host work is done."""
        pf = self.prefills[x]
        if pf.host_free > now:  # the step forms when the host work ends, from what waits then
            pf.busy = True
            self.push(pf.host_free, _PREFILL_STEP, x)
            return
        started = pf.start(now)
        if started is None:
            return
        end, admitted = started
        for i in admitted:
            self.t_pstart[i] = now
            self.dispatcher.on_prefill_start(i, now)
        self.push(end, _PREFILL_DONE, x)

    def _next_step(self, x: int, now: float) -> None:
        pf = self.prefills[x]
        pf.busy = False
        if pf.stepper:
            self._start_prefill(x, now)
        else:
            pf.went_idle(now)

    def _prefill_done(self, x: int, now: float) -> None:
        """Instance x's step ended (or runs on for the prompts that arrived during it): the prompts it finished end
        their prefill (in admission order; the next step starts once the last told the dispatcher) and go on."""
        if stretch := self.prefills[x].stretched():
            return self.push(now + stretch, _PREFILL_DONE, x)
        done = self.prefills[x].end(now)
        if not done:
            self._next_step(x, now)
            return
        last = done[-1]
        d = self.dispatcher
        for i in done:
            self.t_pend[i] = now
            d.on_prefill_end(i, now, now - self.t_pstart[i])
            if i == last:
                self._next_step(x, now)
            self._hand_off(i, now)

    def _hand_off(self, i: int, now: float) -> None:
        """Request i's prefill ended: bind it if it is not bound, and move its KV to its decode instance."""
        d = self.dispatcher
        if self._rx[i] < 0:
            if self._dirty and d.needs_progress:
                self._sync_progress(now)
            try:
                self._bind(i, d.index_of(d.bind_late(i, now)))
            except NoCapacityError:
                self._fail(i, now, "no_capacity")
                self._freed(now)
                return
        moved = self._prompt_l[i] if self.cache is None else self.cache.pull(self._rx[i], i, self._prompt_l[i])
        dec = self.decoders[y := self._rx[i]]
        assert dec is not None  # the read starts in the decode instance's next step; it joins after (_decode_start)
        read = (prof := self.profiles.at[y]).http_rtt_s + prof.kv_transfer_time(moved)  # the pull's round trip too
        self.push(dec.read_done(dec.next_step_boundary(now + 2 * prof.http_rtt_s), read), _DECODE_START, i)
        if self.scaler.draining:
            self._apply(self.scaler.check(now))
        if d.admission and d.queue.params.max_prefill_backlog_s is not None:
            self._release(now)  # the queue holds arrivals while prefill is backlogged

    def _decode_start(self, i: int, now: float) -> None:
        x = self._rx[i]
        self.t_dstart[i] = now
        if self.cache is not None:
            self.cache.handoff(i)
        self.dispatcher.on_decode_start(i, now)
        dec = self.decoders[x]
        assert dec is not None
        if self.lora is None or self.lora.decode_arrive(x, i, now, dec):
            dec.admit(i, self._out_l[i], self._prompt_l[i], now)
        self._dirty.add(x)
        self._reschedule(x)

    def _decode_event(self, x: int, now: float) -> None:
        dec = self.decoders[x]
        assert dec is not None
        firsts, done = dec.fire(now)
        for r, t in firsts:
            self.t_first[r] = t
        d = self.dispatcher
        mig = self.migrator
        for r in done:
            if r in mig.pending:
                self._apply(mig.cancel(r, now, "finished"))
            self.t_finish[r] = now
            self.ok[r] = True
            if self.cache is not None:
                self.cache.finish(r, self._out_l[r])
            d.on_finish(r, now, self._out_l[r], float(self.t_first[r]))
        if dec.detached:
            self._apply(mig.on_detached(x, now))
        if self.lora is not None and done:  # their adapters are free: requests waiting for one may join
            self._apply([fx.Wake(y) for y in self.lora.decode_end(done, now, self.decoders) if y != x])
        freed = bool(done)
        rejected: list[int] | None = getattr(dec, "rejected", None)
        if rejected:
            for r in rejected:
                self._fail(r, now, "kv_capacity")
            rejected.clear()
            freed = True
        self._dirty.add(x)
        self._reschedule(x)
        if freed:
            self._freed(now)

    def _freed(self, now: float) -> None:
        """Requests left the cluster: held ones may go, draining instances may be idle."""
        if self.dispatcher.queue_depth():
            self._release(now)
        if self.scaler.draining:
            self._apply(self.scaler.check(now))

    def _sync_progress(self, now: float) -> None:
        d = self.dispatcher
        for x in self._dirty:
            dec = self.decoders[x]
            assert dec is not None
            reqs, gen = dec.progress(now)
            if reqs:
                d.on_progress_bulk(reqs, np.asarray(gen), now)
        self._dirty.clear()

    # --- timed decision points ----------------------------------------------------------------
    def _periodic(self, version: int, now: float) -> None:
        if version != self._periodic_version:
            return
        d = self.dispatcher
        if self._dirty and d.needs_progress:
            self._sync_progress(now)
        resched = d.reschedule
        if getattr(resched, "needs_progress", False) and d.runner.due.get(PolicyKind.RESCHEDULE, _INF) <= now:
            # The reschedule policy weighs every running request's tokens: observe them all.
            self._dirty.update(x for x, dec in enumerate(self.decoders) if dec is not None)
            self._sync_progress(now)
        decisions = d.periodic(now)
        self.migrations_proposed += len(decisions.migrations)
        for m in decisions.migrations:
            self._apply(self.migrator.execute(m, now)[1])
        for action in decisions.scale:
            self._apply(self.scaler.execute(action, now))
        self._release(now)
        self._arm_periodic()

    def _expire(self, now: float) -> None:
        if now >= self._expiry_armed:
            self._expiry_armed = _INF
        for req in self.dispatcher.expire(now):
            self.status[int(req.id)] = "expired"
            if self.cache is not None:
                self.cache.release(int(req.id))
        self._arm_expiry()

    def migrate(self, migration: Migration, now: float) -> bool:
        """Carry out one migration now (as if a reschedule policy proposed it); False if refused."""
        accepted, effects = self.migrator.execute(migration, now)
        self._apply(effects)
        return accepted

    # --- main loop ----------------------------------------------------------------------------
    def run(self, on_progress: Callable[[int, int], None] | None = None, every: int = 2000) -> ClusterSimResult:
        n = len(self.arrival)
        heap = self._heap
        swaps = deque(self.swaps)
        for s in swaps:
            self.push(s.time, _SWAP, 0)
        self._arm_periodic()
        finished_seen = 0
        arrivals = self._arr_l
        d = self.dispatcher
        while self._next_i < n or heap:
            next_i = self._next_i
            t_arr = arrivals[next_i] if next_i < n else _INF
            if heap and heap[0][0] <= t_arr:
                t, kind, _, a, b = heapq.heappop(heap)
                if kind == _DECODE:
                    if b != self._version[a]:
                        continue
                    self._decode_event(a, t)
                elif kind == _PREFILL_DONE:
                    self._prefill_done(a, t)
                elif kind == _PREFILL_STEP:
                    self._next_step(a, t)
                elif kind == _DECODE_START:
                    self._decode_start(a, t)
                elif kind == _SWAP:
                    s = swaps.popleft()
                    d.set_policy(s.kind, s.name, s.params, source="sim", now=t)
                    if s.kind in (PolicyKind.RESCHEDULE, PolicyKind.SCALING):
                        self._arm_periodic()
                    elif s.kind == PolicyKind.QUEUE:
                        self._release(t)
                elif kind == _READY:
                    self.scaler.ready(a, t)
                    self._release(t)
                elif kind == _PERIODIC:
                    self._periodic(a, t)
                elif kind == _MIGRATED:
                    self._apply(self.migrator.transfer_done(a, t))
                else:
                    self._expire(t)
            else:
                self._next_i = next_i + 1
                self._arrive(next_i, t_arr)
            self.events += 1
            if on_progress is not None and self.events % every == 0:
                done_now = self._next_i
                if done_now != finished_seen:
                    finished_seen = done_now
                    on_progress(done_now, n)
        if on_progress is not None:
            on_progress(n, n)
        status = self.status
        status[self.ok] = "ok"
        status[status == ""] = "unfinished"
        ratios = d.assignment_ratios()
        return ClusterSimResult(
            arrival=self.arrival,
            prompt_tokens=self.prompt,
            output_tokens=self.out,
            prefill_instance=self.r_prefill,
            decode_instance=self.r_decode,
            prefill_start=self.t_pstart,
            prefill_end=self.t_pend,
            decode_start=self.t_dstart,
            first_token=self.t_first,
            finish=self.t_finish,
            ok=self.ok,
            instance_ids=list(d.view.instance_ids),
            events=self.events,
            preemptions=sum(getattr(x, "preemptions", 0) for x in self.decoders),
            assignment_ratio=ratios.pop("active"),
            shadow_ratios=ratios,
            policy_events=list(d.policy_events),
            status=status,
            prefill_ids=list(self.prefill_ids),
            decode_ids=list(self.decode_ids),
            scale_events=list(self.scaler.events),
            queued=self.queued,
            migrations_proposed=self.migrations_proposed,
            migrations=self.migrator.completed,
            migrations_refused=dict(self.migrator.refused),
            migrated_tokens=self.migrator.tokens_moved,
            migration_events=list(self.migrator.events),
            request_migrations=self.migrator.per_request.copy(),
            **(
                SimCache.no_results(self.prompt, self.t_dstart, self.r_prefill)
                if self.cache is None
                else self.cache.results()
            ),
            **(NO_LORA if self.lora is None else self.lora.results()),
        )
