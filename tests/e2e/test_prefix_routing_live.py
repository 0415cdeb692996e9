"""Prefix-aware routing on a live console with emulated instances: where a prefix is cached, the next
request sharing it goes, and the engine there reports the hit (approximate and precise index alike)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.procs import FAST_PROFILE, Console, kill_children, start_console, wait_for

BLOCK = 128
"""The test profiles' KV block size (the console keys requests in the engines' own block size)."""


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def _console(tmp: Path, source: str, policy: str, prefill: int, decode: int) -> Console:
    cfg = tmp / "console.toml"
    cfg.write_text(
        f'prefill = {prefill}\ndecode = {decode}\nprofile = "{FAST_PROFILE}"\npolicy = "{policy}"\n'
        'params = { decode = "least_load" }\n'
        f'[prefix]\nsource = "{source}"\n'
    )
    return start_console(tmp, str(cfg))


@pytest.fixture
def cleanup() -> Iterator[list[Console]]:
    consoles: list[Console] = []
    yield consoles
    for con in consoles:
        con.stop()
        kill_children(con.home)


def _complete(url: str, prompt: list[int]) -> None:
    r = httpx.post(
        url + "/v1/completions",
        json={"model": "sibyl-model", "prompt": prompt, "max_tokens": 2, "ignore_eos": True},
        timeout=60,
    )
    assert r.status_code == 200, r.text


def _events_followed(con: Console, n: int) -> bool:
    prefix = con.state().get("prefix") or {}
    events = prefix.get("events") or {}
    return len(events) == n and all(e["connected"] for e in events.values())


@pytest.mark.parametrize(
    "source",
    # approximate runs in make test-slow (~9 s); the default suite keys approximately in the text-prompt test below
    [pytest.param("approximate", marks=pytest.mark.slow), "precise"],
)
def test_a_request_goes_where_its_prefix_is_cached_and_hits_there(
    tmp_path: Path, cleanup: list[Console], source: str
) -> None:
    con = _console(tmp_path, source, "prefix_aware", prefill=2, decode=1)
    cleanup.append(con)
    state = con.state()
    assert state["prefix"]["source"] == source and state["prefix"]["block_size"] == BLOCK
    prefill_urls = {i["id"]: i["url"] for i in state["instances"] if i["role"] == "prefill"}
    if source == "precise":  # every instance publishes; the console follows each stream
        wait_for(lambda: _events_followed(con, 3), 30, "a KV-event subscription per instance")
    for k in range(4):  # four distinct 6-block prefixes, each sent twice (the second with a new tail)
        shared = list(range(1000 * (k + 1), 1000 * (k + 1) + 6 * BLOCK))
        before = {p: _metric(u, "vllm:prefix_cache_hits_total") for p, u in prefill_urls.items()}
        queries = {p: _metric(u, "vllm:prefix_cache_queries_total") for p, u in prefill_urls.items()}
        seq = {i: e["last_seq"] for i, e in (con.state()["prefix"].get("events") or {}).items()}
        _complete(con.url, shared + [7] * 8)
        first = next(p for p, u in prefill_urls.items() if _metric(u, "vllm:prefix_cache_queries_total") > queries[p])
        if source == "precise":  # the index hears the blocks before the next request is routed

            def heard(f: str = first, s: dict[str, int] = seq) -> bool:
                last = con.state()["prefix"]["events"][f]["last_seq"]
                return last is not None and (s[f] is None or last > s[f])

            wait_for(heard, 10, f"{first}'s BlockStored batch")
        _complete(con.url, shared + [9] * 24)
        hits = {p: _metric(u, "vllm:prefix_cache_hits_total") - before[p] for p, u in prefill_urls.items()}
        assert hits[first] == 6 * BLOCK, (k, first, hits)  # the second request went to the first's instance
        assert sum(hits.values()) == 6 * BLOCK
    assert con.state()["prefix"]["keyed_share"] == 1.0


def test_prefix_pd_serves_a_request_on_the_decode_instance_that_holds_its_prompt(
    tmp_path: Path, cleanup: list[Console]
) -> None:
    con = _console(tmp_path, "precise", "prefix_pd", prefill=1, decode=1)
    cleanup.append(con)
    urls = {i["role"]: i["url"] for i in con.state()["instances"]}
    wait_for(lambda: _events_followed(con, 2), 30, "a KV-event subscription per instance")
    d_id = next(i["id"] for i in con.state()["instances"] if i["role"] == "decode")
    seq = con.state()["prefix"]["events"][d_id]["last_seq"]
    prompt = list(range(5000, 5000 + 7 * BLOCK))
    _complete(con.url, prompt)  # P computes it, D pulls and caches the 7 blocks

    def heard() -> bool:
        last = con.state()["prefix"]["events"][d_id]["last_seq"]
        return last is not None and (seq is None or last > seq)

    wait_for(heard, 10, "the decode instance's BlockStored batch")
    prefill_before = _metric(urls["prefill"], "vllm:prompt_tokens_total")
    hits_before = _metric(urls["decode"], "vllm:prefix_cache_hits_total")
    _complete(con.url, prompt + [3] * 8)  # 7 full blocks of 7.06 held by D: no prefill leg
    assert _metric(urls["prefill"], "vllm:prompt_tokens_total") == prefill_before  # P saw nothing
    assert _metric(urls["decode"], "vllm:prefix_cache_hits_total") - hits_before == 7 * BLOCK  # D reused its blocks


def test_text_prompts_are_keyed_through_the_engines_tokenizer(tmp_path: Path, cleanup: list[Console]) -> None:
    """A text prompt gets prefix keys from a prefill instance's /tokenize (for a policy that reads the
    cache): the second request sharing a long text prefix goes where the first was computed."""
    con = _console(tmp_path, "approximate", "prefix_aware", prefill=2, decode=1)
    cleanup.append(con)
    prefill_urls = {i["id"]: i["url"] for i in con.state()["instances"] if i["role"] == "prefill"}
    shared = " ".join(f"w{k}" for k in range(700))
    queries = {p: _metric(u, "vllm:prefix_cache_queries_total") for p, u in prefill_urls.items()}
    before = {p: _metric(u, "vllm:prefix_cache_hits_total") for p, u in prefill_urls.items()}
    for tail in (" first", " second"):
        r = httpx.post(
            con.url + "/v1/completions",
            json={"model": "sibyl-model", "prompt": shared + tail, "max_tokens": 2},
            timeout=60,
        )
        assert r.status_code == 200, r.text
    first = next(p for p, u in prefill_urls.items() if _metric(u, "vllm:prefix_cache_queries_total") > queries[p])
    hits = {p: _metric(u, "vllm:prefix_cache_hits_total") - before[p] for p, u in prefill_urls.items()}
    assert hits[first] >= BLOCK and sum(hits.values()) == hits[first], hits
    prefix = con.state()["prefix"]
    assert prefix["keyed_share"] == 1.0 and prefix["tokenize_ms_mean"] is not None
