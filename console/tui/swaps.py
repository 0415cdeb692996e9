"""Which policy swaps the dashboard shows: every one the event stream reports, fallbacks only once."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def _key(entry: Mapping[str, Any]) -> tuple[Any, str]:
    return entry.get("new", entry.get("name")), json.dumps(entry.get("params") or {}, sort_keys=True, default=str)


class SwapTracker:
    """Remembers the policy shown for each kind so the same swap is not logged twice.

    The event stream is the source of truth. When it is down, swaps are noticed either from the
    `PUT` answer of a swap made here or from two consecutive snapshots; both report the same swap,
    so a fallback is only shown when it changes what is already known.
    """

    def __init__(self) -> None:
        self._shown: dict[str, tuple[Any, str]] = {}

    def prime(self, policies: Mapping[str, Mapping[str, Any]]) -> None:
        """The policies active when the dashboard first saw the console (not swaps)."""
        for kind, entry in policies.items():
            self._shown.setdefault(kind, _key(entry))

    def reset(self) -> None:
        self._shown.clear()

    def accept(self, event: Mapping[str, Any], *, fallback: bool = False) -> bool:
        """Whether to show this `policy` event; records it as known either way."""
        kind, key = str(event.get("kind")), _key(event)
        if fallback and self._shown.get(kind) == key:
            return False
        self._shown[kind] = key
        return True

    @staticmethod
    def between(old: Mapping[str, Any], new: Mapping[str, Any], t: float) -> list[dict[str, Any]]:
        """Swaps implied by two snapshots' `policies` (the source is unknown: "?")."""
        out = []
        for kind, entry in new.items():
            before = old.get(kind) or {}
            if before != entry:
                out.append(
                    {
                        "type": "policy",
                        "kind": kind,
                        "old": before.get("name"),
                        "new": entry.get("name"),
                        "params": entry.get("params") or {},
                        "source": "?",
                        "t": t,
                    }
                )
        return out
