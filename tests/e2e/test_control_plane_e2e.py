"""The control plane end to end on emulated processes: scaling by a policy, role flips, the priority
queue, capability refusals, and the same scaling policy in the simulator at the same load."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from openai import OpenAI

from adapters.store import RunStore
from core.dispatch import Dispatcher
from core.perf import get_profile
from core.sim.cluster import ClusterSimulation
from tests.procs import (
    FIXED_PROFILE,
    Console,
    emulators,
    instance_steps_live,
    kill_children,
    start_console,
    wait_for,
)

PROFILE = FIXED_PROFILE
"""A fixed profile: the thresholds below are set in its terms
(the shipped cpu-tiny-llama is refreshed by calibration)."""
# Scale out when the decode instances average ≥ 6.4 requests in flight (of the profile's 256
# slots), back in after 2 s below 2.56; decisions every 0.5 s. The same params drive the simulator.
THRESHOLD = {
    "role": "decode",
    "period_s": 0.5,
    "util_high": 0.025,
    "util_low": 0.01,
    "kv_high": 0.99,
    "kv_low": 0.98,
    "cooldown_s": 1.0,
    "scale_in_after_s": 2.0,
    "min_instances": 1,
    "max_instances": 2,
}
RATE, SECONDS, OUTPUT = 5.0, 6.0, 200
"""Open-loop load: 30 requests of 200 tokens at 5/s keep ≈ 8 in flight on one decode instance."""


def write_config(tmp: Path, text: str) -> Path:
    path = tmp / "console.toml"
    path.write_text(text)
    return path


def instance_steps(con: Console, iid: str) -> list[tuple[str, str]]:
    return [(e["event"], e["detail"]) for e in RunStore(con.db).instance_events(con.run_id) if e["instance_id"] == iid]


def open_loop(url: str, n: int, rate: float, max_tokens: int, errors: list[str]) -> list[threading.Thread]:
    """Send n streaming requests at a fixed rate, each from its own thread."""
    client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)

    def one(k: int) -> None:
        try:
            stream = client.completions.create(
                model="sibyl-model", prompt=[7] * 8, max_tokens=max_tokens, stream=True, extra_body={"ignore_eos": True}
            )
            tokens = sum(1 for ch in stream if ch.choices and ch.choices[0].text)
            if tokens != max_tokens:
                errors.append(f"request {k}: {tokens} tokens")
        except Exception as e:  # noqa: BLE001 - every failure is a finding
            errors.append(f"request {k}: {type(e).__name__}: {e}")

    threads = []
    t0 = time.monotonic()
    for k in range(n):
        time.sleep(max(0.0, t0 + k / rate - time.monotonic()))
        th = threading.Thread(target=one, args=(k,))
        th.start()
        threads.append(th)
    return threads


@pytest.mark.slow  # waits out the policy's load windows both ways: ~12 s (make test-slow)
def test_threshold_scales_out_under_load_then_drains_back_with_no_failed_request(tmp_path: Path) -> None:
    params = ", ".join(f"{k} = {json.dumps(v)}" for k, v in THRESHOLD.items())
    cfg = write_config(
        tmp_path,
        f'prefill = 1\ndecode = 1\nprofile = "{PROFILE}"\npolicy = "least_load"\n'
        f'[scaling]\nname = "threshold"\nparams = {{ {params} }}\n',
    )
    con = start_console(tmp_path, str(cfg))
    try:
        errors: list[str] = []
        threads = open_loop(con.url, int(RATE * SECONDS), RATE, OUTPUT, errors)
        wait_for(lambda: any(ev == "added" for ev, _ in instance_steps_live(con, "d1")), 20, "the policy to add d1")
        for th in threads:
            th.join(60)
        assert errors == []
        # the load has ended: one decode instance drains once its streams finish (seconds alone; over 30 s
        # once in a full test-slow run). The policy drains the least loaded one: d1 as a rule, d0 once in a
        # full test-slow run, where the load's last second already read low with two instances
        def removed() -> list[str]:
            return [iid for iid in ("d0", "d1") if any(ev == "removed" for ev, _ in instance_steps_live(con, iid))]

        wait_for(lambda: removed() != [], 60, "a decode instance to be drained away")
        gone = removed()
        assert len(gone) == 1
        assert [i["id"] for i in con.state()["instances"] if i["role"] == "decode"] == [
            iid for iid in ("d0", "d1") if iid not in gone
        ]
        con.stop()
        steps = instance_steps(con, "d1")
        assert [ev for ev, _ in steps[:2]] == ["starting", "added"]
        assert "utilisation" in steps[0][1] and "[policy:threshold]" in steps[0][1]  # the reason quotes the numbers
        drained = instance_steps(con, gone[0])
        assert [ev for ev, _ in drained[-2:]] == ["draining", "removed"] and drained[-1][1].startswith("drained")
        rows = RunStore(con.db).requests(con.run_id)
        assert len(rows) == RATE * SECONDS and all(r["status"] == "ok" for r in rows)
        assert any(r["decode_instance"] == "d1" for r in rows)  # added while the load lasted, and used
    finally:
        con.stop()
        kill_children(con.home)


def test_the_same_threshold_policy_in_the_simulator_scales_at_the_same_load() -> None:
    """The load of the live test above, simulated: one decode instance added while it lasts and
    removed after it; a tenth of that load adds nothing."""
    prof = get_profile(PROFILE).model_copy(update={"cold_start_s": 1.0})  # an emulator process starts in ≈ 1 s

    def simulate(rate: float) -> list[tuple[float, str, str]]:
        n = int(rate * SECONDS)
        d = Dispatcher(prof, "least_load", scaling=("threshold", THRESHOLD))
        sim = ClusterSimulation(
            arrivals=np.arange(n) / rate,
            prompt_tokens=np.full(n, 8),
            output_tokens=np.full(n, OUTPUT),
            profile=prof,
            n_prefill=1,
            n_decode=1,
            dispatcher=d,
            mode="iteration",
        )
        r = sim.run()
        assert r.ok.all()
        return [(e.time, e.action, e.phase) for e in r.scale_events]

    busy = simulate(RATE)
    starts = [t for t, action, phase in busy if action == "add" and phase == "starting"]
    assert len(starts) == 1 and starts[0] < SECONDS
    assert [phase for _, action, phase in busy if action == "remove"][-1] == "stopped"
    assert simulate(RATE / 10) == []


def test_a_role_flip_changes_where_requests_go(tmp_path: Path) -> None:
    con = start_console(tmp_path, "--profile", PROFILE, "--prefill", "1", "--decode", "2", "--policy", "round_robin")
    try:
        c = OpenAI(base_url=con.url + "/v1", api_key="x", max_retries=0)
        for _ in range(4):
            c.completions.create(model="sibyl-model", prompt="before", max_tokens=2)
        out = con.cli("flip", "d1", "prefill", "--json")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout) == {"instance": "d1", "role": "prefill"}
        state = con.state()
        assert {i["id"]: i["role"] for i in state["instances"]} == {"p0": "prefill", "d0": "decode", "d1": "prefill"}
        assert state["cluster"] == "2P1D"
        # concurrent arrivals: prefill goes to the instance that frees up first, now p0 or d1
        threads = [
            threading.Thread(
                target=c.completions.create, kwargs={"model": "sibyl-model", "prompt": "after", "max_tokens": 2}
            )
            for _ in range(6)
        ]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
        refused = con.cli("flip", "d0", "prefill")  # the last decode instance stays
        assert refused.returncode != 0 and "last active decode instance" in refused.stderr
        con.stop()
        rows = RunStore(con.db).requests(con.run_id)
        before, after = rows[:4], rows[4:]
        assert {r["decode_instance"] for r in before} == {"d0", "d1"} and {r["prefill_instance"] for r in before} == {
            "p0"
        }
        assert {r["decode_instance"] for r in after} == {"d0"}
        assert "d1" in {r["prefill_instance"] for r in after}
        assert ("flipped", "decode -> prefill: operator via cli [cli]") in instance_steps(con, "d1")
    finally:
        con.stop()
        kill_children(con.home)


@pytest.mark.slow  # ~6 s (make test-slow, which CI runs); the policy itself: tests/core/policies
def test_priority_queue_releases_urgent_requests_first_and_sheds_past_its_bound(tmp_path: Path) -> None:
    """One request in flight at a time (max_in_flight_per_instance 1 × 1 decode instance): while a
    long request runs, three low-priority requests and then an urgent one wait; the urgent one goes
    first. The queue holds at most 4: the next arrival is shed with 429 and Retry-After. (SLO
    admission would answer the held ones 503 past their 2 s wait bound: its bounded wait is
    raised to 30 s so the queue policy's order shows.)"""
    cfg = write_config(tmp_path, "[admission]\nextra_wait_s = 30\n")
    con = start_console(
        tmp_path,
        str(cfg),
        "--profile",
        PROFILE,
        "--prefill",
        "1",
        "--decode",
        "1",
        "--queue",
        "priority",
        "--param",
        "priority.max_in_flight_per_instance=1",
        "--param",
        "priority.max_queued=4",
    )
    try:
        body = {"model": "sibyl-model", "prompt": [1] * 8, "ignore_eos": True}
        results: dict[str, int] = {}

        def send(name: str, priority: int, max_tokens: int) -> None:
            r = httpx.post(
                con.url + "/v1/completions",
                json={**body, "max_tokens": max_tokens, "priority": priority},
                headers={"X-Request-Id": name},
                timeout=60,
            )
            results[name] = r.status_code

        threads = [threading.Thread(target=send, args=("long", 5, 1000))]  # ≈ 3 s of decode
        threads[0].start()
        wait_for(lambda: con.state()["requests"]["in_flight"] == 1, 10, "the long request to run")
        for k, (name, prio) in enumerate([("low-0", 5), ("low-1", 5), ("low-2", 5), ("urgent", 0)]):
            threads.append(threading.Thread(target=send, args=(name, prio, 4)))
            threads[-1].start()
            wait_for(lambda k=k: con.state()["queue"]["depth"] == k + 1, 10, f"{name} to be queued")
        assert con.state()["queue"]["by_class"] == {"0": 1, "5": 3}
        shed = httpx.post(con.url + "/v1/completions", json={**body, "max_tokens": 4}, timeout=10)
        assert shed.status_code == 429 and int(shed.headers["retry-after"]) >= 1
        assert "queue is full" in shed.json()["error"]["message"]
        for th in threads:
            th.join(60)
        assert results == {"long": 200, "low-0": 200, "low-1": 200, "low-2": 200, "urgent": 200}
        con.stop()
        rows = {r["request_id"]: r for r in RunStore(con.db).requests(con.run_id)}
        started = sorted(("long", "low-0", "low-1", "low-2", "urgent"), key=lambda n: rows[n]["prefill_start"])
        assert started == ["long", "urgent", "low-0", "low-1", "low-2"]
        assert all(rows[n]["queued"] is not None for n in started[1:]) and rows["long"]["queued"] is None
        shed_rows = [r for r in rows.values() if r["status"] == "failed"]
        assert len(shed_rows) == 1 and "queue is full" in shed_rows[0]["reason"]
    finally:
        con.stop()
        kill_children(con.home)


@pytest.mark.slow  # ~11 s (make test-slow); refusals on a constructed controller: tests/console/live/test_controller.py
def test_what_a_backend_cannot_do_is_refused_with_the_reason(tmp_path: Path) -> None:
    """Attached instances are never started or stopped by the console: a scaling policy and a
    flip are refused, saying which capability is missing; nothing changes."""
    with emulators(("prefill", ["--profile", PROFILE]), ("decode", ["--profile", PROFILE])) as (p, d):
        con = start_console(tmp_path, "--backend", "vllm", "--attach", f"prefill={p.url};decode={d.url}")
        try:
            assert con.state()["capabilities"] == {"replay": False}
            with con.control() as ctl:
                r = ctl.put("/control/policies/scaling", json={"name": "threshold"})
                assert r.status_code == 422
                assert (
                    "cannot do" in r.json()["error"]["message"]
                    and "no scale capability" in r.json()["error"]["message"]
                )
                r = ctl.put("/control/policies/routing", json={"name": "clairvoyant"})
                assert r.status_code == 422 and "runs only in the simulator" in r.json()["error"]["message"]
                r = ctl.post("/control/flip", json={"instance": "d0", "role": "prefill"})
                assert r.status_code == 409
                # vLLM cannot move a running request: rescheduling and a migration are refused
                r = ctl.put("/control/policies/reschedule", json={"name": "current_load"})
                assert r.status_code == 422 and "moves running requests" in r.json()["error"]["message"]
                r = ctl.post("/control/migrate", json={"request_id": "any", "target": "d0"})
                assert (
                    r.status_code == 409 and "does not support moving a running request" in r.json()["error"]["message"]
                )
                # no data-parallel decode instance: a rank policy has nothing to choose
                r = ctl.put("/control/policies/rank", json={"name": "bf_io"})
                assert r.status_code == 422 and "chooses data-parallel ranks" in r.json()["error"]["message"]
            out = con.cli("scale", "decode", "1")
            assert out.returncode != 0 and "cannot add or remove instances" in out.stderr
            assert con.state()["policies"]["scaling"]["name"] == "static"
        finally:
            con.stop()
            kill_children(con.home)


@pytest.mark.slow  # ~14 s (make test-slow); the queue in the default suite: the priority-queue test above
def test_a_request_queued_past_its_ttl_gets_a_prompt_503_with_retry_after(tmp_path: Path) -> None:
    con = start_console(
        tmp_path,
        "--profile",
        PROFILE,
        "--prefill",
        "1",
        "--decode",
        "1",
        "--queue",
        "fcfs",
        "--param",
        "fcfs.max_in_flight_per_instance=1",
        "--param",
        "fcfs.ttl_s=1",
    )
    try:
        body = {"model": "sibyl-model", "prompt": [1] * 8, "ignore_eos": True}
        long = threading.Thread(
            target=httpx.post,
            args=(con.url + "/v1/completions",),
            kwargs={"json": {**body, "max_tokens": 1000}, "timeout": 60},
        )
        long.start()
        wait_for(lambda: con.state()["requests"]["in_flight"] == 1, 10, "the long request to run")
        started = time.monotonic()
        r = httpx.post(con.url + "/v1/completions", json={**body, "max_tokens": 4}, timeout=30)
        waited = time.monotonic() - started
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
        assert "ttl_s=1" in r.json()["error"]["message"] and r.json()["error"]["type"] == "ServiceUnavailableError"
        assert 1.0 <= waited < 10  # held for its ttl, then answered; never an unbounded wait
        long.join(60)
    finally:
        con.stop()
        kill_children(con.home)


def test_a_policy_that_binds_late_chooses_the_decode_instance_at_prefill_end(tmp_path: Path) -> None:
    """least_load with bind=prefill_end: routed with no decode instance, bound when leg 1 returns."""
    con = start_console(
        tmp_path,
        "--profile",
        PROFILE,
        "--prefill",
        "1",
        "--decode",
        "2",
        "--policy",
        "least_load",
        "--param",
        "bind=prefill_end",
    )
    try:
        assert con.state()["policies"]["routing"]["params"]["bind"] == "prefill_end"
        c = OpenAI(base_url=con.url + "/v1", api_key="x", max_retries=0)
        for _ in range(4):
            out = c.completions.create(
                model="sibyl-model", prompt=[3] * 8, max_tokens=3, extra_body={"ignore_eos": True}
            )
            assert out.usage is not None and out.usage.completion_tokens == 3
        con.stop()
        rows = RunStore(con.db).requests(con.run_id)
        assert len(rows) == 4 and all(r["status"] == "ok" for r in rows)
        assert {r["decode_instance"] for r in rows} <= {"d0", "d1"} and all(r["decode_instance"] for r in rows)
        assert all(r["prefill_end"] >= r["prefill_start"] and r["decode_start"] >= r["prefill_end"] for r in rows)
    finally:
        con.stop()
        kill_children(con.home)


@pytest.mark.slow  # builds prompt-heavy load until the policy flips: ~11 s (make test-slow)
def test_hyperflexis_flips_a_decode_instance_to_prefill_under_prompt_heavy_load_with_no_failed_request(
    tmp_path: Path,
) -> None:
    """Long prompts at 5/s keep one prefill instance busy (≈ 0.3 s each on the fixed profile) while
    two decode instances idle: HyperFlexis' scaler takes a decode instance for prefill by a flip
    (drained first), with its reason, and no client request fails."""
    scaling = {"period_s": 0.5, "low_ticks": 40, "max_instances": 3}
    params = ", ".join(f"{k} = {json.dumps(v)}" for k, v in scaling.items())
    cfg = write_config(
        tmp_path,
        f'prefill = 1\ndecode = 2\nprofile = "{PROFILE}"\npolicy = "hyperflexis"\n'
        f'[queue]\nname = "hyperflexis"\n[scaling]\nname = "hyperflexis"\nparams = {{ {params} }}\n'
        "[admission]\nenabled = false\n",
    )  # the backlog the scaler reacts to is the point: do not shed it
    con = start_console(tmp_path, str(cfg))
    try:
        client = OpenAI(base_url=con.url + "/v1", api_key="x", max_retries=0, timeout=60)
        errors: list[str] = []

        def one(k: int) -> None:
            try:
                out = client.completions.create(
                    model="sibyl-model", prompt=f"{k} " + "p" * 3200, max_tokens=8, extra_body={"ignore_eos": True}
                )  # distinct from the first token: no prefix to reuse
                if out.usage is None or out.usage.completion_tokens != 8:
                    errors.append(f"request {k}: short")
            except Exception as e:  # noqa: BLE001
                errors.append(f"request {k}: {type(e).__name__}: {e}")

        threads = []
        for k in range(30):
            th = threading.Thread(target=one, args=(k,))
            th.start()
            threads.append(th)
            time.sleep(0.2)  # an open-loop arrival process at 5/s, not a wait for readiness
        wait_for(lambda: any(ev == "flipped" for ev, _ in instance_steps_live(con, "d1")), 20, "the scaler to flip d1")
        for th in threads:
            th.join(60)
        assert errors == []
        state = con.state()
        assert {i["id"]: i["role"] for i in state["instances"]}["d1"] == "prefill"
        con.stop()
        steps = instance_steps(con, "d1")
        flip = next(detail for ev, detail in steps if ev == "flipped")
        assert flip.startswith("decode -> prefill: prefill hot (") and "[policy:hyperflexis]" in flip
        rows = RunStore(con.db).requests(con.run_id)
        assert len(rows) == 30 and all(r["status"] == "ok" for r in rows)
        assert any(r["prefill_instance"] == "d1" for r in rows)  # the flipped instance took prompts
    finally:
        con.stop()
        kill_children(con.home)


@pytest.mark.slow  # ~9 s (make test-slow); tail_aware on constructed states: tests/core/policies/test_tail_aware.py
def test_tail_aware_releases_held_requests_in_phi_order_and_the_config_asks_vllm_for_priority(tmp_path: Path) -> None:
    """One request in flight at a time: a long prompt held first and a short one held 0.2 s later
    leave the queue in Φ = arrival − boost(τ·bin(prompt)) order: the short one first (τ = 10 ms
    per token: boosts of 1.17 s and 0.37 s outweigh the 0.2 s). With tail_aware the vLLM backend
    is started with priority scheduling."""
    from console.live.config import ConsoleConfig

    assert ConsoleConfig(queue={"name": "tail_aware"}).vllm.scheduling_policy == "priority"
    assert (
        ConsoleConfig(queue={"name": "tail_aware"}, vllm={"scheduling_policy": "fcfs"}).vllm.scheduling_policy == "fcfs"
    )
    assert ConsoleConfig().vllm.scheduling_policy == "fcfs"
    cfg = write_config(tmp_path, "[admission]\nextra_wait_s = 30\n")  # held past the 2 s wait bound: not answered 503
    con = start_console(
        tmp_path,
        str(cfg),
        "--profile",
        PROFILE,
        "--prefill",
        "1",
        "--decode",
        "1",
        "--queue",
        "tail_aware",
        "--param",
        "tail_aware.max_in_flight_per_instance=1",
        "--param",
        "tail_aware.tau_s=0.01",
    )
    try:

        def post(prompt: list[int], max_tokens: int, rid: str) -> threading.Thread:
            th = threading.Thread(
                target=httpx.post,
                args=(con.url + "/v1/completions",),
                kwargs={
                    "json": {"model": "sibyl-model", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True},
                    "headers": {"X-Request-Id": rid},
                    "timeout": 60,
                },
            )
            th.start()
            return th

        threads = [post([1] * 8, 600, "busy")]
        wait_for(lambda: con.state()["requests"]["in_flight"] == 1, 10, "the first request to run")
        threads.append(post([1] * 900, 4, "long-prompt"))
        wait_for(lambda: con.state()["queue"]["depth"] == 1, 10, "the long prompt held")
        time.sleep(0.2)  # the arrival gap Φ weighs against the boost
        threads.append(post([1] * 10, 4, "short-prompt"))
        wait_for(lambda: con.state()["queue"]["depth"] == 2, 10, "both held")
        for th in threads:
            th.join(60)
        con.stop()
        rows = {r["request_id"]: r for r in RunStore(con.db).requests(con.run_id)}
        assert all(r["status"] == "ok" for r in rows.values())
        assert rows["short-prompt"]["prefill_start"] < rows["long-prompt"]["prefill_start"]
    finally:
        con.stop()
        kill_children(con.home)


@pytest.mark.slow  # ~10 s (make test-slow); bf_io: tests/core/policies/rank/, DP groups: tests/adapters/emulator/
def test_bf_io_chooses_the_rank_of_every_request_on_data_parallel_decode_groups(tmp_path: Path) -> None:
    """Two emulated decode instances, each a 4-rank data-parallel group. The rank policy starts as
    the group's own balancer (no header), is swapped to bf_io live, and then every stream carries
    X-data-parallel-rank: the emulators hold each request on the rank the gateway chose, the
    dashboard's per-rank loads match, and the choices are in the run store."""
    cfg = write_config(tmp_path, 'policy = "round_robin"\n[emulator]\ndata_parallel_size = 4\n')
    con = start_console(tmp_path, str(cfg), "--profile", PROFILE, "--prefill", "1", "--decode", "2")
    try:
        assert con.state()["policies"]["rank"]["name"] == "engine"
        with con.control() as ctl:
            assert ctl.put("/control/policies/rank", json={"name": "bf_io"}).status_code == 200
        c = OpenAI(base_url=con.url + "/v1", api_key="x", max_retries=0)
        texts: list[str] = []
        prompts = ["x" * (4 * n) for n in (500, 50, 60, 70, 300, 80, 90, 100)]

        def stream(prompt: str) -> None:
            s = c.completions.create(
                model="sibyl-model", prompt=prompt, max_tokens=500, stream=True, extra_body={"ignore_eos": True}
            )
            texts.append("".join(ch.choices[0].text for ch in s if ch.choices))

        threads = [threading.Thread(target=stream, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
            time.sleep(0.05)  # arrivals in order, so each decision sees the ones before
        decode_urls = [i["url"] for i in con.state()["instances"] if i["role"] == "decode"]

        def emulated_ranks() -> list[list[int]]:
            return [
                [r["running"] for r in httpx.get(u + "/admin/info", timeout=5).json()["ranks"]] for u in decode_urls
            ]

        wait_for(lambda: [sum(g) for g in emulated_ranks()] == [4, 4], 30, "four streams decoding on each group")
        state = con.state()
        for inst in (i for i in state["instances"] if i["role"] == "decode"):
            emulated = httpx.get(inst["url"] + "/admin/info", timeout=5).json()["ranks"]
            tracked = inst["dp_ranks"]
            # H = 0 spreads the four streams of each group over its four ranks, one each, and the
            # gateway's per-rank loads (what the dashboard shows) name the same ranks
            assert [r["running"] for r in emulated] == [1, 1, 1, 1] and len(tracked) == 4 and min(tracked) > 0
        for t in threads:
            t.join(60)
        assert len(texts) == 8 and all(t.count(" t") == 500 for t in texts)
        con.stop()
        rows = RunStore(con.db).requests(con.run_id)
        assert len(rows) == 8 and all(r["status"] == "ok" and r["dp_rank"] in (0, 1, 2, 3) for r in rows)
        events = [(e["kind"], e["new"]) for e in RunStore(con.db).policy_events(con.run_id)]
        assert ("rank", "bf_io") in events
    finally:
        con.stop()
        kill_children(con.home)
