"""`sibyl-console up --headless` end to end: real console and emulator processes on 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from adapters.emulator.process import EmulatorProcess
from adapters.store import RunStore
from tests.procs import (
    FIXED_PROFILE,
    Console,
    alive,
    decode_counts,
    emulators,
    kill_children,
    start_console,
    wait_for,
)

PROFILE = ["--profile", FIXED_PROFILE]
"""The stream lengths and waits below are set in this profile's step times."""


@pytest.fixture(scope="module")
def console(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Console]:
    tmp = tmp_path_factory.mktemp("console")
    c = start_console(tmp, *PROFILE)
    try:
        yield c
    finally:
        c.stop()
        kill_children(c.home)


def test_openai_client_through_a_2p4d_cluster(console: Console) -> None:
    s = console.state()
    assert s["cluster"] == "2P4D" and s["backend"] == "emulator" and all(i["healthy"] for i in s["instances"])
    c = OpenAI(base_url=console.url + "/v1", api_key="x")
    r = c.completions.create(model="sibyl-model", prompt="hello " * 40, max_tokens=12, extra_body={"ignore_eos": True})
    assert r.choices[0].text == "".join(f" t{i}" for i in range(12)) and r.usage and r.usage.completion_tokens == 12
    stream = c.completions.create(
        model="sibyl-model", prompt="hello", max_tokens=7, stream=True, extra_body={"ignore_eos": True}
    )
    assert "".join(ch.choices[0].text for ch in stream if ch.choices) == "".join(f" t{i}" for i in range(7))
    chat = c.chat.completions.create(
        model="sibyl-model", messages=[{"role": "user", "content": "hi"}], max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert chat.choices[0].message.content == " t0 t1 t2"
    chunks = c.chat.completions.create(
        model="sibyl-model",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == " t0 t1 t2"
    assert [m.id for m in c.models.list().data] == ["sibyl-model"]
    after = console.state()
    assert after["requests"]["total"] >= 4 and after["requests"]["failed"] == 0
    # the decode instances really served the second legs: their token counters moved
    wait_for(lambda: sum(i["tokens_per_s"] for i in console.state()["instances"] if i["role"] == "decode") >= 0, 2)
    assert any(i["routed_running"] == 0 for i in after["instances"])


def test_client_errors_are_openai_style(console: Console) -> None:
    def post(body: bytes, **kw: Any) -> httpx.Response:
        return httpx.post(
            console.url + "/v1/completions", content=body, headers={"content-type": "application/json"}, **kw
        )

    r = post(b"{broken")
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    r = post(json.dumps({"model": "gpt-5", "prompt": "x"}).encode())
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    r = post(b'{"prompt": "' + b"x" * (5 * 1024 * 1024) + b'"}')
    assert r.status_code == 413 and "exceeds" in r.json()["error"]["message"]
    r = post(json.dumps({"prompt": "x", "max_tokens": -3}).encode())
    assert r.status_code == 400


def test_control_api_needs_the_token(console: Console) -> None:
    assert httpx.get(console.url + "/control/state").status_code == 401
    assert httpx.get(console.url + "/control/state", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert oct(os.stat(console.run_dir / "token").st_mode & 0o777) == "0o600"
    with console.control() as c:
        assert c.get("/control/state").status_code == 200
        r = c.put("/control/policies/routing", json={"name": "nope"})
        assert r.status_code == 422 and "available" in r.json()["error"]["message"]
        r = c.put("/control/policies/routing", json={"name": "sibyl", "params": {"no_type9": True}})
        assert r.status_code == 422
        catalog = c.get("/control/policies").json()
        assert {"sibyl", "least_load", "round_robin", "req_level"} <= {p["name"] for p in catalog["available"]}
        assert {p["kind"] for p in catalog["available"]} == {"routing", "queue", "reschedule", "scaling", "rank"}
        assert "clairvoyant" not in {p["name"] for p in catalog["available"]}  # simulator only
    metrics = httpx.get(console.url + "/metrics").text
    assert "sibyl_routing_decision_seconds_count" in metrics and "sibyl_gateway_requests_total" in metrics
    # --url naming the local console needs no --token: its token file is found
    named = console.cli("status", "--json", "--url", console.url.replace("127.0.0.1", "localhost"))
    assert named.returncode == 0, named.stderr
    assert json.loads(named.stdout)["run_id"] == console.run_id
    listed = console.cli("policy", "list", "--json")
    assert listed.returncode == 0 and json.loads(listed.stdout)["active"]["queue"]["name"] == "fcfs"


def test_policy_swap_under_load_drops_nothing_and_is_recorded(console: Console) -> None:
    c = OpenAI(base_url=console.url + "/v1", api_key="x", max_retries=0)
    errors: list[Exception] = []
    done = []

    def client(k: int) -> None:
        for i in range(6):
            try:
                r = c.completions.create(
                    model="sibyl-model", prompt=f"load {k} {i}", max_tokens=30, extra_body={"ignore_eos": True}
                )
                done.append(r.usage.completion_tokens if r.usage else 0)
            except Exception as e:  # noqa: BLE001 - every failure counts against the test
                errors.append(e)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    out = console.cli("policy", "set", "routing", "round_robin", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["new"] == "round_robin"
    for t in threads:
        t.join()
    assert errors == [] and done == [30] * 36
    before = decode_counts(console)
    for _ in range(8):  # round robin now: eight requests cover the four decode instances twice
        c.completions.create(model="sibyl-model", prompt="rr", max_tokens=1)
    after = decode_counts(console)
    assert {d: after.get(d, 0) - before.get(d, 0) for d in after} == {"d0": 2, "d1": 2, "d2": 2, "d3": 2}
    status = json.loads(console.cli("status", "--json").stdout)
    assert status["policies"]["routing"]["name"] == "round_robin"
    assert {"id", "role", "url", "healthy", "running", "waiting", "kv_usage", "tokens_per_s"} <= status["instances"][
        0
    ].keys()
    wait_for(
        lambda: any(e["source"] == "cli" for e in RunStore(console.db).policy_events(console.run_id)),
        5,
        "the swap to be stored",
    )
    events = RunStore(console.db).policy_events(console.run_id)
    assert [(e["new"], e["source"]) for e in events][-1] == ("round_robin", "cli")


STREAM_TOKENS = 900
"""~4.5 s of decoding at three streams an instance on FIXED_PROFILE: still mid-stream when d0 is killed
even if admitting the six streams takes seconds on a loaded machine."""


@pytest.mark.parametrize(
    "failure_migration",
    [True, pytest.param(False, marks=pytest.mark.slow)],  # "off" (the streams fail) runs in make test-slow
    ids=["failure-migration", "off"],
)
def test_killed_decode_mid_stream_is_resumed_elsewhere_and_marked_down_then_up(
    tmp_path: Path, failure_migration: bool
) -> None:
    """d0 is SIGKILLed while completions (a text and a token-id prompt) and chat streams decode on
    it and d1. With failure migration (the default) d0's streams continue on d1 from prompt +
    streamed text (a token-id prompt + the text as d1 tokenizes it) and every client reads each of
    its STREAM_TOKENS tokens exactly once; with it off they fail, d1's untouched."""
    cfg = tmp_path / "console.toml"
    cfg.write_text(f"failure_migration_attempts = {1 if failure_migration else 0}\n")
    con = start_console(tmp_path, str(cfg), *PROFILE, "--prefill", "1", "--decode", "2", "--policy", "round_robin")
    try:
        state = con.state()
        d0 = next(i for i in state["instances"] if i["id"] == "d0")
        c = OpenAI(base_url=con.url + "/v1", api_key="x", max_retries=0)
        results: dict[int, str] = {}
        usage: dict[int, int] = {}
        read: dict[int, int] = dict.fromkeys(range(6), 0)  # chunks each client has read so far
        expected = "".join(f" t{i}" for i in range(STREAM_TOKENS))

        kinds = ["text", "text", "ids", "ids", "chat", "chat"]  # round robin in arrival order: one of each per instance

        def counted(k: int, s: Any) -> list[Any]:
            chunks = []
            for ch in s:
                chunks.append(ch)
                read[k] += 1
            return chunks

        def stream(k: int) -> None:
            try:
                opts = {"stream_options": {"include_usage": True}}
                if kinds[k] == "chat":
                    s = c.chat.completions.create(
                        model="sibyl-model",
                        messages=[{"role": "user", "content": f"s{k}"}],
                        max_tokens=STREAM_TOKENS,
                        stream=True,
                        extra_body={"ignore_eos": True},
                        **opts,
                    )
                    chunks = counted(k, s)
                    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
                else:
                    prompt: str | list[int] = f"s{k}" if kinds[k] == "text" else [5, 6, 7, k]
                    s = c.completions.create(
                        model="sibyl-model",
                        prompt=prompt,
                        max_tokens=STREAM_TOKENS,
                        stream=True,
                        extra_body={"ignore_eos": True},
                        **opts,
                    )
                    chunks = counted(k, s)
                    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
                usage[k] = next(ch.usage.completion_tokens for ch in chunks if ch.usage)
                results[k] = "ok" if text == expected else f"short:{text.count(' t')}"
            except Exception as e:  # noqa: BLE001
                results[k] = f"error:{type(e).__name__}"

        threads = [threading.Thread(target=stream, args=(k,)) for k in range(len(kinds))]
        for k, t in enumerate(threads):
            t.start()
            wait_for(
                lambda k=k: con.state()["requests"]["in_flight"] == k + 1, 10, f"stream {k} admitted"
            )  # arrival order = k
        wait_for(
            lambda: all(i["running"] == 3 for i in con.state()["instances"] if i["role"] == "decode"),
            10,
            "three streams on each decode instance",
        )
        wait_for(lambda: all(n > 0 for n in read.values()), 10, "every client reading its stream")
        assert all(n < STREAM_TOKENS // 2 for n in read.values()), (
            f"a stream is too far along to be killed mid-stream: {read}"
        )
        os.killpg(d0["pid"], signal.SIGKILL)
        killed_at = time.monotonic()
        wait_for(
            lambda: not next(i for i in con.state()["instances"] if i["id"] == "d0")["healthy"],
            5,
            "d0 to be marked down",
        )
        assert time.monotonic() - killed_at < 2.0
        for t in threads:
            t.join(60)
        assert len(results) == 6
        if failure_migration:
            assert results == {k: "ok" for k in range(6)}, results
            assert usage == {k: STREAM_TOKENS for k in range(6)}, (
                usage
            )  # the resumed streams' usage counts every token once
        else:
            assert sorted(results.values()).count("ok") == 3  # d1's streams are untouched
        # requests now avoid d0
        for _ in range(3):
            assert c.completions.create(model="sibyl-model", prompt="after", max_tokens=2).choices
        port = int(d0["url"].rsplit(":", 1)[1])
        restarted = EmulatorProcess("decode", port, PROFILE).start()
        try:
            restarted.wait_ready(30)
            wait_for(lambda: next(i for i in con.state()["instances"] if i["id"] == "d0")["healthy"], 5, "d0 back up")
        finally:
            restarted.stop()
        con.stop()
        store = RunStore(con.db)
        rows = store.requests(con.run_id)
        hit = [r for r in rows if r["reason"] and "d0 failed mid-stream" in r["reason"]]
        assert len(hit) == 3  # a text, a token-id and a chat stream
        if failure_migration:
            assert all(
                r["status"] == "ok"
                and r["decode_instance"] == "d1"
                and "resumed on d1" in r["reason"]
                and r["output_tokens"] == STREAM_TOKENS
                for r in hit
            )
        else:
            assert all(
                r["status"] == "failed" and r["decode_instance"] == "d0" and "failure migration is off" in r["reason"]
                for r in hit
            )
        events = [(e["instance_id"], e["event"]) for e in store.instance_events(con.run_id)]
        assert ("d0", "down") in events and ("d0", "up") in events
    finally:
        con.stop()
        kill_children(con.home)


@pytest.mark.slow  # ~5-15 s: the default suite stays under 6 min on 2 cores; make test-slow runs it
def test_sigkill_keeps_completed_requests_and_the_run_is_marked_interrupted(tmp_path: Path) -> None:
    con = start_console(tmp_path, *PROFILE, "--prefill", "1", "--decode", "1")
    try:
        c = OpenAI(base_url=con.url + "/v1", api_key="x", max_retries=0)
        finished = 0
        stop = time.monotonic() + 2.5
        while time.monotonic() < stop:
            c.completions.create(model="sibyl-model", prompt="k", max_tokens=4, extra_body={"ignore_eos": True})
            finished += 1
        done_before = time.monotonic()
        time.sleep(1.2)  # the recorder flushes at least every second
        os.killpg(con.proc.pid, signal.SIGKILL)
        con.proc.wait(10)
        del done_before
        with sqlite3.connect(con.db) as db:  # readable as plain SQLite
            stored = db.execute("SELECT COUNT(*) FROM requests WHERE status='ok'").fetchone()[0]
        assert stored == finished
        store = RunStore(con.db)
        assert con.run_id in store.mark_interrupted_runs()
        assert store.get_run(con.run_id).status == "interrupted"
    finally:
        kill_children(con.home)


def test_prefill_retry_no_capacity_503_and_the_event_stream(tmp_path: Path) -> None:
    con = start_console(tmp_path, *PROFILE, "--prefill", "2", "--decode", "1", "--policy", "round_robin")
    try:
        urls = {i["id"]: i["url"] for i in con.state()["instances"]}
        with con.control() as ctl, ctl.stream("GET", "/control/events") as events:
            lines = events.iter_lines()
            first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
            assert first["type"] == "state" and first["state"]["run_id"] == con.run_id
            # p0 now answers every request with 503: each one is retried on p1 and succeeds
            httpx.put(urls["p0"] + "/admin/faults", json={"fail_rate": 1.0, "fail_status": 503})
            c = OpenAI(base_url=con.url + "/v1", api_key="x", max_retries=0)
            for _ in range(4):
                assert c.completions.create(model="sibyl-model", prompt="retry", max_tokens=2).choices[0].text
            con.cli("policy", "set", "routing", "least_load")
            policy = next(
                json.loads(line[6:]) for line in lines if line.startswith("data: ") and '"type":"policy"' in line
            )
            assert (policy["new"], policy["source"]) == ("least_load", "cli")
        # the only decode instance reports unhealthy: requests get a clear 503
        httpx.put(urls["d0"] + "/admin/faults", json={"unhealthy": True})
        wait_for(lambda: not con.state()["instances"][-1]["healthy"], 5, "d0 to be marked down")
        r = httpx.post(con.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and "no healthy decode instance" in r.json()["error"]["message"]
        con.stop()
        rows = RunStore(con.db).requests(con.run_id)
        served = [r for r in rows if r["status"] == "ok"]
        assert len(served) == 4 and all(r["prefill_instance"] == "p1" for r in served)
        rejected = [r for r in rows if r["status"] != "ok"]  # the 503 is recorded too, with why
        assert (
            len(rejected) == 1
            and rejected[0]["decode_instance"] is None
            and "no healthy decode instance" in rejected[0]["reason"]
        )
    finally:
        con.stop()
        kill_children(con.home)


def test_sim_backend_serves_with_the_simulators_timing(tmp_path: Path) -> None:
    """`--backend sim`: processor-sharing decode paced to wall-clock; one request alone decodes at TPS(1)."""
    from core.perf import get_profile

    con = start_console(tmp_path, "--backend", "sim", "--prefill", "1", "--decode", "1", "--profile", "h20-qwen3-32b")
    try:
        assert con.state()["backend"] == "sim" and con.state()["instances"][0]["pid"] is None  # in-process
        c = OpenAI(base_url=con.url + "/v1", api_key="x", max_retries=0)
        stamps = []
        t0 = time.monotonic()
        for ch in c.completions.create(
            model="sibyl-model", prompt=[1] * 100, max_tokens=30, stream=True, extra_body={"ignore_eos": True}
        ):
            if ch.choices and ch.choices[0].text:
                stamps.append(time.monotonic() - t0)
        prof = get_profile("h20-qwen3-32b")
        tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
        assert len(stamps) == 30
        assert tpot == pytest.approx(1 / prof.per_request_rate(1), rel=0.25)
        assert stamps[0] >= float(prof.prefill_time(100))
    finally:
        con.stop()
        kill_children(con.home)


def test_attach_to_running_instances_with_slo_classes_and_cli_errors(tmp_path: Path) -> None:
    with emulators(("prefill", PROFILE), ("decode", PROFILE)) as (p, d):
        con = start_console(tmp_path, "--backend", "vllm", "--attach", f"prefill={p.url};decode={d.url}")
        try:
            assert con.state()["cluster"] == "1P1D" and con.state()["backend"] == "vllm-attached"
            r = httpx.post(
                con.url + "/v1/completions",
                json={"prompt": "x", "max_tokens": 3, "ignore_eos": True},
                headers={"X-Sibyl-SLO-Class": "default"},
            )
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == " t0 t1 t2"
            bad = con.cli("policy", "set", "routing", "nope")
            assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "available:" in bad.stderr
            con.stop()
            assert p.alive() and d.alive()  # attached instances belong to someone else
            rows = RunStore(con.db).requests(con.run_id)
            assert [(r["slo_class"], r["status"]) for r in rows] == [("default", "ok")]
        finally:
            con.stop()


def test_scale_out_and_in_while_serving(tmp_path: Path) -> None:
    con = start_console(tmp_path, *PROFILE, "--prefill", "1", "--decode", "1", "--policy", "round_robin")
    try:
        assert con.state()["capabilities"]["scale"] is True
        out = con.cli("scale", "decode", "1", "--json")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["instances"] == ["d1"]
        wait_for(lambda: any(i["id"] == "d1" and i["healthy"] for i in con.state()["instances"]), 10, "d1 to serve")
        c = OpenAI(base_url=con.url + "/v1", api_key="x", max_retries=0)
        for _ in range(4):
            c.completions.create(model="sibyl-model", prompt="s", max_tokens=2)
        assert decode_counts(con) == {"d0": 2, "d1": 2}  # the new instance takes its share at once
        with con.control() as ctl:
            assert (
                ctl.post("/control/scale", json={"role": "prefill", "delta": -1}).status_code == 409
            )  # the last one stays
            assert ctl.post("/control/scale", json={"role": "gpu", "delta": 1}).status_code == 422
            pid = next(i["pid"] for i in con.state()["instances"] if i["id"] == "d1")
            assert ctl.post("/control/scale", json={"role": "decode", "delta": -1, "source": "tui"}).json()[
                "instances"
            ] == ["d1"]
        wait_for(lambda: all(i["id"] != "d1" for i in con.state()["instances"]), 10, "d1 to be retired")
        wait_for(lambda: not Path(f"/proc/{pid}").exists(), 10, "d1's process to stop")
        for _ in range(2):
            c.completions.create(model="sibyl-model", prompt="s", max_tokens=2)
        assert decode_counts(con) == {"d0": 4, "d1": 2}
        con.stop()
        events = [(e["instance_id"], e["event"], e["detail"]) for e in RunStore(con.db).instance_events(con.run_id)]
        steps = [(i, ev) for i, ev, _ in events if i == "d1"]
        assert steps == [("d1", "starting"), ("d1", "added"), ("d1", "draining"), ("d1", "removed")]
        detail = {ev: d for i, ev, d in events if i == "d1"}
        assert (
            "operator via cli" in detail["added"]
            and detail["draining"].endswith("[tui]")
            and detail["removed"].startswith("drained")
        )
    finally:
        con.stop()
        kill_children(con.home)


def test_client_disconnect_mid_stream_stops_the_relay_and_is_recorded(console: Console) -> None:
    import socket

    body = json.dumps({"prompt": "bye", "max_tokens": 900, "ignore_eos": True, "stream": True}).encode()
    host, port = console.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Request-Id: gone-1\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        received = b""
        while b"data: " not in received:  # the stream started
            chunk = s.recv(4096)
            assert chunk, "connection closed before the first event"
            received += chunk
    # ~900 tokens take ~3 s on this profile; the relay must stop long before that
    wait_for(lambda: console.state()["requests"]["in_flight"] == 0, 2.5, "the relay to stop")
    wait_for(
        lambda: any(r["request_id"] == "gone-1" for r in RunStore(console.db).requests(console.run_id)), 5, "the record"
    )
    row = next(r for r in RunStore(console.db).requests(console.run_id) if r["request_id"] == "gone-1")
    assert row["status"] == "failed" and row["reason"].startswith("client disconnected mid-stream")


def _counter(metrics_text: str, name: str, **labels: str) -> float:
    """The sum of a counter's samples whose labels include `labels`."""
    return sum(
        s.value
        for fam in text_string_to_metric_families(metrics_text)
        for s in fam.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


@pytest.mark.slow  # ~15 s (make test-slow); the default suite's failover matrix runs this case
def test_a_prefill_instance_lost_before_its_kv_is_pulled_is_recomputed_on_the_decode_instance(tmp_path: Path) -> None:
    # vLLM keeps a NIXL read to a dead peer open (the decode leg then never answers); the emulator's
    # kv_pull_hang fault reproduces it. When the console marks the prefill instance down, it drops
    # the stuck decode legs and sends them again without kv_transfer_params.
    con = start_console(tmp_path, *PROFILE, "--prefill", "1", "--decode", "1")
    try:
        urls = {i["id"]: i["url"] for i in con.state()["instances"]}
        httpx.put(urls["p0"] + "/admin/faults", json={"kv_pull_hang": True}).raise_for_status()
        local_before = _counter(
            httpx.get(urls["d0"] + "/metrics").text, "vllm:prompt_tokens_by_source_total", source="local_compute"
        )
        c = OpenAI(base_url=con.url + "/v1", api_key="x", max_retries=0, timeout=60)
        results: dict[str, str] = {}

        def call(stream: bool) -> None:
            try:
                if stream:
                    s = c.completions.create(
                        model="sibyl-model",
                        prompt="lost kv",
                        max_tokens=8,
                        stream=True,
                        extra_body={"ignore_eos": True},
                    )
                    results["stream"] = "".join(ch.choices[0].text for ch in s if ch.choices)
                else:
                    results["whole"] = (
                        c.completions.create(
                            model="sibyl-model", prompt="lost kv", max_tokens=8, extra_body={"ignore_eos": True}
                        )
                        .choices[0]
                        .text
                    )
            except Exception as e:  # noqa: BLE001
                results["stream" if stream else "whole"] = f"error:{type(e).__name__}: {e}"

        threads = [threading.Thread(target=call, args=(stream,)) for stream in (True, False)]
        for t in threads:
            t.start()
        # both decode legs are on d0, waiting on pulls p0 never answers
        wait_for(lambda: httpx.get(urls["d0"] + "/load").json()["server_load"] == 2, 10, "both decode legs stuck on d0")
        assert all(t.is_alive() for t in threads) and con.state()["requests"]["in_flight"] == 2
        httpx.put(urls["p0"] + "/admin/faults", json={"unhealthy": True}).raise_for_status()
        for t in threads:
            t.join(30)
        whole = "".join(f" t{k}" for k in range(8))
        assert results == {"stream": whole, "whole": whole}, results
        local_after = _counter(
            httpx.get(urls["d0"] + "/metrics").text, "vllm:prompt_tokens_by_source_total", source="local_compute"
        )
        assert local_after - local_before >= 2  # both prompts were computed on d0 itself
        assert httpx.get(urls["d0"] + "/load").json()["server_load"] == 0  # the dropped legs left nothing behind
        con.stop()
        rows = RunStore(con.db).requests(con.run_id)
        assert [r["status"] for r in rows] == ["ok", "ok"]
        assert all("prefill p0 was lost before decode d0 received the prompt's KV" in r["reason"] for r in rows)
    finally:
        con.stop()
        kill_children(con.home)


@pytest.mark.slow  # ~8 s (make test-slow); failover stays in the default suite through the failover matrix
def test_a_decode_instance_that_refuses_the_connection_is_replaced_before_anything_streams(tmp_path: Path) -> None:
    # d0 dies; before the console's probes mark it down (20 failed probes: 10 s here), round
    # robin still sends it every other request: each of those is rebound to d1, which pulls the
    # same KV from p0.
    cfg = tmp_path / "console.toml"
    cfg.write_text("down_after_failures = 20\nbreaker_failures = 20\n")
    con = start_console(tmp_path, str(cfg), *PROFILE, "--prefill", "1", "--decode", "2", "--policy", "round_robin")
    try:
        d0 = next(i for i in con.state()["instances"] if i["id"] == "d0")
        os.killpg(d0["pid"], signal.SIGKILL)
        wait_for(lambda: not alive(d0["pid"]), 5, "d0 to die")
        c = OpenAI(base_url=con.url + "/v1", api_key="x", max_retries=0)
        texts = [
            c.completions.create(model="sibyl-model", prompt=f"r{k}", max_tokens=3, extra_body={"ignore_eos": True})
            .choices[0]
            .text
            for k in range(2)
        ]
        assert texts == [" t0 t1 t2"] * 2
        failures = {i["id"]: i["failures"] for i in con.state()["instances"] if i["role"] == "decode"}
        con.stop()
        rows = RunStore(con.db).requests(con.run_id)
        assert [(r["status"], r["decode_instance"]) for r in rows] == [("ok", "d1"), ("ok", "d1")]
        assert failures["d0"] >= 1  # the refused leg counted against d0 (its breaker and probe)
    finally:
        con.stop()
        kill_children(con.home)
