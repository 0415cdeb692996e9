"""Settings of one emulated instance (its LoRA flags included) and the output-length distribution it draws from."""

from __future__ import annotations

import os
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from adapters.emulator.faults import FaultConfig
from adapters.vllm.kv_wire import KVEventsConfig
from core.errors import ConfigError
from core.perf import PerfProfile

Role = Literal["prefill", "decode", "both"]
RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
"""vLLM's switch for /v1/load_lora_adapter and /v1/unload_lora_adapter."""


def runtime_updating_allowed(env: Mapping[str, str] | None = None) -> bool:
    """vLLM's reading of VLLM_ALLOW_RUNTIME_LORA_UPDATING: "1" or "true", any case."""
    value = (os.environ if env is None else env).get(RUNTIME_ENV, "0")
    return value.strip().lower() in ("1", "true")


@dataclass(frozen=True, slots=True)
class LoraSettings:
    """The LoRA flags of one instance."""

    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    """Adapters the instance keeps (its LRU cache); None: max_loras, as vLLM defaults it."""
    allow_runtime_updating: bool = False
    """VLLM_ALLOW_RUNTIME_LORA_UPDATING: whether the load/unload routes exist."""

    @property
    def capacity(self) -> int:
        return max(self.max_cpu_loras or self.max_loras, self.max_loras)


@dataclass
class InstanceSettings:
    """Everything one emulated instance is started with (`emulate` flags)."""

    role: Role
    port: int
    profile: PerfProfile
    host: str = "127.0.0.1"
    model: str = "sibyl-model"
    max_num_seqs: int | None = None
    kv_capacity_tokens: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    output_len_dist: str = "uniform:1:256"
    seed: int = 0
    kv_lease_s: float = 30.0
    kv_handshake_timeout_s: float = 5.0
    kv_load_failure_policy: Literal["fail", "recompute"] = "fail"
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    admin_token: str | None = None
    writer_threads: int = 2
    data_parallel_size: int = 1
    """Ranks of a data-parallel group stepping together (adapters/emulator/dp_group.py); 1: one engine."""
    """Threads writing a large step's tokens at its deadline (1: the event loop alone)."""
    faults: FaultConfig = field(default_factory=FaultConfig)
    block_size: int | None = None
    """Tokens per KV block (vLLM's --block-size); None: the profile's."""
    enable_prefix_caching: bool = True
    """Automatic prefix caching (vLLM's default; --no-enable-prefix-caching turns it off)."""
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)
    """vLLM's --kv-events-config: publish the block pool's events over ZMQ."""
    enable_prompt_tokens_details: bool = False
    """Report usage.prompt_tokens_details (cached tokens), as vLLM's --enable-prompt-tokens-details."""
    otlp_traces_endpoint: str | None = None
    """vLLM's --otlp-traces-endpoint: each request ends with an `llm_request` span (adapters/emulator/tracing.py)."""
    otlp_traces_protocol: Literal["http/protobuf", "grpc"] = "http/protobuf"
    host_board: str | None = None
    """The host board file the instances of one host share (adapters/emulator/host_board.py); None: none."""
    host_slot: int = 0
    """This instance's slot on the host board."""
    lora: LoraSettings = field(default_factory=LoraSettings)
    """vLLM's --enable-lora, --max-loras, --max-lora-rank, --max-cpu-loras (adapters/emulator/lora.py)."""

    @property
    def kv_tokens(self) -> int:
        return self.kv_capacity_tokens or self.profile.kv_capacity_tokens

    @property
    def context_len(self) -> int:
        """The served max_model_len: the profile's (or --max-model-len), at most the KV capacity.

        vLLM refuses to start when one max-length request cannot fit in the KV cache; the emulator
        serves the shorter context instead (and says so at start).
        """
        want = self.max_model_len or self.profile.max_model_len
        cache = self.kv_tokens // self.kv_block_size * self.kv_block_size
        return max(2, min(want, cache))

    @property
    def kv_block_size(self) -> int:
        return self.block_size or self.profile.block_size

    @property
    def advertised_host(self) -> str:
        """The host a decode instance should pull from (a wildcard bind advertises loopback)."""
        return "127.0.0.1" if self.host in ("0.0.0.0", "", "::") else self.host


class OutputLengths:
    """Output length of a request without ignore_eos.

    `uniform:A:B` (integers A..B), `fixed:N`, `exp:MEAN` (exponential, at least 1) or
    `normal:MEAN:STD` (rounded, at least 1). Draws come from one RNG seeded with --seed, in
    arrival order; a request that sets `seed` gets a draw that depends only on both seeds.
    """

    def __init__(self, spec: str, seed: int) -> None:
        kind, _, rest = spec.partition(":")
        try:
            nums = [float(a) for a in rest.split(":")] if rest else []
        except ValueError:
            nums = []
        ok = (
            (kind == "uniform" and len(nums) == 2 and 1 <= nums[0] <= nums[1])
            or (kind in ("fixed", "exp") and len(nums) == 1 and nums[0] >= 1)
            or (kind == "normal" and len(nums) == 2 and nums[0] >= 1 and nums[1] >= 0)
        )
        if not ok:
            raise ConfigError(
                f"--output-len-dist {spec!r}: expected uniform:A:B (1 <= A <= B), fixed:N, exp:MEAN or normal:MEAN:STD"
            )
        self.kind, self.args = kind, nums
        self.seed = seed
        self.rng = random.Random(seed)

    def draw(self, request_seed: int | None = None) -> int:
        rng = self.rng if request_seed is None else random.Random(f"{self.seed}:{request_seed}")
        a = self.args
        if self.kind == "uniform":
            return rng.randint(int(a[0]), int(a[1]))
        if self.kind == "fixed":
            return int(a[0])
        if self.kind == "exp":
            return max(1, round(rng.expovariate(1.0 / a[0])))
        return max(1, round(rng.gauss(a[0], a[1])))
