"""The emulator's data-parallel group: ranks step together, the straggler sets the step, the
X-data-parallel-rank header places a request."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from adapters.emulator.dp_group import DataParallelGroup
from adapters.emulator.engine import Sequence
from adapters.emulator.faults import Faults
from adapters.emulator.process import EmulatorProcess
from adapters.ports import free_port
from tests.emulator_fixtures import profile_file
from tests.helpers import toy_profile

PROFILE = toy_profile(
    decode_step_base_s=0.002,
    decode_step_per_seq_s=0.0005,
    decode_step_per_kv_token_s=0.00001,
    prefill_base_s=0.001,
    prefill_per_token_s=0.00001,
    block_size=16,
)


def test_every_step_lasts_as_long_as_its_slowest_rank_and_requests_stay_on_their_rank() -> None:
    """Rank 0 holds one request with a 1,000-token prompt, rank 1 two short ones: each decode step
    of the group lasts step_time of rank 0 (the straggler), and rank 1 waits for it."""

    async def main() -> tuple[DataParallelGroup, list[Sequence]]:
        group = DataParallelGroup(2, PROFILE, Faults(), max_num_seqs=8, kv_capacity_tokens=65536)
        seqs = [Sequence("long", 1000, 6), Sequence("a", 10, 6), Sequence("b", 10, 6)]
        for s, rank in zip(seqs, (0, 1, 1), strict=True):
            s.dp_rank = rank
        group.start()
        for s in seqs:
            group.submit(s)
        await asyncio.wait_for(asyncio.gather(*(s.done.wait() for s in seqs)), 20)
        await group.stop()
        return group, seqs

    group, seqs = asyncio.run(main())
    assert [s.dp_rank for s in seqs] == [0, 1, 1] and all(s.generated == 6 for s in seqs)
    decode_steps = [(rec, ranks) for rec, ranks in zip(group.steps, group.rank_steps, strict=True) if not rec.chunks]
    assert len(decode_steps) >= 4
    for rec, ranks in decode_steps:
        (b0, kv0), (b1, kv1) = ranks
        assert (b0, b1) == (1, 2) and kv0 > kv1
        straggler = max(PROFILE.step_time(b0, kv0), PROFILE.step_time(b1, kv1))
        assert rec.end - rec.start == pytest.approx(straggler, rel=1e-9)  # the barrier: one step, the slowest rank's
        assert straggler == pytest.approx(PROFILE.step_time(b0, kv0))
    for rank in group.ranks:  # both ranks logged the same step boundaries
        assert [(r.start, r.end) for r in rank.steps if not r.chunks][-3:] == [
            (rec.start, rec.end) for rec, _ in decode_steps
        ][-3:]


def test_without_a_rank_the_group_fills_the_least_busy_rank_first() -> None:
    group = DataParallelGroup(3, PROFILE, Faults(), max_num_seqs=8)
    placed = []

    async def main() -> None:
        for k in range(6):
            s = Sequence(f"s{k}", 10, 50)
            group.submit(s)
            placed.append(s.dp_rank)

    asyncio.run(main())
    assert placed == [0, 1, 2, 0, 1, 2] and group.waiting == 6


@pytest.fixture(scope="module")
def dp_emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmulatorProcess]:
    d = tmp_path_factory.mktemp("dp")
    p = EmulatorProcess(
        "decode", free_port(), ["--profile", profile_file(d, PROFILE), "--data-parallel-size", "4", "--model", "tiny"]
    ).start()
    try:
        p.wait_ready(30)
        yield p
    finally:
        p.stop()


def test_the_header_places_a_request_on_its_rank_and_a_bad_rank_is_refused(dp_emulator: EmulatorProcess) -> None:
    url = dp_emulator.url
    body: dict[str, Any] = {"model": "tiny", "prompt": "x" * 400, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", url + "/v1/completions", json=body, headers={"X-data-parallel-rank": "2"}) as r,
    ):
        assert r.status_code == 200
        chunks = r.iter_bytes()  # kept: a dropped iterator closes the stream, and the emulator aborts the request
        next(chunks)  # decoding now
        ranks = http.get(url + "/admin/info").json()["ranks"]
        assert [x["running"] for x in ranks] == [0, 0, 1, 0] and ranks[2]["kv_tokens"] >= 100
    for bad in ("4", "-1", "two"):
        r = httpx.post(
            url + "/v1/completions", json={**body, "stream": False}, headers={"X-data-parallel-rank": bad}, timeout=10
        )
        assert r.status_code == 400 and "data_parallel_rank" in r.json()["error"]["message"]


def test_a_group_refuses_to_migrate(dp_emulator: EmulatorProcess, tmp_path: Path) -> None:
    r = httpx.post(
        dp_emulator.url + "/admin/migrate", json={"request_id": "nope", "target": "http://127.0.0.1:9"}, timeout=10
    )
    assert r.status_code in (404, 409) and r.json()["ok"] is False
