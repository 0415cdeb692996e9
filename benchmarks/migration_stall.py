"""How long a client's stream stalls when its request is live-migrated between emulated decode
instances, in milliseconds and in the request's own decode steps (target: under two).

For each profile a console (1P2D, emulated, started here on a free port and stopped at the end)
serves --migrations streaming requests one after another; each is migrated to the other decode
instance mid-stream through the control API. The stall is what the gateway measured: the gap
between the last token from the source and the first from the target. The final stage's KV
transfer is part of it, so a profile whose transfer latency is large next to its decode step
(cpu-tiny-llama: 15 ms per transfer against ~3 ms steps) cannot get under two steps.

Usage: python -m benchmarks.migration_stall [--profile cpu-tiny-llama --profile h20-qwen3-32b] [--migrations 8]
"""

from __future__ import annotations

import argparse
import re
import secrets
import sys
import threading
import time
import uuid
from pathlib import Path
from tempfile import TemporaryDirectory

import httpx
import numpy as np

from adapters.ports import free_port
from adapters.store import RunStore
from benchmarks.harness import console_env, start_console, stop
from core.perf import get_profile

ROOT = Path(__file__).resolve().parents[1]

STALL = re.compile(r"waited ([\d.]+) ms between tokens \(([\d.]+) of its decode steps of ([\d.]+) ms\)")


def measure(profile: str, migrations: int, home: Path) -> list[tuple[float, float, float]]:
    """(stall ms, stall in decode steps, step ms) per migration."""
    port, token = free_port(), secrets.token_urlsafe(16)
    console = start_console(
        port,
        ["--prefill", "1", "--decode", "2", "--profile", profile, "--policy", "round_robin"],
        console_env(home, token),
    )
    url = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {token}"}
    steps = get_profile(profile).step_time(1, 100)
    tokens = int(min(get_profile(profile).max_model_len - 16, max(200, 1.5 / steps)))  # ~1.5 s of decoding
    try:
        for k in range(migrations):
            rid = uuid.uuid4().hex
            body = {
                "model": "sibyl-model",
                "prompt": f"stall {k}",
                "max_tokens": tokens,
                "ignore_eos": True,
                "stream": True,
            }
            t = threading.Thread(
                target=lambda b=body, r=rid: httpx.post(
                    url + "/v1/completions", json=b, headers={"X-Request-Id": r}, timeout=120
                )
            )
            t.start()
            source = None
            while source is None:
                state = httpx.get(url + "/control/state", headers=auth).json()
                busy = [i["id"] for i in state["instances"] if i["role"] == "decode" and i["running"] > 0]
                source = busy[0] if busy else None
                time.sleep(0.05)
            time.sleep(0.3)  # let it decode a while: the step time is its own mean gap before the move
            target = "d1" if source == "d0" else "d0"
            r = httpx.post(
                url + "/control/migrate", json={"request_id": rid, "target": target}, headers=auth, timeout=60
            )
            if r.status_code != 200:
                print(f"  migration {k}: refused: {r.text[:200]}", file=sys.stderr)
            t.join(120)
            print(f"  {profile}: {k + 1}/{migrations}", file=sys.stderr, flush=True)
    finally:
        stop(console, 60)
    store = RunStore(home / "runs.db")
    out = []
    for run in store.list_runs():
        for e in store.instance_events(run.run_id):
            m = STALL.search(e["detail"] or "") if e["event"] == "migrated" else None
            if m:
                out.append((float(m.group(1)), float(m.group(2)), float(m.group(3))))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", action="append", help="emulator profile (repeatable) [cpu-tiny-llama, h20-qwen3-32b]")
    ap.add_argument("--migrations", type=int, default=8)
    a = ap.parse_args()
    profiles = a.profile or ["cpu-tiny-llama", "h20-qwen3-32b"]
    print(
        "| profile | migrations | KV transfer base (ms) | step (ms) | stall p50 (ms) "
        "| p90 (ms) | stall p50 (steps) | p90 (steps) | under 2 steps |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for profile in profiles:
        with TemporaryDirectory() as tmp:
            rows = measure(profile, a.migrations, Path(tmp))
        if not rows:
            print(f"| {profile} | 0 | | | | | | | |")
            continue
        ms, st, step = (np.array(x) for x in zip(*rows, strict=True))
        base = get_profile(profile).kv_transfer_base_s * 1000
        print(
            f"| {profile} | {len(rows)} | {base:.1f} | {np.median(step):.1f} | "
            f"{np.median(ms):.1f} | {np.percentile(ms, 90):.1f} | {np.median(st):.2f} "
            f"| {np.percentile(st, 90):.2f} | {int((st < 2).sum())}/{len(st)} |"
        )


if __name__ == "__main__":
    main()
