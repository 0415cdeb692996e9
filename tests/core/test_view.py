"""The cluster view's hand-off projection (the KV read and the decode steps a busy decode instance
adds) and its cached routable indices."""

from __future__ import annotations

import numpy as np
import pytest

from core.dispatch import Dispatcher
from core.perf import get_profile
from core.types import Request, Role

PROFILE = get_profile("h20-qwen3-32b")


def running(d: Dispatcher, k: int, prompt: int) -> int:
    """Request k decoding since t = 0.1 (nothing generated yet at 0.1); its decode instance's index."""
    d.route(Request(k, 0.0, prompt, 50), 0.0)
    d.on_prefill_end(k, 0.1)
    d.on_decode_start(k, 0.1)
    return d._index[str(d.decode_of(k))]


def test_an_idle_decode_instance_adds_the_read_and_one_step_of_the_new_sequence() -> None:
    d = Dispatcher(PROFILE, "round_robin")
    d.add_instance("p0", Role.PREFILL)
    d.add_instance("d0", Role.DECODE)
    assert d.view.handoff_s(300) == pytest.approx(PROFILE.kv_transfer_time(300) + PROFILE.step_time(1, 300))


def test_a_busy_decode_instance_adds_one_step_of_its_batch_before_the_step_that_makes_the_token() -> None:
    """vLLM's NIXL pull starts when the step under way ends and the sequence joins at the boundary
    after the read: half a step each, expected, then the step that makes the token. Three
    sequences run on d0: two of its steps, the measured one when given, else the profile's."""
    d = Dispatcher(PROFILE, "round_robin")
    d.add_instance("p0", Role.PREFILL)
    d.add_instance("d0", Role.DECODE)
    for k in range(3):
        running(d, k, 100)
    v = d.view
    v.now = 0.1
    step = PROFILE.step_time(3, 3 * PROFILE.ps_context_tokens)
    assert v.handoff_s(300) == pytest.approx(PROFILE.kv_transfer_time(300) + 2 * step)
    assert step > 0.02  # h20: one step is ~22 ms, what the hand-off gains here
    assert v.handoff_s(300, busy_step_s=0.05) == pytest.approx(PROFILE.kv_transfer_time(300) + 0.1)


def test_the_hand_off_is_on_the_soonest_routable_decode_instance_unless_one_is_named() -> None:
    d = Dispatcher(PROFILE, "round_robin")
    d.add_instance("p0", Role.PREFILL)
    d.add_instance("d0", Role.DECODE)
    d.add_instance("d1", Role.DECODE)
    busy_at = running(d, 0, 100)
    v = d.view
    v.now = 0.1
    other = ({d._index["d0"], d._index["d1"]} - {busy_at}).pop()
    idle = PROFILE.kv_transfer_time(300) + PROFILE.step_time(1, 300)
    assert v.handoff_s(300) == pytest.approx(idle)
    assert v.handoff_s(300, other) == pytest.approx(idle)
    busy = PROFILE.kv_transfer_time(300) + 2 * PROFILE.step_time(1, PROFILE.ps_context_tokens)
    assert v.handoff_s(300, busy_at) == pytest.approx(busy)


def test_the_routable_indices_follow_health_changes_and_a_narrowed_copy() -> None:
    d = Dispatcher(PROFILE, "round_robin")
    for k in range(3):
        d.add_instance(f"p{k}", Role.PREFILL)
    d.add_instance("d0", Role.DECODE)
    v = d.view
    assert v.routable_indices(Role.PREFILL) == [0, 1, 2] and v.routable_indices(Role.DECODE) == [3]
    d.set_health("p1", False)
    assert v.routable_indices(Role.PREFILL) == [0, 2] == np.flatnonzero(v.prefill_mask()).tolist()
    narrow = v.narrowed(np.array([False, False, True, True]), np.ones(4, dtype=bool))
    assert narrow.routable_indices(Role.PREFILL) == [2] and v.routable_indices(Role.PREFILL) == [0, 2]
