"""The console's tenants: keys files (TOML, YAML, `tenants add`), the bearer key, reloads that keep or
replace the table, and a held queue released fairly between tenants through the real dispatcher."""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from typer.testing import CliRunner

import console.gateway.proxy as proxy_mod
from console.cli import _register_commands, app
from console.gateway.proxy import Proxy
from console.live.channel import Rejected
from console.live.record import Outcome, Step
from console.live.tenants import Tenants, bearer_key, keys_file_line, read_keys_file
from core.admission import SloAdmission
from core.errors import ConfigError
from core.tenants import hash_key
from core.types import Request
from tests.console.live.fakes import dispatcher, instances, record

_register_commands()


def test_tenants_add_writes_only_the_hash_and_prints_a_new_key_once(tmp_path: Path) -> None:
    keys = tmp_path / "tenants.toml"
    runner = CliRunner()
    out = runner.invoke(app, ["tenants", "add", "team-a", "--file", str(keys), "--max-in-flight", "4"])
    assert out.exit_code == 0, out.output
    key = re.search(r"(sk-sibyl-\S+)", out.stdout)
    assert key is not None and key.group(1) not in keys.read_text()
    out = runner.invoke(app, ["tenants", "add", "b", "--file", str(keys), "--key", "sk-b", "--tokens-per-minute", "9"])
    assert out.exit_code == 0 and "sk-b" not in out.stdout
    specs = read_keys_file(keys)
    assert specs["team-a"].key_sha256 == [hash_key(key.group(1))] and specs["team-a"].max_in_flight == 4
    assert specs["b"].tokens_per_minute == 9 and oct(os.stat(keys).st_mode & 0o777) == "0o600"
    again = runner.invoke(app, ["tenants", "add", "b", "--file", str(keys), "--key", "sk-c"])
    assert again.exit_code != 0 and "already there" in str(again.exception or again.output)
    assert runner.invoke(app, ["tenants", "hash", "abc"]).stdout.strip() == hash_key("abc")


def test_a_yaml_keys_file_and_what_a_bad_one_says(tmp_path: Path) -> None:
    y = tmp_path / "tenants.yaml"
    y.write_text(f"tenants:\n  a:\n    key_sha256: {hash_key('k')}\n    weight: 2\n  b:\n    key_sha256: nope\n")
    with pytest.raises(ConfigError, match=r"tenants.yaml, line 5: tenant 'b': field 'key_sha256'"):
        read_keys_file(y)
    y.write_text(f"tenants:\n  a:\n    key_sha256: {hash_key('k')}\n    weight: 2\n")
    assert read_keys_file(y)["a"].weight == 2
    with pytest.raises(ConfigError, match="invalid TOML"):
        (tmp_path / "t.toml").write_text("[tenants.a\n")
        read_keys_file(tmp_path / "t.toml")
    with pytest.raises(ConfigError, match="cannot read"):
        read_keys_file(tmp_path / "missing.toml")


def test_bearer_keys() -> None:
    assert bearer_key("Bearer sk-1") == b"sk-1" and bearer_key("bearer  sk-1 ") == b"sk-1"
    assert bearer_key("Basic abc") is None and bearer_key("Bearer ") is None and bearer_key(None) is None


def test_a_changed_file_is_reloaded_and_a_bad_one_keeps_the_table(tmp_path: Path) -> None:
    keys = tmp_path / "tenants.toml"
    keys.write_text(keys_file_line("a", "sk-a", max_in_flight=1))
    d = dispatcher(instances(1, 1))
    gate = d.use_slo_admission(SloAdmission())
    t = Tenants(keys, d, now=0.0)
    seen: list[dict[str, object]] = []
    t.on_reload = seen.append
    assert t.keyed and d.admission.fair is t.fair and t.authenticate("Bearer sk-a") == "a"
    live = record("r1")
    live.request.tenant = "a"
    t.admit(live)
    keys.write_text(keys_file_line("a", "sk-a2", max_in_flight=1) + keys_file_line("b", "sk-b", weight=3))
    t.poll(10.0)
    assert seen[-1]["ok"] and t.authenticate("Bearer sk-a") is None and t.authenticate("Bearer sk-b") == "b"
    assert t.fair is not None and t.fair.weights == {"a": 1.0, "b": 3.0}
    second = record("r3")
    second.request.tenant = "a"
    with pytest.raises(Rejected) as over:
        t.admit(second)  # the request admitted before the reload still counts
    assert over.value.status == 429 and over.value.retry_after_s == 1.0 and over.value.outcome is Outcome.TENANT_LIMIT
    # counted with admission's refusals, by cause (the wait its limit asks, no bound)
    assert gate.refusals_by_cause()["tenant_limit"] == {"count": 1, "last_projected_s": 1.0, "bound_s": 0.0}
    keys.write_text("[tenants.a]\nkey_sha256 = 1\n")
    t.poll(20.0)
    assert not seen[-1]["ok"] and "line 1: tenant 'a'" in str(t.last_error)
    assert t.authenticate("Bearer sk-b") == "b" and t.snapshot()["last_error"] == t.last_error
    assert t.reloads == {"ok": 1, "error": 1}


def test_without_a_file_everything_is_default_and_open() -> None:
    d = dispatcher(instances(1, 1))
    t = Tenants(None, d, now=0.0)
    assert not t.keyed and d.admission.fair is None and t.authenticate(None) == "default"
    assert t.label(Request("x", 0.0, 1, 1, tenant="whoever")) == "default" and t.priority("default", -5) == -5
    with pytest.raises(ConfigError, match="no tenants' keys file"):
        t.reload()


def test_held_requests_are_released_round_robin_between_tenants(tmp_path: Path) -> None:
    keys = tmp_path / "tenants.toml"
    keys.write_text(keys_file_line("a", "sk-a") + keys_file_line("b", "sk-b"))
    d = dispatcher(instances(1, 1), queue=("fcfs", {"max_in_flight_per_instance": 1}))
    Tenants(keys, d, now=0.0)
    assert d.admit(Request("first", 0.0, 10, 10, tenant="a"), 0.0).value == "route"
    d.route(Request("first", 0.0, 10, 10, tenant="a"), 0.0)
    for rid, tenant in [("a1", "a"), ("a2", "a"), ("a3", "a"), ("b1", "b"), ("b2", "b")]:
        assert d.admit(Request(rid, 0.0, 10, 10, tenant=tenant), 0.0).value == "queued"
    order = []
    for k in range(5):
        d.on_fail("first" if k == 0 else order[-1], 1.0 + k)
        released = d.release(1.0 + k)
        order.append(str(released[0].id))
        d.route(released[0], 1.0 + k)
    assert order == ["a1", "b1", "a2", "b2", "a3"]


def test_runs_show_sums_requests_by_tenant() -> None:
    from console.commands.runs import per_tenant

    rows = [
        {"tenant": "a", "status": "ok", "slo_met": True, "reason": None},
        {"tenant": "a", "status": "ok", "slo_met": False, "reason": None},
        {"tenant": "a", "status": "failed", "slo_met": False, "reason": "tenant 'a' has 8 requests in flight, ..."},
        {"tenant": "b", "status": "failed", "slo_met": False, "reason": "the cluster is saturated: ..."},
        {"tenant": None, "status": "ok", "slo_met": True, "reason": None},  # a row from before schema 8
    ]
    assert per_tenant(rows) == {
        "a": {"requests": 3, "ok": 2, "met": 1, "limited": 1, "attainment": 0.5},
        "b": {"requests": 1, "ok": 0, "met": 0, "limited": 0, "attainment": None},
    }


def test_without_a_file_every_request_is_still_charged_to_the_default_tenant() -> None:
    t = Tenants(None, dispatcher(instances(1, 1)), now=0.0)
    done, refused = record("r1", prompt=10), record("r2", prompt=7)
    for live in (done, refused):
        live.request.tenant = "named-by-the-client"  # its fair share in the queue, not its charge
        t.admit(live)
    assert t.snapshot()["tenants"]["default"]["in_flight"] == 2
    done.enter(Step.DECODING)  # a decode-only assignment: the prompt was computed all the same
    done.outcome, done.output_tokens = Outcome.OK, 3
    t.finished(done, met=True)
    t.finished(refused, met=False)  # left before any leg: failed, its prompt not counted
    assert list(t.snapshot()["tenants"]) == ["default"]
    row = t.snapshot()["tenants"]["default"]
    assert row["in_flight"] == 0 and row["prompt_tokens"] == 10 and row["output_tokens"] == 3
    assert row["requests"] == {"met": 1, "missed": 0, "failed": 1, "limited": 0}


def test_the_gateway_charges_the_keys_tenant_or_lets_the_client_name_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With keys: the key's tenant, its priority band, the key kept in the gateway, 401 without one.
    Without: the client's X-Sibyl-Tenant, its own priority, its Authorization passed on to the legs."""
    keys = tmp_path / "tenants.toml"
    keys.write_text(keys_file_line("a", "sk-a", priority=5))
    runs: list[tuple[Request, dict[str, Any], bytes]] = []

    class Captured:
        def __init__(self, req: Request, path: str, body: dict[str, Any], fwd: bytes, model: str = "") -> None:
            runs.append((req, body, fwd))

        async def run(self, c: Any, client: Any) -> None:
            return None

    monkeypatch.setattr(proxy_mod, "LiveRequest", Captured)

    def call(tenants: Tenants, headers: list[tuple[bytes, bytes]]) -> list[dict[str, Any]]:
        sent: list[dict[str, Any]] = []
        msgs = iter([{"type": "http.request", "body": b'{"prompt": "x", "priority": 1}', "more_body": False}])

        async def receive() -> dict[str, Any]:
            return next(msgs)

        async def send(m: dict[str, Any]) -> None:
            sent.append(m)

        pool = type("Pool", (), {"model": "m"})()  # hashable, as core.pools.Pool: runtime_of is keyed by it
        runtime = SimpleNamespace(  # the pool's own parts (console.live.pools.PoolRuntime)
            instances={},
            prefix=SimpleNamespace(known_keys=lambda body, tokenize=True, lora=None: ()),
            dispatcher=SimpleNamespace(routing=SimpleNamespace(reads_prefix=False), reads_prefix=False),
            services=None,  # the LiveRequest is Captured: it never uses them
            advised=False,
        )
        c = SimpleNamespace(
            pools=SimpleNamespace(routes={}, default=SimpleNamespace(pool=pool, adapter=None)),
            runtime_of={pool: runtime},
            draining=False,
            config=SimpleNamespace(max_body_bytes=1 << 20, slo={"default": None}),
            tenants=tenants,
            tracing=None,
        )
        scope = {"type": "http", "path": "/v1/completions", "headers": headers}
        asyncio.run(Proxy(cast(Any, c))(scope, receive, send))
        return sent

    d = dispatcher(instances(1, 1))
    keyed = Tenants(keys, d, now=0.0)
    named = [(b"x-sibyl-tenant", b"someone")]
    assert call(keyed, [(b"authorization", b"Bearer sk-a"), *named]) == []
    req, body, fwd = runs.pop()
    assert (req.tenant, req.priority, body["priority"]) == ("a", 5, 5) and b"Authorization" not in fwd
    sent = call(keyed, named)
    assert sent[0]["status"] == 401 and keyed.table.unauthorized == 1 and not runs

    open_v1 = Tenants(None, d, now=0.0)
    assert call(open_v1, [(b"authorization", b"Bearer sk-upstream"), *named]) == []
    req, body, fwd = runs.pop()
    assert (req.tenant, req.priority, body["priority"]) == ("someone", 1, 1)
    assert b"Authorization: Bearer sk-upstream\r\n" in fwd
