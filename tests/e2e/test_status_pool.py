"""`status --pool NAME` against a real console of two [[pools]] (emulated processes on 127.0.0.1, free ports): only
that pool's instances (`B.p0`, `B.d0`), its policies and adapters, in the table and in `--json`; the adapter line keeps
its bracketed counts; an unknown pool is refused with exit code 2 naming the pools."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.procs import FAST_PROFILE, kill_children, start_console


@pytest.mark.slow  # two pools and six CLI runs: ~7 s (make test-slow, which CI runs)
def test_status_pool_shows_one_pool_and_refuses_an_unknown_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # rich wraps at the terminal's width; the `status` calls inherit it
    sql = tmp_path / "sql"
    sql.mkdir()
    (sql / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16}))
    pool = f'prefill = 1\ndecode = 1\nprofile = "{FAST_PROFILE}"\n'
    config = tmp_path / "pools.toml"
    config.write_text(
        f'policy = "round_robin"\n[[pools]]\nmodel = "A"\n{pool}[pools.adapters]\nsql = "{sql}"\n\n'
        f'[[pools]]\nmodel = "B"\n{pool}'
    )
    con = start_console(tmp_path, str(config))
    try:
        assert con.cli("policy", "set", "routing", "least_load", "--pool", "B").returncode == 0
        everything = con.cli("status")
        assert everything.returncode == 0, everything.stderr
        assert all(i in everything.stdout for i in ("A.p0", "A.d0", "B.p0", "B.d0"))

        b = con.cli("status", "--pool", "B")
        assert b.returncode == 0, b.stderr
        assert "pool B (B, 1P1D) policies: routing=least_load" in b.stdout and "pool A (" not in b.stdout
        assert "B.p0" in b.stdout and "B.d0" in b.stdout and "A.p0" not in b.stdout and "A.d0" not in b.stdout
        assert "below: pool B's queue, admission and refusals; tenants and SLO attainment of all pools" in b.stdout

        a = con.cli("status", "--pool", "A")
        assert a.returncode == 0, a.stderr
        counts = con.state()["pools"]["A"]["lora_counts"]
        assert "pool A (A, 1P1D) policies: routing=round_robin" in a.stdout and "B.d0" not in a.stdout
        assert f"[hits {counts.get('hits', 0)}, misses {counts.get('misses', 0)}, loads {counts.get('loads', 0)}" in (
            a.stdout
        )

        as_json = con.cli("status", "--pool", "B", "--json")
        assert as_json.returncode == 0, as_json.stderr
        shown = json.loads(as_json.stdout)
        assert sorted(i["id"] for i in shown["instances"]) == ["B.d0", "B.p0"] and list(shown["pools"]) == ["B"]
        assert shown["queue"] == shown["pools"]["B"]["queue"]  # the pool's own queue and admission
        assert shown["pools"]["B"]["policies"]["routing"]["name"] == "least_load"

        unknown = con.cli("status", "--pool", "C")
        assert unknown.returncode == 2 and "no pool 'C'; pools: A, B" in unknown.stderr and not unknown.stdout
    finally:
        con.stop()
        kill_children(con.home)
