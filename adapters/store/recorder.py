"""RunRecorder: buffers a live run's records and flushes them from a background thread."""

from __future__ import annotations

import logging
import threading
from typing import Any

import orjson

from adapters.store.store import RunStore, advisor_row
from core.decision_records import Record

log = logging.getLogger(__name__)


class RunRecorder:
    """Thread-safe buffers, written every `flush_interval_s` and on close (a kill -9 loses ≤ 1 s)."""

    def __init__(self, store: RunStore, run_id: str, flush_interval_s: float = 0.5) -> None:
        self.store = store
        self.run_id = run_id
        self.flush_interval_s = flush_interval_s
        self._lock = threading.Lock()
        self._requests: list[dict[str, Any]] = []
        self._samples: list[dict[str, Any]] = []
        self._policy: list[dict[str, Any]] = []
        self._instance: list[dict[str, Any]] = []
        self._advisor: list[dict[str, Any]] = []
        self._decisions: list[tuple[list[Record], float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"recorder-{run_id}", daemon=True)
        self._thread.start()
        self.closed = False

    def request(self, row: dict[str, Any]) -> None:
        """One finished request: a key per column of RunStore.add_requests (model, lora, arm, session and
        prefix_keys among them; a missing key is NULL)."""
        with self._lock:
            self._requests.append(row)

    def sample(self, row: dict[str, Any]) -> None:
        with self._lock:
            self._samples.append(row)

    def policy_event(
        self,
        *,
        t: float,
        kind: str,
        old: str | None,
        new: str,
        params: dict[str, Any],
        source: str,
        pool: str | None = None,
    ) -> None:
        """A policy became active in pool `pool` (None: a run without pools)."""
        row = {"t": t, "kind": kind, "old": old, "new": new, "params": params, "source": source, "pool": pool}
        with self._lock:
            self._policy.append(row)

    def instance_event(self, *, t: float, instance_id: str, event: str, detail: str = "") -> None:
        with self._lock:
            self._instance.append({"t": t, "instance_id": instance_id, "event": event, "detail": detail})

    def advisor_event(
        self,
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
        """An advice (event="advice") or a canary's canary_start, canary_reading or canary_end; `data` is the
        advice, plan or reading as JSON. An unknown event is a ValueError here, at the caller."""
        row = advisor_row(
            t=t, event=event, canary=canary, kind=kind, policy=policy, decision=decision, detail=detail, data=data
        )
        with self._lock:
            self._advisor.append(row)

    def decisions(self, records: list[Record], t0: float = 0.0) -> None:
        """Decision records; stored with their time minus `t0` (turned into rows by the flusher thread)."""
        with self._lock:
            self._decisions.append((records, t0))

    def flush(self) -> None:
        with self._lock:
            requests, samples, policy, instance = self._requests, self._samples, self._policy, self._instance
            self._requests, self._samples, self._policy, self._instance = [], [], [], []
            pending, self._decisions = self._decisions, []
            advisor, self._advisor = self._advisor, []
        batch = (requests, samples, policy, instance, self._rows(pending), advisor)
        if any(batch):
            try:
                self.store.write_batch(self.run_id, *batch)
            except Exception:  # one bad record must not cost the batch, nor stop the recorder
                log.exception("run store: a batch of run %s failed; writing its records one by one", self.run_id)
                self._write_one_by_one(batch)

    def _rows(self, pending: list[tuple[list[Record], float]]) -> list[dict[str, Any]]:
        """Decision records made into rows here, off the event loop; one that fails is logged and left out."""
        rows = []
        for records, t0 in pending:
            for r in records:
                try:
                    rows.append(decision_row(r, t0))
                except Exception:
                    log.exception("run store: a decision record of run %s could not be made", self.run_id)
        return rows

    def _write_one_by_one(self, batch: tuple[list[dict[str, Any]], ...]) -> None:
        lost = 0
        for kind, rows in enumerate(batch):
            for row in rows:
                parts: list[list[dict[str, Any]]] = [[] for _ in batch]
                parts[kind] = [row]
                try:
                    self.store.write_batch(self.run_id, *parts)
                except Exception:
                    lost += 1
        if lost:
            log.error("run store: %d records of run %s could not be written", lost, self.run_id)

    def _loop(self) -> None:
        while not self._stop.wait(self.flush_interval_s):
            self.flush()

    def close(self, status: str | None = None, summary: dict[str, Any] | None = None) -> None:
        """Stop the flusher, write what is left and, with a status, close the run record."""
        if self.closed:
            return
        self.closed = True
        self._stop.set()
        self._thread.join()
        self.flush()
        if status is not None:
            self.store.finish_run(self.run_id, status=status, summary=summary)


def decision_row(r: Record, t0: float = 0.0) -> dict[str, Any]:
    """A decision record as a row of the `decisions` table (its time minus `t0`); the candidates are
    kept as the hot path left them (core.decision_records.Record.payload), one JSON encoding."""
    kind, stage, policy, t, chosen, scorer, score_name, info = r.head
    return {
        "request_id": r.request_id,
        "t": t - t0,
        "kind": kind,
        "stage": stage,
        "policy": policy,
        "scorer": scorer,
        "chosen": chosen,
        "score_name": score_name,
        "candidates": orjson.dumps(r.payload(), option=orjson.OPT_SERIALIZE_NUMPY).decode(),
        "info": orjson.dumps(info).decode(),
    }
