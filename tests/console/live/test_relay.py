"""DecodeRelay: a stream relayed to its end, ended early, handed over by a migration, and failure migration's
limits; what it returns, what it keeps, and what it tells the dispatcher, the health and the migrations."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from adapters.vllm.instances import Instance
from console.live.channel import ClientChannel
from console.live.config import ConsoleConfig
from console.live.record import Outcome
from console.live.relay import DecodeRelay, Handover
from console.live.tracing import NO_TRACE
from core.types import Request
from tests.console.live.fakes import FakeParts, Sent, dispatcher, instances, never_disconnects


class Stream:
    """A decode leg's response: its chunks, in order; released once."""

    def __init__(self, *chunks: bytes) -> None:
        self.chunks = chunks
        self.released = 0

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk

    def release(self) -> None:
        self.released += 1


def tokens(*texts: str) -> bytes:
    return b"".join(b'data: {"choices":[{"text":"%s"}]}\n\n' % t.encode() for t in texts)


DONE = b"data: [DONE]\n\n"


def relay_over(
    insts: list[Instance], decode_id: str = "d0", attempts: int = 1, stream: bool = True
) -> tuple[DecodeRelay, FakeParts]:
    parts = FakeParts(insts, dispatcher(insts), ConsoleConfig(failure_migration_attempts=attempts))
    parts.dispatcher.admit(Request("r1", 0.0, 10, 40), 0.0)
    parts.dispatcher.route(Request("r1", 0.0, 10, 40), 0.0)
    body = {"prompt": "hi", "stream": stream}
    relay = DecodeRelay(parts.services, Request("r1", 0.0, 10, 40), "/v1/completions", body, b"", NO_TRACE, decode_id)
    return relay, parts


async def started(sent: Sent) -> ClientChannel:
    client = ClientChannel(sent, never_disconnects)
    await client.start_stream("r1")
    return client


def test_a_whole_stream_is_relayed_and_returned_ok() -> None:
    async def body() -> None:
        relay, parts = relay_over(instances(1, 2))
        sent = Sent()
        client = await started(sent)
        result = await relay.relay(client, Stream(tokens("a", "b", "c"), DONE))
        assert (result.outcome, result.output_tokens, result.reason, result.moved) == (Outcome.OK, 3, None, False)
        assert result.decode_id == "d0" and relay.first_token_at is not None
        assert parts.calls == [("ok", "d0")]
        assert sent.body.endswith(DONE) and sent.messages[-1]["more_body"] is False

    asyncio.run(body())


def test_a_stream_that_ends_without_done_is_an_upstream_failure() -> None:
    async def body() -> None:
        relay, parts = relay_over(instances(1, 2))
        result = await relay.relay(await started(Sent()), Stream(tokens("a", "b")))
        assert result.outcome is Outcome.UPSTREAM and result.output_tokens == 2
        assert result.reason == "decode d0 stream ended early: no [DONE]" and parts.calls == []

    asyncio.run(body())


def test_a_hand_off_nobody_asked_for_ends_the_stream() -> None:
    async def body() -> None:
        relay, _ = relay_over(instances(1, 2))
        handoff = b'data: {"sibyl_migrated": {"target": "d1"}}\n\n'
        result = await relay.relay(await started(Sent()), Stream(tokens("a"), handoff))
        assert result.outcome is Outcome.UPSTREAM and result.reason is not None and "unasked" in result.reason
        assert result.output_tokens == 0  # as the gateway always recorded it

    asyncio.run(body())


def test_a_migration_moves_the_stream_and_its_first_token_after_lands_it() -> None:
    async def body() -> None:
        insts = instances(1, 2)
        relay, parts = relay_over(insts)
        target = Stream(tokens("c", "d"), DONE)
        relay.migrating_to = "d1"  # what expect_migration sets, with the continuation already open:
        relay.resume_leg = asyncio.get_running_loop().create_future()
        relay.resume_leg.set_result(target)  # type: ignore[arg-type]
        assert relay.migrating
        client = await started(Sent())
        handoff = b'data: {"sibyl_migrated": {"target": "d1"}}\n\n'
        moved = await relay.relay(client, Stream(tokens("a", "b"), handoff))
        assert moved.moved and moved.decode_id == "d1" and relay.decode_id == "d1" and moved.outcome is None
        assert isinstance(relay.handed_over, Handover) and relay.handed_over.tokens == 2
        assert relay.migrating_to is None and relay.resume_leg is None and relay.migrating
        done = await relay.resume(client)
        assert (done.outcome, done.output_tokens, done.decode_id) == (Outcome.OK, 4, "d1")
        assert relay.handed_over is None and ("migrated", "r1") in parts.calls and ("ok", "d1") in parts.calls
        assert target.released == 1  # the continuation leg is the relay's own to release

    asyncio.run(body())


def test_failure_migration_stops_at_its_attempts_or_when_no_decode_instance_is_left() -> None:
    insts = instances(1, 3)
    relay, _ = relay_over(insts, attempts=1)
    first = relay.fail_over("d0", 4, "decode d0 died")
    assert first.target is not None and first.target.id != "d0" and relay.decode_id == first.target.id
    resumed = f"resumed on {first.target.id} after 4 tokens by recomputing prompt + streamed tokens"
    assert first.note == f"decode d0 died: {resumed}"
    second = relay.fail_over(first.target.id, 6, "it died too")
    assert second.target is None and second.note == "it died too (failure migration: 1 attempt allowed, used)"
    assert relay.tried_decode == ["d0", first.target.id]
    alone, _ = relay_over(instances(1, 1), attempts=3)
    nowhere = alone.fail_over("d0", 0, "decode d0 died")
    assert nowhere.target is None and nowhere.note == "decode d0 died; no other decode instance to continue it"


def test_a_broken_stream_without_failure_migration_ends_with_502_and_why() -> None:
    class Broken(Stream):
        async def iter_chunks(self) -> AsyncIterator[bytes]:
            yield tokens("a")
            raise ConnectionResetError("gone")

    async def body() -> None:
        relay, parts = relay_over(instances(1, 2), attempts=0)
        sent = Sent()
        result = await relay.relay(await started(sent), Broken())
        assert result.outcome is Outcome.UPSTREAM and result.output_tokens == 1 and not result.moved
        assert result.reason is not None and result.reason.endswith("(failure migration is off)")
        assert parts.calls == [("failed", "d0")] and b"error" in sent.body

    asyncio.run(body())


def test_a_data_parallel_decode_instance_gets_the_rank_the_policy_chose() -> None:
    insts = instances(1, 1)
    insts[1].dp_size = 2
    d = dispatcher(insts, rank=("bf_io", {}))
    d.set_data_parallel("d0", 2, 8)
    parts = FakeParts(insts, d)
    req = Request("r1", 0.0, 10, 40)
    d.admit(req, 0.0)
    assert d.route(req, 0.0).decode == "d0"
    relay = DecodeRelay(parts.services, req, "/v1/completions", {"stream": True}, b"", NO_TRACE, "d0")
    headers: Any = relay.leg_headers(insts[1])
    assert relay.decode_id == "d0" and relay.dp_rank == 0  # both ranks empty: the first
    assert headers == b"X-data-parallel-rank: %d\r\n" % relay.dp_rank
