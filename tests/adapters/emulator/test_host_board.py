"""The host board emulated instances share: what each streams, and the prefill steps it slows."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest

from adapters.emulator.host_board import SLACK_S, SLOTS, HostBoard, InstanceStreaming
from adapters.emulator.process import running
from adapters.emulator.sequence import Sequence, StepRecord
from tests.emulator_fixtures import FAST_PROFILE, complete, profile_file
from tests.procs import wait_for

TOKEN = {"Authorization": "Bearer s3cret"}


def test_instances_mapping_one_board_see_the_rates_of_steps_still_current(tmp_path: Path) -> None:
    """Two mappings of one board (as two processes): each sees the other's rates while they are current,
    until one more step of their length (and SLACK_S) has passed, so an instance that idles drops out."""
    path = tmp_path / "board"
    now = [100.0]
    mine, theirs = HostBoard(path, lambda: now[0]), HostBoard(path, lambda: now[0])
    assert path.stat().st_size == SLOTS * 3 * 8 and theirs.total() == 0.0
    mine.publish(3, 100.0, 99.99, 100.0)  # a 10 ms step that just ended
    theirs.publish(7, 25.0, 99.90, 99.98)  # an 80 ms step that ended 20 ms ago
    assert mine.total() == theirs.total() == 125.0
    now[0] = 100.0 + 0.01 + SLACK_S + 0.001  # the first idled past one more step of its own
    assert theirs.total() == 25.0
    theirs.publish(7 + SLOTS, 0.0)  # a slot beyond the board wraps around: slot 7 streams nothing
    assert mine.total() == 0.0
    mine.close()
    theirs.close()


def test_an_instance_counts_the_tokens_its_steps_stream_to_clients(tmp_path: Path) -> None:
    """A step's rate is the tokens it sent to clients over its length: a prefill leg's token stays home."""
    now = [10.0]
    board = HostBoard(tmp_path / "board", lambda: now[0])
    share = InstanceStreaming(board, 5)
    streamed = [Sequence(f"s{k}", 4, 8) for k in range(3)]
    for seq in streamed:
        seq.sink = object()  # type: ignore[assignment]
    leg = Sequence("leg", 4, 1, prefill_only=True)
    leg.sink = object()  # type: ignore[assignment]
    quiet = Sequence("quiet", 4, 8)  # no client listening
    record = StepRecord(1, 9.99, 10.0, 5, 20, 5, [], 5, 1.0, "chain")
    share.on_step(record, [*streamed, leg, quiet])
    assert board.total() == pytest.approx(300.0)  # 3 tokens in 10 ms
    share.stop()


def test_a_prefill_step_on_one_process_slows_while_another_streams(tmp_path: Path) -> None:
    """Two emulator processes on one board, 0.5 ms of host work per streamed token. While the first
    streams one request (a token every 2.1 ms step: ~476 tokens/s), a prompt's prefill step on the
    second takes 1 / (1 − 0.0005·476) of its time; the board reads 0 again once the stream ends."""
    prof = FAST_PROFILE.model_copy(update={"name": "streaming-host", "host_per_streamed_token_s": 0.0005})
    board = tmp_path / "host-board"
    args = ["--profile", profile_file(tmp_path, prof), "--admin-token", "s3cret", "--host-board", str(board)]
    with running(
        ("decode", [*args, "--host-slot", "0"]), ("prefill", [*args, "--host-slot", "1"]), log_dir=tmp_path
    ) as (streamer, prefiller):
        reader = HostBoard(board)
        body = {"prompt": [1], "max_tokens": 600, "ignore_eos": True, "stream": True}
        streaming = threading.Thread(target=complete, args=(streamer.url,), kwargs=body)
        streaming.start()
        try:
            wait_for(lambda: reader.total() > 0, 10, "the stream to show on the board")
            rate = 1 / prof.step_time(1, 100)
            assert reader.total() == pytest.approx(rate, rel=0.05)
            url = prefiller.url
            since = httpx.get(url + "/admin/info", headers=TOKEN).json()["steps"]
            assert complete(url, prompt=[1] * 200, max_tokens=1).status_code == 200
            steps = httpx.get(url + f"/admin/steps?since={since}", headers=TOKEN).json()["steps"]
        finally:
            streaming.join(30)
        prefill = [s for s in steps if s[6]]
        assert len(prefill) == 1
        _, start, end, batch, kv, *_ = prefill[0]
        own = prof.step_time(batch, kv) + float(prof.prefill_time(200))
        assert (end - start) / own == pytest.approx(1 / (1 - 0.0005 * rate), rel=0.02)
        wait_for(lambda: reader.total() == 0.0, 10, "the finished stream to leave the board")
        reader.close()


def test_the_emulator_backend_gives_its_instances_one_board_and_a_free_slot_each(tmp_path: Path) -> None:
    """`up`'s emulated backend: every instance gets the run folder's board and the lowest slot no live
    instance holds; an instance removed zeroes its slot as it stops, and its slot goes to the next one."""
    import asyncio
    import time

    from adapters.backends.emulator import EmulatorBackend
    from adapters.backends.settings import BackendSettings
    from core.types import Role

    settings = BackendSettings(prefill=1, decode=1, profile=profile_file(tmp_path, FAST_PROFILE))
    backend = EmulatorBackend(settings, tmp_path / "run")
    board_path = tmp_path / "run" / "host-board"

    def slots() -> dict[str, int]:
        out = {}
        for iid, p in backend.procs.items():
            assert p.args[p.args.index("--host-board") + 1] == str(board_path)
            out[iid] = int(p.args[p.args.index("--host-slot") + 1])
        return out

    async def main() -> None:
        first = await backend.start()
        reader = HostBoard(board_path)
        try:
            assert sorted(slots().values()) == [0, 1]
            third = await backend.add(Role.DECODE, "d9")
            assert slots()["d9"] == 2
            gone = first[0].id
            freed = slots()[gone]
            now = time.monotonic()
            reader.publish(freed, 123.0, now - 0.01, now + 60)  # as if its last step were streaming still
            assert reader.total() == 123.0
            await backend.remove(gone)
            assert reader.total() == 0.0
            await backend.add(Role.DECODE, "d10")
            assert slots()["d10"] == freed and third.id == "d9"
        finally:
            reader.close()
            await backend.stop()

    asyncio.run(main())
