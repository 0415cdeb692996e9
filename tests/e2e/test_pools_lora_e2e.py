"""Pools with LoRA adapters end to end on emulated processes (127.0.0.1, free ports). One pool: `lora add` refuses a
bad path before touching an instance and loads a good one; a request under it runs on instances holding it on both
legs (loaded where it was missing, counted in /metrics), the run store records its model and adapter; /v1/models lists
the model and the adapter with its parent; an unknown model gets OpenAI's 404 naming it; `policy set --pool` acts on
the pool. Two [[pools]]: each model's requests run on its own pool's instances (ids `A.p0`, `B.d0`), /v1/models lists
both and the adapter, `policy set`/`scale` act on the pool named, and the run store records each request's model."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from adapters.store import RunStore
from tests.procs import FAST_PROFILE, ROOT, kill_children, start_console, wait_for

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


def test_two_pools_serve_each_model_on_its_own_instances(tmp_path: Path) -> None:
    sql = adapter_dir(tmp_path, "sql")
    pool = f'prefill = 1\ndecode = 1\nprofile = "{FAST_PROFILE}"\n'
    config = tmp_path / "pools.toml"
    config.write_text(
        f'policy = "round_robin"\n[[pools]]\nmodel = "A"\n{pool}[pools.adapters]\nsql = "{sql}"\n\n'
        f'[[pools]]\nmodel = "B"\n{pool}'
    )
    con = start_console(tmp_path, str(config))
    try:
        state = con.state()
        urls = {i["id"]: i["url"] for i in state["instances"]}
        assert sorted(urls) == ["A.d0", "A.p0", "B.d0", "B.p0"] and state["cluster"] == "2P2D"
        assert {i["id"]: i["pool"] for i in state["instances"]} == {"A.d0": "A", "A.p0": "A", "B.d0": "B", "B.p0": "B"}
        assert {n: (p["model"], p["instances"]) for n, p in state["pools"].items()} == {
            "A": ("A", ["A.d0", "A.p0"]),
            "B": ("B", ["B.d0", "B.p0"]),
        }
        served = {iid: httpx.get(u + "/v1/models", timeout=5).json()["data"][0]["id"] for iid, u in urls.items()}
        assert served == {"A.d0": "A", "A.p0": "A", "B.d0": "B", "B.p0": "B"}  # each pool's model name

        with httpx.Client(base_url=con.url, timeout=30) as http:
            cards = {c["id"]: c for c in http.get("/v1/models").json()["data"]}
            assert set(cards) == {"A", "B", "sql"} and cards["sql"]["parent"] == "A"
            for k, model in enumerate(("A", "B", "sql", "A", "B")):
                body = {"model": model, "prompt": [1, 2, 3, 4, k], "max_tokens": 3, "ignore_eos": True}
                r = http.post("/v1/completions", json=body, headers={"X-Request-Id": f"{model}-{k}"})
                assert r.status_code == 200, r.text
            nope = http.post("/v1/completions", json={"model": "C", "prompt": "x", "max_tokens": 2})
            err = nope.json()["error"]
            assert nope.status_code == 404 and err["type"] == "NotFoundError" and err["param"] == "model"
            assert "`C` does not exist" in err["message"] and "A, B, sql" in err["message"]
            unnamed = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert unnamed.status_code == 400 and "serves several models" in unnamed.json()["error"]["message"]

        ambiguous = con.cli("policy", "set", "routing", "least_load")
        assert ambiguous.returncode == 2 and "this console runs 2 pools (A, B): name one" in ambiguous.stderr
        swap = con.cli("policy", "set", "routing", "least_load", "--pool", "B")
        assert swap.returncode == 0 and "routing (pool B): round_robin -> least_load" in swap.stdout
        pools = con.state()["pools"]
        assert pools["A"]["policies"]["routing"]["name"] == "round_robin"
        assert pools["B"]["policies"]["routing"]["name"] == "least_load"
        for name in ("A", "B"):  # each pool's own queue, admission, assignment ratio and prefix index
            assert pools[name]["queue"]["depth"] == 0 and pools[name]["queue"]["admission"] is not None
            assert set(pools[name]["queue"]["refusals"]) >= {"prefill_backlog", "kv"}
            assert "assignment_ratio" in pools[name] and "source" in pools[name]["prefix"]
        metrics = httpx.get(con.url + "/metrics").text
        assert_pool_series(metrics)
        status = con.cli("status").stdout
        assert "pool A (A, 1P1D) policies: routing=round_robin" in status
        assert "pool B (B, 1P1D) policies: routing=least_load" in status

        assert con.cli("scale", "decode", "1").returncode == 2  # which pool?
        scaled = con.cli("scale", "decode", "1", "--pool", "B", "--json")
        assert scaled.returncode == 0, scaled.stderr
        assert json.loads(scaled.stdout) == {"role": "decode", "delta": 1, "instances": ["B.d1"], "pool": "B"}
        wait_for(lambda: con.state()["pools"]["B"]["cluster"] == "1P2D", 30, "B.d1 to start")
        assert con.state()["pools"]["A"]["instances"] == ["A.d0", "A.p0"]
    finally:
        con.stop()
        kill_children(con.home)
    rows = {r["request_id"]: r for r in RunStore(con.db).requests(con.run_id)}
    for k, model in enumerate(("A", "B", "sql", "A", "B")):
        row = rows[f"{model}-{k}"]
        pool = "B" if model == "B" else "A"
        assert row["status"] == "ok" and row["model"] == pool and row["lora"] == (model if model == "sql" else None)
        assert row["prefill_instance"] == f"{pool}.p0" and row["decode_instance"] == f"{pool}.d0"


def samples(metrics: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """A /metrics text as {(sample name, its labels): value}."""
    return {
        (x.name, frozenset(x.labels.items())): x.value
        for family in text_string_to_metric_families(metrics)
        for x in family.samples
    }


def assert_pool_series(metrics: str) -> None:
    """/metrics of the two pools A and B after A's 3 requests (A, sql, A) and B's 2, all under round_robin, and B's
    swap to least_load: each pool's policies, swaps, decisions, decision quality and refusals under its own `pool`."""
    got = samples(metrics)

    def value(name: str, **labels: str) -> float | None:
        return got.get((name, frozenset(labels.items())))

    info = {(dict(k)["pool"], dict(k)["name"]) for n, k in got if n == "sibyl_policy_info" and ("kind", "routing") in k}
    assert info == {("A", "round_robin"), ("B", "least_load")}
    assert value("sibyl_policy_swaps_total", pool="A", kind="routing") == 0.0
    assert value("sibyl_policy_swaps_total", pool="B", kind="routing") == 1.0
    assert value("sibyl_policy_last_swap_timestamp_seconds", pool="A", kind="routing") == 0.0
    assert (value("sibyl_policy_last_swap_timestamp_seconds", pool="B", kind="routing") or 0.0) > 1e9
    for pool, n in (("A", 3.0), ("B", 2.0)):
        routed = {"kind": "routing", "policy": "round_robin", "outcome": "routed"}
        assert value("sibyl_decisions_total", pool=pool, **routed) == n
        assert value("sibyl_decode_choices_scored_total", pool=pool, router="active") == n
        assert value("sibyl_admission_refusals_total", pool=pool, cause="prefill_backlog") == 0.0
        assert value("sibyl_prefix_achievable_tokens_total", pool=pool) is not None
        assert (value("sibyl_decision_records_total", pool=pool) or 0.0) > 0
    # no series of these families without a pool, nor of a pool that does not exist
    per_pool = (
        "sibyl_policy_info",
        "sibyl_policy_swaps_total",
        "sibyl_decisions_total",
        "sibyl_decode_choices_scored_total",
        "sibyl_admission_refusals_total",
        "sibyl_decision_records_total",
    )
    assert {dict(k).get("pool") for n, k in got if n in per_pool} == {"A", "B"}


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
