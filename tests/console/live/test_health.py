"""InstanceHealth and RankWatch: breakers, probes, lost signals, data-parallel rank drift."""

from __future__ import annotations

import asyncio

from adapters.vllm.instances import Instance
from console.live.config import ConsoleConfig
from console.live.events import EventBus, InstanceListeners
from console.live.health import InstanceHealth, RankWatch
from console.live.state import InstanceRow
from core.types import Role
from tests.console.live.fakes import dispatcher, instances


class Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.up: list[tuple[str, bool]] = []
        self.samples: list[str] = []

    def instance_event(self, instance_id: str, role: Role | None, event: str, detail: str, source: str = "") -> None:
        self.events.append((instance_id, event))

    def instance_up(self, inst: Instance, up: bool) -> None:
        self.up.append((inst.id, up))

    def sample(self, inst: Instance, now: float) -> None:
        self.samples.append(inst.id)


def make(failures: int = 2, cooloff_s: float = 5.0) -> tuple[InstanceHealth, Log, list[str]]:
    insts = instances(1, 2)
    log, released, kicked = Log(), [], []
    health = InstanceHealth(
        ConsoleConfig(breaker_failures=failures, breaker_cooloff_s=cooloff_s),
        {i.id: i for i in insts},
        dispatcher(insts),
        log,
        lambda: released.append("release"),
        InstanceListeners(),
    )
    health.kick = lambda: kicked.append("kick")
    return health, log, kicked


def routable(health: InstanceHealth, iid: str) -> bool:
    return bool(health.dispatcher.view.healthy[health.dispatcher.index_of(iid)])


def test_a_breaker_opens_after_failures_half_opens_after_the_cooloff_and_closes_on_success() -> None:
    health, log, kicked = make(failures=2, cooloff_s=5.0)
    health.upstream_ok("d0")  # nothing failed yet: no breaker made
    assert health.breakers == {} and health.breaker_state("d0") == "closed"
    health.upstream_failed("d0")
    assert health.breaker_state("d0") == "closed" and routable(health, "d0") and kicked == ["kick"]
    health.upstream_failed("d0")
    assert health.breaker_state("d0") == "open" and not routable(health, "d0")
    assert health.instances["d0"].failed == 2
    health.tick(health.breakers["d0"].opened_at + 1.0)
    assert health.breaker_state("d0") == "open"
    health.tick(health.breakers["d0"].opened_at + 5.0)
    assert health.breaker_state("d0") == "half_open" and routable(health, "d0")
    health.upstream_ok("d0")
    assert health.breaker_state("d0") == "closed"
    assert [e for _, e in log.events] == ["circuit_open", "circuit_half_open", "circuit_closed"]


def test_an_instance_marked_down_resolves_its_lost_signal_and_a_recovered_one_gets_a_fresh_one() -> None:
    async def body() -> None:
        health, log, _ = make()
        released: list[str] = []
        health.release = lambda: released.append("release")
        d0 = health.instances["d0"]
        lost = health.lost_signal("d0")
        assert health.lost_signal("d0") is lost and not lost.done()
        d0.healthy = False
        health.on_status(d0, False, "connection refused")
        assert lost.done() and not routable(health, "d0") and log.up == [("d0", False)] and released == []
        d0.healthy = True
        health.on_status(d0, True, "answers /health")
        assert routable(health, "d0") and released == ["release"]
        fresh = health.lost_signal("d0")
        assert fresh is not lost and not fresh.done()
        health.instance_removed("d0")
        assert fresh.done()
        assert health.lost_signal("gone").done()  # an unknown instance is lost already
        assert [e for _, e in log.events] == ["down", "up"]

    asyncio.run(body())


def test_the_backend_seeing_an_instance_die_marks_it_down_once() -> None:
    async def body() -> None:
        health, log, _ = make()
        health.instance_lost("d1", "actor died")
        assert (
            not health.instances["d1"].healthy
            and health.instances["d1"].consecutive_failures >= health.config.down_after_failures
        )
        health.instance_lost("d1", "node gone")  # already down: recorded only
        health.instance_lost("nope", "?")
        assert log.events == [("d1", "down"), ("d1", "lost")]

    asyncio.run(body())


def test_a_sample_reaches_the_dispatcher_and_the_log() -> None:
    health, log, _ = make()
    d0 = health.instances["d0"]
    i = health.dispatcher.index_of("d0")
    assert health.dispatcher.view.waiting_obs_at[i] == float("inf")  # nothing reported yet
    d0.sample.waiting, d0.sample.kv_usage = 7, 0.5
    d0.update(d0.sample, 11.9)  # the poller took the page at 11.9
    health.on_sample(d0, 12.0)
    assert log.samples == ["d0"]
    view = health.dispatcher.view
    assert (view.waiting_obs[i], view.kv_usage[i], view.waiting_obs_at[i]) == (7, 0.5, 11.9)


def test_a_group_whose_ranks_drift_apart_is_reported_once_and_again_when_balanced() -> None:
    bus = EventBus()
    published = bus.history
    watch = RankWatch(bus, lambda: "jsq")
    for loads in ([100, 100], [300, 100], [400, 100], [115, 100], [105, 100]):
        watch.check([InstanceRow(id="d0", role="decode", dp_ranks=loads), InstanceRow(id="d1", role="decode")])
    assert [(e["factor"], e["balanced"], e["policy"]) for e in published] == [(1.5, False, "jsq"), (1.07, True, "jsq")]


def test_the_console_reports_a_group_whose_ranks_drift_apart_once_and_again_when_balanced() -> None:
    from types import SimpleNamespace

    from console.live.health import RankWatch
    from console.live.state import InstanceRow
    from console.tui.events import describe
    from console.tui.fmt import Palette

    published: list[dict[str, object]] = []
    events = SimpleNamespace(publish=lambda kind, **kw: published.append({"type": kind, **kw}))
    watch = RankWatch(events, lambda: "jsq")  # type: ignore[arg-type]
    for loads in (
        [100, 100, 100, 100],
        [400, 100, 100, 100],
        [500, 100, 100, 100],
        [130, 100, 100, 100],
        [110, 100, 100, 100],
    ):
        watch.check(
            [InstanceRow(id="d0", role="decode", dp_ranks=loads), InstanceRow(id="d1", role="decode", dp_ranks=None)]
        )
    # x2.29 is reported once (not again at x2.5); x1.24 is not yet balanced; x1.07 is
    assert [(e["factor"], e["busiest"], e["balanced"]) for e in published] == [(2.29, 0, False), (1.07, 0, True)]
    tag, text, _ = describe(published[0], Palette("g", "y", "r", "b", "d"))
    assert tag == "RANKS" and "rank 0 at x2.29" in text and "jsq" in text
    tag, text, _ = describe(
        {"type": "recovered", "request_id": "r1", "detail": "decode d0 failed mid-stream: resumed on d1"},
        Palette("g", "y", "r", "b", "d"),
    )
    assert tag == "MOVED" and "resumed on d1" in text
