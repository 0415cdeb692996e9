"""The advisor's worker: a real spawned process answers a window, reports its CPU, runs niced and stops."""

from __future__ import annotations

import asyncio
import dataclasses
import os

from console.advisor.simulate import Candidate, Shape
from console.advisor.window import Window
from console.advisor.worker import NICE, AdvisorWorker
from core.perf import PerfProfile


def test_a_worker_process_answers_reports_its_cpu_and_stops(
    prefix_window: Window, small_cache_profile: PerfProfile
) -> None:
    worker = AdvisorWorker(Shape(2, 2), small_cache_profile, candidates=[Candidate("routing", "prefix_aware")])
    try:
        assert worker.pid is not None and worker.pid != os.getpid() and worker.latest() is None
        first = worker.submit(prefix_window)
        second = worker.submit(prefix_window)  # waits for the first
        third = worker.submit(prefix_window)  # replaces the second
        assert (first, second, third) == (1, 2, 3) and worker.busy and worker.skipped == 1

        async def answers() -> list[int]:
            got = []
            while len(got) < 2:
                answer = await worker.next_answer(120.0)
                assert answer is not None
                got.append(answer.job)
            return got

        assert asyncio.run(answers()) == [1, 3]
        answer = worker.latest()
        assert answer is not None and answer.error is None and answer.advice is not None
        assert answer.pid == worker.pid and answer.cpu_s > 0 and 0 < answer.job_cpu_s <= answer.cpu_s
        assert answer.advice.ranked[0].label == "routing:prefix_aware"
        # it reniced itself before taking its first window
        assert os.getpriority(os.PRIO_PROCESS, worker.pid) >= min(os.getpriority(os.PRIO_PROCESS, 0) + NICE, 19)
        share = worker.cpu_share()
        assert share is not None and share > 0
        assert answer.to_json()["advice"]["best"] in (None, "routing:prefix_aware")
    finally:
        worker.close()
    assert not worker.alive


def test_a_window_the_advisor_cannot_simulate_is_an_answer_not_a_dead_worker(
    prefix_window: Window, small_cache_profile: PerfProfile
) -> None:
    worker = AdvisorWorker(Shape(1, 1), small_cache_profile, candidates=[])
    try:
        bad = dataclasses.replace(prefix_window, active={"routing": ("nope", {}), "queue": ("fcfs", {})})
        worker.submit(bad)
        answer = asyncio.run(worker.next_answer(120.0))
        assert answer is not None and answer.advice is None
        assert answer.error is not None and "unknown routing policy 'nope'" in answer.error
        assert worker.alive and not worker.busy
    finally:
        worker.close()
    assert not worker.alive
