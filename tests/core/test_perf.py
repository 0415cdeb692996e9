"""Performance profiles: SIBYL's curve, the roofline, closed-form step sums, profile files."""

from __future__ import annotations

import json
import math

import pytest

from core.errors import ProfileError
from core.perf import get_profile, profile_names, save_profile_file
from tests.helpers import toy_profile


def test_sibyl_h20_curve_peaks_near_53_and_is_clamped() -> None:
    p = get_profile("h20-qwen3-32b")
    assert p.tps_curve is not None and p.tps_curve.peak_n == pytest.approx(52.915, abs=1e-3)
    assert p.total_tps(1) == pytest.approx(-0.423 + 44.766 - 7.753)
    assert p.total_tps(53) == pytest.approx(p.total_tps(200))
    assert p.per_request_rate(100) == pytest.approx(p.total_tps(53) / 100)


def test_roofline_profiles_exist_for_three_accelerators() -> None:
    names = profile_names()
    for accel in ("h100", "h20", "a100"):
        assert f"roofline-{accel}-llama3-8b" in names
    h100, a100 = get_profile("roofline-h100-llama3-8b"), get_profile("roofline-a100-llama3-8b")
    assert h100.prefill_time(1000) < a100.prefill_time(1000)  # more FLOPS
    assert h100.step_time(32, 32000) < a100.step_time(32, 32000)  # more bandwidth
    assert h100.kv_capacity_tokens == a100.kv_capacity_tokens  # same memory


def test_closed_form_step_sums_match_a_loop() -> None:
    p = toy_profile(decode_step_base_s=0.01, decode_step_per_seq_s=0.001, decode_step_per_kv_token_s=1e-6)
    total, kv = 0.0, 500
    for _ in range(37):
        total += p.step_time(8, kv)
        kv += 8
    assert p.steps_time(37, 8, 500) == pytest.approx(total)
    assert p.steps_within(total, 8, 500) == 37
    assert p.steps_within(total - 1e-6, 8, 500) == 36


def test_a_prefill_batch_pays_the_fixed_cost_once_and_each_prompt_its_own() -> None:
    p = toy_profile().model_copy(
        update={"prefill_base_s": 0.01, "prefill_per_token_s": 0.001, "prefill_per_token2_s": 1e-6}
    )
    assert p.prefill_batch_time([100, 200]) == pytest.approx(0.01 + 0.001 * 300 + 1e-6 * (100**2 + 200**2))
    assert p.prefill_batch_time([300]) == pytest.approx(p.prefill_time(300))


def test_profile_file_round_trip_and_errors(tmp_path) -> None:
    path = tmp_path / "fitted.json"
    save_profile_file(toy_profile(name="fitted"), path)
    assert get_profile(str(path)).name == "fitted"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**json.loads(path.read_text()), "decode_step_base_s": -1}))
    with pytest.raises(ProfileError, match="decode_step_base_s"):
        get_profile(str(bad))
    with pytest.raises(ProfileError, match="built-in profiles: .*cpu-tiny-llama"):
        get_profile("nope")


def test_the_shipped_cpu_profile_is_a_calibration_of_real_vllm() -> None:
    """cpu-tiny-llama is core/cpu-tiny-llama.json, which `make refresh-cpu-profile` writes from the
    real-vLLM stage's calibration: each timed term says where it came from, capacities are vLLM
    0.32's CPU defaults."""
    from core.perf import CPU_TINY_LLAMA_FILE, load_profile_file

    p = get_profile("cpu-tiny-llama")
    assert p == load_profile_file(CPU_TINY_LLAMA_FILE)
    assert p.fit is not None
    for term in (
        "prefill_base_s",
        "prefill_per_token_s",
        "decode_step_base_s",
        "decode_step_per_seq_s",
        "kv_transfer_base_s",
    ):
        assert p.fit[term]["source"].startswith(("fit", "prior: ")), term
    assert p.fit["decode_step_per_seq_s"]["source"] == "fit" and p.fit["prefill_per_token_s"]["source"] == "fit"
    assert (p.max_num_seqs, p.max_num_batched_tokens, p.max_model_len) == (128, 2048, 1024)


def test_the_wake_up_cost_grows_with_idle_time_towards_idle_wake_s() -> None:
    """idle_wake_s·(1 − e^(−g/τ)): nothing without idling or without a cost, 1 − 1/e of it after τ,
    all of it after many τ (M = 20 ms, τ = 1.5 s)."""
    p = toy_profile(idle_wake_s=0.02, idle_wake_tau_s=1.5)
    assert p.wake_time(0.0) == 0.0 and p.wake_time(-1.0) == 0.0
    assert toy_profile().wake_time(10.0) == 0.0  # the default profile has no wake-up cost
    assert toy_profile(idle_wake_tau_s=1.5).wake_time(10.0) == 0.0
    assert p.wake_time(1.5) == pytest.approx(0.02 * (1 - math.exp(-1)), rel=1e-12)
    assert p.wake_time(0.75) == pytest.approx(0.02 * (1 - math.exp(-0.5)), rel=1e-12)
    assert p.wake_time(1e-9) == pytest.approx(0.02 * 1e-9 / 1.5, rel=1e-6)  # linear at first
    assert p.wake_time(60.0) == pytest.approx(0.02, rel=1e-12) and p.wake_time(math.inf) == 0.02
    assert p.wake_time(0.5) < p.wake_time(1.0) < p.wake_time(3.0) < 0.02
