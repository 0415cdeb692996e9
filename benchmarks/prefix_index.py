"""The prefix index (core/cache/index.py) at scale: KV-event ingest rate, lookup latency, memory per block.

Issue 27's targets, on one core: >= 100k block events/s ingested; a longest-prefix lookup of a
32k-token prompt in <= 100 µs at p99 with 100k blocks per instance; memory per cached block stated.

The state: --instances precise instances (default 64), each holding --blocks blocks (100k): the
leading blocks of --probes probe prompts of --prompt-tokens tokens (32k, 16-token blocks: 2,048
keys) at a random depth per instance and probe (64 instances: 64 different match depths per probe,
the lookup's worst case), the rest distinct blocks of other prompts. Lookups:
  depths   every probe against that state (64 different depths)
  full     a prompt every instance holds entirely (one depth)
  miss     a prompt nobody holds (the first key misses)
each by the default (prefix-closed) match and by exact=True (a walk over every key). The default
match learns each chain's runs as it reads them, so the probes are timed three ways:
  warm     the same probes again, nothing changed in between (what the table's "depths" reads)
  cold     the index's run hints dropped before every lookup (a chain seen for the first time)
  changed  before every lookup one instance's depth on that probe moves by a block (BlockStored of
           the next block or BlockRemoved of its last one: what a request's prefill or an eviction
           does), so the hint of that run is stale
Ingest: the whole state as BlockStored events of --event-blocks blocks (a prompt's blocks at once),
then churn (BlockRemoved + BlockStored of one block each: what a decoding request emits).
Memory: tracemalloc on a small index (bytes per key with one holder; per further holder).

Usage: python -m benchmarks.prefix_index [--instances 64] [--blocks 100000] [--reps 2000] [--json]
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import time
import tracemalloc
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from core.cache.events import BlockRemoved, BlockStored, KVEvent
from core.cache.index import CacheIndex
from core.cache.keys import BlockKey


def _keys(rng: np.random.Generator, n: int) -> list[BlockKey]:
    """`n` random signed 63-bit keys (as our chain hashes: spread over the int range)."""
    return [int(k) for k in rng.integers(-(2**62), 2**62, size=n, dtype=np.int64)]


def _chunks(keys: Sequence[BlockKey], size: int) -> list[KVEvent]:
    return [BlockStored(tuple(keys[i : i + size]), None, (), 16) for i in range(0, len(keys), size)]


def build(
    instances: int, blocks: int, prompt_blocks: int, probes: int, event_blocks: int, seed: int = 0
) -> tuple[CacheIndex, dict[str, list[list[BlockKey]]], dict[str, float]]:
    """The index of the module docstring, fed by events; returns it, the probe prompts by scenario
    and the ingest measurement."""
    rng = np.random.default_rng(seed)
    probe_keys = [_keys(rng, prompt_blocks) for _ in range(probes)]
    full_key = _keys(rng, prompt_blocks)
    per_inst: list[list[KVEvent]] = []
    last: list[BlockKey] = []
    for _ in range(instances):
        events: list[KVEvent] = []
        depths = rng.integers(1, prompt_blocks + 1, size=probes)
        held = 0
        for keys, d in zip(probe_keys, depths.tolist(), strict=True):
            events += _chunks(keys[:d], event_blocks)
            held += d
        events += _chunks(full_key, event_blocks)
        held += prompt_blocks
        events += _chunks(_keys(rng, max(blocks - held, 0)), event_blocks)
        per_inst.append(events)
        last.append(events[-1].keys[-1])  # type: ignore[union-attr]
    n_blocks = sum(len(e.keys) for ev in per_inst for e in ev if isinstance(e, BlockStored))
    n_events = sum(len(ev) for ev in per_inst)
    idx = CacheIndex(ttl_s=None)
    gc.collect()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    for i, ev in enumerate(per_inst):
        apply = idx.apply
        for e in ev:
            apply(i, e)
    wall = time.perf_counter() - t0
    del per_inst
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    ingest = {
        "stored_blocks": n_blocks,
        "stored_events": n_events,
        "store_s": wall,
        "store_blocks_per_s": n_blocks / wall,
        "store_events_per_s": n_events / wall,
        "rss_growth_mib": (rss1 - rss0) / 1024,
    }
    # churn: one block removed and one stored per step, on every instance in turn
    steps = 200_000
    fresh = _keys(rng, steps)
    gone = list(last)  # each instance's last stored block: removed, and a fresh one stored, per step
    churn: list[tuple[int, KVEvent]] = []
    for s in range(steps):
        i = s % instances
        churn.append((i, BlockRemoved((gone[i],))))
        churn.append((i, BlockStored((fresh[s],), None, (), 16)))
        gone[i] = fresh[s]
    t0 = time.perf_counter()
    for i, e in churn:
        idx.apply(i, e)
    wall = time.perf_counter() - t0
    ingest |= {"churn_events": len(churn), "churn_s": wall, "churn_events_per_s": len(churn) / wall}
    scenarios = {"depths": probe_keys, "full": [full_key], "miss": [_keys(rng, prompt_blocks)]}
    return idx, scenarios, ingest


def cold(idx: CacheIndex) -> Callable[[list[BlockKey]], None]:
    """Before each lookup: drop the run hints earlier lookups learned."""
    return lambda keys: idx.forget_run_hints()


def changed(idx: CacheIndex, prompts: list[list[BlockKey]], seed: int = 2) -> Callable[[list[BlockKey]], None]:
    """Before each lookup: one instance holding the prompt's first block, picked at random, holds
    one block more of it (BlockStored of the next one) or one less (BlockRemoved of its last one).
    The depths are kept here (read once by exact lookups), so nothing else touches the index."""
    rng = np.random.default_rng(seed)
    depths = {keys[0]: idx.match(keys, exact=True) for keys in prompts}  # exact: learns nothing

    def change(keys: list[BlockKey]) -> None:
        held = depths[keys[0]]
        inst = list(held)[int(rng.integers(len(held)))]
        d = held[inst]
        if d < len(keys) and (d == 1 or rng.random() < 0.5):
            idx.apply(inst, BlockStored((keys[d],), keys[d - 1], (), 16))
            held[inst] = d + 1
        else:
            idx.apply(inst, BlockRemoved((keys[d - 1],)))
            held[inst] = d - 1

    return change


def time_lookups(
    idx: CacheIndex,
    prompts: list[list[BlockKey]],
    reps: int,
    exact: bool,
    before: Callable[[list[BlockKey]], None] | None = None,
) -> dict[str, Any]:
    """`reps` lookups cycling over `prompts` (after a warm-up), each after `before(prompt)` if given
    (untimed): latency in µs and the answers' spread."""
    samples = np.empty(reps)
    match = idx.match
    for k in range(50):
        match(prompts[k % len(prompts)], exact=exact)
    for k in range(reps):
        keys = prompts[k % len(prompts)]
        if before is not None:
            before(keys)
        t0 = time.perf_counter_ns()
        match(keys, exact=exact)
        samples[k] = (time.perf_counter_ns() - t0) / 1000.0
    depths = [len(set(match(p).values())) for p in prompts]
    return {
        "mean_us": float(samples.mean()),
        "p50_us": float(np.percentile(samples, 50)),
        "p99_us": float(np.percentile(samples, 99)),
        "max_us": float(samples.max()),
        "distinct_depths": max(depths),
    }


def against_the_grid(
    idx: CacheIndex, prompts: list[list[BlockKey]], reps: int, before: Callable[[list[BlockKey]], None] | None
) -> dict[str, float]:
    """The default lookup and the grid alone (``_match_grid``: the lookup before run hints)
    alternated on the same prompts, each after its own ``before``: p50/p99 µs of each and the
    ratio of their p50s (one process, so the machine's load weighs on both alike)."""
    holders = idx._holders

    def grid(keys: list[BlockKey]) -> object:
        n = len(keys)
        return idx._match_grid(keys, n, holders.get(keys[0], 0), holders.get(keys[n - 1], 0))

    samples: dict[str, list[float]] = {"runs": [], "grid": []}
    for k in range(reps):
        keys = prompts[k % len(prompts)]
        for name, lookup in (("runs", idx.match), ("grid", grid)):
            if before is not None:
                before(keys)
            t0 = time.perf_counter_ns()
            lookup(keys)
            samples[name].append((time.perf_counter_ns() - t0) / 1000.0)
    out = {f"{name}_{q}": float(np.percentile(v, int(q[1:]))) for name, v in samples.items() for q in ("p50", "p99")}
    return out | {"ratio_p50": out["runs_p50"] / out["grid_p50"]}


def memory_per_block(n: int = 200_000, seed: int = 1) -> dict[str, float]:
    """tracemalloc bytes per key held by one instance, and per further instance holding the same
    keys (the index holding the only reference to each key's int, as when fed by decoded events).
    The two instances take slots 62 and 63, so their masks are not among CPython's cached small ints."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(-(2**62), 2**62, size=n, dtype=np.int64)
    idx = CacheIndex(ttl_s=None)
    for i in range(62):
        idx.apply(f"other{i}", BlockStored((i,), None, (), 16))
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    idx.apply("a", BlockStored(tuple(int(k) for k in raw), None, (), 16))
    one = tracemalloc.get_traced_memory()[0]
    idx.apply("b", BlockStored(tuple(int(k) for k in raw), None, (), 16))
    two = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return {"bytes_first_holder": (one - base) / n, "bytes_further_holder": (two - one) / n}


def run(args: argparse.Namespace) -> dict[str, Any]:
    prompt_blocks = args.prompt_tokens // args.block_size
    idx, scenarios, ingest = build(args.instances, args.blocks, prompt_blocks, args.probes, args.event_blocks)
    lookups = [
        {"scenario": name, "exact": exact, **time_lookups(idx, prompts, args.reps, exact)}
        for name, prompts in scenarios.items()
        for exact in (False, True)
    ]
    probes = scenarios["depths"]
    befores = {"depths, cold": cold(idx), "depths, changed": changed(idx, probes)}
    for name, before in befores.items():
        lookups.append({"scenario": name, "exact": False, **time_lookups(idx, probes, args.reps, False, before)})
    versus = {
        name: against_the_grid(idx, probes, args.reps, before) for name, before in {"depths": None, **befores}.items()
    }
    return {
        "instances": args.instances,
        "blocks_per_instance": args.blocks,
        "prompt_tokens": args.prompt_tokens,
        "block_size": args.block_size,
        "event_blocks": args.event_blocks,
        "keys_indexed": len(idx),
        "ingest": ingest,
        "lookups": lookups,
        "against_the_grid": versus,
        "run_hints": len(idx._runs),
        "memory": memory_per_block(),
    }


def print_report(r: dict[str, Any]) -> None:
    ing, mem = r["ingest"], r["memory"]
    print(
        f"{r['instances']} instances × {r['blocks_per_instance']:,} blocks ({r['keys_indexed']:,} distinct keys); "
        f"lookups of a {r['prompt_tokens']:,}-token prompt ({r['prompt_tokens'] // r['block_size']:,} blocks)\n"
    )
    print("| ingest | events | blocks | s | events/s | blocks/s |")
    print("|---|---:|---:|---:|---:|---:|")
    print(
        f"| BlockStored, up to {r['event_blocks']} blocks each | "
        f"{ing['stored_events']:,} | {ing['stored_blocks']:,} | {ing['store_s']:.2f} | "
        f"{ing['store_events_per_s']:,.0f} | {ing['store_blocks_per_s']:,.0f} |"
    )
    print(
        f"| churn: BlockRemoved + BlockStored, 1 block each | {ing['churn_events']:,} | {ing['churn_events']:,} | "
        f"{ing['churn_s']:.2f} | {ing['churn_events_per_s']:,.0f} | {ing['churn_events_per_s']:,.0f} |"
    )
    print("\n| lookup | match | depths | mean µs | p50 µs | p99 µs | max µs |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for x in r["lookups"]:
        print(
            f"| {x['scenario']} | {'exact walk' if x['exact'] else 'default'} | {x['distinct_depths']} | "
            f"{x['mean_us']:.1f} | {x['p50_us']:.1f} | {x['p99_us']:.1f} | {x['max_us']:.1f} |"
        )
    print("\n| the same probes, alternated | runs p50 / p99 µs | grid alone p50 / p99 µs | p50 ratio |")
    print("|---|---:|---:|---:|")
    for name, v in r["against_the_grid"].items():
        print(
            f"| {name} | {v['runs_p50']:.1f} / {v['runs_p99']:.1f} | {v['grid_p50']:.1f} / {v['grid_p99']:.1f} | "
            f"{v['ratio_p50']:.2f} |"
        )
    print(
        f"\nmemory (tracemalloc): {mem['bytes_first_holder']:.0f} B per key with its first holder, "
        f"{mem['bytes_further_holder']:.0f} B per further holder; RSS grew {ing['rss_growth_mib']:,.0f} MiB "
        f"while ingesting; {r['run_hints']:,} run hints learned by the lookups "
        f"({r['run_hints'] / r['keys_indexed']:.4%} of the keys)"
    )


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--instances", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=100_000, help="blocks held per instance")
    ap.add_argument("--prompt-tokens", type=int, default=32_768)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--probes", type=int, default=8, help="probe prompts with a random depth per instance")
    ap.add_argument("--event-blocks", type=int, default=32, help="blocks per BlockStored event while building")
    ap.add_argument("--reps", type=int, default=2000, help="lookups timed per scenario")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    r = run(args)
    if args.json:
        print(json.dumps(r, indent=1))
    else:
        print_report(r)


if __name__ == "__main__":
    main()
