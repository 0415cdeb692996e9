"""The emulator's OpenAI/vLLM HTTP surface, as a real process on 127.0.0.1, with the official client."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from openai import OpenAI

from adapters.emulator.process import EmulatorProcess, running
from tests.emulator_fixtures import complete, delta, profile_file, scrape, sse
from tests.procs import wait_for


@pytest.fixture(scope="module")
def emu(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmulatorProcess]:
    d = tmp_path_factory.mktemp("emu-api")
    with running(
        ("both", ["--profile", profile_file(d), "--model", "tiny", "--output-len-dist", "uniform:2:40"]), log_dir=d
    ) as (e,):
        yield e


@pytest.fixture(scope="module")
def client(emu: EmulatorProcess) -> OpenAI:
    return OpenAI(base_url=emu.url + "/v1", api_key="unused", max_retries=0)


def test_official_client_completions_and_chat_streaming_and_not(client: OpenAI) -> None:
    r = client.completions.create(model="tiny", prompt=[1, 2, 3, 4], max_tokens=5, extra_body={"ignore_eos": True})
    assert r.choices[0].text == " t0 t1 t2 t3 t4" and r.choices[0].finish_reason == "length"
    assert r.usage is not None and (r.usage.prompt_tokens, r.usage.completion_tokens) == (4, 5)
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == "tiny"

    chunks = list(
        client.completions.create(
            model="tiny",
            prompt="hello there",
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == " t0 t1 t2 t3"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (3, 4)  # 11 bytes → 3 tokens

    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert chat.choices[0].message.content == " t0 t1 t2" and chat.choices[0].message.role == "assistant"
    assert chat.usage is not None and chat.usage.prompt_tokens == 3 + 4 + 1 and chat.id.startswith("chatcmpl-")

    stream = list(
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_completion_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == " t0 t1 t2"
    assert stream[-1].usage is not None and stream[-1].usage.completion_tokens == 3
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_sse_wire_format(emu: EmulatorProcess) -> None:
    r = complete(emu.url, prompt=[5] * 3, max_tokens=2, ignore_eos=True, stream=True)
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.content.endswith(b"data: [DONE]\n\n") and r.content.count(b"data: ") == 3
    events = sse(r.content)
    assert [e["choices"][0]["text"] for e in events[:2]] == [" t0", " t1"] and events[2] == "[DONE]"


@pytest.mark.parametrize(
    ("body", "status", "etype", "param"),
    [
        (b"{not json", 400, "Bad Request", "body.1"),
        (b"[1, 2]", 400, "Bad Request", "body"),
        (b'{"prompt": "x", "max_tokens": "many"}', 400, "Bad Request", "body.max_tokens"),
        (b'{"max_tokens": 3}', 400, "Bad Request", "prompt"),
        (b'{"model": "other", "prompt": "x"}', 404, "NotFoundError", "model"),
        (b'{"prompt": "x", "max_tokens": 0}', 400, "BadRequestError", "max_tokens"),
        (b'{"prompt": "x", "max_tokens": -3}', 400, "BadRequestError", "max_tokens"),
        (b'{"prompt": [' + b",".join([b"1"] * 1024) + b"]}", 400, "BadRequestError", "input_tokens"),
        (b'{"prompt": "x", "max_tokens": 4, "min_tokens": 9}', 400, "BadRequestError", "min_tokens"),
        (b'{"prompt": "x", "stream_options": {"include_usage": true}}', 400, "Bad Request", "stream_options"),
    ],
)
def test_bad_requests_get_vllm_status_codes_and_error_bodies(
    emu: EmulatorProcess, body: bytes, status: int, etype: str, param: str
) -> None:
    r = httpx.post(emu.url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    err = r.json()["error"]
    assert r.status_code == status and err["type"] == etype and err["param"] == param and err["code"] == status
    assert isinstance(err["message"], str) and err["message"]


def test_the_official_client_raises_the_matching_errors(client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-9", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="maximum context length is 1024"):
        client.completions.create(model="tiny", prompt=[1] * 2000, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="at least 1"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=0)


def test_no_model_is_served_and_context_overflow_is_cut_with_length(emu: EmulatorProcess) -> None:
    r = complete(emu.url, prompt=[1] * 1020, max_tokens=50, ignore_eos=True).json()
    assert (
        r["model"] == "tiny" and r["usage"]["completion_tokens"] == 4 and r["choices"][0]["finish_reason"] == "length"
    )
    r = complete(emu.url, prompt=[1] * 1020, max_tokens=50).json()  # a drawn length, but still at most 4
    assert r["usage"]["completion_tokens"] <= 4


def test_without_ignore_eos_lengths_follow_the_seeded_distribution_and_min_tokens(emu: EmulatorProcess) -> None:
    lengths, reasons = [], set()
    for _ in range(8):
        r = complete(emu.url, prompt="x", max_tokens=300, min_tokens=5).json()
        lengths.append(r["usage"]["completion_tokens"])
        reasons.add(r["choices"][0]["finish_reason"])
    assert all(5 <= n <= 40 for n in lengths) and len(set(lengths)) > 1 and reasons == {"stop"}
    same = {
        complete(emu.url, prompt="x", max_tokens=300, seed=1234).json()["usage"]["completion_tokens"] for _ in range(3)
    }
    assert len(same) == 1  # a request seed makes the draw reproducible
    assert complete(emu.url, prompt="x", max_tokens=3, min_tokens=3).json()["choices"][0]["finish_reason"] == "length"


def test_operator_endpoints(emu: EmulatorProcess) -> None:
    assert httpx.get(emu.url + "/health").status_code == 200 and httpx.get(emu.url + "/health").content == b""
    assert httpx.get(emu.url + "/ping").status_code == 200 and httpx.post(emu.url + "/ping").status_code == 200
    assert httpx.get(emu.url + "/version").json()["version"].startswith("0.32.0")
    assert httpx.get(emu.url + "/load").json() == {"server_load": 0}
    models = httpx.get(emu.url + "/v1/models").json()["data"]
    assert models[0]["id"] == "tiny" and models[0]["owned_by"] == "vllm" and models[0]["max_model_len"] == 1024
    tok = httpx.post(emu.url + "/tokenize", json={"prompt": "twelve bytes"}).json()
    assert tok["count"] == 3 == len(tok["tokens"]) and tok["max_model_len"] == 1024
    assert httpx.post(emu.url + "/tokenize", json={"prompt": [4, 5]}).json()["tokens"] == [4, 5]
    assert httpx.get(emu.url + "/nope").status_code == 404
    assert httpx.get(emu.url + "/v1/completions").status_code == 405


def test_load_counts_in_flight_requests_and_a_client_disconnect_aborts(emu: EmulatorProcess) -> None:
    before = scrape(emu.url)
    body = b'{"prompt": [1, 2], "max_tokens": 900, "ignore_eos": true, "stream": true}'
    with socket.create_connection(("127.0.0.1", emu.port)) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
        )
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
        wait_for(lambda: httpx.get(emu.url + "/load").json()["server_load"] == 1, 5, "the stream to be in flight")
        assert scrape(emu.url)["vllm:num_requests_running"] == 1
    wait_for(lambda: scrape(emu.url)["vllm:num_requests_running"] == 0, 5, "the abort")
    after = scrape(emu.url)
    assert delta(after, before, "vllm:request_success_total{finished_reason=abort}") == 1
    assert httpx.get(emu.url + "/load").json() == {"server_load": 0}


def test_streamed_tokens_follow_the_step_schedule(emu: EmulatorProcess) -> None:
    """Token i arrives when its step ends: ~2.1 ms apart for one sequence, not all at once."""
    t0 = time.monotonic()
    with httpx.stream(
        "POST", emu.url + "/v1/completions", json={"prompt": [1], "max_tokens": 40, "ignore_eos": True, "stream": True}
    ) as r:
        stamps = [time.monotonic() for line in r.iter_lines() if line.startswith("data: {")]
    assert len(stamps) == 40
    span = stamps[-1] - stamps[0]
    assert 39 * 0.0021 * 0.8 < span < 39 * 0.0021 * 4 and stamps[0] - t0 < 0.5


def test_any_asgi_server_works_through_the_queue_path() -> None:
    """Outside uvicorn (here httpx's in-process ASGI transport) tokens go through ASGI sends."""
    from adapters.emulator.app import EmulatedInstance
    from adapters.emulator.settings import InstanceSettings
    from tests.emulator_fixtures import FAST_PROFILE

    async def main() -> None:
        inst = EmulatedInstance(InstanceSettings(role="both", port=0, profile=FAST_PROFILE))
        await inst.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=inst), base_url="http://emu") as c:
                r = await c.post(
                    "/v1/completions", json={"prompt": [1, 2], "max_tokens": 3, "ignore_eos": True, "stream": True}
                )
                assert [e["choices"][0]["text"] for e in sse(r.content) if isinstance(e, dict)] == [" t0", " t1", " t2"]
                r = await c.post(
                    "/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "ignore_eos": True},
                )
                assert r.json()["choices"][0]["message"]["content"] == " t0 t1"
                assert (await c.get("/metrics")).text.count("vllm:generation_tokens_total{") == 1
        finally:
            await inst.stop()

    asyncio.run(main())


def test_a_prompt_ending_in_the_emulators_own_tokens_is_continued_there(client: OpenAI) -> None:
    """How a request recomputed elsewhere continues: completions by prompt, chat by vLLM's
    continue_final_message (which refuses add_generation_prompt, as vLLM does)."""
    first = (
        client.completions.create(model="tiny", prompt="go", max_tokens=3, extra_body={"ignore_eos": True})
        .choices[0]
        .text
    )
    rest = (
        client.completions.create(model="tiny", prompt="go" + first, max_tokens=2, extra_body={"ignore_eos": True})
        .choices[0]
        .text
    )
    assert (first, rest) == (" t0 t1 t2", " t3 t4")
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "go"}, {"role": "assistant", "content": " t0 t1"}],
        max_tokens=2,
        extra_body={"ignore_eos": True, "continue_final_message": True, "add_generation_prompt": False},
        stream=True,
    )
    assert "".join(ch.choices[0].delta.content or "" for ch in chat if ch.choices) == " t2 t3"
    with pytest.raises(openai.BadRequestError, match="continue_final_message"):
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "go"}],
            max_tokens=2,
            extra_body={"continue_final_message": True},
        )
