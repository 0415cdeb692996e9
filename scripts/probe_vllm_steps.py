"""Measure a vLLM instance's prefill steps from the engine's own iteration log, and its per-request host work.

Starts one plain `vllm serve` (no P/D; the launcher's command and environment for a CPU instance
pinned to one core) with `--enable-logging-iteration-details`, which makes the engine core log every
step: the prompts it computed chunks of, their tokens, and the step's elapsed time. It sends lone
prompts of several lengths (0.4 s apart: no wake-up, no queue) and bursts of k equal prompts at
once, then fits the step time by least squares:

    step = a + b·T + c·Σ(hi² − lo²)

T the prompt tokens the step computed and the sum over its chunks [lo, hi) (chunks inferred first
come first served within max_num_batched_tokens, as vLLM's scheduler forms them). The client's
time for a burst, less the sum of its steps, is the work outside the engine's steps: the API
server's intake and answer and the hand-offs between the processes; its growth per request of a
burst is the host work a batch adds.

    .venv/bin/python scripts/probe_vllm_steps.py --model .build/tiny-llama --out .build/steps.json

It measures; it writes no profile. docs/fidelity.md says which priors of cpu-tiny-llama came from it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from adapters.ports import free_port  # noqa: E402
from adapters.vllm.launcher import VllmInstanceSpec, build_command, build_env  # noqa: E402

ITERATION = re.compile(
    r"Iteration\((\d+)\): (\d+) context requests, (\d+) context tokens, (\d+) generation requests.*"
    r"elapsed time: ([\d.]+) ms"
)
LONE = (32, 128, 256, 512, 768, 1000)
BURSTS = ((128, 256, 512, 900), (2, 3, 4, 6))


def plan() -> list[tuple[str, int, int]]:
    """(kind, prompts, length) of each probe, in order."""
    out = [("lone", 1, length) for length in LONE for _ in range(3)]
    return out + [("burst", k, length) for length in BURSTS[0] for k in BURSTS[1]]


async def drive(url: str, log: Any, vocab: int, seed: int) -> None:
    rng = random.Random(seed)

    async def one(client: httpx.AsyncClient, length: int) -> None:
        prompt = [rng.randrange(5, vocab) for _ in range(length)]  # random ids: no prefix is shared
        r = await client.post(url + "/v1/completions", json={"model": "probe", "prompt": prompt, "max_tokens": 1})
        r.raise_for_status()

    async with httpx.AsyncClient(timeout=120) as client:
        for _ in range(3):
            await one(client, 64)  # warm-up, not measured
        for kind, k, length in plan():
            await asyncio.sleep(0.4)
            t0 = time.monotonic()
            print(f"PROBE {kind} {k} {length}", file=log, flush=True)
            await asyncio.gather(*(one(client, length) for _ in range(k)))
            print(f"PROBE-DONE {1e3 * (time.monotonic() - t0):.2f}", file=log, flush=True)


def parse(text: str, budget: int) -> tuple[np.ndarray, list[tuple[int, float, float, int]]]:
    """Steps (tokens, Σ(hi² − lo²), elapsed s) and probes (prompts, client s, Σ step s, steps)."""
    steps: list[tuple[float, float, float]] = []
    probes: list[tuple[int, float, float, int]] = []
    queue: list[list[int]] = []
    mine: list[float] = []
    k = 0
    for line in text.splitlines():
        if m := re.search(r"PROBE (\w+) (\d+) (\d+)", line):
            k, length = int(m[2]), int(m[3])
            queue, mine = [[0, length] for _ in range(k)], []
        elif m := re.search(r"PROBE-DONE ([\d.]+)", line):
            probes.append((k, float(m[1]) / 1e3, sum(mine), len(mine)))
            queue = []
        elif (m := ITERATION.search(line)) and queue:
            left, quad = int(m[3]), 0.0
            for q in queue:  # first come first served, each prompt's next chunk
                if left <= 0:
                    break
                take = min(left, q[1] - q[0], budget)
                if take <= 0:
                    continue
                quad += (q[0] + take) ** 2 - q[0] ** 2
                q[0] += take
                left -= take
            steps.append((float(m[3]), quad, float(m[5]) / 1e3))
            mine.append(float(m[5]) / 1e3)
    return np.array(steps), probes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="model directory (scripts/make_tiny_llama.py)")
    ap.add_argument("--vllm-venv", default=os.environ.get("VLLM_VENV", ""), help="the vLLM venv (env VLLM_VENV)")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--budget", type=int, default=2048, help="vLLM's max_num_batched_tokens on this platform")
    ap.add_argument("--core", default="0", help="the core the instance is pinned to")
    ap.add_argument("--out", type=Path, help="write the measurements and the fit as JSON")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    vocab = int(json.loads((Path(args.model) / "config.json").read_text())["vocab_size"])
    port = free_port("127.0.0.1")
    spec = VllmInstanceSpec(
        role="prefill",
        port=port,
        model=args.model,
        served_model_name="probe",
        max_model_len=args.max_model_len,
        block_size=128,
        kv_cache_gib=2,
        kv_connector=None,
        enforce_eager=True,
        cpu_bind=args.core,
        extra_args=["--enable-logging-iteration-details", "--max-num-batched-tokens", str(args.budget)],
    )
    cmd = build_command(spec, Path(args.vllm_venv) / "bin" / "vllm")
    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"probe-vllm-steps-{port}.log"
    url = f"http://127.0.0.1:{port}"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            ["taskset", "-c", args.core, *cmd], env={**os.environ, **build_env(spec)}, stdout=log, stderr=log
        )
        try:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    sys.exit(f"vllm serve exited with {proc.returncode}; its log: {log_path}")
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            else:
                sys.exit(f"vllm serve not ready after 300 s; its log: {log_path}")
            asyncio.run(drive(url, log, vocab, args.seed))
            time.sleep(6)  # the stats logger flushes the last iterations
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    steps, probes = parse(log_path.read_text(), args.budget)
    if len(steps) < 10:
        sys.exit(f"only {len(steps)} steps in the engine's log ({log_path}): is --enable-logging-iteration-details on?")
    x = np.c_[np.ones(len(steps)), steps[:, 0], steps[:, 1]]
    coef, *_ = np.linalg.lstsq(x, steps[:, 2], rcond=None)
    rms = float(np.sqrt(np.mean((steps[:, 2] - x @ coef) ** 2)))
    outside = np.array([(k, wall - inside) for k, wall, inside, _ in probes])
    slope, level = np.polyfit(outside[:, 0], outside[:, 1], 1)
    print(f"{len(steps)} engine steps, {len(probes)} probes (log: {log_path})")
    print("| term | value |\n|---|---|")
    print(f"| step constant a | {1e3 * coef[0]:.2f} ms |")
    print(f"| per computed token b | {1e6 * coef[1]:.2f} µs |")
    print(f"| per chunk hi² − lo² c | {coef[2]:.3g} s |")
    print(f"| RMS residual | {1e3 * rms:.2f} ms |")
    print(f"| outside the steps, a lone request | {1e3 * (level + slope):.2f} ms |")
    print(f"| outside the steps, each more request of a burst | {1e3 * slope:.2f} ms |")
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "step_constant_s": coef[0],
                    "per_token_s": coef[1],
                    "per_token2_s": coef[2],
                    "rms_s": rms,
                    "outside_lone_s": level + slope,
                    "outside_per_request_s": slope,
                    "steps": steps.tolist(),
                    "probes": probes,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
