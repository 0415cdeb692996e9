"""A pool with LoRA adapters end to end on emulated processes (127.0.0.1, free ports): `lora add` refuses a bad path
before touching an instance and loads a good one; a request under it runs on instances holding it on both legs
(loaded where it was missing, counted in /metrics), the run store records its model and adapter; /v1/models lists
the model and the adapter with its parent; an unknown model gets OpenAI's 404 naming it; `policy set --pool` acts
on the pool. Several [[pools]] in one console are refused with the reason (see the report: not wired yet)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from adapters.store import RunStore
from tests.procs import FAST_PROFILE, ROOT, kill_children, start_console

MODEL = "tiny"


def adapter_dir(root: Path, name: str) -> Path:
    d = root / name
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16}))
    return d


def instance_adapters(url: str) -> set[str]:
    """The adapters an emulated instance itself lists in its /v1/models (cards with a parent)."""
    cards = httpx.get(url + "/v1/models", timeout=5).json()["data"]
    return {c["id"] for c in cards if c.get("parent")}


def test_an_adapter_added_at_run_time_is_served_on_both_legs(tmp_path: Path) -> None:
    config = tmp_path / "console.toml"
    config.write_text(
        f'policy = "round_robin"\n[[pools]]\nmodel = "{MODEL}"\nprefill = 1\ndecode = 2\nprofile = "{FAST_PROFILE}"\n'
        "[emulator]\nenable_lora = true\nmax_loras = 2\n"
    )
    con = start_console(tmp_path, str(config))
    try:
        urls = {i["id"]: i["url"] for i in con.state()["instances"]}
        assert sorted(urls) == ["d0", "d1", "p0"] and con.state()["pools"][MODEL]["instances"] == ["d0", "d1", "p0"]

        bad = con.cli("lora", "add", "sql", str(tmp_path))  # a directory without adapter_config.json
        assert bad.returncode == 2 and "has no adapter_config.json" in bad.stderr
        assert all(instance_adapters(u) == set() for u in urls.values())  # no instance was touched

        added = con.cli("lora", "add", "sql", str(adapter_dir(tmp_path, "sql")), "--json")
        assert added.returncode == 0, added.stderr
        first = json.loads(added.stdout)
        assert first["pool"] == MODEL and first["loaded_on"] == ["p0", "d0"] and first["errors"] == []

        with httpx.Client(base_url=con.url, timeout=30) as http:
            cards = {c["id"]: c for c in http.get("/v1/models").json()["data"]}
            assert set(cards) >= {MODEL, "sql"} and cards["sql"]["parent"] == MODEL and "parent" not in cards[MODEL]
            for k in range(4):  # round robin: both decode instances take some
                body = {"model": "sql", "prompt": [1, 2, 3, 4, 5, 6, 7, k], "max_tokens": 4, "ignore_eos": True}
                r = http.post("/v1/completions", json=body, headers={"X-Request-Id": f"lora-{k}"})
                assert r.status_code == 200, r.text
            base = http.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2})
            assert base.status_code == 200
            nope = http.post("/v1/completions", json={"model": "nope", "prompt": "x", "max_tokens": 2})
            err = nope.json()["error"]
            assert nope.status_code == 404 and err["type"] == "NotFoundError" and err["param"] == "model"
            assert "`nope` does not exist" in err["message"] and "sql" in err["message"]
            metrics = http.get("/metrics").text
        assert all(instance_adapters(u) == {"sql"} for u in urls.values())  # d1 loaded it for a request
        assert f'sibyl_lora_loads_total{{pool="{MODEL}"}} 3.0' in metrics
        listed = json.loads(con.cli("lora", "list", "--json").stdout)[MODEL]["adapters"]["sql"]
        assert listed["instances"] == ["d0", "d1", "p0"] and listed["in_flight"] == 0

        swap = con.cli("policy", "set", "routing", "lora_affinity", "--param", "routing=least_load", "--pool", MODEL)
        assert swap.returncode == 0 and "routing (pool tiny): round_robin -> lora_affinity" in swap.stdout
        assert con.state()["pools"][MODEL]["policies"]["routing"]["name"] == "lora_affinity"
        wrong = con.cli("policy", "set", "routing", "least_load", "--pool", "other")
        assert wrong.returncode == 2 and "no pool 'other'; pools: tiny" in wrong.stderr
        with httpx.Client(base_url=con.url, timeout=30) as http:  # routed by residency now
            r = http.post("/v1/completions", json={"model": "sql", "prompt": [9, 9, 9], "max_tokens": 2})
            assert r.status_code == 200

        removed = con.cli("lora", "remove", "sql")
        assert removed.returncode == 0 and all(instance_adapters(u) == set() for u in urls.values())
        gone = httpx.post(con.url + "/v1/completions", json={"model": "sql", "prompt": "x", "max_tokens": 2})
        assert gone.status_code == 404
    finally:
        con.stop()
        kill_children(con.home)
    rows = {r["request_id"]: r for r in RunStore(con.db).requests(con.run_id)}
    for k in range(4):
        row = rows[f"lora-{k}"]
        assert row["status"] == "ok" and (row["model"], row["lora"]) == (MODEL, "sql")
        assert row["prefill_instance"] == "p0" and row["decode_instance"] in ("d0", "d1")
    assert {rows[f"lora-{k}"]["decode_instance"] for k in range(4)} == {"d0", "d1"}


def test_several_pools_are_refused_with_the_reason(tmp_path: Path) -> None:
    config = tmp_path / "pools.toml"
    pool = 'prefill = 1\ndecode = 1\n'
    config.write_text(f'[[pools]]\nmodel = "a"\n{pool}\n[[pools]]\nmodel = "b"\n{pool}')
    out = subprocess.run(
        [sys.executable, "-m", "console.cli", "up", "--headless", "--port", "0", str(config)],
        cwd=ROOT,
        env={"SIBYL_HOME": str(tmp_path / "home"), "SIBYL_DB": str(tmp_path / "runs.db"), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0 and "2 [[pools]] are configured, but a console serves one pool" in out.stderr


@pytest.mark.parametrize("bad", ['prefill = 0', 'colour = "red"'])
def test_a_bad_pool_definition_names_the_file_line_and_field(tmp_path: Path, bad: str) -> None:
    config = tmp_path / "pools.toml"
    config.write_text(f'[[pools]]\nmodel = "a"\n{bad}\n')
    out = subprocess.run(
        [sys.executable, "-m", "console.cli", "up", "--headless", "--port", "0", str(config)],
        cwd=ROOT,
        env={"SIBYL_HOME": str(tmp_path / "home"), "SIBYL_DB": str(tmp_path / "runs.db"), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    field = bad.split()[0]
    assert out.returncode == 2 and f"pools.toml:3: field 'pools.0.{field}'" in out.stderr
