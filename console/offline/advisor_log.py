"""What the advisor advised over a run, and each policy canary's life, read from the run store's advisor events."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

KEEP = "(keep the active policies)"
"""How an advice that names no candidate (none beat the active ones past the advisor's error) is shown."""


def advice_timeline(events: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The run's advice as spans: consecutive advice events naming the same candidate make one span
    (`from_t`, `to_t`, `advised`, how many `readings`, and the last one's `detail` and `decision`)."""
    spans: list[dict[str, Any]] = []
    for e in events:
        if e["event"] != "advice":
            continue
        advised = e.get("policy") or KEEP
        if spans and spans[-1]["advised"] == advised:
            span = spans[-1]
            span.update(to_t=e["t"], readings=span["readings"] + 1, detail=e["detail"], decision=e.get("decision"))
            continue
        spans.append(
            {
                "from_t": e["t"],
                "to_t": e["t"],
                "advised": advised,
                "kind": e.get("kind"),
                "readings": 1,
                "detail": e["detail"],
                "decision": e.get("decision"),
            }
        )
    return spans


def canary_lives(events: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One entry per canary, in the order they started: its `start`, `readings` and `end` events (None
    while none was recorded: it was running when the run's record stopped) and its `verdict`."""
    lives: dict[str, dict[str, Any]] = {}
    for e in events:
        if not e["event"].startswith("canary_"):
            continue
        key = str(e.get("canary") or "")
        life = lives.setdefault(
            key, {"canary": key, "kind": None, "policy": None, "start": None, "readings": [], "end": None}
        )
        life["kind"] = life["kind"] or e.get("kind")
        life["policy"] = life["policy"] or e.get("policy")
        if e["event"] == "canary_start":
            life["start"] = dict(e)
        elif e["event"] == "canary_reading":
            life["readings"].append(dict(e))
        else:
            life["end"] = dict(e)
    for life in lives.values():
        life["verdict"] = None if life["end"] is None else life["end"].get("decision")
    return list(lives.values())
