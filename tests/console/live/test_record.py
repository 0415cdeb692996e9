"""The request record: steps stamped, outcomes, recoveries kept in order; the stored row has the store's columns."""

from __future__ import annotations

from adapters.store.schema import RequestRecord as StoredRequest
from console.live.record import ROW_COLUMNS, Outcome, RequestRecord, Step
from core.types import Request


def test_a_record_stamps_its_steps_and_is_ok_only_with_that_outcome() -> None:
    rec = RequestRecord(Request(7, 100.0, 10, 4), stream=True)
    assert rec.id == "7" and rec.step == Step.ADMITTED and rec.times == {Step.ADMITTED: 100.0}
    assert rec.enter(Step.QUEUED, 100.5) == 100.5 and rec.at(Step.QUEUED) == 100.5 and rec.at(Step.PREFILL) is None
    rec.enter(Step.FAILED, 101.0)
    assert rec.finish == 101.0 and not rec.ok
    rec.outcome = Outcome.UPSTREAM
    assert not rec.ok
    rec.outcome = Outcome.OK
    assert rec.ok


def test_recoveries_are_kept_in_the_order_they_happened() -> None:
    rec = RequestRecord(Request("r1", 0.0, 10, 4), stream=True)
    rec.saved("prefill p0 was lost: recomputed on d0")
    rec.saved("decode d0 failed mid-stream: resumed on d1")
    assert rec.recovered == "prefill p0 was lost: recomputed on d0; decode d0 failed mid-stream: resumed on d1"


def test_the_stored_row_has_exactly_the_stores_request_columns() -> None:
    stored = set(StoredRequest.model_fields) - {"id", "run_id"}  # the store adds its key and the run
    assert set(ROW_COLUMNS) == stored and len(ROW_COLUMNS) == 30


def test_every_way_a_request_ends_is_one_outcome() -> None:
    assert [o.value for o in Outcome] == [
        "ok",
        "shed",
        "expired",
        "abandoned",
        "no_capacity",
        "tenant_limit",
        "upstream",
        "client_gone",
        "internal",
    ]
