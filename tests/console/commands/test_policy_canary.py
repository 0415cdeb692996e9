"""`policy canary` as the operator reads it: the running and last canary in lines naming the pool they run on, and
`--pool` in the help with its default (the first pool)."""

from __future__ import annotations

from typing import Any

from typer.testing import CliRunner

from console.cli import _register_commands, app
from console.commands.policy_canary import describe

_register_commands()
runner = CliRunner()


def canary_json(cid: str, pool: str | None, **more: Any) -> dict[str, Any]:
    """A canary as GET /control/canary carries it (`pool` None: a console from before pools were named)."""
    c = {
        "id": cid,
        "plan": {"kind": "routing", "name": "least_load", "params": {}, "share": 0.1, "duration_s": 300.0},
        "source": "cli",
        "elapsed_s": 42.0,
        "finished": {"canary": 3, "control": 27},
        "reading": None,
        **more,
    }
    return c if pool is None else {**c, "pool": pool}


def test_the_running_and_last_canary_name_their_pool() -> None:
    last = canary_json("canary-1", "A", decision="rollback", reason="the canary is worse")
    lines = describe({"running": canary_json("canary-2", "B"), "last": last})
    tail = "for 300 s [cli], 42 s in; finished 3 canary, 27 control"
    assert lines == [
        f"running: canary-2 routing least_load  on 10% of pool B {tail}",
        f"last: canary-1 routing least_load  on 10% of pool A {tail}",
        "  verdict: rollback: the canary is worse",
    ]
    older = describe({"running": canary_json("canary-3", None), "last": None})
    assert older == [f"running: canary-3 routing least_load  on 10% {tail}"]
    assert describe({"running": None, "last": None}) == ["no canary has run on this console"]


def test_the_help_offers_pool_with_the_first_as_default() -> None:
    result = runner.invoke(app, ["policy", "canary", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0 and "--pool" in result.stdout and "default: the first pool" in result.stdout
