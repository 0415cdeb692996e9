"""The two P/D leg bodies and the SSE token counter."""

from __future__ import annotations

from adapters.vllm.pd_protocol import SSETokenCounter, decode_leg_body, prefill_leg_body


def test_leg_bodies_follow_vllms_proxy() -> None:
    body = {"prompt": "x", "max_tokens": 50, "max_completion_tokens": 50, "stream": True, "stream_options": {"include_usage": True}, "min_tokens": 3}
    leg1 = prefill_leg_body(body)
    assert leg1["max_tokens"] == 1 and leg1["max_completion_tokens"] == 1 and leg1["stream"] is False
    assert "stream_options" not in leg1 and "min_tokens" not in leg1 and leg1["kv_transfer_params"]["do_remote_decode"] is True
    leg2 = decode_leg_body(body, {"remote_engine_id": "e"})
    assert leg2["max_tokens"] == 50 and leg2["min_tokens"] == 3 and leg2["kv_transfer_params"] == {"remote_engine_id": "e"}


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
    u.feed(b'data: {"choices":[{"text":" a"}]}\n\ndata: {"choices":[],"usage":{"completion_tokens":9}}\n\ndata: [DONE]\n\n')
    assert u.output_tokens == 9 and u.tokens == 1
