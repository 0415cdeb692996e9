"""RunStore: the SQLite run store (WAL, bulk inserts) that every run of sibyl-console writes to."""

from __future__ import annotations

import json
import os
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import event, func, insert, select, text, update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DatabaseError, OperationalError
from sqlalchemy.pool import StaticPool
from sqlmodel import SQLModel, create_engine

from adapters.errors import AdapterError
from adapters.pids import pid_alive
from adapters.store.keys import pack_keys, unpack_keys
from adapters.store.paths import default_db_path
from adapters.store.schema import (
    ADVISOR_COLUMNS,
    ADVISOR_EVENTS,
    DECISION_COLUMNS,
    MIGRATIONS,
    REQUEST_COLUMNS,
    SAMPLE_COLUMNS,
    SCHEMA_VERSION,
    AdvisorEventRecord,
    DecisionRecord,
    InstanceEvent,
    InstanceSample,
    PolicyEventRecord,
    RequestRecord,
    Run,
)
from core.decision_records import from_payload

# sqlite3 binds an exact int, float, str or bytearray as it is; any other value goes through its adaptation
# protocol first, which looks `__adapt__` up on its PrepareProtocol class and raises and clears an
# AttributeError each time: for None, a bool, bytes — most of a request row's columns. An adapter registered
# for the type skips that and gives the value sqlite3 would have bound (NULL, the integer 0 or 1, the BLOB).
_NULL: dict[None, None] = {}
sqlite3.register_adapter(type(None), _NULL.get)
sqlite3.register_adapter(bool, int)
sqlite3.register_adapter(bytes, bytes)


class StoreError(AdapterError):
    """The run store cannot be opened, or a run id is unknown."""


@dataclass
class RunInfo:
    """One run as `runs list/show` present it."""

    run_id: str
    kind: str
    started_at: float
    ended_at: float | None
    status: str
    backend: str
    cluster: str
    workload: str
    policy: str
    seed: int | None
    requests: int
    parent_run_id: str | None
    config: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] | None = None
    sweep: str | None = None

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _new_run_id() -> str:
    return time.strftime("r-%Y%m%d-%H%M%S-", time.gmtime()) + secrets.token_hex(2)


SQLITE_INT = (-(2**63), 2**63 - 1)


def _storable(value: Any) -> Any:
    """An int outside SQLite's 64-bit range becomes None; anything else is kept."""
    if type(value) is int and not SQLITE_INT[0] <= value <= SQLITE_INT[1]:
        return None
    return value


def _packed(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Request rows with their prefix keys packed into the stored BLOB (rows without keys as they are)."""
    return [r if r.get("prefix_keys") is None else {**r, "prefix_keys": pack_keys(r["prefix_keys"])} for r in rows]


def advisor_row(
    *,
    t: float,
    event: str,
    canary: str | None = None,
    kind: str | None = None,
    policy: str | None = None,
    decision: str | None = None,
    detail: str = "",
    data: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One row of the advisor_events table; an unknown `event` is a ValueError (events: ADVISOR_EVENTS)."""
    if event not in ADVISOR_EVENTS:
        raise ValueError(f"unknown advisor event {event!r}; events: {', '.join(ADVISOR_EVENTS)}")
    return {
        "t": t,
        "event": event,
        "canary": canary,
        "kind": kind,
        "policy": policy,
        "decision": decision,
        "detail": detail,
        "data": json.dumps(data or {}, default=str),
    }


class RunStore:
    """One SQLite file; thread-safe (one connection, one lock)."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = (
            Path(path) if path not in (None, ":memory:") else (default_db_path() if path is None else Path(":memory:"))
        )
        memory = str(self.path) == ":memory:"
        if not memory:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise StoreError(
                    f"cannot create the run store's folder {self.path.parent}: {e.strerror}; pass --db PATH"
                ) from None
        url = "sqlite://" if memory else f"sqlite:///{self.path}"
        self._lock = threading.RLock()
        self.engine: Engine = create_engine(
            url, connect_args={"check_same_thread": False, "timeout": 30}, poolclass=StaticPool
        )

        @event.listens_for(self.engine, "connect")
        def _pragmas(dbapi_conn: Any, _: Any) -> None:
            cur = dbapi_conn.cursor()
            if not memory:
                cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()

        try:
            with self._lock, self.engine.begin() as conn:
                version = conn.execute(text("PRAGMA user_version")).scalar() or 0
                if version > SCHEMA_VERSION:
                    raise StoreError(
                        f"{self.path}: schema version {version} is newer "
                        f"than this sibyl-console ({SCHEMA_VERSION}); upgrade"
                    )
                if version and conn.execute(text("SELECT name FROM sqlite_master WHERE name = 'requests'")).first():
                    tables = {n for (n,) in conn.execute(text("SELECT name FROM sqlite_master WHERE type = 'table'"))}
                    for v in range(version + 1, SCHEMA_VERSION + 1):
                        for statement in MIGRATIONS.get(v, []):
                            altered = statement.split()[2] if statement.startswith("ALTER TABLE") else None
                            if altered is None or altered in tables:  # a table it lacks, create_all makes whole
                                conn.execute(text(statement))
                SQLModel.metadata.create_all(conn)
                conn.execute(text(f"PRAGMA user_version = {SCHEMA_VERSION}"))
        except (DatabaseError, OperationalError) as e:
            raise StoreError(
                f"{self.path}: not a usable SQLite run store ({e.orig}); move it away or pass --db PATH"
            ) from None

    # --- runs -----------------------------------------------------------------------------------
    def create_run(
        self,
        *,
        kind: str,
        backend: str,
        cluster: str = "",
        workload: str = "",
        seed: int | None = None,
        policy: str = "",
        config: dict[str, Any] | None = None,
        parent_run_id: str | None = None,
        sweep: str | None = None,
    ) -> str:
        run_id = _new_run_id()
        row = dict(
            run_id=run_id,
            kind=kind,
            started_at=time.time(),
            status="running",
            backend=backend,
            cluster=cluster,
            workload=workload,
            seed=seed,
            policy=policy,
            config=json.dumps(config or {}, default=str),
            pid=os.getpid(),
            parent_run_id=parent_run_id,
            notes="",
            sweep=sweep,
        )
        with self._lock, self.engine.begin() as conn:
            conn.execute(insert(Run), [row])
        return run_id

    def finish_run(self, run_id: str, status: str = "completed", summary: dict[str, Any] | None = None) -> None:
        values: dict[str, Any] = {"status": status, "ended_at": time.time()}
        if summary is not None:
            values["summary"] = json.dumps(summary, default=str)
        with self._lock, self.engine.begin() as conn:
            conn.execute(update(Run).where(Run.run_id == run_id).values(**values))  # type: ignore[arg-type]

    def mark_interrupted_runs(self) -> list[str]:
        """Runs left "running" by a process that is gone become "interrupted"."""
        with self._lock, self.engine.begin() as conn:
            rows = conn.execute(select(Run).where(Run.status == "running")).all()  # type: ignore[arg-type]
            dead = [r.run_id for r in rows if not pid_alive(r.pid)]
            if dead:
                conn.execute(update(Run).where(Run.run_id.in_(dead)).values(status="interrupted"))  # type: ignore[attr-defined]
        return dead

    # --- records ----------------------------------------------------------------------------------
    @staticmethod
    def _bulk(conn: Any, table: str, columns: list[str], run_id: str, rows: list[dict[str, Any]]) -> None:
        """executemany with positional tuples: several times faster than ORM/Core dict inserts.
        An integer SQLite cannot hold (a client's absurd max_tokens, say) is stored as NULL."""
        sql = f"INSERT INTO {table} (run_id, {', '.join(columns)}) VALUES ({', '.join('?' * (len(columns) + 1))})"
        values = [(run_id, *map(r.get, columns)) for r in rows]
        try:
            conn.exec_driver_sql(sql, values)
        except OverflowError:
            conn.exec_driver_sql(sql, [tuple(_storable(v) for v in row) for row in values])

    def add_requests(self, run_id: str, rows: list[dict[str, Any]]) -> None:
        """Request rows, one key per column (RequestRecord's; a missing key is NULL). `prefix_keys` is a
        sequence of ints (or None); model, lora, arm and session are strings (or None)."""
        if not rows:
            return
        with self._lock, self.engine.begin() as conn:
            self._bulk(conn, "requests", REQUEST_COLUMNS, run_id, _packed(rows))

    def add_policy_event(
        self,
        run_id: str,
        *,
        t: float,
        kind: str,
        old: str | None,
        new: str,
        params: dict[str, Any],
        source: str,
        pool: str | None = None,
    ) -> None:
        """A policy became active (in pool `pool`; None: a run without pools, such as a simulation)."""
        row = dict(
            run_id=run_id,
            t=t,
            kind=kind,
            old=old,
            new=new,
            params=json.dumps(params, default=str),
            source=source,
            pool=pool,
        )
        with self._lock, self.engine.begin() as conn:
            conn.execute(insert(PolicyEventRecord), [row])

    def add_instance_samples(self, run_id: str, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        with self._lock, self.engine.begin() as conn:
            self._bulk(conn, "instance_samples", SAMPLE_COLUMNS, run_id, rows)

    def add_instance_event(self, run_id: str, *, t: float, instance_id: str, event: str, detail: str = "") -> None:
        row = dict(run_id=run_id, t=t, instance_id=instance_id, event=event, detail=detail)
        with self._lock, self.engine.begin() as conn:
            conn.execute(insert(InstanceEvent), [row])

    def add_advisor_event(
        self,
        run_id: str,
        *,
        t: float,
        event: str,
        canary: str | None = None,
        kind: str | None = None,
        policy: str | None = None,
        decision: str | None = None,
        detail: str = "",
        data: dict[str, Any] | None = None,
    ) -> None:
        """One advice or canary event (see `advisor_row` and the advisor_events table in schema.py)."""
        row = advisor_row(
            t=t, event=event, canary=canary, kind=kind, policy=policy, decision=decision, detail=detail, data=data
        )
        with self._lock, self.engine.begin() as conn:
            self._bulk(conn, "advisor_events", ADVISOR_COLUMNS, run_id, [row])

    def add_decisions(self, run_id: str, rows: list[dict[str, Any]]) -> None:
        """Decision records as `decision_row` makes them."""
        if not rows:
            return
        with self._lock, self.engine.begin() as conn:
            self._bulk(conn, "decisions", DECISION_COLUMNS, run_id, rows)

    def write_batch(
        self,
        run_id: str,
        requests: list[dict[str, Any]],
        samples: list[dict[str, Any]],
        policy_events: list[dict[str, Any]],
        instance_events: list[dict[str, Any]],
        decisions: list[dict[str, Any]] | None = None,
        advisor_events: list[dict[str, Any]] | None = None,
    ) -> None:
        """Everything a recorder buffered, in one transaction (advisor events as `advisor_row` makes them)."""
        with self._lock, self.engine.begin() as conn:
            if decisions:
                self._bulk(conn, "decisions", DECISION_COLUMNS, run_id, decisions)
            if requests:
                self._bulk(conn, "requests", REQUEST_COLUMNS, run_id, _packed(requests))
            if advisor_events:
                self._bulk(conn, "advisor_events", ADVISOR_COLUMNS, run_id, advisor_events)
            if samples:
                self._bulk(conn, "instance_samples", SAMPLE_COLUMNS, run_id, samples)
            if policy_events:
                rows = [
                    {"run_id": run_id, "pool": None, **e, "params": json.dumps(e.get("params") or {}, default=str)}
                    for e in policy_events
                ]
                conn.execute(insert(PolicyEventRecord), rows)
            if instance_events:
                conn.execute(insert(InstanceEvent), [{"run_id": run_id, **e} for e in instance_events])

    # --- reading -----------------------------------------------------------------------------------
    def _info(self, run: Any, count: int) -> RunInfo:
        return RunInfo(
            run_id=run.run_id,
            kind=run.kind,
            started_at=run.started_at,
            ended_at=run.ended_at,
            status=run.status,
            backend=run.backend,
            cluster=run.cluster,
            workload=run.workload,
            policy=run.policy,
            seed=run.seed,
            requests=count,
            parent_run_id=run.parent_run_id,
            config=json.loads(run.config or "{}"),
            summary=json.loads(run.summary) if run.summary else None,
            sweep=run.sweep,
        )

    def _counts(self, conn: Any, ids: list[str]) -> dict[str, int]:
        col = RequestRecord.__table__.c.run_id  # type: ignore[attr-defined]
        q = select(col, func.count()).where(col.in_(ids)).group_by(col)
        return {r[0]: r[1] for r in conn.execute(q).all()}

    def list_runs(self, limit: int | None = None) -> list[RunInfo]:
        """Newest first."""
        with self._lock, self.engine.connect() as conn:
            q = select(Run).order_by(Run.started_at.desc())  # type: ignore[attr-defined]
            if limit:
                q = q.limit(limit)
            runs = conn.execute(q).all()
            counts = self._counts(conn, [r.run_id for r in runs])
        return [self._info(r, counts.get(r.run_id, 0)) for r in runs]

    def sweep_runs(self, sweep: str) -> list[RunInfo]:
        """Every run tagged with one sweep's name, oldest first."""
        with self._lock, self.engine.connect() as conn:
            tagged = Run.__table__.c.sweep == sweep  # type: ignore[attr-defined]
            runs = conn.execute(select(Run).where(tagged).order_by(Run.started_at)).all()  # type: ignore[arg-type]
            col = RequestRecord.__table__.c.run_id  # type: ignore[attr-defined]
            ids = select(Run.__table__.c.run_id).where(tagged)  # type: ignore[attr-defined]
            counts = {
                r[0]: r[1] for r in conn.execute(select(col, func.count()).where(col.in_(ids)).group_by(col)).all()
            }
        return [self._info(r, counts.get(r.run_id, 0)) for r in runs]

    def get_run(self, run_id: str) -> RunInfo:
        """By id or unique prefix; an unknown id is an error listing recent runs."""
        with self._lock, self.engine.connect() as conn:
            col = Run.__table__.c.run_id  # type: ignore[attr-defined]
            runs = conn.execute(select(Run).where(col.startswith(run_id))).all()
            exact = [r for r in runs if r.run_id == run_id]
            if exact:
                runs = exact
            if len(runs) == 1:
                return self._info(runs[0], self._counts(conn, [runs[0].run_id]).get(runs[0].run_id, 0))
        if len(runs) > 1:
            raise StoreError(f"run id prefix {run_id!r} is ambiguous: {', '.join(r.run_id for r in runs[:5])}")
        recent = ", ".join(r.run_id for r in self.list_runs(5)) or "none yet"
        raise StoreError(f"unknown run {run_id!r} in {self.path}; recent runs: {recent}")

    def _rows(self, table: Any, run_id: str, order: Any) -> list[dict[str, Any]]:
        with self._lock, self.engine.connect() as conn:
            result = conn.execute(select(table).where(table.__table__.c.run_id == run_id).order_by(order))
            return [dict(r._mapping) for r in result]

    def requests(self, run_id: str) -> list[dict[str, Any]]:
        """A run's request rows in the order they were written; prefix_keys as a tuple of ints (or None)."""
        rows = self._rows(RequestRecord, run_id, RequestRecord.id)
        for r in rows:
            if r["prefix_keys"] is not None:
                r["prefix_keys"] = unpack_keys(r["prefix_keys"])
        return rows

    def advisor_events(self, run_id: str, event: str | None = None) -> list[dict[str, Any]]:
        """A run's advice and canary events (those of one kind, with `event`), oldest first, data JSON decoded."""
        table = AdvisorEventRecord.__table__  # type: ignore[attr-defined]
        q = select(table).where(table.c.run_id == run_id)
        if event is not None:
            q = q.where(table.c.event == event)
        with self._lock, self.engine.connect() as conn:
            rows = [dict(r._mapping) for r in conn.execute(q.order_by(table.c.id))]
        for r in rows:
            r["data"] = json.loads(r["data"] or "{}")
        return rows

    def policy_events(self, run_id: str) -> list[dict[str, Any]]:
        """A run's policy events, oldest first, params JSON decoded; `pool` names the pool (None: not recorded)."""
        rows = self._rows(PolicyEventRecord, run_id, PolicyEventRecord.id)
        for r in rows:
            r["params"] = json.loads(r["params"] or "{}")
        return rows

    def instance_samples(self, run_id: str) -> list[dict[str, Any]]:
        return self._rows(InstanceSample, run_id, InstanceSample.id)

    def instance_events(self, run_id: str) -> list[dict[str, Any]]:
        return self._rows(InstanceEvent, run_id, InstanceEvent.id)

    def decisions(self, run_id: str, request_id: str | None = None) -> list[dict[str, Any]]:
        """A run's decision records (one request's, with `request_id`), oldest first, JSON decoded."""
        table = DecisionRecord.__table__  # type: ignore[attr-defined]
        q = select(table).where(table.c.run_id == run_id)
        if request_id is not None:
            q = q.where(table.c.request_id == request_id)
        with self._lock, self.engine.connect() as conn:
            rows = [dict(r._mapping) for r in conn.execute(q.order_by(table.c.id))]
        out = []
        for r in rows:
            info = json.loads(r["info"] or "{}")
            head = (r["kind"], r["stage"], r["policy"], r["t"], r["chosen"], r["scorer"], r["score_name"], info)
            d = from_payload(head, r["request_id"], json.loads(r["candidates"] or "{}"))
            out.append({**r, "info": info, "margin": d.margin, "ties": d.ties, "candidates": d.candidates()})
        return out

    def decision_count(self, run_id: str) -> int:
        """How many decision records a run has."""
        col = DecisionRecord.__table__.c.run_id  # type: ignore[attr-defined]
        with self._lock, self.engine.connect() as conn:
            return int(conn.execute(select(func.count()).where(col == run_id)).scalar() or 0)

    def close(self) -> None:
        self.engine.dispose()
