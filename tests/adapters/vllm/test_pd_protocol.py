"""The two P/D leg bodies and the SSE token counter."""

from __future__ import annotations

from adapters.vllm.pd_protocol import (
    SSETokenCounter,
    StreamTranscript,
    add_streamed_usage,
    continuation_body,
    decode_leg_body,
    prefill_leg_body,
)


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
