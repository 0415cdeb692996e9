"""Breakdowns of constructed request rows: group order, what `runs show` shows, figures computed by hand."""

from __future__ import annotations

from typing import Any

import pytest

from console.offline.breakdown import BreakdownError, breakdown, breakdowns, check_by, group_rows, worth_showing


def row(rid: str, ttft: float | None, met: bool, **columns: Any) -> dict[str, Any]:
    return {
        "request_id": rid,
        "status": "ok" if ttft is not None else "failed",
        "ttft": ttft,
        "tpot": 0.01 if ttft is not None else None,
        "arrival": 0.0,
        "finish": 1.0,
        "output_tokens": 10,
        "slo_met": met,
        **columns,
    }


ROWS = [
    row("c1", 0.1, True, arm="control", model="llama"),
    row("c2", 0.2, True, arm="control", model="llama", lora="sql"),
    row("k1", 0.5, True, arm="canary", model="llama", lora="chat"),
    row("c3", 0.3, True, arm="control", model="llama"),
    row("n1", None, False, model="llama"),
    row("k2", 0.7, True, arm="canary", model="llama", lora="sql"),
    row("c4", 0.4, False, arm="control", model="llama"),
]


def test_groups_come_in_presentation_order() -> None:
    assert list(group_rows(ROWS, "arm")) == ["control", "canary", None]  # control first: the canary's baseline
    assert list(group_rows(ROWS, "lora")) == [None, "chat", "sql"]  # the base model first
    assert list(group_rows([row("a", 0.1, True, model="m2"), row("b", 0.1, True)], "model")) == ["m2", None]


def test_each_group_gets_its_own_figures() -> None:
    by_arm = {g["group"]: g["metrics"] for g in breakdown(ROWS, "arm")}
    assert set(by_arm) == {"control", "canary", "(no canary)"}
    control, canary, none = by_arm["control"], by_arm["canary"], by_arm["(no canary)"]
    assert (control["requests"], control["slo_attainment"]) == (4, 0.75)
    assert control["ttft_p50"] == pytest.approx(0.25)  # 0.1 0.2 0.3 0.4
    assert (canary["requests"], canary["ttft_p50"], canary["slo_attainment"]) == (2, pytest.approx(0.6), 1.0)
    assert (none["requests"], none["failed"], none["ttft_p50"]) == (1, 1, None)


def test_runs_show_splits_only_where_the_run_differs() -> None:
    assert not worth_showing(ROWS, "model")  # one model throughout
    assert worth_showing(ROWS, "lora") and worth_showing(ROWS, "arm")
    assert set(breakdowns(ROWS)) == {"lora", "arm"}
    plain = [row("a", 0.1, True), row("b", 0.2, True)]
    assert breakdowns(plain) == {}  # a run from before schema 9, or one model, no adapters, no canary
    two_models = [*plain, row("c", 0.3, True, model="qwen")]
    assert [g["group"] for g in breakdowns(two_models)["model"]] == ["qwen", "(unknown)"]


def test_an_unknown_by_names_the_choices() -> None:
    with pytest.raises(BreakdownError, match="--by 'tenant': expected one of model, lora, arm"):
        check_by("tenant")
    with pytest.raises(BreakdownError):
        group_rows(ROWS, "session")
