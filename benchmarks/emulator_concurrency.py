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

import numpy as np
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adapters.emulator.process import EmulatorProcess, free_port  # noqa: E402


class _Stream(asyncio.Protocol):
    """A minimal HTTP/1.1 client: send one request, timestamp every received chunk, parse later.

    Parsing while receiving would put the client's own CPU time into the measurement (client and
    server share the machine's two cores), so only time.time() and a list append happen per chunk.
    """

    def __init__(self, request: bytes, done: asyncio.Future[None]) -> None:
        self.request, self.done = request, done
        self.chunks: list[tuple[float, bytes]] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(self.request)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        self.chunks.append((time.time(), data))
        if b"data: [DONE]" in data:
            self.done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)


async def one(host: str, port: int, tokens: int, errors: list[float]) -> int:
    body = orjson.dumps({"prompt": [1] * 32, "max_tokens": tokens, "ignore_eos": True, "stream": True})
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"x-emulator-timing: 1\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    transport, proto = await loop.create_connection(lambda: _Stream(request, done), host, port)
    await done
    transport.close()
    got = 0
    buf = b""
    for received, data in proto.chunks:
        buf += data
        *events, buf = buf.split(b"\n\n")
        for ev in events:
            start = ev.find(b"data: {")
            if start >= 0 and b"emu_deadline" in ev:
                errors.append(received - orjson.loads(ev[start + 6 :])["emu_deadline"])
                got += 1
    return got


async def main_async(args: argparse.Namespace) -> None:
    port = free_port()
    emu = EmulatorProcess("decode", port, ["--profile", args.profile, "--max-num-seqs", str(args.concurrency), "--kv-capacity-tokens", str(10**8)]).start()
    try:
        emu.wait_ready(30)
        errors: list[float] = []
        await one(emu.host, port, 4, [])  # warm-up
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(emu.host, port, args.tokens, errors) for _ in range(args.concurrency)))
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
