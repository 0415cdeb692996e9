"""The two P/D leg bodies and the SSE token counter (by hand, and property-based: any chunking of a stream counts
the same, and garbage never raises)."""

from __future__ import annotations

import string
from typing import Any

from hypothesis import example, given
from hypothesis import strategies as st

from adapters.vllm.pd_protocol import (
    SSETokenCounter,
    StreamTranscript,
    add_streamed_usage,
    continuation_body,
    decode_leg_body,
    prefill_leg_body,
)
from tests.fuzzing import FAST


def test_leg_bodies_follow_vllms_proxy() -> None:
    body = {
        "prompt": "x",
        "max_tokens": 50,
        "max_completion_tokens": 50,
        "stream": True,
        "stream_options": {"include_usage": True},
        "min_tokens": 3,
    }
    leg1 = prefill_leg_body(body)
    assert leg1["max_tokens"] == 1 and leg1["max_completion_tokens"] == 1 and leg1["stream"] is False
    assert (
        "stream_options" not in leg1
        and "min_tokens" not in leg1
        and leg1["kv_transfer_params"]["do_remote_decode"] is True
    )
    leg2 = decode_leg_body(body, {"remote_engine_id": "e"})
    assert (
        leg2["max_tokens"] == 50 and leg2["min_tokens"] == 3 and leg2["kv_transfer_params"] == {"remote_engine_id": "e"}
    )


def test_counter_skips_role_and_finish_chunks_and_survives_split_events() -> None:
    stream = (
        b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'
        b'data: {"choices":[{"index":0,"delta":{"content":" t0"},"finish_reason":null}]}\n\n'
        b'data: {"choices":[{"index":0,"delta":{"content":" t1"},"finish_reason":null}]}\n\n'
        b'data: {"choices":[{"index":0,"delta":{"content":""},"finish_reason":"length"}]}\n\n'
        b"data: [DONE]\n\n"
    )
    c = SSETokenCounter()
    for k in range(0, len(stream), 7):  # arbitrary network chunking
        c.feed(stream[k : k + 7])
    assert (c.tokens, c.done, c.error) == (2, True, None)
    u = SSETokenCounter()
    u.feed(
        b'data: {"choices":[{"text":" a"}]}\n\ndata: {"choices":[],"usage":{"completion_tokens":9}}\n\ndata: [DONE]\n\n'
    )
    assert u.output_tokens == 9 and u.tokens == 1


def test_transcript_keeps_the_streamed_text_across_split_events_and_compaction() -> None:
    events = b"".join(
        b'data: {"choices":[{"index":0,"delta":{"content":" w%d"},"finish_reason":null}]}\n\n' % i for i in range(3000)
    )
    t = StreamTranscript(chat=True)
    t.add(b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n')
    for k in range(0, len(events), 1000):  # passes COMPACT_BYTES several times, splitting events
        t.add(events[k : k + 1000])
    assert t.text() == "".join(f" w{i}" for i in range(3000)) and t.resumable is None
    done = StreamTranscript(chat=False)
    done.add(b'data: {"choices":[{"index":0,"text":" a"}]}\n\ndata: {"choices":[{"index":0,"te')
    assert done.text() == " a"  # the unfinished event waits for its end
    done.add(b'xt":" b"}]}\n\n')
    assert done.text() == " a b"
    tools = StreamTranscript(chat=True)
    tools.add(b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0}]}}]}\n\n')
    tools.text()
    assert tools.resumable is not None and "tool calls" in tools.resumable


def test_continuation_appends_the_text_and_shrinks_the_token_budget() -> None:
    comp, why = continuation_body(
        {"prompt": ["say"], "max_tokens": 10, "min_tokens": 3, "stream": True, "kv_transfer_params": {"x": 1}},
        False,
        " t0 t1",
        2,
    )
    assert why == "" and comp == {"prompt": "say t0 t1", "max_tokens": 8, "min_tokens": 1, "stream": True}
    chat, _ = continuation_body(
        {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5}, True, " t0", 1
    )
    assert chat is not None and chat["messages"][-1] == {"role": "assistant", "content": " t0"}
    assert (
        chat["continue_final_message"] is True
        and chat["add_generation_prompt"] is False
        and chat["max_completion_tokens"] == 4
    )
    ids, _ = continuation_body({"prompt": [7, 8], "max_tokens": 5}, False, " t0 t1", 2, [1000000, 1000001])
    assert ids is not None and ids["prompt"] == [7, 8, 1000000, 1000001] and ids["max_tokens"] == 3
    default, _ = continuation_body({"prompt": "p"}, False, " t0 t1 t2", 3)
    assert default is not None and default["max_tokens"] == 13  # vLLM's completions default of 16
    for body, chat_path, reason in (
        ({"prompt": [1, 2, 3], "max_tokens": 5}, False, "not tokenized"),
        ({"prompt": "p", "n": 2}, False, "several choices"),
        ({"prompt": "p", "max_tokens": 2}, False, "streamed already"),
    ):
        refused, why = continuation_body(body, chat_path, " t0 t1", 2)
        assert refused is None and reason in why


def test_a_resumed_streams_usage_counts_the_tokens_streamed_before() -> None:
    chunk = (
        b'data: {"choices":[{"index":0,"text":" t9"}]}\n\n'
        b'data: {"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":4,"total_tokens":16}}\n\n'
        b"data: [DONE]\n\n"
    )
    fixed = add_streamed_usage(chunk, 6)
    assert b'"prompt_tokens":6,"completion_tokens":10,"total_tokens":16' in fixed
    assert fixed.startswith(b'data: {"choices":[{"index":0,"text":" t9"}]}\n\n') and fixed.endswith(b"data: [DONE]\n\n")
    c = SSETokenCounter(offset=6)
    c.feed(chunk)
    assert c.output_tokens == 10


# -- SSETokenCounter, property-based -----------------------------------------------------------


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
