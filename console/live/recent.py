"""The request inspector's answers: recent finished requests per instance, a request's records still in memory."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from console.live.record import RequestRecord, RequestRow
    from core.decision_log import DecisionLog

RECENT_REQUESTS = 1000
"""Finished requests the inspector can still list (their stored rows, newest last)."""


class RecentRequests:
    """A RunLog in front of the run's recorder that keeps the last finished requests' stored rows (the
    inspector lists them); each request's typed row becomes the store's dict here, and only here."""

    def __init__(self, log: Any, keep: int = RECENT_REQUESTS) -> None:
        self._log = log
        self.rows: deque[dict[str, Any]] = deque(maxlen=keep)

    def request(self, row: RequestRow) -> None:
        stored = row.stored()
        self.rows.append(stored)
        self._log.request(stored)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._log, name)


def _live_row(live: RequestRecord, rel: Any) -> dict[str, Any]:
    return {
        "request_id": live.id,
        "status": "in_flight",
        "step": live.step.value,
        "arrival": rel(live.request.arrival),
        "prompt_tokens": live.request.prompt_tokens,
        "output_tokens": live.output_tokens,
        "prefill_instance": live.prefill_instance,
        "decode_instance": live.decode_instance,
    }


_ROW_KEYS = ("request_id", "status", "arrival", "prompt_tokens", "output_tokens", "prefill_instance")


def instance_requests(
    instance: str,
    live: Mapping[str, RequestRecord],
    recent: RecentRequests,
    log: DecisionLog | None,
    rel: Any,
    limit: int,
) -> list[dict[str, Any]]:
    """The instance's requests, newest first: those in flight on it, then those that finished there
    (as prefill or decode instance), each marked with whether its decisions are in memory."""
    on = [_live_row(r, rel) for r in live.values() if instance in (r.prefill_instance, r.decode_instance)]
    on.sort(key=lambda r: -(r["arrival"] or 0.0))
    done: list[dict[str, Any]] = []
    for row in reversed(recent.rows):
        if len(on) + len(done) >= limit:
            break
        if instance in (row.get("prefill_instance"), row.get("decode_instance")):
            done.append(
                {
                    **{k: row.get(k) for k in _ROW_KEYS},
                    "step": "finished" if row.get("status") == "ok" else "failed",
                    "decode_instance": row.get("decode_instance"),
                    "ttft": row.get("ttft"),
                    "e2e": row.get("e2e"),
                }
            )
    out = (on + done)[:limit]
    ids = {d.request_id for d in log.ring} if log is not None else set()
    for r in out:
        r["decisions"] = r["request_id"] in ids
    return out


def request_decisions(request_id: str, log: DecisionLog | None, t0: float) -> dict[str, Any]:
    """A request's records still in memory (times relative to the console's start)."""
    records = log.of_request(request_id) if log is not None else []
    out = []
    for d in records:
        js = d.to_json()
        js["t"] = d.t - t0
        out.append(js)
    note = ""
    if not out:
        if log is None:
            note = "decision records are off ([decisions] sample_rate = 0)"
        else:
            note = (
                f"no decisions of {request_id} in memory: not sampled (sample_rate {log.sample_rate}, at most "
                f"{log.max_per_s} requests/s), or older than the {log.ring.maxlen} latest records; "
                "`sibyl-console runs why` reads the run store"
            )
    return {"request_id": request_id, "decisions": out, "note": note}
