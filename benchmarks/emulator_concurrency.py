"""One emulator process under N concurrent streaming requests: does token timing follow the profile?

Each request asks for `x-emulator-timing: 1`, so every SSE chunk carries `emu_deadline`: the
wall-clock time at which the profile says that token's engine step ends (step_time(batch, KV) plus
prefill for new prompts, on an absolute schedule). The error of a token is the time the client
received it minus that deadline: scheduling, HTTP and client delays together. Target (issue 3):
>= 500 concurrent streams with p99 error <= 5 ms.
Usage: python benchmarks/emulator_concurrency.py [--concurrency 500] [--tokens 64] [--profile h20-qwen3-32b]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adapters.emulator.process import EmulatorProcess, free_port  # noqa: E402


async def one(session: aiohttp.ClientSession, url: str, tokens: int, errors: list[float]) -> int:
    body = {"prompt": [1] * 32, "max_tokens": tokens, "ignore_eos": True, "stream": True}
    got = 0
    async with session.post(url, json=body, headers={"x-emulator-timing": "1"}) as r:
        if r.status != 200:
            return -1
        buf = b""
        async for chunk in r.content.iter_any():
            now = time.time()
            buf += chunk
            *events, buf = buf.split(b"\n\n")
            for ev in events:
                if b"emu_deadline" in ev:
                    errors.append(now - orjson.loads(ev[6:])["emu_deadline"])
                    got += 1
    return got


async def main_async(args: argparse.Namespace) -> None:
    port = free_port()
    emu = EmulatorProcess("decode", port, ["--profile", args.profile, "--max-num-seqs", str(args.concurrency), "--kv-capacity-tokens", str(10**8)]).start()
    try:
        emu.wait_ready(30)
        url = f"{emu.url}/v1/completions"
        errors: list[float] = []
        connector = aiohttp.TCPConnector(limit=args.concurrency)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
            await one(session, url, 4, [])  # warm-up
            t0 = time.perf_counter()
            counts = await asyncio.gather(*(one(session, url, args.tokens, errors) for _ in range(args.concurrency)))
            wall = time.perf_counter() - t0
        e = np.array(errors) * 1000
        failed = sum(1 for c in counts if c != args.tokens)
        print(f"emulator profile {args.profile}: {args.concurrency} concurrent streams x {args.tokens} tokens")
        print(f"{'requests':>9} {'tokens':>8} {'wall s':>7} {'tok/s':>8} {'err p50 ms':>11} {'err p99 ms':>11} {'err max ms':>11} {'failed':>7}")
        print(f"{len(counts):>9} {len(e):>8} {wall:>7.2f} {len(e) / wall:>8.0f} {np.percentile(e, 50):>11.2f} {np.percentile(e, 99):>11.2f} {e.max():>11.2f} {failed:>7}")
        print(f"target: p99 <= 5 ms -> {'met' if np.percentile(e, 99) <= 5 and failed == 0 else 'NOT met'}")
    finally:
        emu.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=500)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--profile", default="h20-qwen3-32b")
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
