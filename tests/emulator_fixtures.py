"""Shared pieces of the emulator tests: a fast profile, metric scraping, SSE parsing, polling, a KV-event
subscriber."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import orjson
import zmq
from prometheus_client.parser import text_string_to_metric_families

from adapters.ports import free_port
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


class Events:
    """A SUB socket the emulator's PUB connects to (its endpoint is not a wildcard, so it connects,
    as vLLM's does), decoding batches with plain msgpack by position and field name."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.port = free_port()
        self.sub.bind(f"tcp://127.0.0.1:{self.port}")
        self.replay_port = free_port(avoid=frozenset({self.port}))

    def config(self) -> str:
        return json.dumps(
            {
                "enable_kv_cache_events": True,
                "endpoint": f"tcp://127.0.0.1:{self.port}",
                "replay_endpoint": f"tcp://127.0.0.1:{self.replay_port}",
                "topic": "kv@emu",
            }
        )

    def batches(self, n: int, timeout: float = 5.0) -> list[tuple[int, list[Any]]]:
        """The next `n` batches as (seq, events)."""
        out: list[tuple[int, list[Any]]] = []
        deadline = time.monotonic() + timeout
        while len(out) < n:
            assert self.sub.poll(max(1, int((deadline - time.monotonic()) * 1000))), f"got {len(out)} of {n} batches"
            topic, seq_frame, payload = self.sub.recv_multipart()
            assert topic == b"kv@emu" and len(seq_frame) == 8
            ts, events, rank = msgspec.msgpack.decode(payload)
            assert isinstance(ts, float) and abs(ts - time.time()) < 60 and rank == 0
            out.append((int.from_bytes(seq_frame, "big"), events))
        return out

    def replay(self, start: int) -> list[int]:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{self.replay_port}")
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        seqs = []
        while True:
            assert dealer.poll(5000)
            frames = dealer.recv_multipart()
            if frames[3] == b"":
                assert int.from_bytes(frames[2], "big", signed=True) == -1
                break
            seqs.append(int.from_bytes(frames[2], "big"))
        dealer.close(0)
        return seqs

    def close(self) -> None:
        self.sub.close(0)
        self.ctx.term()
