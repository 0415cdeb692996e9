"""Settings of one emulated instance and the output-length distribution it draws from."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Literal

from adapters.emulator.faults import Faults
from core.errors import ConfigError
from core.perf import PerfProfile


@dataclass
class InstanceSettings:
    role: Literal["prefill", "decode", "both"]
    port: int
    profile: PerfProfile
    host: str = "127.0.0.1"
    model: str = "sibyl-model"
    max_num_seqs: int | None = None
    kv_capacity_tokens: int | None = None
    output_len_dist: str = "uniform:1:256"
    seed: int = 0
    kv_lease_s: float = 30.0
    kv_handshake_timeout_s: float = 5.0
    kv_load_failure_policy: Literal["fail", "recompute"] = "fail"
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    admin_token: str | None = None
    faults: Faults = field(default_factory=Faults)


class OutputLengths:
    """`uniform:A:B`, `fixed:N` or `exp:MEAN` tokens when a request does not set ignore_eos."""

    def __init__(self, spec: str, seed: int) -> None:
        kind, _, rest = spec.partition(":")
        args = rest.split(":") if rest else []
        try:
            nums = [float(a) for a in args]
        except ValueError:
            nums = []
        ok = (kind == "uniform" and len(nums) == 2 and 1 <= nums[0] <= nums[1]) or (
            kind in ("fixed", "exp") and len(nums) == 1 and nums[0] >= 1
        )
        if not ok:
            raise ConfigError(f"--output-len-dist {spec!r}: expected uniform:A:B (1 <= A <= B), fixed:N or exp:MEAN")
        self.kind, self.args = kind, nums
        self.rng = random.Random(seed)

    def draw(self) -> int:
        if self.kind == "uniform":
            return self.rng.randint(int(self.args[0]), int(self.args[1]))
        if self.kind == "fixed":
            return int(self.args[0])
        return max(1, round(self.rng.expovariate(1.0 / self.args[0])))
