"""The advisor's answer for one window: each candidate policy re-simulated on the live shape, ranked against the
active policies, with the advisor's own error (predicted against observed) deciding which gains are shown.

Pure functions over data: the same window, shape, profile, candidates and recent errors give the same
advice (the simulator is deterministic; `seed` goes to the plan for policies that draw).

- **Profiles.** Each simulated instance runs its own profile where the shape carries one (`Shape.profiles`:
  the live instance's calibration, or its calibrated peers' terms), the others `profile`; the advice's
  window notes say so ("per-instance profiles (N calibrated)").
- **Candidates.** By default every registered routing policy that applies (`default_candidates` says
  why the others are left out), run with the active queue policy, and every queue policy, run with
  the active routing policy. The active pair is always run too: it is the baseline.
- **Error.** The active pair's predicted figures against its observed ones over the same window:
  relative error of P99 TTFT and of SLO attainment. None when the window mixes two policies (a swap
  inside it) or the observed figure is unknown.
- **Shown.** A candidate's gain over the active pair (relative, both predicted) is shown only when it
  exceeds the recent error bound (the largest error of the last few windows, this one included) on
  P99 TTFT or attainment, and it is not worse by more than the bound on the other.
- **Rank.** Higher attainment first (to 0.1 point), then lower P99 TTFT, then fewer refusals.
- **Not simulated.** A queue policy only orders the requests admission holds, so where the active pair's
  simulation held none, a queue candidate with the same capacity limits would replay it event for
  event: it gets the active pair's figures without a run (exact, not an approximation), and says so.
- **Coarser cache blocks** (`key_blocks` > 1, off by default; the live worker turns it on by the `[advisor]
  coarse_*` rule, console/advisor/coarse.py): the cache is modelled in blocks of `key_blocks`
  engine blocks, keyed by every `key_blocks`-th key of each request's chain (a chained key names its whole
  prefix, so these are exact keys of the coarser blocks). The cache model's cost is per block, so this divides
  it; what it costs in accuracy is that a cached prefix counts only in whole coarse blocks (up to
  `key_blocks` × block size − 1 tokens fewer per hit) and eviction frees coarse blocks (benchmarks/advisor.py
  measures both against the exact model). The advice says which model it used (`cache_model`).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from console.advisor.coarse import NO_KEYS, cache_label
from console.advisor.figures import Figures, predicted_figures
from console.advisor.window import PolicySetting, Window
from console.offline.simulate import SimPlan, run_one
from core.cluster_spec import parse_cluster
from core.errors import PolicyError
from core.perf import PerfProfile
from core.policies import registry
from core.sim.cluster import CacheParams, ClusterSimResult, Mode
from core.types import PolicyKind

CANDIDATE_KINDS = (PolicyKind.ROUTING, PolicyKind.QUEUE)
"""What the advisor tries: a routing or a queue policy (the others act through the backend, see canary.py)."""
NOT_ADVISED: dict[str, str] = {
    "lora_affinity": "the window records no LoRA adapters, so it routes as the policy it wraps",
}
"""Registered routing policies left out of the default candidates, and why."""
QUEUE_LIMITS = ("max_in_flight_per_instance", "max_queued", "ttl_s", "max_prefill_backlog_s")
"""The active queue policy's limits a queue candidate inherits (they are the operator's capacity
settings, not the ordering the candidate brings)."""
ERROR_HISTORY = 5
"""Windows whose error makes the bound a gain must clear."""


@dataclass(frozen=True)
class Candidate:
    """One policy to try, of kind routing or queue."""

    kind: str
    name: str
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.kind}:{self.name}"


def parse_candidate(text: str) -> Candidate:
    """`[KIND:]NAME` (kind routing by default) → a Candidate; an unknown kind or name is a PolicyError
    that lists what is registered."""
    kind, sep, name = text.strip().partition(":")
    if not sep:
        kind, name = "routing", kind
    if kind not in {k.value for k in CANDIDATE_KINDS}:
        raise PolicyError(f"advisor candidate {text!r}: the advisor tries routing or queue policies, not {kind!r}")
    spec = registry.spec(kind, name)
    if spec.sim_only:
        raise PolicyError(f"advisor candidate {text!r}: {name} is simulator-only (it reads true output lengths)")
    return Candidate(kind, name)


@dataclass(frozen=True)
class Shape:
    """The live cluster's shape as the simulator runs it, with each instance's own profile where it has one."""

    n_prefill: int
    n_decode: int
    profiles: dict[str, PerfProfile] = field(default_factory=dict, hash=False)
    """Simulated instance id (p0.., d0..) → the profile it runs on: what the live calibration projects that
    instance with (console/live/advisor.py `instance_profiles`); an instance not listed runs the advice's
    main profile (core/sim/cluster/profiles.py says what each one times)."""
    calibrated: int = 0
    """How many of `profiles` are the instance's own calibration (the others: its calibrated peers' terms)."""

    @classmethod
    def from_cluster(cls, text: str) -> Shape:
        return cls(*parse_cluster(text))

    def __str__(self) -> str:
        return f"{self.n_prefill}P{self.n_decode}D"

    def profiles_note(self, main: PerfProfile) -> str | None:
        """What the window was simulated with, for the advice's notes (None: every instance on `main`)."""
        if not self.profiles:
            return None
        ids = [f"p{k}" for k in range(self.n_prefill)] + [f"d{k}" for k in range(self.n_decode)]
        peers, rest = len(self.profiles) - self.calibrated, sum(1 for i in ids if i not in self.profiles)
        return (
            f"per-instance profiles ({self.calibrated} calibrated"
            + (f", {peers} on their calibrated peers' terms" if peers else "")
            + (f"; {rest} other instances on {main.name}" if rest else "")
            + ")"
        )


def default_candidates(window: Window) -> tuple[list[Candidate], dict[str, str]]:
    """Every routing and queue policy that applies to the window, and why each other one does not."""
    out: list[Candidate] = []
    skipped: dict[str, str] = {}
    for kind in CANDIDATE_KINDS:
        for spec in registry.specs(kind):
            label = f"{kind.value}:{spec.name}"
            if spec.sim_only:
                skipped[label] = "simulator-only: it reads true output lengths no live console knows"
            elif kind is PolicyKind.ROUTING and spec.name in NOT_ADVISED:
                skipped[label] = NOT_ADVISED[spec.name]
            elif kind is PolicyKind.ROUTING and spec.name == "session_affinity" and window.sessions is None:
                skipped[label] = "no sessions were noted for the window's requests"
            else:
                out.append(Candidate(kind.value, spec.name))
    return out, skipped


def _queue_setting(candidate: Candidate, active: PolicySetting) -> PolicySetting:
    """A queue candidate's params: its own, with the active queue's capacity limits where it takes them."""
    fields = registry.spec(PolicyKind.QUEUE, candidate.name).params_model.model_fields
    inherited = {k: v for k, v in active[1].items() if k in QUEUE_LIMITS and k in fields}
    return candidate.name, {**inherited, **candidate.params}


def simulate(
    window: Window,
    shape: Shape,
    profile: PerfProfile,
    routing: PolicySetting,
    queue: PolicySetting,
    *,
    mode: Mode = "iteration",
    seed: int = 0,
    key_blocks: int = 1,
) -> ClusterSimResult:
    """The window re-simulated under one routing and queue policy: the simulator's per-request result (with
    `key_blocks` > 1, the cache modelled in coarser blocks: see the module docstring). Each instance runs its
    profile in `shape.profiles`, the others `profile`."""
    keys, cache = window.prefix_keys, None
    if keys is not None and key_blocks > 1:
        keys = _coarse_keys_of(keys, key_blocks)
        cache = CacheParams(block_size=profile.block_size * key_blocks)
    plan = SimPlan(
        arrivals=window.arrivals,
        prompt_tokens=window.prompt_tokens,
        output_tokens=window.output_tokens,
        workload=f"advisor window of run {window.run_id}",
        profile=profile,
        n_prefill=shape.n_prefill,
        n_decode=shape.n_decode,
        mode=mode,
        policies=[routing],
        slo=window.slos["default"],
        seed=seed,
        shadow=False,
        queue=queue,
        priorities=window.priorities,
        sessions=window.sessions,
        prefix_keys=keys,
        cache=cache,
        tenants=window.tenants,
        slo_classes=window.slo_classes,
        slos=window.slos,
        instance_profiles=shape.profiles or None,
    )
    _, result = run_one(plan, routing[0], routing[1])
    return result


def predict(
    window: Window,
    shape: Shape,
    profile: PerfProfile,
    routing: PolicySetting,
    queue: PolicySetting,
    *,
    mode: Mode = "iteration",
    seed: int = 0,
    key_blocks: int = 1,
) -> Figures:
    """The window re-simulated under one routing and queue policy; figures over its own arrivals."""
    result = simulate(window, shape, profile, routing, queue, mode=mode, seed=seed, key_blocks=key_blocks)
    return predicted_figures(result, window.measured, window.slo_classes, window.slos)


def coarse_keys(keys: Sequence[tuple[int, ...]], key_blocks: int) -> list[tuple[int, ...]]:
    """Each request's chain of block keys as a chain of blocks `key_blocks` times longer: every `key_blocks`-th
    key (a chained key names the prefix up to its block); a partial last coarse block is left out, as an
    engine caches only full blocks."""
    if key_blocks < 1:
        raise ValueError(f"key_blocks must be >= 1, got {key_blocks}")
    return [tuple(k[key_blocks - 1 :: key_blocks]) for k in keys]


_COARSE: list[tuple[Sequence[tuple[int, ...]], int, list[tuple[int, ...]]] | None] = [None]
"""The last chains coarsened, the factor and the result: every candidate of one advice runs on the same keys
(and the simulator's cache remembers what it derived from them by their identity)."""


def _coarse_keys_of(keys: Sequence[tuple[int, ...]], key_blocks: int) -> list[tuple[int, ...]]:
    last = _COARSE[0]  # read once: another thread may replace it
    if last is not None and last[0] is keys and last[1] == key_blocks:
        return last[2]
    out = coarse_keys(keys, key_blocks)
    _COARSE[0] = (keys, key_blocks, out)
    return out


def queue_limits(queue: PolicySetting) -> tuple[Any, ...]:
    """A queue setting's effective capacity limits (its params with the policy's defaults filled in)."""
    params = registry.build(PolicyKind.QUEUE, queue[0], queue[1]).params
    return tuple(getattr(params, k) for k in QUEUE_LIMITS)


NOTHING_HELD = "not simulated: the active pair's simulation held no request, so this queue policy had nothing to order"
"""Why a queue candidate carries the active pair's figures (see the module docstring)."""


def replays_active(
    pair: tuple[PolicySetting, PolicySetting], active: tuple[PolicySetting, PolicySetting], held: int
) -> bool:
    """Whether a candidate pair would replay the active pair's simulation event for event: it changes only
    the queue policy, keeps the same capacity limits, and the active pair's simulation held (`held`) none.
    Admission consults the queue policy only to order, shed or expire held requests; with the same
    limits the same arrivals find room, so nothing is ever held and the two runs never diverge."""
    (routing, queue), (active_routing, active_queue) = pair, active
    return held == 0 and routing == active_routing and queue_limits(queue) == queue_limits(active_queue)


@dataclass(frozen=True)
class Errors:
    """Relative errors (or gains) on P99 TTFT and SLO attainment; None where a figure is unknown."""

    ttft_p99: float | None
    attainment: float | None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _relative(value: float | None, reference: float | None) -> float | None:
    if value is None or reference is None:
        return None
    if reference == 0:
        return 0.0 if value == 0 else None
    return (value - reference) / reference


def prediction_error(predicted: Figures, observed: Figures) -> Errors:
    """|predicted − observed| / observed for P99 TTFT and attainment."""
    t = _relative(predicted.ttft_p99, observed.ttft_p99)
    a = _relative(predicted.attainment, observed.attainment)
    return Errors(None if t is None else abs(t), None if a is None else abs(a))


def gain_over(candidate: Figures, active: Figures) -> Errors:
    """A candidate's relative gain over the active pair, both predicted: > 0 is better (a lower P99 TTFT,
    a higher attainment)."""
    t = _relative(candidate.ttft_p99, active.ttft_p99)
    return Errors(None if t is None else -t, _relative(candidate.attainment, active.attainment))


def error_bound(errors: Iterable[Errors]) -> Errors:
    """The largest of recent errors, per figure (None: no error known for it)."""
    seen = list(errors)

    def worst(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return max(known) if known else None

    return Errors(worst([e.ttft_p99 for e in seen]), worst([e.attainment for e in seen]))


def clears(gain: Errors, bound: Errors) -> bool:
    """Whether a gain is shown: better than the bound on one figure, not worse than it on the other.
    With no error known the advisor cannot say how far to trust itself, and shows nothing."""
    pairs = [(g, b) for g, b in ((gain.ttft_p99, bound.ttft_p99), (gain.attainment, bound.attainment))]
    if all(b is None for _, b in pairs):
        return False
    better = any(g is not None and b is not None and g > b for g, b in pairs)
    worse = any(g is not None and b is not None and g < -b for g, b in pairs)
    return better and not worse


class ErrorHistory:
    """The advisor's errors over its last `size` windows (what a gain must clear)."""

    def __init__(self, size: int = ERROR_HISTORY) -> None:
        self._errors: deque[Errors] = deque(maxlen=size)

    def add(self, error: Errors | None) -> None:
        if error is not None:
            self._errors.append(error)

    def recent(self) -> list[Errors]:
        return list(self._errors)


@dataclass(frozen=True)
class Ranked:
    """One policy pair's predicted figures, its gain over the active pair and whether the gain is shown."""

    label: str
    routing: PolicySetting
    queue: PolicySetting
    predicted: Figures
    gain: Errors
    shown: bool
    active: bool = False
    note: str = ""
    """Why the figures were not simulated for this pair (empty: they were)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "routing": {"name": self.routing[0], "params": self.routing[1]},
            "queue": {"name": self.queue[0], "params": self.queue[1]},
            "predicted": self.predicted.to_json(),
            "gain": self.gain.to_json(),
            "shown": self.shown,
            "active": self.active,
            "note": self.note,
        }


@dataclass(frozen=True)
class Advice:
    """The advisor's answer for one window."""

    window: dict[str, Any]
    shape: str
    profile: str
    observed: Figures
    predicted_active: Figures
    error: Errors | None
    """This window's error (None when the window mixes policies: its observed figures are no one's)."""
    bound: Errors
    """What a gain had to clear: the largest recent error, this window's included."""
    ranked: list[Ranked]
    """Best first; the active pair is among them."""
    skipped: dict[str, str]
    sim_wall_s: float
    seed: int
    key_blocks: int = 1
    """Engine blocks per modelled cache block: 1, the exact model; more, coarse prefix blocks."""
    cache_why: str = ""
    """Why this cache model (the worker's `[advisor] coarse_*` rule; empty when the caller chose)."""

    @property
    def cache_model(self) -> str:
        """"exact prefix blocks", or "coarse prefix blocks (×8)"."""
        return cache_label(self.key_blocks)

    @property
    def best(self) -> Ranked | None:
        """The best-ranked candidate whose gain is shown, if it ranks above the active pair."""
        for r in self.ranked:
            if r.active:
                return None
            if r.shown:
                return r
        return None

    def to_json(self) -> dict[str, Any]:
        best = self.best
        return {
            "window": self.window,
            "shape": self.shape,
            "profile": self.profile,
            "observed": self.observed.to_json(),
            "predicted_active": self.predicted_active.to_json(),
            "error": None if self.error is None else self.error.to_json(),
            "bound": self.bound.to_json(),
            "ranked": [r.to_json() for r in self.ranked],
            "best": None if best is None else best.label,
            "skipped": dict(self.skipped),
            "sim_wall_s": self.sim_wall_s,
            "seed": self.seed,
            "cache_model": self.cache_model,
            "key_blocks": self.key_blocks,
            "cache_why": self.cache_why,
        }


def rank_key(f: Figures) -> tuple[float, float, int]:
    """Higher attainment (to 0.1 point), then lower P99 TTFT, then fewer refusals."""
    attainment = -round(f.attainment, 3) if f.attainment is not None else 0.0
    return attainment, f.ttft_p99 if f.ttft_p99 is not None else math.inf, f.refusals


def advise(
    window: Window,
    shape: Shape,
    profile: PerfProfile,
    *,
    candidates: Sequence[Candidate] | None = None,
    recent: Sequence[Errors] = (),
    mode: Mode = "iteration",
    seed: int = 0,
    key_blocks: int = 1,
    cache_why: str = "",
) -> Advice:
    """Re-simulate the window under the active pair and each candidate; rank them; judge the gains by the
    advisor's error on this window and the `recent` ones. `key_blocks` > 1 models the cache in coarse blocks
    (a window without prefix keys has no cache to coarsen: its advice says exact); `cache_why` says why."""
    if window.prefix_keys is None:
        key_blocks, cache_why = 1, cache_why or NO_KEYS
    started = time.perf_counter()
    if candidates is None:
        chosen, skipped = default_candidates(window)
    else:
        chosen, skipped = list(candidates), {}
    for c in chosen:
        registry.build(c.kind, c.name, c.params)  # an unknown name or a bad param fails before any simulation
    routing, queue = window.active["routing"], window.active["queue"]
    base_result = simulate(window, shape, profile, routing, queue, mode=mode, seed=seed, key_blocks=key_blocks)
    base = predicted_figures(base_result, window.measured, window.slo_classes, window.slos)
    error = None if window.swapped else prediction_error(base, window.observed)
    bound = error_bound([*recent, *([error] if error is not None else [])])
    pairs: list[tuple[str, PolicySetting, PolicySetting]] = []
    for c in chosen:
        pair = ((c.name, dict(c.params)), queue) if c.kind == "routing" else (routing, _queue_setting(c, queue))
        if pair != (routing, queue) and all((r, q) != pair for _, r, q in pairs):
            pairs.append((c.label, *pair))
    entries = [Ranked("active", routing, queue, base, Errors(0.0, 0.0), False, active=True)]
    for label, r, q in pairs:
        if replays_active((r, q), (routing, queue), base_result.queued):
            entries.append(Ranked(label, r, q, base, Errors(0.0, 0.0), False, note=NOTHING_HELD))
            continue
        figures = predict(window, shape, profile, r, q, mode=mode, seed=seed, key_blocks=key_blocks)
        gain = gain_over(figures, base)
        entries.append(Ranked(label, r, q, figures, gain, clears(gain, bound)))
    entries.sort(key=lambda e: (*rank_key(e.predicted), not e.active, e.label))
    summary, note = window.summary(), shape.profiles_note(profile)
    if note is not None:
        summary["notes"].append(note)
    return Advice(
        window=summary,
        shape=str(shape),
        profile=profile.name,
        observed=window.observed,
        predicted_active=base,
        error=error,
        bound=bound,
        ranked=entries,
        skipped=skipped,
        sim_wall_s=time.perf_counter() - started,
        seed=seed,
        key_blocks=key_blocks,
        cache_why=cache_why,
    )
