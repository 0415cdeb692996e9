"""Two [[pools]] on emulated processes (127.0.0.1, free ports), as the run store keeps them: each pool's configured
policies and a swap on pool B are stored with their pool, the run's summary keeps each pool's decision quality, and
`runs show` prints the pool beside each swap and both pools' decision quality."""

from __future__ import annotations

from pathlib import Path

import httpx
from typer.testing import CliRunner

from adapters.store import RunStore
from console.cli import _register_commands, app
from tests.procs import FAST_PROFILE, kill_children, start_console

_register_commands()


def test_a_swap_on_pool_b_is_recorded_with_its_pool_and_shown_by_runs_show(tmp_path: Path) -> None:
    pool = f'prefill = 1\ndecode = 1\nprofile = "{FAST_PROFILE}"\n'
    config = tmp_path / "pools.toml"
    config.write_text(f'policy = "round_robin"\n[[pools]]\nmodel = "A"\n{pool}\n[[pools]]\nmodel = "B"\n{pool}')
    con = start_console(tmp_path, str(config))
    try:
        with httpx.Client(base_url=con.url, timeout=30) as http:
            for k, model in enumerate(("A", "A", "A", "B")):
                body = {"model": model, "prompt": [1, 2, 3, k], "max_tokens": 3, "ignore_eos": True}
                assert http.post("/v1/completions", json=body).status_code == 200
        swap = con.cli("policy", "set", "routing", "least_load", "--pool", "B")
        assert swap.returncode == 0 and "routing (pool B): round_robin -> least_load" in swap.stdout, swap.stderr
        with httpx.Client(base_url=con.url, timeout=30) as http:  # one more on B, under its new policy
            body = {"model": "B", "prompt": [4, 5, 6], "max_tokens": 3, "ignore_eos": True}
            assert http.post("/v1/completions", json=body).status_code == 200
    finally:
        assert con.stop() == 0
        kill_children(con.home)

    store = RunStore(con.db)
    routing = [(e["pool"], e["old"], e["new"], e["source"]) for e in store.policy_events(con.run_id)
               if e["kind"] == "routing"]
    assert routing == [
        ("A", None, "round_robin", "config"),
        ("B", None, "round_robin", "config"),
        ("B", "round_robin", "least_load", "cli"),
    ]
    assert {e["pool"] for e in store.policy_events(con.run_id)} == {"A", "B"}  # every kind's, each with its pool
    summary = store.get_run(con.run_id).summary or {}
    quality = {name: p["decision_quality"] for name, p in summary["pools"].items()}
    assert {name: (q["decode_scored"], q["decode_still_best"]) for name, q in quality.items()} == {
        "A": (3, 1.0),  # one decode instance per pool: each choice was the least loaded one
        "B": (2, 1.0),
    }
    assert summary["decision_quality"] == quality["A"]  # the first pool's, where one pool's went before
    store.close()

    shown = CliRunner().invoke(app, ["runs", "show", con.run_id, "--db", str(con.db)], terminal_width=200)
    assert shown.exit_code == 0, (shown.stdout, shown.exception)
    text = shown.stdout
    assert "┃ t (s) ┃ pool ┃ kind" in text
    swap_row = next(line for line in text.splitlines() if "least_load" in line and "│ cli" in line)
    assert [cell.strip() for cell in swap_row.strip("│").split("│")][1:4] == ["B", "routing", "round_robin"]
    assert "pool A:\n  decision quality: 100.0% of 3 decode choices" in text
    assert "pool B:\n  decision quality: 100.0% of 2 decode choices" in text
