"""New requests routed on a hand-built dispatcher, and the decode instance each one gets (the routing-policy tests)."""

from __future__ import annotations

import itertools

from core.dispatch import Dispatcher
from core.types import Request

_ids = itertools.count()


def route_n(d: Dispatcher, n: int = 1, prompt: int = 10, now: float = 0.0) -> list[str | None]:
    """The decode instance of each of `n` new requests, routed one after the other at `now`."""
    return [d.route(Request(f"new{next(_ids)}", now, prompt, 100), now).decode for _ in range(n)]


def route_one(d: Dispatcher, prompt: int = 10, out: int = 100, now: float = 0.0) -> str:
    """The decode instance of one new request of `prompt` tokens that will generate `out`."""
    a = d.route(Request(f"new{next(_ids)}", now, prompt, out), now)
    assert a.decode is not None
    return a.decode
