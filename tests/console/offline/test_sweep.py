"""`sibyl-console sweep`: CONFIG validation, the grid and its point keys, and (marked ray) a small
grid on a local two-node Ray cluster landing in SQLite, deterministic, resumable and interruptible."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from adapters.store import RunStore
from adapters.store.schema import MIGRATIONS
from console.cli import _register_commands, app
from console.offline.simulate import json_safe
from console.offline.sweep import SweepError, deterministic, import_ray, run_point
from console.offline.sweep_config import (
    SweepConfigError,
    expand,
    load_config,
    parse_config,
    resolve_profile,
)
from core.perf import get_profile

ROOT = Path(__file__).resolve().parents[3]
_register_commands()
runner = CliRunner()


def _write(tmp_path: Path, text: str, name: str = "sweep.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _error(tmp_path: Path, text: str) -> str:
    path = _write(tmp_path, text)
    with pytest.raises(SweepConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"sweep config {path}: ")
    return message


# --- CONFIG validation (no Ray) --------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('name = "s"\nrates = 1\nmodes = ["fast"]', ["modes[0]: 'fast' is not allowed; allowed: 'ps' or 'iteration'"]),
        ('name = "s"\nrates = 1\nbogus = 1', ["bogus: unknown field; allowed fields: name, ", "policies"]),
        ('name = "s"\nrates = 1\nslo = {ttft = 1}', ["slo.ttft: unknown field; allowed fields: ttft_ms, tpot_ms"]),
        (
            'name = "s"\nrates = 1\npolicies = ["least_load", "nope"]',
            ["policies[1]: unknown routing policy 'nope'; available: ", "sibyl"],
        ),
        (
            'name = "s"\nrates = 1\npolicies = ["sibyl:bogus=1"]',
            ["policies[0]: bad params for routing policy 'sibyl'", "bogus"],
        ),
        (
            'name = "s"\nrates = 1\npolicies = [{name = "sibyl", parms = {}}]',
            ["policies[0]: unknown key parms; a policy table has keys label, name, params"],
        ),
        (
            'name = "s"\nrates = 1\n'
            'policies = ["least_load:by=tokens", {label = "LL", name = "least_load", params = {by = "tokens"}}]',
            ["least_load:by=tokens and LL are the same policy setting"],
        ),
        ('name = "s"\nrates = 1\nshapes = ["4P16D", "4X"]', ["shapes[1]: '4X': expected <prefill>P<decode>D"]),
        ('name = "s"\nrates = [1, -2]', ["rates[1]: Input should be greater than 0 (got -2)"]),
        ('name = "s"\nrates = 1\nloads = 0.9', ["either rates (req/s) or loads", "not both"]),
        ('name = "s"', ["synthetic workloads (reasoning-chat) need rates (req/s) or loads"]),
        (
            'name = "s"\nrates = 1\nworkloads = ["chat"]',
            ["workloads[0]: unknown synthetic workload 'chat'; allowed: random, reasoning-chat, reasoning-code"],
        ),
        (
            'name = "s"\nrates = 1\nworkloads = [{trace = "t.csv", format = "parquet"}]',
            ["workloads[0]: format 'parquet' is not allowed; allowed: auto, mooncake"],
        ),
        ('name = "s"\nrates = 1\nqueue = "lifo"', ["queue: unknown queue policy 'lifo'; available: fcfs"]),
        ('name = "my sweep"\nrates = 1', ["name: 'my sweep': expected letters, digits"]),
        ("rates = 1", ["name: required field is missing"]),
        ('name = "s"\nrates = 1\nseeds = []', ["seeds: needs at least one value"]),
        ('name = "s"\nrates = [1', ["not valid TOML"]),
        (
            'name = "s"\nrates = 1\nworkloads = [{trace = "nowhere.csv"}]',
            ["workloads[0]: trace ", "nowhere.csv: no such file"],
        ),
    ],
)
def test_bad_config_names_the_file_the_field_and_what_is_allowed(
    tmp_path: Path, text: str, expected: list[str]
) -> None:
    message = _error(tmp_path, text)
    for part in expected:
        assert part in message, message
    assert "\n" not in message


def test_bad_config_is_one_line_from_the_cli(tmp_path: Path) -> None:
    path = _write(tmp_path, 'name = "s"\nrates = 1\nmodes = ["fast"]')
    proc = subprocess.run(
        [sys.executable, "-m", "console.cli", "sweep", str(path), "--db", str(tmp_path / "runs.db")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"sibyl-console: error: sweep config {path}: modes[0]: 'fast' is not allowed; allowed: 'ps' or 'iteration'"
    ]
    missing = subprocess.run(
        [sys.executable, "-m", "console.cli", "sweep", str(tmp_path / "none.toml")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert missing.returncode == 2 and "none.toml: no such file" in missing.stderr


def test_missing_ray_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray → ImportError
    with pytest.raises(SweepError, match=r"pip install 'sibyl-console\[ray\]'"):
        import_ray()


# --- the grid and its keys -------------------------------------------------------------------


def test_grid_expands_every_axis_with_stable_keys(tmp_path: Path) -> None:
    grid: dict[str, Any] = {
        "name": "g",
        "workloads": ["random", {"trace": str(ROOT / "demos" / "azure_conv_sample.csv"), "label": "azure"}],
        "seeds": [1, 2],
        "rates": [2, 4.5],
        "burstiness": [1.0, 0.2],
        "shapes": "2p8d",  # one value for a one-value axis; spelled loosely
        "modes": ["ps", "iteration"],
        "policies": ["least_load:by=tokens", {"label": "oracle", "name": "clairvoyant"}],
        "requests": 100,
    }
    config = parse_config(grid)
    profile = get_profile(config.profile)
    points = expand(config, profile)
    # random: 2 modes × 2 rates × 2 burstiness × 2 seeds × 2 policies; the trace keeps its own
    # arrival pattern, so burstiness is no axis of its points
    assert len(points) == 32 + 16
    assert len({p.key for p in points}) == len(points)
    assert {p.cluster for p in points} == {"2P8D"}
    assert {p.burstiness for p in points if p.workload.trace} == {None}
    assert {p.rate for p in points} == {2.0, 4.5}
    oracle = [p for p in points if p.policy.label == "oracle"]
    assert {(p.mode, p.params["model"]) for p in oracle} == {("ps", "ps"), ("iteration", "iteration")}
    trace_point = next(p for p in points if p.workload.trace and p.rate == 4.5)
    outcome = run_point(trace_point, profile)  # the trace (300 requests) rescaled to 4.5 req/s
    assert outcome.row["requests"] == 300 and "azure" in outcome.source.lower()
    assert outcome.row["rate_rps"] == pytest.approx(4.5, rel=0.05)
    least = next(p for p in points if p.policy.name == "least_load")
    assert least.params == {"by": "tokens"} and least.coords()["policy"] == "least_load:by=tokens"
    # the same grid expands to the same keys; a label is a name only, a seed is part of the point
    again = expand(
        parse_config(grid | {"policies": ["least_load:by=tokens", {"label": "o2", "name": "clairvoyant"}]}), profile
    )
    assert [p.key for p in again] == [p.key for p in points]
    first = points[0]
    assert first.key != next(p for p in points if p.coords() == {**first.coords(), "seed": 2}).key
    # typed params: "256" in a spec and 256 in a table are the same setting, the same key
    a = expand(
        parse_config({"name": "k", "rates": 1, "policies": ["sibyl:horizon=lifetime,lifetime_tokens=256"]}), profile
    )
    b = expand(
        parse_config(
            {
                "name": "k",
                "rates": 1,
                "policies": [{"name": "sibyl", "params": {"horizon": "lifetime", "lifetime_tokens": 256}}],
            }
        ),
        profile,
    )
    assert [p.key for p in a] == [p.key for p in b]
    # keys do not depend on the process (no hash randomisation, no dict order)
    code = (
        "from console.offline.sweep_config import parse_config, expand\nfrom core.perf import get_profile\n"
        "c = parse_config("
        f"{json.dumps({'name': 'k', 'rates': 1, 'policies': ['sibyl:horizon=lifetime,lifetime_tokens=256']})})\n"
        "print(expand(c, get_profile(c.profile))[0].key)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "12345"},
        timeout=60,
    )
    assert out.stdout.strip() == a[0].key


def _routing_sweep() -> Any:
    return importlib.import_module("benchmarks.routing_sweep")


def test_the_demo_config_is_the_full_routing_sweep() -> None:
    sw = _routing_sweep()
    config = load_config(ROOT / "demos" / "sweep_routing.toml")
    profile = resolve_profile(config)
    points = expand(config, profile)
    ours = {
        (
            p.workload.name,
            p.mode,
            *p.shape,
            p.load,
            "poisson" if p.burstiness == 1.0 else "bursty",
            p.policy.label,
            p.policy.name,
            json.dumps(p.params, sort_keys=True),
            p.requests,
            p.seed,
            p.profile,
        )
        for p in points
    }
    theirs = {
        (
            c.workload,
            c.mode,
            c.prefill,
            c.decode,
            c.load,
            c.arrival,
            case.label,
            case.name,
            json.dumps(case.params_for(c.mode), sort_keys=True),
            12000,
            7,
            "h20-qwen3-32b",
        )
        for c in sw.cells_of(sw.GRIDS["full"])
        for case in sw.POLICIES
    }
    assert len(points) == 1152 and ours == theirs
    # and a cell gives the same numbers either way (made small: 150 requests)
    cell = sw.Cell("reasoning-code", "iteration", 4, "1:1", 0.9, "bursty")
    case = next(c for c in sw.POLICIES if c.label == "clairvoyant")
    (row,) = sw.run_cell(cell, [case], requests=150, seed=7, profile=profile)
    small = expand(config.model_copy(update={"requests": 150, "shapes": ["4P4D"]}), profile)
    point = next(
        p
        for p in small
        if (p.workload.name, p.mode, p.load, p.burstiness, p.policy.label)
        == ("reasoning-code", "iteration", 0.9, 0.2, "clairvoyant")
    )
    mine = run_point(point, profile).row
    for key in ("tpot_p99", "tpot_p999", "tpot_mean", "ttft_p99", "slo_attainment", "completed", "preemptions"):
        assert mine[key] == row[key], key


def test_an_older_store_gains_the_sweep_column(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    store = RunStore(path)
    old = store.create_run(kind="sim", backend="sim", policy="sibyl")
    store.close()
    with sqlite3.connect(path) as conn:  # undo every migration after 2: a file of that release
        for version in sorted((v for v in MIGRATIONS if v > 2), reverse=True):
            for statement in MIGRATIONS[version]:
                if index := re.match(r"CREATE INDEX (?:IF NOT EXISTS )?(\w+)", statement):
                    conn.execute(f"DROP INDEX {index.group(1)}")
            for statement in MIGRATIONS[version]:
                if column := re.match(r"ALTER TABLE (\w+) ADD COLUMN (\w+)", statement):
                    conn.execute(f"ALTER TABLE {column.group(1)} DROP COLUMN {column.group(2)}")
        conn.execute("PRAGMA user_version = 2")
        assert "sweep" not in {r[1] for r in conn.execute("PRAGMA table_info(runs)")}
    store = RunStore(path)
    assert store.get_run(old).sweep is None and store.sweep_runs("s") == []
    new = store.create_run(kind="sim", backend="sim", sweep="s")
    assert [r.run_id for r in store.sweep_runs("s")] == [new] and store.get_run(new).sweep == "s"
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] >= 3
        assert conn.execute("SELECT name FROM sqlite_master WHERE name = 'ix_runs_sweep'").fetchone()


# --- on a local Ray cluster ------------------------------------------------------------------

GRID = """
name = "tiny"
workloads = ["reasoning-chat"]
requests = 300
seeds = [1, 2]
rates = [4, 8]
shapes = ["1P4D"]
policies = ["least_load", "sibyl:horizon=lifetime"]
"""


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    """A head node and one worker node, one CPU each (the machine has two)."""
    pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    small = {"num_cpus": 1, "object_store_memory": 80 * 1024 * 1024}
    cluster = Cluster(initialize_head=True, head_node_args={**small, "include_dashboard": False})
    try:
        cluster.add_node(**small)
        cluster.wait_for_nodes()
        yield cluster.address
    finally:
        cluster.shutdown()


def _stored(db: Path, sweep: str) -> list[dict[str, Any]]:
    with sqlite3.connect(db) as conn:
        conn.row_factory = sqlite3.Row
        rows = conn.execute(
            "SELECT r.*, (SELECT COUNT(*) FROM requests q WHERE q.run_id = r.run_id) AS n FROM runs r WHERE sweep = ?",
            (sweep,),
        ).fetchall()
    return [dict(r) for r in rows]


def _completed_so_far(db: Path, sweep: str) -> int:
    """Completed points of a sweep another process is writing; 0 while its store is still being
    created (the file appears before its tables do)."""
    if not db.exists():
        return 0
    try:
        return sum(r["status"] == "completed" for r in _stored(db, sweep))
    except sqlite3.OperationalError:  # no such table / column yet
        return 0


def _sweep(*args: str) -> dict[str, Any]:
    result = runner.invoke(app, ["sweep", *args, "--json"])
    assert result.exit_code == 0, (result.output, result.exception)
    data: dict[str, Any] = json.loads(result.stdout)
    return data


@pytest.mark.ray
@pytest.mark.timeout(150)
def test_a_grid_on_ray_lands_in_sqlite_and_resumes(ray_cluster: str, tmp_path: Path) -> None:
    config = _write(tmp_path, GRID)
    db = tmp_path / "runs.db"
    first = _sweep(str(config), "--ray-address", ray_cluster, "--db", str(db))
    cfg = load_config(config)
    profile = resolve_profile(cfg)
    points = {p.key: p for p in expand(cfg, profile)}
    assert len(points) == 8 and len(first["ran"]) == 8 and first["failed"] == 0
    stored = _stored(db, "tiny")
    assert len(stored) == 8
    for run in stored:
        conf = json.loads(run["config"])
        point = points[conf["sweep"]["point"]]
        assert conf["sweep"]["coords"] == point.coords()
        assert (run["status"], run["kind"], run["cluster"], run["seed"], run["policy"], run["n"]) == (
            "completed",
            "sim",
            "1P4D",
            point.seed,
            point.policy.label,
            300,
        )
        # the same point run here gives the same summary (only the wall-clock fields differ)
        assert deterministic(json.loads(run["summary"])) == deterministic(json_safe(run_point(point, profile).row))
    assert {json.loads(r["config"])["sweep"]["point"] for r in stored} == set(points)
    table = first["comparison"]
    assert [(g["rate"], [r["policy"] for r in g["policies"]]) for g in table] == [
        (4.0, ["least_load", "sibyl:horizon=lifetime"]),
        (8.0, ["least_load", "sibyl:horizon=lifetime"]),
    ]
    assert all(r["seeds"] == 2 and r["tpot_p99"]["std"] is not None for g in table for r in g["policies"])
    # the runs are ordinary runs for `runs compare`
    ids = [r["run_id"] for r in stored[:2]]
    result = runner.invoke(app, ["runs", "compare", *ids, "--db", str(db), "--json"])
    assert result.exit_code == 0 and [e["metrics"]["requests"] for e in json.loads(result.stdout)] == [300, 300]

    # resume: nothing missing → nothing runs (and Ray is not even started)
    again = _sweep(str(config), "--ray-address", ray_cluster, "--db", str(db))
    assert again["ran"] == [] and len(_stored(db, "tiny")) == 8 and again["comparison"] == table

    # one point gone → only that one runs again, with the same result
    gone = stored[3]
    with sqlite3.connect(db) as conn:
        conn.execute("DELETE FROM requests WHERE run_id = ?", (gone["run_id"],))
        conn.execute("DELETE FROM runs WHERE run_id = ?", (gone["run_id"],))
    third = _sweep(str(config), "--ray-address", ray_cluster, "--db", str(db))
    assert [r["point"] for r in third["ran"]] == [json.loads(gone["config"])["sweep"]["point"]]
    assert len(_stored(db, "tiny")) == 8 and third["comparison"] == table


@pytest.mark.ray
@pytest.mark.timeout(150)
def test_an_interrupted_sweep_keeps_what_finished_and_resumes(ray_cluster: str, tmp_path: Path) -> None:
    config = _write(
        tmp_path, GRID.replace("requests = 300", "requests = 2500").replace("seeds = [1, 2]", "seeds = [1, 2, 3, 4]")
    )
    db = tmp_path / "runs.db"
    proc = subprocess.Popen(
        [sys.executable, "-m", "console.cli", "sweep", str(config), "--ray-address", ray_cluster, "--db", str(db)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if _completed_so_far(db, "tiny") >= 2:
                break
            time.sleep(0.2)
        else:
            pytest.fail("no point finished in 90 s")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "interrupted:" in err and "again to resume" in err
    kept = _stored(db, "tiny")
    assert 2 <= len(kept) < 16 and all(r["status"] == "completed" for r in kept)
    resumed = _sweep(str(config), "--ray-address", ray_cluster, "--db", str(db))
    assert len(resumed["ran"]) == 16 - len(kept)
    final = _stored(db, "tiny")
    assert len(final) == 16 and len({json.loads(r["config"])["sweep"]["point"] for r in final}) == 16


@pytest.mark.ray
@pytest.mark.timeout(120)
def test_a_failing_point_is_stored_as_failed_and_retried(ray_cluster: str, tmp_path: Path) -> None:
    (tmp_path / "bad.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,ten,3\n")
    config = _write(
        tmp_path,
        'name = "bad"\nworkloads = [{trace = "bad.csv", format = "azure"}]\nrates = 1\npolicies = "least_load"',
    )
    db = tmp_path / "runs.db"
    args = ["sweep", str(config), "--ray-address", ray_cluster, "--db", str(db)]
    result = runner.invoke(app, args)
    assert isinstance(result.exception, SweepError), result.output
    assert "1 of 1 points failed" in str(result.exception) and "bad.csv" in str(result.exception)
    (run,) = _stored(db, "bad")
    assert run["status"] == "failed" and "bad.csv" in json.loads(run["summary"])["error"]
    runner.invoke(app, args)  # a failed point is not done: it runs again
    assert [r["status"] for r in _stored(db, "bad")] == ["failed", "failed"]
