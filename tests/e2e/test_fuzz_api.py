"""Schema-driven fuzzing (schemathesis) of a REAL console: the OpenAI endpoints and the control API.

The console (emulated 1P1D) serves its own OpenAPI document at GET /openapi.json; schemathesis
generates requests from it, valid ones and invalid ones, and every answer must be a success or a
well-formed error `{"error": {"message", "type", "param", "code"}}` that the schema lists —
never a 500, never a traceback in the console's log, never a dead console.

/control/scale really starts processes: the schema bounds |delta| (the gateway refuses more) and
this test lets at most SCALE_OUT_BUDGET instances be added in a run; any further positive delta is
sent negated (exercising the drain path instead).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.config._auth import AuthConfig
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    ignored_auth,
    response_schema_conformance,
    status_code_conformance,
)

from tests.procs import FAST_PROFILE, Console, kill_children, start_console

ARGS = ["--profile", FAST_PROFILE, "--prefill", "1", "--decode", "1"]
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    ignored_auth,
]
SCALE_OUT_BUDGET = 2
MAX_TOKENS_IN_TEST = 8
"""Generated max_tokens are capped here (the schema's own bound is the context length) to keep
each emulated request short."""


@pytest.fixture(scope="module")
def console(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Console]:
    tmp = tmp_path_factory.mktemp("fuzz")
    con = start_console(tmp, *ARGS)
    try:
        yield con
    finally:
        con.stop()
        kill_children(con.home)


def error_shaped(raw: bytes, status: int) -> None:
    err = orjson.loads(raw)["error"]
    assert set(err) >= {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and isinstance(err["type"], str)
    assert err["param"] is None or isinstance(err["param"], str)
    assert err["code"] == status or err["code"] is None or isinstance(err["code"], int | str)


def served_schema(con: Console) -> dict[str, Any]:
    doc: dict[str, Any] = httpx.get(con.url + "/openapi.json", timeout=10).json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        for key in ("max_tokens", "max_completion_tokens"):
            body["properties"][key]["anyOf"][0]["maximum"] = MAX_TOKENS_IN_TEST
    return doc


class Fuzzer:
    """Sends schemathesis cases to the console and checks each answer."""

    def __init__(self, con: Console) -> None:
        self.con = con
        self.added = 0
        self.statuses: dict[str, set[int]] = {}

    def _bound_scale(self, case: Any) -> None:
        body = case.body
        if (
            not isinstance(body, dict)
            or type(body.get("delta")) is not int
            or body.get("role") not in ("prefill", "decode")
        ):
            return
        delta = body["delta"]
        if 0 < delta <= 16:
            left = SCALE_OUT_BUDGET - self.added
            body["delta"] = min(delta, left) if left > 0 else -delta
            self.added += max(0, body["delta"])  # counted before the answer: a refused add costs budget too

    def exercise(self, case: Any) -> None:
        op = case.operation
        if op.path == "/control/scale":
            self._bound_scale(case)
        if (
            op.path == "/control/policies/{kind}"
            and isinstance(case.body, dict)
            and case.body.get("name") == "threshold"
        ):
            case.body["name"] = "static"  # an acting scaling policy would start instances on its own
        kwargs = {"base_url": self.con.url, "timeout": 30}
        try:
            response = case.call(**kwargs)  # the bearer token comes from the schema's auth config
        except requests.ConnectionError:
            code = self.con.proc.poll()
            raise AssertionError(
                f"the console is gone (exit {code}) at {case.as_curl_command()}:\n"
                f"{self.con.log.read_text(errors='replace')[-3000:]}"
            ) from None
        case.validate_response(response, checks=CHECKS, transport_kwargs=kwargs)
        status = response.status_code
        self.statuses.setdefault(op.label, set()).add(status)
        assert status < 500 or status in (502, 503, 504), (case.as_curl_command(), status, response.content[:300])
        ctype = response.headers.get("content-type", "")
        if status >= 400:
            error_shaped(response.content, status)
        elif "text/event-stream" in ctype:
            tail = response.content.rstrip()
            assert tail.endswith(b"data: [DONE]"), (case.as_curl_command(), response.content[-300:])
        assert self.con.proc.poll() is None, "the console died"


def fuzz(fuzzer: Fuzzer, schema: Any, path: str, method: str, mode: GenerationMode, n: int, derandomize: bool) -> None:
    op = schema[path][method]
    strategy = op.as_strategy(generation_mode=mode)

    @settings(
        max_examples=n,
        deadline=None,
        database=None,
        derandomize=derandomize,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def run(case: Any) -> None:
        fuzzer.exercise(case)

    run()


HOT = [("/v1/completions", "POST"), ("/v1/chat/completions", "POST")]
READS = [
    ("/v1/models", "GET"),
    ("/health", "GET"),
    ("/control/state", "GET"),
    ("/control/policies", "GET"),
    ("/control/run", "GET"),
]
WRITES = [
    ("/control/replay/{action}", "POST"),
    ("/control/flip", "POST"),
    ("/control/scale", "POST"),
    ("/control/policies/{kind}", "PUT"),
]


def run_campaign(con: Console, examples: Callable[[str, GenerationMode], int], derandomize: bool) -> Fuzzer:
    """Every operation, valid then invalid requests; `examples(path, mode)` cases each."""
    doc = served_schema(con)
    schema = schemathesis.openapi.from_dict(doc)
    schema.config.max_stream_events = 100_000  # read completion streams to their end (it cuts them at 100)
    schema.config.auth = AuthConfig(openapi={"bearerAuth": {"bearer": con.token}})
    fuzzer = Fuzzer(con)
    for path, method in [*HOT, *READS, *WRITES]:  # policy swaps last: a tight queue would shed the rest
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            if method == "GET" and mode == GenerationMode.NEGATIVE:
                continue  # nothing to make invalid in a bodiless GET
            fuzz(fuzzer, schema, path, method, mode, examples(path, mode), derandomize)
    log = con.log.read_text(errors="replace")
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-4000:]
    health = httpx.get(con.url + "/health", timeout=5)
    assert health.status_code == 200 and con.proc.poll() is None
    return fuzzer


def test_the_console_serves_its_openapi_schema(console: Console) -> None:
    doc = httpx.get(console.url + "/openapi.json", timeout=10).json()
    assert doc["openapi"].startswith("3.1")
    wanted = {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/health",
        "/control/state",
        "/control/policies",
        "/control/policies/{kind}",
        "/control/scale",
        "/control/flip",
        "/control/run",
        "/control/replay/{action}",
    }
    assert wanted <= set(doc["paths"])
    assert doc["components"]["securitySchemes"]["bearerAuth"] == {
        **doc["components"]["securitySchemes"]["bearerAuth"],
        "type": "http",
        "scheme": "bearer",
    }
    assert all(
        op.get("security") == [{"bearerAuth": []}]
        for p, item in doc["paths"].items()
        if p.startswith("/control/")
        for op in item.values()
    )
    completion = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert completion["properties"]["model"]["enum"] == ["sibyl-model"] and completion["required"] == ["prompt"]
    scale = doc["paths"]["/control/scale"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert (scale["properties"]["delta"]["minimum"], scale["properties"]["delta"]["maximum"]) == (-16, 16)
    names = {
        v["properties"]["name"]["const"]
        for v in doc["paths"]["/control/policies/{kind}"]["put"]["requestBody"]["content"]["application/json"][
            "schema"
        ]["oneOf"]
    }
    assert {"sibyl", "least_load", "fcfs", "threshold"} <= names
    schemathesis.openapi.from_dict(doc)  # schemathesis accepts it


def test_bad_requests_get_well_formed_errors_not_500s(console: Console) -> None:
    """Inputs that used to crash a handler (500 with a traceback), now client errors."""
    url = console.url
    cases: list[tuple[str, str, dict[str, Any] | bytes, dict[str, str], int]] = [
        ("POST", "/v1/completions", {"model": ["sibyl-model"], "prompt": "x"}, {}, 400),
        ("POST", "/v1/completions", {"prompt": "x", "max_tokens": None, "max_completion_tokens": "many"}, {}, 400),
        ("POST", "/v1/completions", {"prompt": "x", "max_tokens": True}, {}, 400),
        ("GET", "/v1/completions", b"", {}, 405),
        ("DELETE", "/control/state", b"", {"Authorization": f"Bearer {console.token}"}, 405),
        (
            "POST",
            "/control/scale",
            {"role": "decode", "delta": 10**6},
            {"Authorization": f"Bearer {console.token}"},
            422,
        ),
    ]
    for method, path, body, headers, status in cases:
        content = body if isinstance(body, bytes) else orjson.dumps(body)
        r = httpx.request(
            method, url + path, content=content, headers={"content-type": "application/json", **headers}, timeout=30
        )
        assert r.status_code == status, (method, path, body, r.status_code, r.text)
        error_shaped(r.content, status)
    # a non-UTF-8 request id or tenant header is taken byte for byte (it was a 500)
    r = httpx.post(
        url + "/v1/completions",
        json={"prompt": "x", "max_tokens": 2},
        headers={b"x-request-id": b"r\xe9q", b"x-sibyl-tenant": b"caf\xc3"},
        timeout=30,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text

    # one X-Request-Id in flight twice: 409 for the latecomers, not 500s and a corrupted request table
    def post(_: int) -> httpx.Response:
        return httpx.post(
            url + "/v1/completions",
            json={"prompt": "x", "max_tokens": 100, "ignore_eos": True},
            headers={"x-request-id": "twice"},
            timeout=30,
        )

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(post, range(4)))
    statuses = sorted(r.status_code for r in answers)
    assert statuses[0] == 200 and statuses[-1] == 409 and set(statuses) == {200, 409}, [r.text for r in answers]
    for r in answers:
        if r.status_code == 409:
            error_shaped(r.content, 409)
    assert console.state()["requests"]["in_flight"] == 0
    log = console.log.read_text(errors="replace")
    assert "Traceback" not in log, log[-3000:]


def test_control_api_refuses_without_the_token(console: Console) -> None:
    for method, path in [
        ("GET", "/control/state"),
        ("GET", "/control/policies"),
        ("GET", "/control/run"),
        ("PUT", "/control/policies/routing"),
        ("POST", "/control/scale"),
        ("POST", "/control/flip"),
        ("POST", "/control/replay/pause"),
    ]:
        bad: list[dict[bytes, bytes]] = [
            {},
            {b"authorization": b"Bearer nope"},
            {b"authorization": f"Basic {console.token}".encode()},
            {b"authorization": b"Bearer \xe9"},
        ]
        for headers in bad:
            r = httpx.request(
                method, console.url + path, json={"role": "decode", "delta": 1}, headers=headers, timeout=10
            )
            assert r.status_code == 401, (method, path, headers, r.status_code)
            error_shaped(r.content, 401)
    assert len(console.state()["instances"]) == 2  # nothing was scaled


def test_schemathesis_fuzz_of_every_endpoint(console: Console) -> None:
    def examples(path: str, mode: GenerationMode) -> int:  # about half the cases of before: ~8 s; the long one is slow
        if path.startswith("/v1/") and path != "/v1/models":
            return 15 if mode == GenerationMode.POSITIVE else 20
        return 8 if mode == GenerationMode.POSITIVE else 5

    fuzzer = run_campaign(console, examples, derandomize=True)  # the same cases every run (CI)
    # the fuzzing reached past validation: real completions and real refusals
    assert 200 in fuzzer.statuses["POST /v1/completions"] and 200 in fuzzer.statuses["POST /v1/chat/completions"], (
        fuzzer.statuses
    )
    assert any(s >= 400 for s in fuzzer.statuses["POST /v1/completions"])
    assert fuzzer.statuses["POST /control/replay/{action}"] <= {404, 401}
    assert fuzzer.added <= SCALE_OUT_BUDGET


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_schemathesis_fuzz_of_every_endpoint_long(tmp_path: Path) -> None:
    con = start_console(tmp_path, *ARGS)
    try:
        run_campaign(con, lambda path, mode: 200 if path.startswith("/v1/") else 60, derandomize=False)  # a few minutes
    finally:
        with contextlib.suppress(Exception):
            con.stop()
        kill_children(con.home)
