"""`runs show`, `runs compare --by` and `runs export` through the CLI on a store constructed here: breakdowns by
model, adapter and canary arm, the advisor's and canaries' events, and the columns of schema 9."""

from __future__ import annotations

import csv
import io
import json
from typing import Any

import pytest
from typer.testing import CliRunner

from adapters.store import RunStore
from console.cli import _register_commands, app

_register_commands()
runner = CliRunner()


def req(rid: str, ttft: float, met: bool, **columns: Any) -> dict[str, Any]:
    return {
        "request_id": rid,
        "arrival": 0.0,
        "finish": 1.0,
        "prompt_tokens": 64,
        "output_tokens": 10,
        "status": "ok",
        "ttft": ttft,
        "tpot": 0.01,
        "slo_met": met,
        **columns,
    }


def plan() -> dict[str, Any]:
    """A canary_start event's data as the live canary writes it."""
    return {"plan": {"kind": "routing", "name": "prefix_aware", "share": 0.1, "duration_s": 300.0, "params": {}},
            "source": "cli"}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, str]:
    """Run A: two models, an adapter, a canary (control, canary and requests outside it), advisor events.
    Run B: one model, no adapters, no canary, no advisor."""
    db = str(tmp_path_factory.mktemp("runs") / "runs.db")
    s = RunStore(db)
    a = s.create_run(kind="live", backend="emulator", cluster="1P2D", policy="least_load")
    s.add_requests(
        a,
        [
            req("c1", 0.1, True, model="llama", arm="control", session="s1", prefix_keys=(1, 2, 3)),
            req("c2", 0.2, True, model="llama", arm="control", lora="sql", session="s2"),
            req("c3", 0.3, True, model="llama", arm="control"),
            req("c4", 0.4, False, model="llama", arm="control"),
            req("k1", 0.5, True, model="llama", arm="canary", lora="sql", session="s3"),
            req("k2", 0.7, True, model="llama", arm="canary", lora="sql"),
            req("q1", 1.0, True, model="qwen"),
            req("q2", 2.0, False, model="qwen"),
        ],
    )
    s.add_advisor_event(a, t=30.0, event="advice", kind="routing", detail="no gain past the error")
    s.add_advisor_event(a, t=60.0, event="advice", kind="routing", policy="prefix_aware", detail="ttft_p99 -31%")
    start = {"canary": "c1", "kind": "routing", "policy": "prefix_aware", "data": plan(), "detail": "asked"}
    s.add_advisor_event(a, t=100.0, event="canary_start", **start)
    for k in range(12):
        s.add_advisor_event(a, t=110.0 + 10 * k, event="canary_reading", canary="c1", decision="continue",
                            detail=f"reading {k}")
    s.add_advisor_event(a, t=400.0, event="canary_end", canary="c1", decision="promote", detail="the canary is better")
    b = s.create_run(kind="live", backend="emulator", cluster="1P2D", policy="sibyl")
    s.add_requests(b, [req("b1", 0.2, True, model="llama"), req("b2", 0.4, True, model="llama")])
    c = s.create_run(kind="live", backend="emulator", cluster="1P2D", policy="sibyl")
    s.add_requests(c, [req("x1", 0.2, True, model="llama"), req("x2", 0.3, True, model="mistral")])
    s.close()
    return db, a, b + " " + c


def invoke(*args: str) -> Any:
    result = runner.invoke(app, list(args))
    assert result.exit_code == 0, (result.stdout, result.exception)
    return result


def test_show_breaks_a_run_down_and_lists_its_advice_and_canaries(store: tuple[str, str, str]) -> None:
    db, a, _ = store
    d = json.loads(invoke("runs", "show", a, "--db", db, "--json").stdout)
    assert list(d["breakdowns"]) == ["model", "lora", "arm"]
    arms = {g["group"]: g["metrics"] for g in d["breakdowns"]["arm"]}
    assert list(arms) == ["control", "canary", "(no canary)"]
    assert (arms["control"]["requests"], arms["control"]["slo_attainment"]) == (4, 0.75)
    assert arms["canary"]["ttft_p50"] == pytest.approx(0.6)
    assert [g["group"] for g in d["breakdowns"]["lora"]] == ["(base model)", "sql"]
    assert [(s["from_t"], s["advised"]) for s in d["advice"]] == [(30.0, "(keep the active policies)"),
                                                                  (60.0, "prefix_aware")]
    [canary] = d["canaries"]
    assert (canary["verdict"], len(canary["readings"]), canary["start"]["data"]) == ("promote", 12, plan())
    text = invoke("runs", "show", a, "--db", db).stdout
    for expected in (
        "by model",
        "by LoRA adapter",
        "by canary arm",
        "t=60.0s advised prefix_aware (1x): ttft_p99 -31%",
        "canary c1: routing prefix_aware, started t=100.0s (share 10%, for 300 s, from cli): asked",
        "... 2 earlier readings (--json has them all)",
        "t=220.0s continue: reading 11",
        "ended t=400.0s: promote: the canary is better",
    ):
        assert expected in text, expected
    assert "reading 1\n" not in text  # one of the two earlier readings left out


def test_show_of_a_plain_run_has_no_breakdowns(store: tuple[str, str, str]) -> None:
    db, _, others = store
    b = others.split()[0]
    assert json.loads(invoke("runs", "show", b, "--db", db, "--json").stdout)["breakdowns"] == {}
    text = invoke("runs", "show", b, "--db", db).stdout
    assert "by model" not in text and "by canary arm" not in text and "advisor:" not in text


def test_compare_one_run_by_arm_puts_the_canary_against_the_control_arm(store: tuple[str, str, str]) -> None:
    db, a, _ = store
    entries = json.loads(invoke("runs", "compare", a, "--by", "arm", "--db", db, "--json").stdout)
    assert [(e["group"], e["baseline"]) for e in entries] == [
        ("control", True),
        ("canary", False),
        ("(no canary)", False),
    ]
    assert entries[1]["relative"]["ttft_p50"] == pytest.approx(0.6 / 0.25 - 1)
    assert entries[2]["relative"]["ttft_p50"] == pytest.approx(1.5 / 0.25 - 1)
    assert entries[1]["relative"]["slo_attainment"] == pytest.approx(1.0 / 0.75 - 1)
    text = invoke("runs", "compare", a, "--by", "arm", "--db", db).stdout
    assert "arm=control" in text and "arm=canary" in text and "+140.0%" in text


def test_compare_runs_by_model_matches_each_model_to_the_first_runs(store: tuple[str, str, str]) -> None:
    db, a, others = store
    c = others.split()[1]
    entries = json.loads(invoke("runs", "compare", a, c, "--by", "model", "--db", db, "--json").stdout)
    assert [(e["run"]["run_id"], e["group"], e["baseline"]) for e in entries] == [
        (a, "llama", True),
        (a, "qwen", True),
        (c, "llama", False),
        (c, "mistral", False),
    ]
    assert entries[2]["relative"]["ttft_p50"] == pytest.approx(0.2 / 0.35 - 1)  # a's llama: 0.1 .. 0.7, p50 0.35
    assert all(v is None for v in entries[3]["relative"].values())  # the first run had no mistral requests
    assert "model=mistral" in invoke("runs", "compare", a, c, "--by", "model", "--db", db).stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--by", "tenant"], "--by 'tenant': expected one of model, lora, arm"),
        ([], "runs compare needs at least two run ids (or one, split with --by model|lora|arm)"),
    ],
)
def test_compare_errors_are_clear(store: tuple[str, str, str], args: list[str], message: str) -> None:
    db, a, _ = store
    result = runner.invoke(app, ["runs", "compare", a, *args, "--db", db])
    assert result.exit_code != 0 and message in str(result.exception)


def test_export_has_the_new_columns(store: tuple[str, str, str]) -> None:
    db, a, _ = store
    rows = list(csv.DictReader(io.StringIO(invoke("runs", "export", a, "--db", db).stdout)))
    assert {"model", "lora", "arm", "session", "prefix_keys"} <= set(rows[0])
    assert (rows[0]["model"], rows[0]["arm"], rows[0]["session"], json.loads(rows[0]["prefix_keys"])) == (
        "llama",
        "control",
        "s1",
        [1, 2, 3],
    )
    assert rows[1]["prefix_keys"] == "" and rows[1]["lora"] == "sql"
    as_json = json.loads(invoke("runs", "export", a, "--format", "json", "--db", db).stdout)
    assert as_json[0]["prefix_keys"] == [1, 2, 3] and as_json[6]["arm"] is None
