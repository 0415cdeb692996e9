"""The live what-if advisor: every period, the recent window of finished requests goes to the niced worker process
(console/advisor/worker.py), and its answer is shown, stored, exported and, with `apply`, acted on.

What stays in the console's own process, off the hot path: each finished request's stored row is kept
for one window (`request`), each arrival's prefix keys, session and whether its client set max_tokens are
noted (`note`, one dict insert), and once a period the requests in flight are read from the gateway's
records (`in_flight_rows`, on the event loop: the store has only finished ones), the window is built in a
worker thread (console/advisor/window.py) and handed to the worker process, whose answer is polled
without blocking. The simulation itself, the CPU that matters, runs in the worker; its CPU time is
reported beside every answer (`cpu_share`, /metrics).

It advises on one pool (`[advisor] pool`, default the first): its window holds that pool's requests only (their
stored `model` is the pool's), its shape and profiles are that pool's, and an automatic canary runs there. The
window is marked as mixing two policies (its observed figures are no one's, so no error is taken from it) when a
routing or queue swap or a canary on that pool falls inside it. The shape is the pool's live instances'
(active prefill and decode counts), each with the profile the calibration projects it with now
(`instance_profiles`: its own calibration, or its calibrated peers' terms); an instance on the shared
terms runs the main profile (`cluster_profile`: the prior with the instances' fitted step terms averaged).
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from console.advisor.pools import on_pool
from core.types import InstancePhase

if TYPE_CHECKING:
    from console.advisor.window import RecentArrivals
    from console.advisor.worker import AdvisorWorker, WorkerAnswer
    from console.live.calibrator import Calibrator
    from console.live.canary import AdvisorLog, LiveCanary
    from console.live.config import AdvisorSettings
    from console.live.events import EventBus
    from console.live.outcomes import Outcomes
    from core.dispatch import Dispatcher
    from core.perf import PerfProfile
    from core.slo import SLOClass
    from core.types import Request

log = logging.getLogger(__name__)
ADVISED_KINDS = ("routing", "queue")


def cluster_profile(prior: PerfProfile, fits: Iterable[Mapping[str, Mapping[str, Any]]]) -> PerfProfile:
    """The main profile a window is simulated with: the prior, with each step term some instance's online fit
    identified (console/live/calibrator.py: source "fit…") replaced by the mean of those fits. It times only
    the instances `instance_profiles` leaves out (on the shared terms live) and what the simulator keeps
    cluster-wide (core/sim/cluster/profiles.py); the others run their own profile."""
    fitted: dict[str, list[float]] = {}
    for terms in fits:
        for term, t in terms.items():
            if str(t.get("source", "")).startswith("fit") and isinstance(t.get("value"), int | float):
                fitted.setdefault(term, []).append(float(t["value"]))
    update = {k: sum(v) / len(v) for k, v in fitted.items() if k in type(prior).model_fields}
    return prior.model_copy(update=update) if update else prior


def instance_profiles(dispatcher: Dispatcher, calibration: Calibrator) -> tuple[dict[str, PerfProfile], int]:
    """Each active instance's profile under the name the simulator gives it (the k-th active instance serving
    prefill, in the dispatcher's order, is pk; serving decode, dk: the shape counts the same instances), as
    the calibration projects it now: its own calibration, or its calibrated peers' terms. An instance on the
    shared terms is left out (it runs the main profile). Also how many entries are an instance's own."""
    profiles: dict[str, PerfProfile] = {}
    own, seen = 0, {"p": 0, "d": 0}
    for iid in dispatcher.view.instance_ids:
        if dispatcher.phase_of(iid) is not InstancePhase.ACTIVE:
            continue
        role, projected = dispatcher.role_of(iid), calibration.projected_profile(iid)
        for prefix, serves in (("p", role.serves_prefill()), ("d", role.serves_decode())):
            if serves:
                if projected is not None:
                    profiles[f"{prefix}{seen[prefix]}"] = projected[0]
                    own += projected[1]
                seen[prefix] += 1
    return profiles, own


class RowTee:
    """A RunLog in front of the run's recorder that also hands each finished request's stored row to listeners."""

    def __init__(self, log: Any) -> None:
        self._log = log
        self.listeners: list[Callable[[dict[str, Any]], None]] = []

    def request(self, row: dict[str, Any]) -> None:
        for listener in self.listeners:
            listener(row)
        self._log.request(row)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._log, name)


def _summary(advice: Mapping[str, Any]) -> dict[str, Any]:
    """The advice as the state carries it (every half second to each dashboard): the ranking without the params."""
    return {
        "best": advice["best"],
        "shape": advice["shape"],
        "profile": advice["profile"],
        "error": advice["error"],
        "bound": advice["bound"],
        "observed": advice["observed"],
        "requests": advice["window"]["requests"],
        "swapped": advice["window"]["swapped"],
        "cache_model": advice.get("cache_model"),
        "ranked": [
            {
                "label": r["label"],
                "active": r["active"],
                "shown": r["shown"],
                "ttft_p99": r["predicted"]["ttft_p99"],
                "attainment": r["predicted"]["attainment"],
                "refusals": r["predicted"]["refusals"],
                "gain": r["gain"],
            }
            for r in advice["ranked"]
        ],
    }


class LiveAdvisor:
    """The advisor of a running console (module docstring); a no-op unless `[advisor] enabled`."""

    def __init__(
        self,
        settings: AdvisorSettings,
        *,
        dispatcher: Dispatcher,
        pool: str,
        model: str | None = None,
        canary: LiveCanary,
        log: AdvisorLog,
        events: EventBus,
        t0: float,
        run_id: str,
        slos: Mapping[str, SLOClass],
        shape: Callable[[], str],
        profile: Callable[[], PerfProfile],
        outcomes: Outcomes | None = None,
        calibration: Calibrator | None = None,
    ) -> None:
        self.settings = settings
        self.enabled = settings.enabled
        self.dispatcher, self.canary, self.log, self.events = dispatcher, canary, log, events
        self.pool = pool
        """The name of the pool it advises on (its dispatcher's)."""
        self.model = model
        """That pool's base model: finished and in-flight requests whose model is another are left out (None: all)."""
        self.t0, self.run_id, self.slos = t0, run_id, dict(slos)
        self.shape, self.profile = shape, profile
        """`profile()`: the main profile windows are simulated with (`cluster_profile`: the prior with the
        instances' calibrated step terms), for the instances `calibration` gives no profile of their own."""
        self.calibration = calibration
        """The pool's calibration: each instance's profile in the shape (`instance_profiles`; None: none)."""
        self.outcomes = outcomes
        """The gateway's records of the requests in flight (`live`) and its tenant labels (None: no in-flight
        requests are replayed)."""
        self.rows: deque[dict[str, Any]] = deque()
        self.arrivals: RecentArrivals | None = None
        self.worker: AdvisorWorker | None = None
        self.answer: WorkerAnswer | None = None
        self.advice: dict[str, Any] | None = None
        """The latest advice (Advice.to_json()) with `t` and what was done with it (`detail`)."""
        self.error: str | None = None
        """Why the latest period gave no advice (too few requests, a failed simulation), None after one did."""
        self.windows = 0
        self.autopilot: Any = None
        if self.enabled:
            window = importlib.import_module("console.advisor.window")  # at start-up, before any request
            autopilot = importlib.import_module("console.advisor.autopilot")
            self.arrivals = window.RecentArrivals()
            self.autopilot = autopilot.Autopilot(
                settings.apply,
                share=settings.canary_share,
                duration_s=settings.canary_for_s,
                cooldown_s=settings.cooldown_s,
                max_swaps_per_hour=settings.max_swaps_per_hour,
            )
            canary.on_end.append(self._canary_ended)

    def _canary_ended(self, record: Mapping[str, Any]) -> None:
        """A canary ended: on the advised pool, the autopilot cools down (another pool's canary left its traffic
        alone)."""
        if record.get("pool") in (None, self.pool):
            self.autopilot.quiet(time.monotonic())

    # --- the hot path: one call per arrival and per finished request ---------------------------------
    def note(self, request: Request, max_tokens_set: bool = True) -> None:
        """An arrival's prefix keys, session and whether its client set max_tokens (what the run store does not
        keep)."""
        if self.arrivals is not None:
            self.arrivals.note(str(request.id), request.prefix_keys, request.session, max_tokens_set)

    def request(self, row: dict[str, Any]) -> None:
        """A finished request's stored row, kept for one window when it ran on the advised pool."""
        if not self.enabled or not on_pool(row.get("model"), self.model):
            return
        rows = self.rows
        rows.append(row)
        horizon = time.monotonic() - self.t0 - self.settings.window_s
        while rows and (rows[0].get("finish") or 0.0) < horizon:
            rows.popleft()

    # --- the period ------------------------------------------------------------------------------------
    async def run(self) -> None:
        """Every period_s: take the window, hand it to the worker, take its answer without blocking."""
        if not self.enabled:
            return
        from console.advisor.simulate import parse_candidate
        from console.advisor.worker import AdvisorWorker

        s = self.settings
        candidates = [parse_candidate(c) for c in s.candidates] if s.candidates is not None else None
        shape = self._shape()
        self.worker = await asyncio.to_thread(
            AdvisorWorker, shape, self.profile(), candidates=candidates, coarse=s.coarse_rule()
        )
        next_at = time.monotonic() + s.period_s
        while True:
            await asyncio.sleep(max(next_at - time.monotonic(), 0.0))
            next_at += s.period_s
            try:
                await self._take(self.worker.latest())
                if await self.submit():
                    await self._take(await self.worker.next_answer(max(next_at - time.monotonic(), 0.1)))
            except Exception:  # one bad period is logged; the next one tries again
                log.exception("advisor: the period failed")

    def _shape(self) -> Any:
        """The live shape, each instance with the profile the calibration projects it with now."""
        from console.advisor.simulate import Shape

        shape = Shape.from_cluster(self.shape())
        if self.calibration is None:
            return shape
        profiles, calibrated = instance_profiles(self.dispatcher, self.calibration)
        return dataclasses.replace(shape, profiles=profiles, calibrated=calibrated)

    async def submit(self) -> bool:
        """Build the window (in a thread) and hand it to the worker; False when there is none to advise on."""
        from console.advisor.window import WindowError, window_from_rows

        assert self.worker is not None
        now = time.monotonic()
        try:
            rows = list(self.rows)
            args = self.window_args(now, rows, self.in_flight_rows())
            window = await asyncio.to_thread(window_from_rows, rows, **args)
        except WindowError as e:
            self.error = str(e)
            return False
        self.worker.configure(shape=self._shape(), profile=self.profile())
        self.worker.submit(window)
        self.windows += 1
        return True

    def in_flight_rows(self) -> list[dict[str, Any]]:
        """The requests in the gateway now, as the window takes them (`window_from_rows`' `in_flight`): what was
        known at arrival, the tokens generated so far, and whether the client set max_tokens (as noted; a
        request not noted counts as having set it). Read on the event loop, where the records change."""
        if self.outcomes is None:
            return []
        out, notes = self.outcomes, self.arrivals
        rows = []
        for rec in list(out.live.values()):
            if not on_pool(rec.model, self.model):
                continue  # another pool's
            req = rec.request
            noted = None if notes is None else notes.get(rec.id)
            rows.append(
                {
                    "request_id": rec.id,
                    "arrival": req.arrival - self.t0,
                    "prompt_tokens": req.prompt_tokens,
                    "max_tokens": req.max_tokens,
                    "max_tokens_set": True if noted is None else noted.max_tokens_set,
                    "output_tokens": rec.output_tokens,
                    "slo_class": req.slo_class,
                    "priority": req.priority,
                    "tenant": out.tenant_of(req),
                    "prefix_keys": req.prefix_keys,
                    "session": req.session,
                }
            )
        return rows

    def window_args(
        self, now: float, rows: list[dict[str, Any]], in_flight: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        """What `window_from_rows` takes besides the rows, for the window ending `now` (monotonic): the
        active routing and queue policies, whether a swap or a canary falls inside it, the requests in flight
        (`in_flight_rows`), the noted keys of the rows and of those."""
        s, d = self.settings, self.dispatcher
        active = {k: (p["name"], p["params"]) for k, p in d.active_policies().items() if k in ADVISED_KINDS}
        swapped = any(
            ev.kind.value in ADVISED_KINDS and ev.source != "config" and now - s.window_s < ev.time <= now
            for ev in d.policy_events
        ) or self.canary.ran_since(self.pool, now - s.window_s)
        return {
            "run_id": self.run_id,
            "end": now - self.t0,
            "window_s": s.window_s,
            "active": active,
            "slos": self.slos,
            "keys": None
            if self.arrivals is None
            else self.arrivals.subset(str(r["request_id"]) for r in (*rows, *(in_flight or ()))),
            "in_flight": in_flight or [],
            "swapped": swapped,
            "cluster": self.shape(),
        }

    async def _take(self, answer: WorkerAnswer | None) -> None:
        """A new answer from the worker: kept, stored as an advice event, published when the best one changes,
        and given to the autopilot."""
        if answer is None or answer is self.answer:
            return
        self.answer = answer
        if answer.advice is None:
            self.error = f"the simulation failed: {answer.error}"
            return
        self.error = None
        now = time.monotonic()
        advice = answer.advice
        action, detail = self.autopilot.consider(advice, now, self.canary.current is not None)
        js = advice.to_json()
        before = None if self.advice is None else self.advice["best"]
        t = now - self.t0
        self.advice = {**js, "t": t, "detail": detail, "apply": self.settings.apply}
        best = advice.best
        self.log.advisor_event(
            t=t,
            event="advice",
            kind=None if best is None else best.label.split(":", 1)[0],
            policy=None if best is None else best.label,
            decision=self.settings.apply,
            detail=detail,
            data={**js, "cpu_s": answer.cpu_s, "job_cpu_s": answer.job_cpu_s, "wall_s": answer.wall_s},
        )
        if js["best"] != before:
            self.events.publish("advice", best=js["best"], detail=detail, t=t)
        if action is not None:
            await self.canary.start(
                action.kind,
                action.name,
                action.params,
                action.share,
                action.duration_s,
                source="advisor",
                why=action.why,
                promote=lambda: self.autopilot.may_promote(time.monotonic()),
                pool=self.pool,
            )

    # --- views ---------------------------------------------------------------------------------------------
    def cpu_share(self) -> float | None:
        """The worker process's CPU time as a share of one core since it started."""
        return None if self.worker is None else self.worker.cpu_share()

    def snapshot(self) -> dict[str, Any] | None:
        """What the state shows (None while the advisor is off)."""
        if not self.enabled:
            return None
        s, a, w = self.settings, self.answer, self.worker
        return {
            "pool": self.pool,
            "apply": s.apply,
            "period_s": s.period_s,
            "window_s": s.window_s,
            "pid": None if w is None else w.pid,
            "cpu_share": self.cpu_share(),
            "cpu_s": None if a is None else a.cpu_s,
            "windows": self.windows,
            "skipped": 0 if w is None else w.skipped,
            "error": self.error,
            "t": None if self.advice is None else self.advice["t"],
            "detail": None if self.advice is None else self.advice["detail"],
            "advice": None if self.advice is None else _summary(self.advice),
        }

    def answer_json(self) -> dict[str, Any]:
        """GET /control/advice: the latest advice in full, and the advisor's state."""
        return {"enabled": self.enabled, **(self.snapshot() or {}), "advice": self.advice}

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None


class AdvisorCollector(Collector):
    """The advisor's figures at scrape time: predicted P99 TTFT and attainment per candidate, its error, its CPU."""

    def __init__(self, advisor: LiveAdvisor) -> None:
        self.advisor = advisor

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        a = self.advisor
        if not a.enabled:
            return
        ttft = GaugeMetricFamily(
            "sibyl_advisor_predicted_ttft_p99_seconds",
            "the latest advice's predicted P99 TTFT under each candidate (active: the policies in force)",
            labels=["candidate"],
        )
        attainment = GaugeMetricFamily(
            "sibyl_advisor_predicted_attainment",
            "the latest advice's predicted SLO attainment under each candidate, 0..1",
            labels=["candidate"],
        )
        error = GaugeMetricFamily(
            "sibyl_advisor_error",
            "the advisor's relative error on the active policies (|predicted - observed| / observed; NaN: the "
            "window mixed two policies), and the bound a gain must clear",
            labels=["figure", "of"],
        )
        advice = a.advice
        for r in (advice or {}).get("ranked", []):
            p = r["predicted"]
            ttft.add_metric([r["label"]], math.nan if p["ttft_p99"] is None else p["ttft_p99"])
            attainment.add_metric([r["label"]], math.nan if p["attainment"] is None else p["attainment"])
        if advice is not None:
            for of, errors in (("window", advice["error"] or {}), ("bound", advice["bound"])):
                for figure in ("ttft_p99", "attainment"):
                    value = errors.get(figure)
                    error.add_metric([figure, of], math.nan if value is None else value)
        yield ttft
        yield attainment
        yield error
        cpu = CounterMetricFamily("sibyl_advisor_cpu_seconds", "CPU time of the advisor's worker process")
        cpu.add_metric([], 0.0 if a.answer is None else a.answer.cpu_s)
        yield cpu
        share = a.cpu_share()
        yield GaugeMetricFamily(
            "sibyl_advisor_cpu_share",
            "the advisor's worker process's CPU time as a share of one core since it started",
            value=math.nan if share is None else share,
        )
        yield CounterMetricFamily("sibyl_advisor_windows", "windows handed to the advisor's worker", value=a.windows)
