"""Replays keep a trace's prefix structure: what the replayer sends, and a real emulator's prefix
cache hitting what the hash ids say it can."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from aiohttp import web

from adapters.emulator.process import running
from adapters.store import RunStore
from console.offline.replay import Replayer
from core.dispatch import Dispatcher
from core.perf import PerfProfile
from core.sim.cluster import ClusterSimulation
from core.sim.cluster.cache import CacheParams
from core.traces import Trace, read_trace
from core.traces.prompts import scaled_length
from tests.emulator_fixtures import FAST_PROFILE, profile_file, scrape
from tests.procs import ROOT

SLICE = ROOT / "tests" / "data" / "traces" / "mooncake_conversation_first500.jsonl"
QUICK = FAST_PROFILE.model_copy(
    update={
        "name": "test-prefix",
        "kv_capacity_tokens": 1 << 20,
        "prefill_base_s": 0.0005,
        "prefill_per_token_s": 1e-7,
        "decode_step_base_s": 0.0005,
        "decode_step_per_seq_s": 0.0,
    }
)
"""Quick steps and room for every block of the slice (no evictions); 16-token blocks, 1,024-token context."""


def ideal_hits(
    hash_ids: list[list[int]], lengths: list[int], block: int, seen: set[tuple[int, ...]] | None = None
) -> int:
    """Prefix-cache hits (tokens) a single instance with room for everything gets when the rows
    arrive one after another, each hash block being one `block`-token KV block: a row reuses its
    leading full blocks whose whole hash-id prefix an earlier row sent as full blocks, at most
    (length − 1) // block of them (vLLM recomputes the last token, so never the whole prompt);
    partial last blocks are never cached. No evictions (the cache holds every block)."""
    seen = set() if seen is None else seen
    hits = 0
    for ids, n in zip(hash_ids, lengths, strict=True):
        chains = [tuple(ids[: b + 1]) for b in range(min(len(ids), n // block))]
        k = 0
        while k < len(chains) and chains[k] in seen:
            k += 1
        hits += block * min(k, (n - 1) // block)
        seen.update(chains)
    return hits


def simulated_hits(trace: Trace, lengths: list[int], profile: PerfProfile) -> int:
    """Prefix-cache hits of the cluster simulator's prefill instance on the same rows, one at a time
    (replay seed 1, each hash block as 16 tokens), as the emulator was sent them."""
    n = len(lengths)
    dispatcher = Dispatcher(profile, "round_robin", None, true_lengths=True)
    sim = ClusterSimulation(
        arrivals=np.arange(n, dtype=np.float64) * 60.0,
        prompt_tokens=np.array(lengths),
        output_tokens=np.ones(n, dtype=np.int64),
        profile=profile,
        n_prefill=1,
        n_decode=1,
        dispatcher=dispatcher,
        hash_ids=trace.hash_ids,
        cache=CacheParams(hash_block_tokens=16, prompt_seed=1),
    )
    queries, hits = sim.run().cache_lookups["p0"]
    assert queries == sum(lengths)
    return hits


def collect(rep: Replayer) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    rep.on_result = rows.append
    asyncio.run(rep.run())
    return sorted(rows, key=lambda r: int(r["request_id"].rsplit("-", 1)[1]))


def test_the_replayer_sends_hash_blocks_sessions_and_reads_cached_tokens() -> None:
    trace = Trace(
        "t",
        np.zeros(4),
        np.array([1100, 2300, 900, 700]),
        np.full(4, 3),
        hash_ids=[[0, 1, 2], [0, 1, 2, 3, 4], [0, 7], []],
    )
    seen: list[tuple[dict[str, Any], dict[str, str]]] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        seen.append((orjson.loads(await request.read()), {k.lower(): v for k, v in request.headers.items()}))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices":[{"index":0,"text":" t0"}]}\n\n')
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 16}}
        await resp.write(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\ndata: [DONE]\n\n")
        return resp

    async def main() -> list[dict[str, Any]]:
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        rows: list[dict[str, Any]] = []
        try:
            rep = Replayer.from_trace(
                trace,
                f"http://127.0.0.1:{port}",
                hash_block_tokens=16,
                prompt_seed=5,
                max_concurrency=1,
                on_result=rows.append,
                id_prefix="run1",
            )
            await rep.run()
        finally:
            await runner.cleanup()
        return rows

    rows = asyncio.run(main())
    assert [r["status"] for r in rows] == ["ok"] * 4 and {r["cached_tokens"] for r in rows} == {16}
    bodies = {h["x-request-id"]: (b, h) for b, h in seen}
    prompts = [bodies[f"run1-0-{i}"][0]["prompt"] for i in range(4)]
    assert [len(p) for p in prompts] == [scaled_length(n, 16) for n in (1100, 2300, 900, 700)] == [35, 72, 29, 22]
    assert prompts[1][:35] == prompts[0]  # the next turn extends the first, partial block included
    assert prompts[2][:16] == prompts[0][:16] and prompts[2][16:29] != prompts[0][16:29]
    assert prompts[3][:16] != prompts[0][:16]  # no hash ids: fresh ids
    sessions = [bodies[f"run1-0-{i}"][1]["x-session-id"] for i in range(4)]
    assert sessions == ["run1-0-s0", "run1-0-s0", "run1-0-s2", "run1-0-s3"]
    assert all("user" not in bodies[f"run1-0-{i}"][0] for i in range(4))  # the gateway's tenant stays the client's


def test_an_emulator_hits_its_prefix_cache_as_the_hash_ids_predict(tmp_path: Path) -> None:
    """The first 500 Mooncake conversation rows, each 512-token hash block as one 16-token block, sent
    one at a time to one emulated instance with room for every block: its prefix-cache hits equal the
    ideal from the hash ids. A replay under a new --prompt-seed hits only its own prefixes (the same
    ideal, nothing of the first replay); the first seed again hits everything it can."""
    profile = QUICK
    trace = read_trace(SLICE)
    trace = Trace(
        trace.name, trace.arrivals, trace.prompt_tokens, np.ones(len(trace), dtype=np.int64), hash_ids=trace.hash_ids
    )
    assert trace.hash_ids is not None
    with running(("both", ["--profile", profile_file(tmp_path, profile)]), log_dir=tmp_path) as (p,):

        def replay(seed: int) -> tuple[float, float, list[int]]:
            before = scrape(p.url)
            rep = Replayer.from_trace(
                trace,
                p.url,
                hash_block_tokens=16,
                prompt_seed=seed,
                speed=1e6,
                max_concurrency=1,
                max_context=1024,
                id_prefix=f"s{seed}",
            )
            rows = collect(rep)
            assert all(r["status"] == "ok" for r in rows), rows[:3]
            after = scrape(p.url)
            hits = after["vllm:prefix_cache_hits_total"] - before.get("vllm:prefix_cache_hits_total", 0.0)
            queries = after["vllm:prefix_cache_queries_total"] - before.get("vllm:prefix_cache_queries_total", 0.0)
            return hits, queries, [r["prompt_tokens"] for r in rows]

        hits, queries, lengths = replay(1)
        assert lengths == [min(scaled_length(n, 16), 1023) for n in trace.prompt_tokens.tolist()]
        assert queries == sum(lengths)
        ideal = ideal_hits(trace.hash_ids, lengths, 16)
        cap = sum(16 * ((n - 1) // 16) for n in lengths)
        print(
            json.dumps(
                {
                    "hits": hits,
                    "ideal": ideal,
                    "queries": queries,
                    "hit_rate": hits / queries,
                    "ideal_rate": ideal / queries,
                    "capped_all": cap,
                }
            )
        )
        assert ideal > 0.15 * queries  # the slice has real reuse: the system prompt and 74 later turns
        assert hits == ideal
        assert simulated_hits(trace, lengths, profile) == hits  # the simulator's cache agrees to the token
        fresh, queries2, _ = replay(2)
        assert queries2 == queries and fresh == ideal  # nothing of replay 1 was reused
        again, _, _ = replay(1)
        assert again == cap  # the same seed: every full block (short of the last token) is cached


def test_the_replay_command_scales_hash_blocks_and_records_its_options(tmp_path: Path) -> None:
    env = {**os.environ, "SIBYL_HOME": str(tmp_path / "home"), "SIBYL_DB": str(tmp_path / "runs.db"), "COLUMNS": "200"}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "console.cli", "replay", *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    out = cli("--help")
    assert out.returncode == 0 and "--hash-block-tokens" in out.stdout and "--session-min-blocks" in out.stdout
    azure = ROOT / "tests" / "data" / "traces" / "azure_sample.csv"
    out = cli(str(azure), "--hash-block-tokens", "16", "--url", "http://127.0.0.1:9")
    assert out.returncode == 2 and "has no hash_ids" in out.stderr
    with running(("both", ["--profile", profile_file(tmp_path, QUICK)]), log_dir=tmp_path) as (p,):
        out = cli(
            str(SLICE),
            "--limit",
            "30",
            "--speed",
            "1000",
            "--hash-block-tokens",
            "16",
            "--prompt-seed",
            "3",
            "--url",
            p.url,
            "--json",
        )
        assert out.returncode == 0, out.stderr
        summary = json.loads(out.stdout)
        assert summary["done"] == 30
        hits = scrape(p.url)["vllm:prefix_cache_hits_total"]
    run = RunStore(tmp_path / "runs.db").get_run(summary["run_id"])
    assert run.config["hash_block_tokens"] == 16 and run.config["prefixes"] is True and run.config["prompt_seed"] == 3
    assert (
        run.config["session_min_blocks"] == 2 and run.config["sessions"] == 30
    )  # the first 30 rows are 30 conversations
    rows = RunStore(tmp_path / "runs.db").requests(summary["run_id"])
    assert sorted(r["prompt_tokens"] for r in rows) == sorted(
        min(scaled_length(n, 16), 1024 - o)
        for n, o in zip(
            read_trace(SLICE, limit=30).prompt_tokens.tolist(),
            read_trace(SLICE, limit=30).output_tokens.tolist(),
            strict=True,
        )
    )
    assert hits >= 16 * 20  # at least the shared system-prompt block of most rows (they arrive in two bursts)
