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
each by the default (prefix-closed) match and by exact=True (a walk over every key).
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
from collections.abc import Sequence
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


def time_lookups(idx: CacheIndex, prompts: list[list[BlockKey]], reps: int, exact: bool) -> dict[str, Any]:
    """`reps` lookups cycling over `prompts` (after a warm-up): latency in µs and the answers' spread."""
    samples = np.empty(reps)
    match = idx.match
    for k in range(50):
        match(prompts[k % len(prompts)], exact=exact)
    for k in range(reps):
        keys = prompts[k % len(prompts)]
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
    return {
        "instances": args.instances,
        "blocks_per_instance": args.blocks,
        "prompt_tokens": args.prompt_tokens,
        "block_size": args.block_size,
        "event_blocks": args.event_blocks,
        "keys_indexed": len(idx),
        "ingest": ingest,
        "lookups": lookups,
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
    print(
        f"\nmemory (tracemalloc): {mem['bytes_first_holder']:.0f} B per key with its first holder, "
        f"{mem['bytes_further_holder']:.0f} B per further holder; RSS grew {ing['rss_growth_mib']:,.0f} MiB "
        "while ingesting"
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
