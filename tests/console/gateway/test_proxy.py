"""The gateway's request parsing (console/gateway/proxy.py), property-based (hypothesis) and by hand.

Bad input (the body, its size, the headers) gives an OpenAI-shaped 4xx, never another exception type; a body
that parses becomes a sane Request; one X-Request-Id is not in flight twice.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import orjson
from hypothesis import example, given
from hypothesis import strategies as st

import console.gateway.proxy as proxy_mod
from console.gateway.proxy import ClientError, Proxy, estimate_prompt_tokens, read_bounded_body
from core.pools import Pool, Pools
from tests.fuzzing import FAST, json_values

MODEL = "sibyl-model"


# -- request bodies ---------------------------------------------------------------------------


prompts = st.one_of(
    st.text(max_size=40),
    st.lists(st.integers(min_value=0, max_value=2**40), max_size=8),
    st.lists(st.text(max_size=10), max_size=4),
    st.lists(st.lists(st.integers(min_value=0, max_value=1000), max_size=6), max_size=3),
    json_values,
)


messages = st.one_of(
    st.lists(
        st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]), "content": json_values}),
        max_size=4,
    ),
    json_values,
)


token_field = st.one_of(
    st.none(),
    st.integers(min_value=-3, max_value=2**64 - 1),  # orjson: 64-bit at most
    st.booleans(),
    st.floats(allow_nan=False),
    st.text(max_size=5),
    st.lists(st.integers(min_value=-5, max_value=5), max_size=2),
)


request_bodies = st.fixed_dictionaries(
    {},
    optional={
        "model": st.one_of(st.just(MODEL), json_values),
        "prompt": prompts,
        "messages": messages,
        "max_tokens": token_field,
        "max_completion_tokens": token_field,
        "stream": json_values,
        "priority": json_values,
        "slo_class": json_values,
        "user": json_values,
    },
)


def fake_controller(**kw: Any) -> Any:
    """`tokenized`: each known_keys call's `tokenize` flag goes there; `advised`: the advisor advises the pool."""
    config = SimpleNamespace(max_body_bytes=kw.get("limit", 1 << 20), slo={"default": None, "interactive": None})
    tokenized: list[bool] = kw.get("tokenized", [])

    def no_keys(body: Any, tokenize: bool = True, lora: str | None = None) -> tuple[int, ...]:
        tokenized.append(tokenize)
        return ()

    pool = Pool(MODEL, MODEL, cast(Any, SimpleNamespace(view=SimpleNamespace(lora=None))))
    prefix = SimpleNamespace(known_keys=no_keys)
    dispatcher = SimpleNamespace(routing=SimpleNamespace(reads_prefix=False), reads_prefix=False)
    advised = kw.get("advised", False)
    runtime = SimpleNamespace(prefix=prefix, dispatcher=dispatcher, instances={}, services=None, advised=advised)
    return SimpleNamespace(
        pools=Pools([pool]),
        runtime_of={pool: runtime},  # the one pool's parts, as Controller.runtime_of maps them
        draining=False,
        config=config,
        instances={},
        prefix=prefix,
        dispatcher=dispatcher,
        # an open /v1 (no keys file), as console.live.tenants.Tenants is without one
        tenants=SimpleNamespace(keyed=False, authenticate=lambda header: "default", priority=lambda t, asked: asked),
        tracing=None,
        services=None,  # what a LiveRequest uses: these tests capture the LiveRequest instead
    )


def error_shaped(raw: bytes, status: int) -> None:
    err = orjson.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    assert err["param"] is None or isinstance(err["param"], str)
    assert err["code"] == status


# -- read_bounded_body ----------------------------------------------------------------------------


def run_read_bounded_body(messages: list[dict[str, Any]], limit: int) -> bytes:
    it = iter(messages)

    async def receive() -> dict[str, Any]:
        return next(it)

    return asyncio.run(read_bounded_body(receive, limit))


@FAST
@given(
    chunks=st.lists(st.binary(max_size=64), min_size=1, max_size=8),
    limit=st.integers(min_value=0, max_value=300),
    gone_at=st.none() | st.integers(min_value=0, max_value=7),
)
def test_read_bounded_body_joins_chunks_or_refuses_cleanly(
    chunks: list[bytes], limit: int, gone_at: int | None
) -> None:
    msgs: list[dict[str, Any]] = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)
    ]
    if gone_at is not None and gone_at < len(msgs):
        msgs[gone_at] = {"type": "http.disconnect"}
    try:
        body = run_read_bounded_body(msgs, limit)
    except ClientError as e:
        if gone_at is not None and gone_at < len(msgs) and sum(map(len, chunks[:gone_at])) <= limit:
            assert e.status == 400 and "disconnected" in e.message
        else:
            assert e.status == 413 and sum(map(len, chunks)) > limit
        return
    assert gone_at is None or gone_at >= len(msgs)
    assert body == b"".join(chunks) and len(body) <= limit


# -- Proxy._parse and estimate_prompt_tokens --------------------------------------------------


def check_parse(raw: bytes) -> dict[str, Any] | None:
    p = Proxy(fake_controller())
    try:
        body = p._parse(raw)
    except ClientError as e:
        assert e.status in (400, 404)
        error_shaped(proxy_mod.error_body(e.status, e.message, e.param), e.status)
        return None
    assert isinstance(body, dict) and ("prompt" in body or "messages" in body)
    model = body.get("model")
    assert model is None or isinstance(model, str)  # which pool serves it is routing's question (_route)
    if model not in (None, MODEL):
        try:
            p._route(model)
        except ClientError as e:
            assert e.status == 404 and e.param == "model"
        else:
            raise AssertionError(f"{model!r} was routed")
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        assert v is None or (type(v) is int and 1 <= v < 2**63), (key, v)  # what SQLite and engines hold
    prio = body.get("priority")
    assert type(prio) is not int or -(2**63) <= prio < 2**63, prio
    return body


@FAST
@given(raw=st.binary(max_size=200))
@example(raw=b"")
@example(raw=b"\xff\xfe")
@example(raw=b"[1,2]")
@example(raw=b'{"prompt": "x", "max_tokens": NaN}')
def test_parse_random_bytes(raw: bytes) -> None:
    check_parse(raw)


@FAST
@given(body=request_bodies)
@example(body={"model": ["a"], "prompt": "x"})
@example(body={"model": {"a": 1}, "prompt": "x"})
@example(body={"prompt": "", "model": ""})  # an empty model name is a string: routing answers 404
@example(body={"prompt": "x", "max_tokens": None, "max_completion_tokens": "lots"})
@example(body={"prompt": "x", "max_tokens": None, "max_completion_tokens": 0.5})
@example(body={"prompt": "x", "max_tokens": 2**64 - 1})  # JSON parsers take it; SQLite and engines cannot
@example(body={"prompt": "x", "priority": 2**63})
@example(body={"prompt": "x", "max_tokens": True})
def test_parse_json_bodies(body: dict[str, Any]) -> None:
    parsed = check_parse(orjson.dumps(body))
    if parsed is not None:
        n = estimate_prompt_tokens(parsed)
        assert type(n) is int and n >= 1


@FAST
@given(body=st.dictionaries(st.sampled_from(["prompt", "messages", "model", "x"]), json_values, max_size=3))
def test_estimate_prompt_tokens_is_a_positive_int(body: dict[str, Any]) -> None:
    n = estimate_prompt_tokens(body)
    assert type(n) is int and n >= 1


@FAST
@given(ids=st.lists(st.integers(min_value=0, max_value=10**6), min_size=1, max_size=50), text=st.text(max_size=100))
def test_estimate_prompt_tokens_counts(ids: list[int], text: str) -> None:
    assert estimate_prompt_tokens({"prompt": ids}) == len(ids)
    assert estimate_prompt_tokens({"prompt": text}) == max(1, len(text.encode()) // 4)
    assert estimate_prompt_tokens({"messages": [{"role": "user", "content": text}]}) == max(1, len(text.encode()) // 4)


# what an HTTP server may hand over as a header value: visible ASCII, space, tab, obs-text
header_values = st.binary(max_size=24).map(lambda b: bytes(c for c in b if c == 9 or 32 <= c <= 126 or c >= 128))


header_names = st.sampled_from(
    [b"x-request-id", b"x-sibyl-slo-class", b"x-sibyl-tenant", b"authorization", b"content-type", b"x-other"]
)


class Captured:
    runs: list[Any] = []

    def __init__(self, req: Any, path: str, body: dict[str, Any], fwd: bytes, model: str = "") -> None:
        self.req, self.path, self.body, self.fwd = req, path, body, fwd

    async def run(self, c: Any, client: Any) -> None:
        Captured.runs.append(self)


def call_proxy(
    body: bytes, headers: list[tuple[bytes, bytes]], **controller: Any
) -> tuple[list[dict[str, Any]], list[Captured]]:
    sent: list[dict[str, Any]] = []
    msgs = iter([{"type": "http.request", "body": body, "more_body": False}])

    async def receive() -> dict[str, Any]:
        return next(msgs)

    async def send(m: dict[str, Any]) -> None:
        sent.append(m)

    Captured.runs = []
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}
    orig = proxy_mod.LiveRequest
    proxy_mod.LiveRequest = Captured  # type: ignore[assignment,misc]
    try:
        asyncio.run(Proxy(fake_controller(**controller))(scope, receive, send))
    finally:
        proxy_mod.LiveRequest = orig  # type: ignore[misc]
    return sent, Captured.runs


@FAST
@given(body=request_bodies, headers=st.lists(st.tuples(header_names, header_values), max_size=5))
@example(body={"prompt": "x"}, headers=[(b"x-request-id", b"\xff\xfe")])
@example(body={"prompt": "x"}, headers=[(b"x-sibyl-tenant", b"caf\xe9")])
@example(body={"prompt": "x"}, headers=[(b"x-sibyl-slo-class", b"\x80")])
@example(body={"prompt": "x"}, headers=[(b"authorization", b"Bearer \xff")])
@example(body={"prompt": "x", "max_tokens": None, "max_completion_tokens": "many"}, headers=[])
def test_proxy_call_answers_a_client_error_or_builds_a_sane_request(
    body: dict[str, Any], headers: list[tuple[bytes, bytes]]
) -> None:
    sent, runs = call_proxy(orjson.dumps(body), headers)
    if not runs:
        assert len(sent) == 2 and sent[0]["type"] == "http.response.start"
        assert 400 <= sent[0]["status"] < 500
        error_shaped(sent[1]["body"], sent[0]["status"])
        return
    assert not sent  # the LiveRequest answers from here on
    (lr,) = runs
    req = lr.req
    assert isinstance(req.id, str) and req.id
    assert type(req.max_tokens) is int and req.max_tokens >= 1
    assert type(req.prompt_tokens) is int and req.prompt_tokens >= 1
    assert req.slo_class in ("default", "interactive")
    assert type(req.priority) is int and isinstance(req.tenant, str)
    # the forwarded header lines are well formed: one CRLF per line, nothing else breaks a line
    lines = lr.fwd.split(b"\r\n")
    assert lines[-1] == b"" and all(b"\r" not in ln and b"\n" not in ln and b": " in ln for ln in lines[:-1])
    sent_rid = dict(headers).get(b"x-request-id")
    if sent_rid:
        assert req.id.encode("latin-1") == sent_rid  # the client's id, byte for byte


def test_a_request_id_in_flight_twice_is_a_409_then_free_again() -> None:
    """Two requests with one X-Request-Id at once corrupted the dispatcher's table (KeyError, 500s)."""
    gate = asyncio.Event()
    runs: list[str] = []

    class Slow:
        def __init__(self, req: Any, *_: Any) -> None:
            self.req = req

        async def run(self, c: Any, client: Any) -> None:
            runs.append(self.req.id)
            await gate.wait()

    async def one(p: Proxy, sent: list[dict[str, Any]]) -> None:
        msgs = iter([{"type": "http.request", "body": b'{"prompt": "x"}', "more_body": False}])

        async def receive() -> dict[str, Any]:
            return next(msgs)

        async def send(m: dict[str, Any]) -> None:
            sent.append(m)

        await p({"type": "http", "path": "/v1/completions", "headers": [(b"x-request-id", b"dup")]}, receive, send)

    async def main() -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
        p = Proxy(fake_controller())
        a: list[dict[str, Any]] = []
        b: list[dict[str, Any]] = []
        c: list[dict[str, Any]] = []
        first = asyncio.create_task(one(p, a))
        await asyncio.sleep(0)
        await one(p, b)  # while the first is in flight
        gate.set()
        await first
        await one(p, c)  # the id is free again
        return a, b, c

    orig = proxy_mod.LiveRequest
    proxy_mod.LiveRequest = Slow  # type: ignore[assignment,misc]
    try:
        a, b, c = asyncio.run(main())
    finally:
        proxy_mod.LiveRequest = orig  # type: ignore[misc]
    assert runs == ["dup", "dup"] and a == [] and c == []
    assert b[0]["status"] == 409
    error_shaped(b[1]["body"], 409)


def test_the_prompt_is_keyed_for_the_advisor_even_when_the_active_policy_reads_no_cache() -> None:
    """Under round robin the gateway keys only prompts it can hash without tokenizing; on a pool the advisor
    advises it tokenizes the rest too (the real-vLLM stage found the advisor's window without keys)."""
    plain: list[bool] = []
    call_proxy(b'{"prompt": "hello"}', [], tokenized=plain)
    advised: list[bool] = []
    call_proxy(b'{"prompt": "hello"}', [], tokenized=advised, advised=True)
    assert plain == [False] and advised == [True]
