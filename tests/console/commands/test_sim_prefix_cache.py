"""`sibyl-console sim` models the prefix cache for traces with hash ids: hit rate and KV moved in the table, the JSON
and the stored run; traces without hash ids are simulated as before."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from typer.testing import CliRunner

from console.cli import _register_commands, app
from console.commands.sim_table import results_table as _table

_register_commands()
runner = CliRunner()
AZURE = Path(__file__).parents[2] / "data" / "traces" / "azure_sample.csv"
PROFILE = "roofline-h100-qwen2.5-7b"


def mooncake(tmp_path: Path, n: int = 40) -> Path:
    """Four conversations growing a block per turn behind a shared first block (Mooncake's layout),
    one turn of each arriving together every 3 s."""
    rows = []
    turns: dict[int, list[int]] = {}
    for i in range(n):
        c = i % 4
        turns[c] = turns.get(c) or [0, 100 + c]
        turns[c] = [*turns[c], 1000 + i]
        rows.append(
            {
                "timestamp": (i // 4) * 3000,
                "input_length": 512 * len(turns[c]) - 10,
                "output_length": 20,
                "hash_ids": turns[c],
            }
        )
    path = tmp_path / "mooncake.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def sim(*args: str) -> list[dict[str, Any]]:
    result = runner.invoke(app, ["sim", *args, "--profile", PROFILE, "--json"])
    assert result.exit_code == 0, result.stdout
    rows: list[dict[str, Any]] = json.loads(result.stdout)
    return rows


def test_a_trace_with_hash_ids_reports_hit_rate_and_kv_moved_and_stores_them(tmp_path: Path) -> None:
    db = str(tmp_path / "runs.db")
    rows = sim(
        str(mooncake(tmp_path)), "--cluster", "2P2D", "--policy", "least_load", "--policy", "prefix_aware", "--db", db
    )
    by = {r["policy"]: r for r in rows}
    assert by["prefix_aware"]["prefix_source"] == "precise"
    # every turn re-sends its conversation, and finds it cached where the prefix-aware choice sends it
    assert by["prefix_aware"]["prefix_hit_rate"] >= by["least_load"]["prefix_hit_rate"] > 0
    for r in rows:
        assert r["kv_transferred_tokens"] > 0 and 0 < r["kv_transferred_share"] <= 1
    from adapters.store import RunStore

    store = RunStore(Path(db))
    run = store.get_run(by["prefix_aware"]["run_id"])
    assert run.summary is not None and run.summary["prefix_hit_rate"] == by["prefix_aware"]["prefix_hit_rate"]
    assert run.summary["kv_transferred_tokens"] == by["prefix_aware"]["kv_transferred_tokens"]
    assert run.config["prefix_cache"]["source"] == "precise" and run.config["prefix_cache"]["hash_block_tokens"] == 512
    wide = Console(width=400, record=True)
    wide.print(_table(rows))
    text = wide.export_text()
    assert "hit rate" in text and "KV moved" in text


def test_cache_options_block_size_source_and_off(tmp_path: Path) -> None:
    path = str(mooncake(tmp_path))
    base = ["--cluster", "2P2D", "--policy", "prefix_aware", "--no-db"]
    approx = sim(path, *base, "--prefix-source", "approximate")[0]
    assert approx["prefix_source"] == "approximate" and approx["prefix_hit_rate"] > 0
    big = sim(path, *base, "--block-size", "64")[0]
    assert big["cache_block_size"] == 64
    off = sim(path, *base, "--no-prefix-cache")[0]
    assert "prefix_hit_rate" not in off and "kv_transferred_tokens" not in off
    bad = runner.invoke(app, ["sim", path, *base, "--prefix-source", "psychic"])
    assert bad.exit_code != 0


def test_a_trace_without_hash_ids_is_simulated_as_before(tmp_path: Path) -> None:
    rows = sim(str(AZURE), "--cluster", "1P2D", "--policy", "round_robin", "--no-db")
    assert "prefix_hit_rate" not in rows[0] and "prefix_source" not in rows[0]
    wide = Console(width=400, record=True)
    wide.print(_table(rows))
    assert "hit rate" not in wide.export_text()
