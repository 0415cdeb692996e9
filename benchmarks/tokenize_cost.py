"""The gateway's added CPU per request for keying text prompts: none, the local tokenizer, or /tokenize.

Starts an emulated prefill instance (it answers /tokenize) and a zero-latency decode stand-in
(`shared/tools/fake_upstream.py`), then for each mode a console attached to both (`prefix_aware`
routing, `[prefix] source = "approximate"`, SLO admission off) and drives it with
`shared/tools/loadgen.py` (streaming /v1/completions with a text prompt of --prompt-words words,
16 tokens), loaded (64 clients) and unloaded (one). Modes: `[prefix] tokenize = "off"` (text prompts
get no keys: the gateway's cost without keying), `"local"` (the model's tokenizer.json and chat
template in the gateway, adapters/tokenizer.py) and `"instance"` (POST /tokenize on the prefill
instance before routing). The gateway's CPU per request comes from /proc (loadgen --watch-pid).

Usage: python -m benchmarks.tokenize_cost [--tokenizer .build/tiny-llama] [--prompt-words 200] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from adapters.ports import free_port
from adapters.tokenizer import LocalTokenizer
from benchmarks.harness import run_loadgen, start, stop, wait_http

ROOT = Path(__file__).resolve().parents[1]
MODES = ("off", "local", "instance")


def load(loadgen: Path, url: str, pid: int, concurrency: int, n: int, words: int) -> dict[str, Any]:
    return run_loadgen(loadgen, url, pid, concurrency, n, warmup=100, prompt_words=words)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shared", type=Path, default=ROOT.parent / "shared")
    ap.add_argument(
        "--tokenizer", type=Path, default=ROOT / ".build" / "tiny-llama", help="a model dir or tokenizer.json"
    )
    ap.add_argument("--prompt-words", type=int, default=200)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument(
        "--rounds", type=int, default=2, help="each mode this many times, interleaved (a shared box is noisy)"
    )
    ap.add_argument("--profile", default=str(ROOT / "tests" / "data" / "cpu-fast.json"), help="the emulator's profile")
    args = ap.parse_args()
    if not (args.tokenizer.is_file() or (args.tokenizer / "tokenizer.json").is_file()):
        raise SystemExit(f"no tokenizer at {args.tokenizer} (make test-vllm builds .build/tiny-llama)")
    tools = args.shared / "tools"
    pp, dp = free_port(), free_port()
    procs = [
        start(
            [
                sys.executable,
                "-m",
                "adapters.emulator",
                "--role",
                "prefill",
                "--port",
                str(pp),
                "--profile",
                args.profile,
                "--model",
                "fake-model",
            ]
        ),  # fmt: skip
        start([sys.executable, str(tools / "fake_upstream.py"), "--port", str(dp)]),
    ]
    rows = []
    try:
        wait_http(f"http://127.0.0.1:{pp}/health", 60)
        wait_http(f"http://127.0.0.1:{dp}/health")
        for mode in [m for _ in range(args.rounds) for m in MODES]:
            home = tempfile.mkdtemp(prefix="sibyl-tokenize-cost-")
            config = Path(home) / "bench.toml"
            tokenizer = f'tokenizer = "{args.tokenizer}"\n' if mode == "local" else ""
            config.write_text(
                'policy = "prefix_aware"\n[admission]\nenabled = false\n'
                f'[prefix]\nsource = "approximate"\ntokenize = "{mode}"\n{tokenizer}'
            )
            gport = free_port()
            env = {**os.environ, "SIBYL_HOME": home, "SIBYL_DB": f"{home}/runs.db"}
            ours = start(
                [sys.executable, "-m", "console.cli", "up", str(config), "--headless", "--port", str(gport),
                 "--backend", "vllm", "--attach", f"prefill=http://127.0.0.1:{pp};decode=http://127.0.0.1:{dp}"],
                env,
            )  # fmt: skip
            try:
                url = f"http://127.0.0.1:{gport}"
                wait_http(url + "/health", 60, ours)
                loaded = load(tools / "loadgen.py", url, ours.pid, 64, args.requests, args.prompt_words)
                idle = load(tools / "loadgen.py", url, ours.pid, 1, 300, args.prompt_words)
            finally:
                stop(ours)
            cpu = (loaded.get("cpu_pct") or {}).get("proxy")
            rows.append((mode, loaded, idle, cpu / 100 / loaded["req_per_s"] * 1000 if cpu is not None else None))
            print(f"{mode}: {rows[-1][3]} ms CPU/req", file=sys.stderr)
    finally:
        for p in reversed(procs):
            stop(p)
    offs = [r[3] for r in rows if r[0] == "off" and r[3] is not None]
    base = sum(offs) / len(offs) if offs else None
    print(f"prefix_aware, text prompts of {args.prompt_words} words, tokenizer {args.tokenizer}")
    local = LocalTokenizer.load(args.tokenizer)
    body = {"prompt": " ".join(["hello"] * args.prompt_words)}  # loadgen's prompt
    started = time.process_time()
    for _ in range(1000):
        local.token_ids(body)
    cpu_ms = time.process_time() - started  # 1000 calls: seconds = ms per call
    print(f"the local tokenizer alone: {cpu_ms:.3f} ms CPU per prompt ({len(local.token_ids(body) or [])} tokens)")
    print(
        "| text prompts keyed by | req/s @64 | gateway CPU ms/req | added vs off (mean) | p50 ms @64 | p50 ms @1 "
        "| errors |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for mode, loaded, idle, cpu in rows:
        added = "-" if cpu is None or base is None else f"{cpu - base:+.3f}"
        cpu_s = "-" if cpu is None else f"{cpu:.3f}"
        print(
            f"| {mode} | {loaded['req_per_s']:.0f} | {cpu_s} | {added} | {loaded['p50_ms']:.2f} | {idle['p50_ms']:.2f} "
            f"| {loaded['errors'] + idle['errors']} |"
        )


if __name__ == "__main__":
    main()
