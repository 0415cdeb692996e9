"""Decision records: what a policy saw of every candidate when it decided, its choice, the margin and ties.

A policy reports a choice through `note` while it decides; `note` does nothing unless the dispatcher
asked for a record of this decision (it set `view.explain` to an `Explain` before calling the
policy), so an unsampled decision costs one attribute test. What a record holds was captured at the
moment of the decision, from the arrays the policy scored and from the view it read (STYLE.md 23:
record what the policy saw, not a recomputation).

Scores are the policy's own measure, lower is better (projected load at τ, estimated TTFT, a
rotation distance, ...). The margin is the best other eligible candidate's score minus the chosen
one's (negative when a guard made the policy pass over a better score); ties count the other
eligible candidates whose score equals the chosen one's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from core.types import Request
    from core.view import ClusterView

TIE_TOL = 1e-9
"""Scores within this (relative to max(1, |score|)) of the chosen one's count as ties."""
Info = dict[str, float | str]


@dataclass(slots=True)
class Decision:
    """One decision: its candidates (instances, ranks or held requests), each with its features and
    score as the policy saw them, and which one was chosen. Values are kept column-wise (a list per
    feature, one entry per candidate), as the run store keeps them."""

    kind: str
    """route (a routing decision), bind (a late decode choice at prefill end), handoff (the decode
    choice scored against the state when decoding began), rank, release (a queue release), retry
    (failover to another instance), scale, reschedule."""
    stage: str
    """What was chosen: prefill, decode, rank, queue, scaling, reschedule."""
    policy: str
    """The policy that decided (a request's router; the active policy of the kind)."""
    t: float
    """The dispatcher's clock (the console stores it relative to its start)."""
    request_id: str | None = None
    chosen: str | None = None
    scorer: str = ""
    """The policy whose scores these are, when not `policy` itself (a composed router's decode policy)."""
    score_name: str = ""
    """What the scores measure (lower is better); empty when the policy scored nothing."""
    names: tuple[str, ...] = ()
    """The candidates."""
    scores: list[float] | None = None
    """Each candidate's score (NaN where it has none); None when the policy scored nothing."""
    eligible: list[bool] | None = None
    """Whether each candidate could be chosen (a load guard or admissibility test); None: all."""
    values: dict[str, list[float]] = field(default_factory=dict)
    """Per feature, its value for each candidate."""
    info: Info = field(default_factory=dict)
    """Decision-wide facts (τ, an action's reason, whether a decode choice was still best at handoff)."""

    @classmethod
    def of(
        cls,
        kind: str,
        stage: str,
        policy: str,
        t: float,
        *,
        names: Sequence[str],
        scores: Sequence[float] | None,
        features: Mapping[str, Sequence[float]] | None = None,
        eligible: Sequence[bool] | None = None,
        **kw: Any,
    ) -> Decision:
        """A record from plain sequences."""
        return cls(
            kind,
            stage,
            policy,
            t,
            names=tuple(names),
            scores=None if scores is None else [float(x) for x in scores],
            eligible=None if eligible is None else [bool(x) for x in eligible],
            values={f: [float(x) for x in v] for f, v in (features or {}).items()},
            **kw,
        )

    @property
    def features(self) -> tuple[str, ...]:
        """The feature names."""
        return tuple(self.values)

    def feature(self, name: str) -> list[float]:
        """One feature's value for each candidate."""
        return self.values[name]

    def _others(self) -> tuple[float, list[float]] | None:
        """The chosen one's score and the other eligible candidates' finite scores."""
        s = self.scores
        if s is None or self.chosen not in self.names:
            return None
        c = self.names.index(self.chosen)
        ok = self.eligible
        others = [x for i, x in enumerate(s) if i != c and (ok is None or ok[i]) and math.isfinite(x)]
        return s[c], others

    @property
    def margin(self) -> float | None:
        """The best other eligible score minus the chosen one's (None: nothing to compare)."""
        got = self._others()
        if got is None or not got[1] or not math.isfinite(got[0]):
            return None
        return min(got[1]) - got[0]

    @property
    def ties(self) -> int:
        """Other eligible candidates scoring what the chosen one scored."""
        got = self._others()
        if got is None or not math.isfinite(got[0]):
            return 0
        mine, others = got
        tol = TIE_TOL * max(1.0, abs(mine))
        return sum(1 for x in others if abs(x - mine) <= tol)

    def columns(self) -> dict[str, Any]:
        """The candidates column-wise, as the run store keeps them."""
        return {"names": list(self.names), "scores": self.scores, "eligible": self.eligible, "features": self.values}

    def candidates(self) -> list[dict[str, Any]]:
        """One dict per candidate: name, score, eligible, chosen, features."""
        return candidate_rows(self.columns(), self.chosen)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "stage": self.stage,
            "policy": self.policy,
            "scorer": self.scorer or self.policy,
            "t": self.t,
            "request_id": self.request_id,
            "chosen": self.chosen,
            "score_name": self.score_name,
            "margin": self.margin,
            "ties": self.ties,
            "info": self.info,
            "candidates": self.candidates(),
        }


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def candidate_rows(columns: dict[str, Any], chosen: str | None) -> list[dict[str, Any]]:
    """Column-wise candidates (as stored; JSON null for NaN) as one dict per candidate."""
    names = columns.get("names") or []
    scores = columns.get("scores")
    eligible = columns.get("eligible")
    features = columns.get("features") or {}
    return [
        {
            "name": name,
            "score": None if scores is None else _finite(scores[k]),
            "eligible": True if eligible is None else bool(eligible[k]),
            "chosen": name == chosen,
            "features": {f: _finite(v[k]) for f, v in features.items()},
        }
        for k, name in enumerate(names)
    ]


@dataclass(slots=True)
class _Choice:
    by: str
    score_name: str
    scores: np.ndarray | None
    eligible: np.ndarray | None
    chosen: int
    features: dict[str, np.ndarray]
    info: Info


MAKERS: dict[str, Callable[..., Decision]] = {}
"""Functions that build a Decision from what a hot path kept (NumPy arrays, or the same as JSON lists)."""


def maker(name: str) -> Callable[[Callable[..., Decision]], Callable[..., Decision]]:
    """Register a builder of lazy records under `name` (stored with the record's arguments)."""

    def register(fn: Callable[..., Decision]) -> Callable[..., Decision]:
        MAKERS[name] = fn
        return fn

    return register


class Record:
    """A decision record as the hot path leaves it: its heading (kind, stage, policy, time, choice)
    and the arguments of a registered maker — references to what the policy scored, copies of the
    view's arrays it read. The `Decision` is made only when someone reads it (`get`); the run store
    keeps the arguments as they are (`payload`) and makes the decision when it is read back, so a
    sampled decision costs a few array copies where it is taken and one JSON encoding where it is
    stored."""

    __slots__ = ("request_id", "head", "maker", "args", "_done")

    def __init__(self, request_id: str | None, head: tuple[Any, ...], maker: str, args: tuple[Any, ...]) -> None:
        self.request_id = request_id
        self.head = head
        """(kind, stage, policy, t, chosen, scorer, score_name, info)."""
        self.maker = maker
        self.args = args
        self._done: Decision | None = None

    @classmethod
    def of(cls, d: Decision) -> Record:
        """A record already made."""
        r = cls(d.request_id, (d.kind, d.stage, d.policy, d.t, d.chosen, d.scorer, d.score_name, d.info), "", ())
        r._done = d
        return r

    def get(self) -> Decision:
        """The decision (made anew on each call: a record keeps only what it is made from)."""
        if self._done is not None:
            return self._done
        return MAKERS[self.maker](*self.args)

    def payload(self) -> dict[str, Any]:
        """What the run store keeps (JSON with NumPy arrays inside): the made decision's columns, or
        the maker and its arguments (`from_payload` turns either back into a Decision)."""
        if self._done is not None:
            return self._done.columns()
        return {"maker": self.maker, "args": self.args}


def from_payload(head: tuple[Any, ...], rid: str | None, payload: dict[str, Any]) -> Decision:
    """A stored record back as a Decision (`head` as in `Record.head`)."""
    if "maker" in payload:
        return MAKERS[payload["maker"]](*payload["args"])
    kind, stage, policy, t, chosen, scorer, score_name, info = head
    return Decision(
        kind,
        stage,
        policy,
        t,
        request_id=rid,
        chosen=chosen,
        scorer=scorer,
        score_name=score_name,
        names=tuple(payload.get("names") or ()),
        scores=[math.nan if x is None else x for x in payload["scores"]] if payload.get("scores") else None,
        eligible=payload.get("eligible"),
        values={f: [math.nan if x is None else x for x in v] for f, v in (payload.get("features") or {}).items()},
        info=info,
    )


def _list(values: Any) -> list[Any]:
    out: list[Any] = values.tolist() if isinstance(values, np.ndarray) else values
    return out


def _pick(values: Any, idx: list[int]) -> list[float]:
    """The entries `idx` of a per-instance array or list, as floats (NaN for a stored null)."""
    v = _list(values)
    return [math.nan if v[i] is None else float(v[i]) for i in idx]


@maker("choice")
def _choice_decision(
    kind: str,
    stage: str,
    policy: str,
    t: float,
    rid: str,
    ids: list[str],
    mask: Any,
    by: str,
    score_name: str,
    scores: Any,
    eligible: Any,
    chosen: int,
    features: dict[str, Any],
    info: Info,
    base: list[Any],
    est_work: Any,
    now: float,
) -> Decision:
    """Build one routing record (see `Explain.records`) from what the hot path kept: plain Python
    over a handful of candidates, cheaper than NumPy on arrays this small."""
    m = _list(mask)
    idx = [i for i, ok in enumerate(m) if ok or i == chosen]
    k = len(idx)
    values: dict[str, list[float]] = {}
    if stage == "prefill":
        free_at, prefill_n, cached = base
        queued = [max(q - now, 0.0) for q in _pick(free_at, idx)]
        values["queued_s"] = queued
        values["in_prefill"] = _pick(prefill_n, idx)
        values["cached_tokens"] = _pick(cached, idx) if cached is not None else [0.0] * k
        work = _pick(est_work, idx) if isinstance(est_work, np.ndarray | list) else [float(est_work)] * k
        values["est_ttft_s"] = [q + w for q, w in zip(queued, work, strict=True)]
    else:
        running, pending, cached = base
        values["running"] = _pick(running, idx)
        values["pending"] = _pick(pending, idx)
        values["cached_tokens"] = _pick(cached, idx) if cached is not None else [0.0] * k
    for name, arr in features.items():
        values[name] = _pick(arr, idx)
    return Decision(
        kind,
        stage,
        policy,
        t,
        request_id=rid,
        chosen=ids[chosen],
        scorer="" if by == policy else by,
        score_name=score_name,
        names=tuple(ids[i] for i in idx),
        scores=_pick(scores, idx) if scores is not None else None,
        eligible=None if eligible is None else [bool(x) for x in _pick(eligible, idx)],
        values=values,
        info=info,
    )


@maker("handoff")
def handoff_decision(
    ids: list[str], policy: str, rid: str, chosen: int, load: Any, mask: Any, best: bool, unit: str, t: float
) -> Decision:
    """The decode choice against the load when decoding began: was it still (one of) the least loaded?"""
    m = _list(mask)
    idx = [i for i, ok in enumerate(m) if ok or i == chosen]
    return Decision(
        "handoff",
        "decode",
        policy,
        t,
        request_id=rid,
        chosen=ids[chosen],
        score_name=f"load_at_handoff_{unit}",
        names=tuple(ids[i] for i in idx),
        scores=_pick(load, idx),
        eligible=[bool(m[i]) for i in idx],
        info={"still_best": int(best)},
    )


class Explain:
    """The scratch a policy fills while it decides (one choice per stage; a later one replaces an
    earlier one of the same stage, as when a policy re-decides with a later τ)."""

    __slots__ = ("choices",)

    def __init__(self) -> None:
        self.choices: dict[str, _Choice] = {}

    def records(
        self, kind: str, policy: str, request: Request, view: ClusterView, t: float, made: dict[str, int]
    ) -> list[Record]:
        """A record per choice `made` (stage → instance index), each with every routable candidate of
        its stage and the features the view held for them: queued prefill seconds, requests in
        prefill, the prefix overlap (cached tokens) and the estimated TTFT on prefill candidates;
        running and pending requests and the prefix overlap on decode candidates. The policy's own
        scores and features (a name clash: its own win) where it noted this very choice; a choice
        it did not note (a plugin policy) has candidates and features but no scores."""
        out = []
        rid = str(request.id)
        cached = view.cached_tokens(request) if request.prefix_keys and view.prefix is not None else None
        for stage, chosen in made.items():
            c = self.choices.get(stage)
            if c is None or c.chosen != chosen:
                c = _Choice(policy, "", None, None, chosen, {}, {"note": "the policy noted no scores for this choice"})
            if stage == "prefill":
                mask = view.prefill_mask()
                base: list[np.ndarray | None] = [view.prefill_free_at.copy(), view.prefill_n.copy(), cached]
                # est_ttft_s = queued + this: the first token as projected, batched (core/prefill.py)
                uncached = request.prompt_tokens if cached is None else np.maximum(request.prompt_tokens - cached, 1.0)
                est: float | np.ndarray = view.first_token_at(uncached) - np.maximum(view.prefill_free_at, view.now)
            else:
                mask = view.decode_mask()
                base = [view.running_n.copy(), view.pending_n.copy(), cached]
                est = 0.0
            ids = view.instance_ids
            scorer = "" if c.by == policy else c.by
            head = (kind, stage, policy, t, ids[chosen], scorer, c.score_name, c.info)
            args = (kind, stage, policy, t, rid, ids, mask, c.by, c.score_name, c.scores, c.eligible, chosen)
            out.append(Record(rid, head, "choice", (*args, c.features, c.info, base, est, view.now)))
        self.choices.clear()
        return out


def note(
    view: ClusterView,
    stage: str,
    by: str,
    score_name: str,
    scores: np.ndarray | None,
    eligible: np.ndarray | None,
    chosen: int,
    info: Info | None = None,
    **features: np.ndarray,
) -> None:
    """A policy chose instance index `chosen` for `stage` ("prefill" or "decode") by `scores` (per
    instance index, lower is better) among `eligible`; `features` are more per-index arrays it read.
    The arrays are kept, not copied: pass arrays computed for this decision (not the view's own,
    which change in place). Nothing happens unless the dispatcher asked for a record (`view.explain`)."""
    ex = view.explain
    if ex is None:
        return
    ex.choices[stage] = _Choice(by, score_name, scores, eligible, int(chosen), features, info or {})


def annotate(view: ClusterView, stage: str, info: Info | None = None, **features: np.ndarray) -> None:
    """Add decision-wide facts and per-index features to the choice already noted for `stage` (a
    wrapping policy adding what it saw to the choice of the policy it wraps); nothing when no
    record is asked for or nothing was noted for `stage`."""
    ex = view.explain
    if ex is None:
        return
    c = ex.choices.get(stage)
    if c is None:
        return
    c.features.update(features)
    if info:
        c.info = {**c.info, **info}
