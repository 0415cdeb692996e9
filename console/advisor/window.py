"""A run's recent window as the simulator takes it: the arrivals recorded in it, those in flight at its start and at
its end, and the active policies' observed figures over it.

What the run store keeps of each request is its lengths, SLO class, priority, tenant and timings. It
does not keep a request's prefix keys or session: the live server notes those in a `RecentArrivals`
as the gateway computes them, and passes it here; without it the window has no prefix structure
(the simulation then models no cache, and prefix-aware policies tie with load-based ones).

The store holds a request once it has finished, so a window read from it has the requests that
arrived in it *and finished* by its end; the requests in flight at its start are replayed from their
own arrival (unmeasured) so the simulated cluster starts the window as loaded as the live one was.
The requests still in flight at its end are not in the store: the live server passes them (`in_flight`,
from the gateway's own records) and they are replayed too, unmeasured, with an estimated output length
(`estimated_outputs`), so the simulated cluster carries the load the live one carried to the window's end.
The figures, observed and predicted, are over the window's finished arrivals only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from adapters.store import RunStore, StoreError
from console.advisor.figures import Figures, observed_figures
from console.advisor.pools import RecordedPool, on_pool, recorded_pools
from console.errors import ConsoleError
from core.slo import DEFAULT_SLO, SLOClass

DEFAULT_WINDOW_S = 300.0
"""The advisor's default window: the last five minutes of arrivals."""
ADVISED_KINDS = ("routing", "queue")
"""The policy kinds the advisor re-simulates (and whose swaps inside a window make its observed figures mixed)."""

PolicySetting = tuple[str, dict[str, Any]]


class WindowError(ConsoleError):
    """A window that cannot be taken (no run, no arrivals in it, a bad length)."""


@dataclass(frozen=True, slots=True)
class ArrivalKeys:
    """What the gateway knew of a request at arrival that the run store does not keep."""

    prefix_keys: tuple[int, ...]
    session: str = ""
    max_tokens_set: bool = True
    """Whether the client set max_tokens (else the gateway's default stood in for it)."""


class RecentArrivals:
    """The prefix keys and session of the latest `capacity` arrivals, by request id (oldest forgotten
    first). The live server calls `note` once per request as it keys it; the advisor reads it."""

    def __init__(self, capacity: int = 100_000) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._keys: OrderedDict[str, ArrivalKeys] = OrderedDict()

    def note(
        self, request_id: str, prefix_keys: Sequence[int], session: str = "", max_tokens_set: bool = True
    ) -> None:
        self._keys[str(request_id)] = ArrivalKeys(tuple(prefix_keys), session, max_tokens_set)
        self._keys.move_to_end(str(request_id))
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def get(self, request_id: str) -> ArrivalKeys | None:
        return self._keys.get(str(request_id))

    def subset(self, request_ids: Iterable[str]) -> RecentArrivals:
        """A copy holding only these requests' keys (to read in another thread while notes go on here)."""
        out = RecentArrivals(self.capacity)
        for rid in request_ids:
            found = self._keys.get(str(rid))
            if found is not None:
                out._keys[str(rid)] = found
        return out

    def __len__(self) -> int:
        return len(self._keys)


@dataclass(frozen=True)
class Window:
    """The simulator's input for one window, and what the live cluster did over it.

    Rows are sorted by arrival; `arrivals` are seconds from the first replayed arrival (an in-flight
    request's, when there is one). `measured` marks the window's own finished arrivals: the figures,
    observed and predicted, are over those only."""

    run_id: str
    start: float
    """Window start, seconds since the console started (the store's clock)."""
    end: float
    request_ids: list[str]
    arrivals: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    """Tokens each request generated (its max_tokens when it did not finish: refused or failed; an estimate
    for one still in flight at the window's end, see `estimated_outputs`)."""
    measured: np.ndarray
    slo_classes: list[str]
    tenants: list[str]
    priorities: np.ndarray
    slos: dict[str, SLOClass]
    active: dict[str, PolicySetting]
    """The routing and queue policies in force at the window's end (kind → (name, params))."""
    observed: Figures
    swapped: bool = False
    """A routing or queue policy changed inside the window: the observed figures mix two policies."""
    cluster: str = ""
    """The run's recorded shape ("2P4D")."""
    sessions: list[str] | None = None
    prefix_keys: list[tuple[int, ...]] | None = None
    notes: list[str] = field(default_factory=list)
    unfinished: np.ndarray | None = None
    """Marks the requests still in flight at the window's end (arrived in it or before it), replayed unmeasured
    with an estimated output; None: none were passed."""
    start_at: float = 0.0
    """The window's start on `arrivals`' clock: rows that arrived before it were in flight at its start."""

    @property
    def in_flight(self) -> int:
        """Requests in flight at the window's start (finished since or not), replayed unmeasured."""
        return int((self.arrivals < self.start_at).sum())

    @property
    def in_flight_at_end(self) -> int:
        """Requests in flight at the window's end (arrived in it or before it), replayed unmeasured."""
        return 0 if self.unfinished is None else int(self.unfinished.sum())

    def summary(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "start": self.start,
            "end": self.end,
            "requests": int(self.measured.sum()),
            "in_flight_at_start": self.in_flight,
            "in_flight_at_end": self.in_flight_at_end,
            "with_prefix_keys": self.prefix_keys is not None,
            "with_sessions": self.sessions is not None,
            "active": {k: {"name": n, "params": p} for k, (n, p) in self.active.items()},
            "swapped": self.swapped,
            "notes": list(self.notes),
        }


def _output_tokens(row: Mapping[str, Any]) -> int:
    if row["status"] == "ok" and row.get("output_tokens"):
        return int(row["output_tokens"])
    return int(row.get("max_tokens") or row.get("output_tokens") or 1)


def estimated_outputs(
    in_flight: Sequence[Mapping[str, Any]], finished: Sequence[Mapping[str, Any]]
) -> tuple[list[int], int | None]:
    """The output length each request still in flight is replayed with, and the window's mean output.

    A request whose client set max_tokens (`max_tokens_set`; a row that does not say counts as set) is
    replayed with its max_tokens, the bound it may run to (what the simulator takes as the true length;
    a client's generous bound over-estimates). One whose client did not set it (the gateway's default of
    16 stood in) is replayed with the mean output of the window's requests that finished ok (`finished`):
    the mean keeps the window's decode work. With none finished ok it keeps its max_tokens. Never fewer
    than the tokens it has generated so far (`output_tokens`), nor than one. The mean is None when nothing
    finished ok."""
    outputs = [int(r.get("output_tokens") or 0) for r in finished if r.get("status") == "ok"]
    outputs = [n for n in outputs if n > 0]
    mean = max(round(sum(outputs) / len(outputs)), 1) if outputs else None
    lengths = []
    for r in in_flight:
        bound = int(r.get("max_tokens") or 1)
        guess = bound if r.get("max_tokens_set", True) or mean is None else mean
        lengths.append(max(guess, int(r.get("output_tokens") or 0), 1))
    return lengths, mean


def _in_flight_note(running: Sequence[Mapping[str, Any]], mean: int | None) -> str:
    bound = sum(1 for r in running if r.get("max_tokens_set", True) or mean is None)
    guessed = len(running) - bound
    parts = [f"{bound} with their max_tokens"] if bound else []
    if guessed:
        parts.append(f"{guessed} with the window's mean output ({mean} tokens: their clients set no max_tokens)")
    return f"{len(running)} requests in flight at the window's end are replayed unmeasured, " + " and ".join(parts)


def window_from_rows(
    rows: Sequence[Mapping[str, Any]],
    *,
    run_id: str,
    end: float,
    window_s: float = DEFAULT_WINDOW_S,
    active: Mapping[str, PolicySetting],
    slos: Mapping[str, SLOClass] | None = None,
    keys: RecentArrivals | None = None,
    swapped: bool = False,
    cluster: str = "",
    in_flight: Sequence[Mapping[str, Any]] = (),
) -> Window:
    """The window [end − window_s, end] of a run's request rows (the run store's columns).

    `in_flight`: the requests in flight at `end` (the gateway's; the store has none of them), in the
    store's columns as known at arrival (request_id, arrival, prompt_tokens, max_tokens, slo_class,
    priority, tenant, prefix_keys, session) with `output_tokens` generated so far and `max_tokens_set`;
    a row the store already holds as finished is left out. Those that arrived by `end` are replayed
    unmeasured with `estimated_outputs`; they count in the simulated load, not in the figures."""
    if not window_s > 0:
        raise WindowError(f"window_s must be > 0, got {window_s}")
    start = end - window_s
    timed = [r for r in rows if r.get("arrival") is not None]
    finished_ids = {str(r["request_id"]) for r in timed}
    running = [
        r
        for r in in_flight
        if r.get("arrival") is not None and r["arrival"] <= end and str(r["request_id"]) not in finished_ids
    ]
    measured_rows = [r for r in timed if start <= r["arrival"] <= end]
    if not measured_rows:
        still = sum(1 for r in running if r["arrival"] >= start)
        raise WindowError(
            f"run {run_id} has no recorded arrivals in [{start:.1f}, {end:.1f}] s"
            + (f" ({still} arrived in it and are still in flight)" if still else "")
        )
    early = [r for r in timed if r["arrival"] < start and (r.get("finish") is None or r["finish"] > start)]
    lengths, mean_output = estimated_outputs(running, measured_rows)
    tagged: list[tuple[Mapping[str, Any], int | None]] = [(r, None) for r in (*early, *measured_rows)]
    tagged += list(zip(running, lengths, strict=True))
    tagged.sort(key=lambda t: (t[0]["arrival"], str(t[0]["request_id"])))
    chosen = [r for r, _ in tagged]
    ids = [str(r["request_id"]) for r in chosen]
    if keys is None and any(r.get("prefix_keys") or r.get("session") for r in chosen):
        keys = RecentArrivals(len(chosen))  # the run store kept them (schema 9)
        for r in chosen:
            keys.note(str(r["request_id"]), r.get("prefix_keys") or (), r.get("session") or "")
    t0 = float(chosen[0]["arrival"])
    found = [keys.get(i) for i in ids] if keys is not None else []
    with_keys = any(k is not None and k.prefix_keys for k in found)
    with_sessions = any(k is not None and k.session for k in found)
    notes = []
    if keys is not None and found and not all(k is not None for k in found):
        missing = sum(k is None for k in found)
        notes.append(f"{missing} of {len(found)} requests had no prefix keys noted (forgotten or never keyed)")
    if running:
        notes.append(_in_flight_note(running, mean_output))
    return Window(
        run_id=run_id,
        start=start,
        end=end,
        request_ids=ids,
        arrivals=np.array([float(r["arrival"]) - t0 for r in chosen]),
        prompt_tokens=np.array([max(int(r.get("prompt_tokens") or 1), 1) for r in chosen], dtype=np.int64),
        output_tokens=np.array(
            [max(_output_tokens(r), 1) if n is None else n for r, n in tagged], dtype=np.int64
        ),
        measured=np.array([n is None and start <= r["arrival"] for r, n in tagged], dtype=bool),
        slo_classes=[str(r.get("slo_class") or "default") for r in chosen],
        tenants=[str(r.get("tenant") or "default") for r in chosen],
        priorities=np.array([int(r.get("priority") or 0) for r in chosen], dtype=np.int64),
        slos={"default": DEFAULT_SLO, **dict(slos or {})},
        active=dict(active),
        observed=observed_figures(measured_rows),
        swapped=swapped,
        cluster=cluster,
        sessions=[k.session if k is not None and k.session else i for k, i in zip(found, ids, strict=True)]
        if with_sessions
        else None,
        prefix_keys=[k.prefix_keys if k is not None else () for k in found] if with_keys else None,
        notes=notes,
        unfinished=np.array([n is not None for _, n in tagged], dtype=bool),
        start_at=start - t0,
    )


def active_policies(
    events: Sequence[Mapping[str, Any]],
    config: Mapping[str, Any],
    policy: str,
    at: float,
    pool: str | None = None,
) -> tuple[dict[str, PolicySetting], list[float]]:
    """The routing and queue policies in force at `at` (the last policy event of each kind by then, else
    the run's configuration), and the times of every swap of those kinds. With several pools, pool `pool`'s
    (None: the first pool's, the pool of the first event naming one); events stored before pools were
    recorded name none and count."""
    first_pool = pool if pool is not None else next((ev["pool"] for ev in events if ev.get("pool")), None)
    queue = config.get("queue") or {}
    active: dict[str, PolicySetting] = {
        "routing": (policy or str(config.get("policy") or "round_robin"), dict(config.get("params") or {})),
        "queue": (str(queue.get("name") or "fcfs"), dict(queue.get("params") or {})),
    }
    swaps = []
    for ev in sorted(events, key=lambda e: float(e["t"])):
        if ev["kind"] not in ADVISED_KINDS or float(ev["t"]) > at or ev.get("pool") not in (None, first_pool):
            continue
        if ev.get("source") != "config":
            swaps.append(float(ev["t"]))
        active[ev["kind"]] = (str(ev["new"]), dict(ev.get("params") or {}))
    return active, swaps


def _pool_of(run_id: str, pools: Sequence[RecordedPool], pool: str | None) -> RecordedPool | None:
    """The recorded pool named `pool` (None: the first; None too when the run recorded none and none is named)."""
    if pool is None:
        return pools[0] if pools else None
    found = next((p for p in pools if p.name == pool), None)
    if found is None:
        known = f"pools: {', '.join(p.name for p in pools)}" if pools else "it recorded no pools"
        raise WindowError(f"run {run_id} has no pool {pool!r}; {known}")
    return found


def window_from_store(
    store: RunStore,
    run_id: str,
    window_s: float = DEFAULT_WINDOW_S,
    *,
    end: float | None = None,
    keys: RecentArrivals | None = None,
    pool: str | None = None,
) -> Window:
    """The window [end − window_s, end] of a run in the store (`end`: default the pool's last recorded
    arrival or finish), with the policies, SLO classes and shape the run recorded.

    With several pools it is one pool's, as the live advisor's is (`pool`: its name; None: the first pool):
    only its requests (`on_pool`: those of its model), its configured shape and its policies; a name the run
    has no pool of is a WindowError naming the run's pools."""
    try:
        info = store.get_run(run_id)
    except StoreError as e:
        raise WindowError(str(e)) from None
    advised = _pool_of(info.run_id, recorded_pools(info.config), pool)
    model = None if advised is None else advised.model
    rows = [r for r in store.requests(info.run_id) if on_pool(r.get("model"), model)]
    if end is None:
        times = [t for r in rows for t in (r.get("finish"), r.get("arrival")) if t is not None]
        if not times:
            on = "" if advised is None or model is None else f" on pool {advised.name}"
            raise WindowError(f"run {info.run_id} has no recorded requests{on}")
        end = max(times)
    slos = {
        str(name): SLOClass.model_validate({"name": name, **dict(v)}) if isinstance(v, Mapping) else v
        for name, v in dict(info.config.get("slo") or {}).items()
    }
    events = store.policy_events(info.run_id)
    active, swaps = active_policies(events, info.config, info.policy, end, None if advised is None else advised.name)
    return window_from_rows(
        rows,
        run_id=info.run_id,
        end=end,
        window_s=window_s,
        active=active,
        slos=slos,
        keys=keys,
        swapped=any(end - window_s < t <= end for t in swaps),
        cluster=advised.shape if advised is not None and advised.shape is not None else info.cluster,
    )
