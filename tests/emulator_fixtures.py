"""Shared pieces of the emulator tests: a fast profile, metric scraping, SSE parsing, polling."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import orjson
from prometheus_client.parser import text_string_to_metric_families

from core.perf import PerfProfile, save_profile_file

FAST_PROFILE = PerfProfile(
    name="test-fast",
    description="round numbers for tests: 2 ms steps, cheap prefill, 16-token blocks",
    prefill_base_s=0.002,
    prefill_per_token_s=0.00001,
    decode_step_base_s=0.002,
    decode_step_per_seq_s=0.0001,
    kv_transfer_base_s=0.05,
    kv_transfer_per_token_s=0.0001,
    kv_capacity_tokens=65536,
    block_size=16,
    max_num_seqs=64,
    max_model_len=1024,
)
"""Steps of 2 ms + 0.1 ms per sequence; a KV pull of n tokens takes 50 ms + 0.1 ms per token."""


def profile_file(directory: Path, profile: PerfProfile = FAST_PROFILE) -> str:
    path = directory / f"{profile.name}.json"
    save_profile_file(profile, path)
    return str(path)


def scrape(url: str) -> dict[str, float]:
    """/metrics parsed by prometheus_client: sample name{labels except model_name/engine} → value."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name", "engine"))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def sse(body: bytes) -> list[Any]:
    """The JSON events of an SSE body ("[DONE]" kept as the string)."""
    out: list[Any] = []
    for event in body.split(b"\n\n"):
        if event.startswith(b"data: "):
            payload = event[6:]
            out.append("[DONE]" if payload == b"[DONE]" else orjson.loads(payload))
    return out


def complete(url: str, **body: Any) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, timeout=30)
