"""A calibrated cluster for the live calibration's tests: an engine 10× faster than the console's prior, its
/metrics pages one interval at a time, and a dispatcher whose p0 was calibrated on them."""

from __future__ import annotations

import pytest

from adapters.vllm.instances import Instance
from console.live.calibration import CalibrationFeed
from console.live.calibrator import Calibrator
from core.dispatch import Dispatcher
from core.perf import PerfProfile
from core.types import Role

TRUE = PerfProfile(
    name="engine",
    description="what the engine runs",
    prefill_base_s=0.002,
    prefill_per_token_s=2e-5,
    decode_step_base_s=0.003,
    decode_step_per_seq_s=2e-4,
    kv_capacity_tokens=65536,
    block_size=16,
    max_num_seqs=64,
    max_model_len=4096,
)
PRIOR = TRUE.model_copy(
    update={
        "name": "prior",
        **{k: 10 * getattr(TRUE, k) for k in ("prefill_base_s", "prefill_per_token_s")},
        **{k: 10 * getattr(TRUE, k) for k in ("decode_step_base_s", "decode_step_per_seq_s")},
    }
)


class FakeEngine:
    """A /metrics page of vLLM's request histograms, cumulative, advanced one interval at a time
    with requests whose prefill time and time per output token follow TRUE exactly (their prefill
    `slower_s` more: a fresh engine's first requests, or a slower engine)."""

    def __init__(self) -> None:
        self.hist: dict[str, tuple[float, float]] = {}
        self.running = 0.0

    def _observe(self, name: str, value: float, n: int) -> None:
        count, total = self.hist.get(name, (0.0, 0.0))
        self.hist[name] = (count + n, total + n * value)

    def interval(self, requests: int, prompt: int, batch: int, output: int = 20, slower_s: float = 0.0) -> str:
        kv = batch * (prompt + output / 2)
        step = TRUE.decode_step_base_s + TRUE.decode_step_per_seq_s * batch
        prefill = step + TRUE.prefill_base_s + 2e-5 * prompt + slower_s
        self._observe("vllm:request_prefill_time_seconds", prefill, requests)
        self._observe("vllm:request_time_per_output_token_seconds", step + 0 * kv, requests)
        self._observe("vllm:request_prompt_tokens", prompt, requests)
        self._observe("vllm:request_generation_tokens", output, requests)
        self.running = batch
        lines = [f"vllm:num_requests_running {self.running}", "vllm:num_requests_waiting 0"]
        for name, (count, total) in self.hist.items():
            lines += [f'{name}_bucket{{le="+Inf"}} {count}', f"{name}_sum {total}", f"{name}_count {count}"]
        return "\n".join(lines) + "\n"


def cluster() -> tuple[Dispatcher, Calibrator, Instance]:
    d = Dispatcher(PRIOR)
    d.add_instance("p0", Role.PREFILL)
    d.add_instance("d0", Role.DECODE)
    return d, Calibrator(CalibrationFeed(PRIOR, refit_every_s=0), d, apply_every_s=1.0), Instance("p0", Role.PREFILL, "http://p0")


def calibrated_p0() -> tuple[Dispatcher, Calibrator, Instance, FakeEngine]:
    """p0 calibrated under a steady load (its terms the prior's scaled by ~0.1, the engine's speed), and a
    second prefill instance p1 added at 4 s, its first page (no interval yet) scraped."""
    d, cal, p0 = cluster()
    engine = FakeEngine()
    p0.metrics_page = engine.interval(0, 1, 1)
    cal.scraped(p0, 0.0)
    for t in range(1, 4):
        p0.metrics_page = engine.interval(4, 300, 8)
        cal.scraped(p0, float(t))
        cal.tick(float(t) + 0.05)
    row = cal.row("p0", 4.0)
    assert row is not None and row["calibrated"] and row["correction"]["prefill"] == pytest.approx(0.1, rel=0.1)
    d.add_instance("p1", Role.PREFILL)
    p1, fresh = Instance("p1", Role.PREFILL, "http://p1"), FakeEngine()
    p1.metrics_page = fresh.interval(0, 1, 1)
    cal.scraped(p1, 4.0)
    return d, cal, p1, fresh
