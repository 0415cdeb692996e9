"""The prefix sweep's cells, policies and profile, and one cell's runs: the slice's floors and a row per policy."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.paths import AZURE_CONV
from console.offline.simulate import PrefixSource, SimPlan, run_one
from core.cache.trace_keys import TraceKeys
from core.perf import (
    ACCELERATORS,
    MODELS,
    AcceleratorSpec,
    PerfProfile,
    get_profile,
    roofline_profile,
)
from core.sim.cluster import CacheParams
from core.slo import SLOClass
from core.traces import Trace, read_trace

BASE_PROFILE = "roofline-h100-qwen2.5-7b"
MAX_MODEL_LEN = 131_072
HASH_BLOCK_TOKENS = 512

TRACES: dict[str, tuple[Path, str]] = {
    "mooncake-conv": (Path("mooncake_fast25") / "conversation_trace.jsonl", "mooncake"),
    "mooncake-synth": (Path("mooncake_fast25") / "synthetic_trace.jsonl", "mooncake"),
    "azure-conv": (AZURE_CONV, "azure"),
}


@dataclass(frozen=True)
class Cell:
    trace: str
    pd: str
    """Instances as "P:D", e.g. "4:4"."""
    rate: float
    """Arrival rate, requests/s (the slice's arrivals rescaled to it)."""
    cache: float
    """Cached blocks per instance as a multiple of the profile's KV capacity."""
    tp: int = 1
    """GPUs per instance (tensor parallel: the roofline of a TP-times larger accelerator)."""

    @property
    def prefill(self) -> int:
        return int(self.pd.split(":")[0])

    @property
    def decode(self) -> int:
        return int(self.pd.split(":")[1])

    @property
    def key(self) -> str:
        tp = f"/tp{self.tp}" if self.tp != 1 else ""
        return f"{self.trace}/{self.prefill}P{self.decode}D{tp}/rate{self.rate:g}/cache{self.cache:g}x"


@dataclass(frozen=True)
class PolicyCase:
    label: str
    name: str
    params: dict[str, Any] = field(default_factory=dict)
    source: PrefixSource = "precise"


POLICIES: list[PolicyCase] = [
    PolicyCase("least_load", "least_load"),
    PolicyCase("round_robin", "round_robin"),
    PolicyCase("sibyl", "sibyl"),
    PolicyCase("session_affinity", "session_affinity"),
    PolicyCase("prefix_aware(approx)", "prefix_aware", source="approximate"),
    PolicyCase("prefix_aware(precise)", "prefix_aware"),
    PolicyCase("prefix_pd", "prefix_pd"),
    PolicyCase("oracle", "oracle"),
]
BASELINE = "least_load"
DEFAULT = "sibyl"
ORACLE = "oracle"
PRECISE = "prefix_aware(precise)"
APPROX = "prefix_aware(approx)"

OPERATING_POINT = Cell("mooncake-conv", "4:4", 6.5, 4.0)
"""Where least_load's P99 TTFT is 2-10 s on mooncake-conv, one H100 per instance (a search over
the rate at 4P4D, cache x4: 6.0 → 7.3 s, 6.5 → 8.8 s, 7.0 → 9.8 s, 7.5 → 17.8 s). The targets are read here."""
OPERATING_POINT_TP4 = Cell("mooncake-conv", "2:2", 11.0, 1.0, tp=4)
"""The same with 4 H100s per instance (prefill 4x faster, so the P99 is mostly queueing, not the
longest prompts' own prefill): a search over the rate at 2P2D, cache x1: 10 → 2.4 s, 11 → 3.0 s,
11.5 → 2.9 s, 12 → 3.6 s, 13 → 4.1 s (not monotone: the trace's arrivals come in 3-s batches)."""
OPERATING_POINT_QUEUE = Cell("mooncake-conv", "4:4", 29.0, 1.0, tp=4)
"""Where queueing, not the longest prompts' own prefill, sets least_load's P99 (4 H100s per instance, 4P4D,
at the knee of the prefill pool's load): least_load's P99 TTFT 6.3 s against a no-queue floor of 1.4 s.
Chosen by least_load's P99 alone (the 2-10 s window), no policy parameter changed; its neighbours in the
grid (27 and 31 req/s, and 2P2D at 14.5 and 15) were not looked at first."""
OPERATING_POINTS = (OPERATING_POINT, OPERATING_POINT_TP4, OPERATING_POINT_QUEUE)

GRIDS: dict[str, list[Cell]] = {
    "full": [
        OPERATING_POINT,
        Cell("mooncake-conv", "4:4", 6.0, 4.0),  # another rate (not tuned on)
        Cell("mooncake-conv", "4:4", 6.5, 1.0),  # GPU memory only
        Cell("mooncake-conv", "4:2", 6.5, 4.0),  # another P:D ratio
        OPERATING_POINT_TP4,
        Cell("mooncake-conv", "2:2", 10.0, 1.0, tp=4),  # another rate (not tuned on)
        Cell("mooncake-conv", "2:2", 11.5, 1.0, tp=4),  # the other side of the knee
        OPERATING_POINT_QUEUE,
        Cell("mooncake-conv", "4:4", 27.0, 1.0, tp=4),  # another rate (not tuned on)
        Cell("mooncake-conv", "4:4", 31.0, 1.0, tp=4),  # another rate (not tuned on)
        Cell("mooncake-conv", "2:2", 14.5, 1.0, tp=4),  # another P:D count, queueing too (not tuned on)
        Cell("mooncake-conv", "2:2", 15.0, 1.0, tp=4),
        Cell("mooncake-synth", "4:4", 3.5, 4.0),  # the synthetic trace (not tuned on)
        Cell("mooncake-synth", "4:4", 3.5, 1.0),
        Cell("azure-conv", "4:4", 40.0, 1.0),  # the control: nothing to reuse
        Cell("azure-conv", "2:4", 30.0, 1.0),
        Cell("azure-conv", "2:4", 36.0, 1.0),  # prefill about 90% busy: queues form
    ],
    "quick": [OPERATING_POINT, Cell("azure-conv", "4:4", 40.0, 1.0)],
}
REQUESTS = {"full": 3000, "quick": 200}


@cache
def sweep_profile(tp: int = 1) -> PerfProfile:
    """The sweep's profile: BASE_PROFILE (the H100 roofline of Qwen2.5-7B) with a 128k context
    (Qwen2.5-7B with YaRN); with `tp` > 1, the roofline of one instance on `tp` H100s (compute,
    memory, bandwidth and link times tp; no tensor-parallel overhead counted)."""
    if tp == 1:
        base = get_profile(BASE_PROFILE)
    else:
        h100 = ACCELERATORS["h100"]
        accel = AcceleratorSpec(
            name=f"h100x{tp}",
            flops=tp * h100.flops,
            mem_bandwidth=tp * h100.mem_bandwidth,
            memory_bytes=tp * h100.memory_bytes,
            link_bandwidth=tp * h100.link_bandwidth,
        )
        base = roofline_profile(MODELS["qwen2.5-7b"], accel, name=f"roofline-h100x{tp}-qwen2.5-7b")
    return base.model_copy(update={"name": f"{base.name}-128k", "max_model_len": MAX_MODEL_LEN})


@cache
def _read(folder: str, name: str) -> Trace:
    path, fmt = TRACES[name]
    return read_trace(Path(folder) / path, fmt)


def load_trace(name: str, requests: int, folder: Path) -> Trace:
    """The first `requests` rows of a trace, with sessions derived from its hash ids."""
    return _read(str(folder), name).window(limit=requests).with_sessions()


def ideal_cached(hash_ids: Sequence[Sequence[int]], prompts: np.ndarray, block_size: int) -> np.ndarray:
    """Per request: prompt tokens one unbounded cache would hold, having seen every earlier prompt
    (whole blocks, capped at prompt − 1 tokens as vLLM caps a hit). Keys as the simulator's."""
    tk = TraceKeys(block_size, hash_block_tokens=HASH_BLOCK_TOKENS, seed=(0, 0))
    seen: set[Any] = set()
    out = np.zeros(len(prompts), dtype=np.int64)
    for i, (ids, n) in enumerate(zip(hash_ids, prompts.tolist(), strict=True)):
        keys = tk.keys(ids, n, i)
        cap = min(len(keys), max(n - 1, 0) // block_size)
        k = 0
        while k < cap and keys[k] in seen:
            k += 1
        out[i] = k * block_size
        seen.update(keys)
    return out


def floors(t: Trace, profile: PerfProfile) -> dict[str, float]:
    """The slice's ideal hit rate and the no-queue P99 prefill with and without ideal reuse."""
    prompts = t.prompt_tokens
    no_reuse = float(np.percentile(profile.prefill_time(prompts.astype(float)), 99))
    if t.hash_ids is None:
        return {"ideal_hit_rate": 0.0, "floor_p99_s": no_reuse, "floor_p99_no_reuse_s": no_reuse}
    cached = ideal_cached(t.hash_ids, prompts, profile.block_size)
    uncached = np.maximum(prompts - cached, 1).astype(float)
    return {
        "ideal_hit_rate": float(cached.sum() / prompts.sum()),
        "floor_p99_s": float(np.percentile(profile.prefill_time(uncached), 99)),
        "floor_p99_no_reuse_s": no_reuse,
    }


def plan_for(cell: Cell, t: Trace, profile: PerfProfile, source: PrefixSource) -> SimPlan:
    t = t.with_rate(cell.rate)
    hashed = t.hash_ids is not None
    return SimPlan(
        arrivals=t.arrivals,
        prompt_tokens=t.prompt_tokens,
        output_tokens=t.output_tokens,
        workload=cell.trace,
        profile=profile,
        n_prefill=cell.prefill,
        n_decode=cell.decode,
        mode="ps",
        policies=[],
        slo=SLOClass(),
        shadow=False,
        hash_ids=t.hash_ids,
        sessions=[str(s) for s in t.session.tolist()] if hashed and t.session is not None else None,
        cache=CacheParams(
            capacity_blocks=max(1, int(cell.cache * profile.kv_capacity_tokens) // profile.block_size),
            hash_block_tokens=HASH_BLOCK_TOKENS,
        ),
        prefix_source=source,
    )


def _clean(x: Any) -> Any:
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    return x


METRICS = (
    "ttft_p50",
    "ttft_p99",
    "ttft_mean",
    "tpot_p99",
    "tpot_mean",
    "completed",
    "failed",
    "prefix_hit_rate",
    "kv_transferred_tokens",
    "kv_transferred_share",
    "decode_only",
    "sim_wall_s",
)


def run_cell(
    cell: Cell,
    policies: Sequence[PolicyCase],
    *,
    requests: int,
    folder: Path,
    done: set[tuple[str, str]] | None = None,
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Simulate every policy not yet `done` on one cell; returns (and hands to `on_row`) the rows."""
    todo = [p for p in policies if done is None or (cell.key, p.label) not in done]
    if not todo:
        return []
    profile = sweep_profile(cell.tp)
    t = load_trace(cell.trace, requests, folder)
    ref = floors(t, profile)
    rows = []
    for case in todo:
        metrics, _ = run_one(plan_for(cell, t, profile, case.source), case.name, dict(case.params))
        row = {
            "cell": cell.key,
            "trace": cell.trace,
            "pd": cell.pd,
            "prefill": cell.prefill,
            "decode": cell.decode,
            "tp": cell.tp,
            "rate": cell.rate,
            "cache": cell.cache,
            "policy": case.label,
            "name": case.name,
            "params": case.params,
            "source": case.source,
            "requests": requests,
            "profile": profile.name,
            **ref,
            **{k: _clean(metrics.get(k)) for k in METRICS},
        }
        row["prefix_hit_rate"] = row["prefix_hit_rate"] or 0.0
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows
