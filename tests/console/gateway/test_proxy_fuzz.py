"""Property-based tests (hypothesis) of everything that parses untrusted input.

The gateway's request parsing (console/gateway/proxy.py), the SSE token counter that reads the
decode instances' streams (adapters/vllm/pd_protocol.py) and the trace readers (core/traces/):
bad input gives a clean client error (an OpenAI-shaped 4xx, a TraceError naming the file), never
another exception type.
"""

from __future__ import annotations

import asyncio
import json
import string
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import orjson
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import console.gateway.proxy as proxy_mod
from adapters.vllm.pd_protocol import SSETokenCounter
from console.gateway.proxy import ClientError, Proxy, estimate_prompt_tokens, read_bounded_body
from core.errors import TraceError
from core.pools import Pool, Pools
from core.traces import Trace, read_azure, read_burstgpt, read_mooncake, read_servegen, read_trace

FAST = settings(max_examples=100, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
MODEL = "sibyl-model"

# -- JSON values ------------------------------------------------------------------------------

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
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
    config = SimpleNamespace(max_body_bytes=kw.get("limit", 1 << 20), slo={"default": None, "interactive": None})

    def no_keys(body: Any, tokenize: bool = True, lora: str | None = None) -> tuple[int, ...]:
        return ()

    pool = Pool(MODEL, MODEL, cast(Any, SimpleNamespace(view=SimpleNamespace(lora=None))))
    prefix = SimpleNamespace(known_keys=no_keys)
    dispatcher = SimpleNamespace(routing=SimpleNamespace(reads_prefix=False), reads_prefix=False)
    runtime = SimpleNamespace(prefix=prefix, dispatcher=dispatcher, instances={}, services=None)
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
    assert body.get("model") in (None, MODEL)
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


# -- Proxy.__call__: headers and the Request it builds ----------------------------------------

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


def call_proxy(body: bytes, headers: list[tuple[bytes, bytes]]) -> tuple[list[dict[str, Any]], list[Captured]]:
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
        asyncio.run(Proxy(fake_controller())(scope, receive, send))
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


# -- SSETokenCounter --------------------------------------------------------------------------

TOKEN = 'data: {"id":"c","choices":[{"index":0,"text":"%s","finish_reason":null}]}\n\n'
EMPTY = 'data: {"id":"c","choices":[{"index":0,"text":"","finish_reason":"length"}]}\n\n'
ROLE = 'data: {"id":"c","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
CHAT = 'data: {"id":"c","choices":[{"index":0,"delta":{"content":"%s"}}]}\n\n'


@st.composite
def sse_streams(draw: Any) -> tuple[bytes, int, bool, int | None]:
    """A stream as vLLM sends it (blank lines between events allowed, as SSE allows them)."""
    parts: list[str] = []
    n = 0
    for kind in draw(st.lists(st.sampled_from(["token", "chat", "empty", "role", "blank"]), max_size=30)):
        if kind in ("token", "chat"):
            text = draw(st.text(alphabet=string.ascii_letters + " ", min_size=1, max_size=6))
            parts.append((TOKEN if kind == "token" else CHAT) % text)
            n += 1
        else:
            parts.append({"empty": EMPTY, "role": ROLE, "blank": "\n"}[kind])
    usage = draw(st.none() | st.integers(min_value=0, max_value=10**6))
    if usage is not None:
        parts.append(
            'data: {"id":"c","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":' + str(usage) + "}}\n\n"
        )
    done = draw(st.booleans())
    if done:
        parts.append("data: [DONE]\n\n")
    return "".join(parts).encode(), n, done, usage


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


@FAST
@given(stream=sse_streams(), cuts=st.lists(st.integers(min_value=0, max_value=10**6), max_size=12))
@example(
    stream=(b"data: " + TOKEN.encode()[6:] + b"\n" + (TOKEN % "b").encode(), 2, False, None), cuts=[len(TOKEN) + 1]
)
def test_sse_counter_is_independent_of_chunking(stream: tuple[bytes, int, bool, int | None], cuts: list[int]) -> None:
    data, n, done, usage = stream
    counter = SSETokenCounter()
    seen = sum(counter.feed(chunk) for chunk in split_at(data, cuts))
    assert (counter.tokens, seen, counter.done, counter.error) == (n, n, done, None)
    assert counter.output_tokens == (usage if usage is not None else n)


@FAST
@given(
    chunks=st.lists(
        st.binary(max_size=80)
        | st.sampled_from([b"\n\n", b"data: ", b'"choices":[]', b'"error"', b"[DONE]", b'"usage":']),
        max_size=20,
    )
)
@example(chunks=[b'data: ["\\"choices\\":[]"]\n\n'])
@example(chunks=[b'data: {"choices":[],"usage":5}\n\n'])
@example(chunks=[b'data: {"choices":[],"usage":{"completion_tokens":[1]}}\n\n'])
@example(chunks=[b'xxxxx{"choices":[],"usage":[1]}\n\n'])
@example(chunks=[b'data: \xff\xfe"error"\n\n'])
def test_sse_counter_never_raises_on_garbage(chunks: list[bytes]) -> None:
    counter = SSETokenCounter()
    total = 0
    for chunk in chunks:
        got = counter.feed(chunk)
        assert got >= 0
        total += got
    assert total == counter.tokens
    assert counter.usage_completion_tokens is None or type(counter.usage_completion_tokens) is int
    assert counter.error is None or isinstance(counter.error, str)
    # and the same bytes in one piece count the same
    whole = SSETokenCounter()
    whole.feed(b"".join(chunks))
    assert (whole.tokens, whole.done, whole.usage_completion_tokens) == (
        counter.tokens,
        counter.done,
        counter.usage_completion_tokens,
    )


# -- trace readers ----------------------------------------------------------------------------

READERS = {"mooncake": read_mooncake, "azure": read_azure, "burstgpt": read_burstgpt, "auto": read_trace}


def read_or_error(reader: Any, path: Path) -> Trace | TraceError:
    try:
        trace = reader(path)
    except TraceError as e:
        assert path.name in str(e), str(e)  # the error names the file
        return e
    assert isinstance(trace, Trace)
    return trace


def write(tmp: str, name: str, data: bytes) -> Path:
    path = Path(tmp) / name
    path.write_bytes(data)
    return path


@FAST
@given(data=st.binary(max_size=300), reader=st.sampled_from(sorted(READERS)))
@example(data=b"\xef\xbb\xbf", reader="auto")
@example(data=b"\x00\x00", reader="azure")
@example(data=b'{"timestamp": 0, "input_length": 1, "output_length": 1}\n\xff', reader="auto")
@example(data=b'{"timestamp": ' + b"1" * 5000 + b', "input_length": 1, "output_length": 1}', reader="auto")
@example(
    data=b'{"timestamp": 0, "input_length": 1, "output_length": 1}\n{"timestamp": ' + b"1" * 5000 + b"}",
    reader="mooncake",
)
def test_trace_readers_on_random_bytes(data: bytes, reader: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        read_or_error(READERS[reader], write(tmp, "trace.txt", data))


cells = st.one_of(
    st.integers(min_value=-5, max_value=2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(alphabet=string.printable.replace("\r", "").replace("\n", ""), max_size=12),
    st.sampled_from(
        [
            "",
            " ",
            "1e400",
            "9" * 25,
            "2023-11-16 18:15:46.6805900",
            "2023-02-30 00:00:00",
            "2023-11-16 24:00:00",
            '"1,2"',
        ]
    ),
)


def row_error_names_line_and_field(err: TraceError, fields: tuple[str, ...]) -> None:
    text = str(err)
    if "field '" in text:
        field = text.split("field '", 1)[1].split("'", 1)[0]
        assert field in fields, text
        assert text.split(":", 2)[1].isdigit(), text  # name:line: field ...


@FAST
@given(
    rows=st.lists(st.tuples(cells, cells, cells), min_size=1, max_size=6), fmt=st.sampled_from(["azure", "burstgpt"])
)
@example(rows=[("2023-11-16 18:15:46", "99999999999999999999", "1")], fmt="azure")
@example(rows=[("1", "99999999999999999999", "3")], fmt="burstgpt")
def test_csv_readers_on_random_rows(rows: list[tuple[str, str, str]], fmt: str) -> None:
    fields = (
        ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
        if fmt == "azure"
        else ("Timestamp", "Request tokens", "Response tokens")
    )
    text = ",".join(fields) + "\n" + "".join(",".join(r) + "\n" for r in rows)
    with tempfile.TemporaryDirectory() as tmp:
        got = read_or_error(READERS[fmt], write(tmp, f"{fmt}.csv", text.encode()))
    if isinstance(got, TraceError):
        row_error_names_line_and_field(got, fields)
    else:
        assert len(got) >= 1 and (got.prompt_tokens >= 1).all()


mooncake_values = st.one_of(
    json_values,
    st.integers(min_value=-5, max_value=2**80),
    st.floats(min_value=0, max_value=1e308),
    st.sampled_from([0, 1, 1.5, 2**63, 10**400]),
)


@FAST
@given(
    rows=st.lists(
        st.dictionaries(
            st.sampled_from(["timestamp", "input_length", "output_length", "hash_ids"]), mooncake_values, min_size=2
        ),
        min_size=1,
        max_size=5,
    )
)
@example(rows=[{"timestamp": 0, "input_length": 2**63, "output_length": 1}])
@example(rows=[{"timestamp": 0, "input_length": 1e300, "output_length": 1}])
@example(rows=[{"timestamp": 10**400, "input_length": 1, "output_length": 1}])
def test_mooncake_on_random_rows(rows: list[dict[str, Any]]) -> None:
    text = "".join(json.dumps(r) + "\n" for r in rows)
    with tempfile.TemporaryDirectory() as tmp:
        got = read_or_error(read_mooncake, write(tmp, "m.jsonl", text.encode()))
    if isinstance(got, TraceError):
        row_error_names_line_and_field(got, ("timestamp", "input_length", "output_length", "hash_ids"))
    else:
        assert len(got) == len(rows)


servegen_cells = st.one_of(
    st.floats(min_value=0, max_value=50).map(lambda x: f"{x:.3f}"),
    st.sampled_from(["", "Gamma", "Weibull", "Exponential", "x", "-1", "nan", "0"]),
)


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.lists(st.lists(servegen_cells, min_size=4, max_size=7), min_size=1, max_size=4),
    dataset=st.one_of(
        json_values,
        st.dictionaries(
            st.sampled_from(["0", "21600", "x"]),
            st.dictionaries(
                st.sampled_from(["input_tokens", "output_tokens"]),
                st.one_of(
                    json_values, st.sampled_from(["{1: 0.5, 8: 0.5}", "{}", "{0: 1}", "{1: -1}", "[1]", "{1: 0.5"])
                ),
            ),
        ),
    ),
)
@example(rows=[["0.000", "5.000", "1.000", "Gamma", "1.000", "1.000"]], dataset={})  # no windows: was an IndexError
def test_servegen_on_random_folders(rows: list[list[str]], dataset: Any) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        write(tmp, "chunk-3-trace.csv", "".join(",".join(r) + "\n" for r in rows).encode())
        write(tmp, "chunk-3-dataset.json", json.dumps(dataset, indent=1).encode())
        try:
            got = read_servegen(Path(tmp), duration_s=100.0)
        except TraceError as e:
            assert "chunk-3" in str(e) or tmp in str(e), str(e)
            return
        assert isinstance(got, Trace)


def test_a_csv_field_over_the_csv_module_limit_is_a_trace_error(tmp_path: Path) -> None:
    path = write(
        str(tmp_path), "big.csv", b"TIMESTAMP,ContextTokens,GeneratedTokens\n" + b'"' + b"1" * 200_000 + b'",1,1\n'
    )
    with pytest.raises(TraceError, match=r"big\.csv:2"):
        read_azure(path)


@pytest.mark.xfail(
    strict=True,
    raises=(MemoryError, OverflowError, ValueError),
    reason=(
        "core/traces/servegen.py (not fixed here): a huge rate allocates rate × window gaps at once; "
        "a PMF key beyond int64 overflows; a 5000-digit number in the dataset JSON is a ValueError"
    ),
)
@pytest.mark.parametrize(
    ("trace_row", "dataset"),
    [
        ("0,1e12,1,Gamma,1,0", b'{"0": {"input_tokens": "{1: 1}", "output_tokens": "{1: 1}"}}'),
        ("0,1,1,Gamma,1,0", b'{"0": {"input_tokens": "{99999999999999999999: 1}", "output_tokens": "{1: 1}"}}'),
        ("0,1,1,Gamma,1,0", b'{"0": {"input_tokens": "{1: 1}", "output_tokens": "{1: 1}", "x": ' + b"1" * 5000 + b"}}"),
    ],
    ids=["huge-rate", "huge-pmf-key", "huge-json-number"],
)
def test_servegen_extreme_numbers_are_trace_errors(tmp_path: Path, trace_row: str, dataset: bytes) -> None:
    write(str(tmp_path), "chunk-1-trace.csv", (trace_row + "\n").encode())
    write(str(tmp_path), "chunk-1-dataset.json", dataset)
    with pytest.raises(TraceError, match="chunk-1"):
        read_servegen(tmp_path, duration_s=10.0)
