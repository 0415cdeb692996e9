"""The dispatcher's decision records beyond routing: late binds, handoffs, releases, ranks, retries (core/dispatch/)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from core.decision_log import PrefixHits
from core.decision_records import Decision, Record
from core.types import Assignment, Request

if TYPE_CHECKING:
    from core.policies.base import QueuePolicy
    from core.policies.rank.state import DPState
    from core.view import ClusterView

RELEASE_NEXT = 4
"""A release record lists the released request and at most this many that still wait after it."""


def made(view: ClusterView, a: Assignment) -> dict[str, int]:
    """The choices an assignment made, by stage (instance indices)."""
    out = {}
    if a.prefill is not None:
        out["prefill"] = view.index[a.prefill]
    if a.decode is not None:
        out["decode"] = view.index[a.decode]
    return out


def count_prefix_hit(hits: PrefixHits, view: ClusterView, request: Request, a: Assignment) -> None:
    """Achieved (the overlap where the prompt is computed) against achievable (the best overlap of a
    routable prefill instance, or of the decode instance serving the request alone) prefix tokens."""
    cached = view.cached_tokens(request)
    mask = view.prefill_mask()
    best = float(cached[mask].max()) if mask.any() else 0.0
    where = a.prefill if a.prefill is not None else a.decode
    got = float(cached[view.index[where]]) if where is not None else 0.0
    hits.add(int(got), int(max(best, got)))


def handoff(
    view: ClusterView,
    policy: str,
    rid: Hashable,
    chosen: int,
    load: np.ndarray,
    mask: np.ndarray,
    best: bool,
    unit: str,
) -> Record:
    """A handoff record (core.decision_records.handoff_decision), made when read; the load is copied now."""
    ids = view.instance_ids
    head = (
        "handoff",
        "decode",
        policy,
        view.now,
        ids[chosen],
        "",
        f"load_at_handoff_{unit}",
        {"still_best": int(best)},
    )
    return Record(str(rid), head, "handoff", (ids, policy, str(rid), chosen, load.copy(), mask, best, unit, view.now))


def release_records(queue: QueuePolicy, released: Sequence[Request], now: float, sampled: set[int]) -> list[Record]:
    """For each sampled released request (`sampled`: positions in `released`): who went before whom
    and why — the requests released with it and the next still held, in the queue policy's order,
    each with its wait and the policy's ordering key."""
    waiting = queue.items()[:RELEASE_NEXT]
    key = getattr(queue, "order_key", None)
    out = []
    for k in sorted(sampled):
        line = [*released[k:], *waiting][: RELEASE_NEXT + 1]
        feats: dict[str, list[float]] = {
            "waited_s": [now - r.arrival for r in line],
            "priority": [float(r.priority) for r in line],
            "arrival": [r.arrival for r in line],
        }
        if key is not None:
            for name in key(line[0]):
                feats[name] = [float(key(r)[name]) for r in line]
        out.append(
            Record.of(
                Decision.of(
                    "release",
                    "queue",
                    queue.name,
                    now,
                    request_id=str(released[k].id),
                    chosen=str(released[k].id),
                    score_name="release_order",
                    names=[str(r.id) for r in line],
                    scores=[float(i) for i in range(len(line))],
                    features=feats,
                    info={"held": len(queue) + len(released) - k, "released_together": len(released)},
                )
            )
        )
    return out


def rank_record(policy: str, rid: Hashable, instance: str, state: DPState, rank: int | None, now: float) -> Decision:
    """A rank choice on a data-parallel group: each rank's resident KV tokens, requests and slots."""
    g = len(state.loads)
    return Decision.of(
        "rank",
        "rank",
        policy,
        now,
        request_id=str(rid),
        chosen=None if rank is None else f"{instance}/rank{rank}",
        score_name="resident_kv_tokens",
        names=[f"{instance}/rank{r}" for r in range(g)],
        scores=[float(x) for x in state.loads.tolist()],
        features={
            "running": [float(x) for x in state.running.tolist()],
            "slots": [float(x) for x in state.capacity.tolist()],
        },
        info={"instance": instance},
    )


def retry_record(
    view: ClusterView, stage: str, rid: Hashable, score: np.ndarray, mask: np.ndarray, chosen: int
) -> Decision:
    """The dispatcher's own failover choice (`stage`'s least loaded instance not tried yet; for prefill, the one
    whose projected first token comes soonest)."""
    idx = np.flatnonzero(view.decode_mask() if stage == "decode" else view.prefill_mask()).tolist()
    values = score.tolist()
    return Decision.of(
        "retry",
        stage,
        "dispatcher",
        view.now,
        request_id=str(rid),
        chosen=view.instance_ids[chosen],
        score_name="requests" if stage == "decode" else "first_token_s",
        names=[view.instance_ids[i] for i in idx],
        scores=[float(values[i]) for i in idx],
        eligible=[bool(mask[i]) for i in idx],
    )
