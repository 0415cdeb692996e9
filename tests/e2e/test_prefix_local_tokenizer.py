"""Chat prompts keyed by the gateway's own tokenizer (`[prefix] tokenizer`) on a live console with emulated
instances: no /tokenize round trip, the second chat sharing a long prefix goes where the first was computed
and hits there, and POST /control/prefix/match shows the index's view of that chat."""

from __future__ import annotations

import re
from pathlib import Path

import httpx

from tests.procs import FAST_PROFILE, kill_children, start_console
from tests.tiny_tokenizer import tokenizer_dir

BLOCK = 128


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def test_chats_are_keyed_locally_and_routed_to_their_cached_prefix(tmp_path: Path) -> None:
    tok = tokenizer_dir(tmp_path / "tokenizer")
    cfg = tmp_path / "console.toml"
    cfg.write_text(
        f'prefill = 2\ndecode = 1\nprofile = "{FAST_PROFILE}"\npolicy = "prefix_aware"\n'
        'params = { decode = "least_load" }\n'
        f'[prefix]\nsource = "approximate"\ntokenize = "local"\ntokenizer = "{tok}"\n'
    )
    con = start_console(tmp_path, str(cfg))
    try:
        prefill = {i["id"]: i["url"] for i in con.state()["instances"] if i["role"] == "prefill"}
        system = {"role": "system", "content": " ".join(["hello world how are you"] * 120)}  # ~600 tokens
        queries = {p: _metric(u, "vllm:prefix_cache_queries_total") for p, u in prefill.items()}
        before = {p: _metric(u, "vllm:prefix_cache_hits_total") for p, u in prefill.items()}
        for question in ("hello", "how are you"):
            r = httpx.post(
                con.url + "/v1/chat/completions",
                json={
                    "model": "sibyl-model",
                    "messages": [system, {"role": "user", "content": question}],
                    "max_tokens": 2,
                },
                timeout=60,
            )
            assert r.status_code == 200, r.text
        first = next(p for p, u in prefill.items() if _metric(u, "vllm:prefix_cache_queries_total") > queries[p])
        hits = {p: _metric(u, "vllm:prefix_cache_hits_total") - before[p] for p, u in prefill.items()}
        assert hits[first] >= BLOCK and sum(hits.values()) == hits[first], hits
        prefix = con.state()["prefix"]
        assert prefix["keyed_share"] == 1.0 and prefix["tokenizer"] == str(tok / "tokenizer.json")
        assert prefix["local_tokenize_ms_mean"] is not None and prefix["tokenize_ms_mean"] == 0.0  # no /tokenize
        body = {"messages": [system, {"role": "user", "content": "hello"}]}
        with con.control() as control:
            r = control.post("/control/prefix/match", json=body)
            bad = control.post("/control/prefix/match", json=[1])
        assert r.status_code == 200, r.text
        seen = r.json()
        assert seen["source"] == "approximate" and seen["blocks"] == 4 and seen["match"][first] == 4, seen
        assert set(seen["match"]) - set(prefill) == {"d0"}  # approximate: the decode leg's instance holds it too
        assert con.state()["prefix"]["keyed_share"] == 1.0  # a lookup is not a request
        assert bad.status_code == 400
    finally:
        con.stop()
        kill_children(con.home)
