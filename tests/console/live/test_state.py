"""ConsoleState: the JSON it serves has exactly the keys set, any console's JSON validates,
every field is documented."""

from __future__ import annotations

import json
from typing import Any

from console.live.state import ConsoleState, InstanceRow, ScrapedCounters, json_schema
from tests.console.live.fakes import LEGACY_ROW_KEYS
from tests.console.tui.fakes import FakeConsole


def test_a_starting_row_has_the_keys_it_always_had_and_no_breaker() -> None:
    row = InstanceRow(
        id="d2",
        role="decode",
        phase="starting",
        url="",
        healthy=False,
        managed=True,
        running=0,
        waiting=0,
        kv_usage=0.0,
        tokens_per_s=0.0,
        projected_load=None,
        routed_running=0,
        routed_pending=0,
        failures=0,
        pid=None,
        node=None,
        dp_ranks=None,
        scraped=ScrapedCounters(),
    )
    dumped = ConsoleState(instances=[row]).to_json()["instances"][0]
    assert list(dumped) == [k for k in LEGACY_ROW_KEYS if k != "breaker"]
    assert dumped["scraped"] == {}


def test_what_a_console_sends_comes_back_unchanged() -> None:
    sent: dict[str, Any] = json.loads(json.dumps(FakeConsole(1, 2).state()))
    sent["future_field"] = {"kept": True}  # a newer console's key survives `status --json`
    state = ConsoleState.model_validate(sent)
    assert state.to_json() == sent
    assert json.dumps(state.to_json()) == json.dumps(sent)  # the order of the keys too
    assert state.instances[1].id == "d0" and state.instances[1].load == state.instances[1].projected_load


def test_fields_a_console_leaves_out_take_the_dashboards_fallbacks() -> None:
    state = ConsoleState.model_validate({"instances": [{"id": "d0", "role": "decode", "running": 2, "waiting": 1}]})
    row = state.instances[0]
    assert (row.phase, row.breaker, row.healthy, row.kv_usage, row.load) == ("active", "closed", False, None, 3.0)
    assert (
        state.queue is None
        and state.replay is None
        and state.capabilities == {}
        and state.slo.window.attainment is None
    )


def test_every_field_of_the_schema_is_documented_and_refers_to_components() -> None:
    schema, defs = json_schema("#/components/schemas/")
    assert "instances" in schema["required"]
    assert schema["properties"]["instances"]["items"] == {"$ref": "#/components/schemas/InstanceRow"}
    for name, model in {"ConsoleState": schema, **defs}.items():
        assert model.get("description"), name
        if name == "SLOClass":  # core's model, documented where it lives
            continue
        for field_name, prop in model["properties"].items():
            assert prop.get("description"), f"{name}.{field_name}"
