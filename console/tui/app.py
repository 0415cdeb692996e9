"""`SibylDashboard`: layout, bindings and the wiring between control-API workers and widgets."""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import Awaitable, Iterable
from functools import partial
from typing import Any

from pydantic import ValidationError
from textual import work
from textual.app import App, ComposeResult, SystemCommand
from textual.containers import Horizontal
from textual.message import Message
from textual.reactive import reactive
from textual.screen import Screen
from textual.widgets import Footer, Static
from textual.worker import Worker, WorkerState

from console.live.state import ConsoleState
from console.tui import canary_view
from console.tui.actions import ACTIONS, POLICY_KINDS, action_name, bindings, requirement
from console.tui.advisor import AdvisorPanel
from console.tui.charts import LoadChart, SloChart
from console.tui.client import ApiError, ConnectionLost, DashboardClient
from console.tui.confirm import ConfirmScreen
from console.tui.events import EventLog
from console.tui.header import DashboardHeader
from console.tui.help import HelpScreen, QuitScreen
from console.tui.inspector import InspectorScreen
from console.tui.instances import InstanceTable
from console.tui.messages import ConnectionChanged, ConsoleEvent, StateArrived
from console.tui.policy_picker import PolicyPicker
from console.tui.slo import SloPanel
from console.tui.swaps import SwapTracker
from core.dispatch.canary import SPLIT_KINDS


class SibylDashboard(App[str]):
    """The live dashboard of one console, reached only through its control API."""

    CSS_PATH = "dashboard.tcss"
    TITLE = "sibyl-console"
    BINDINGS = bindings()

    connection_error: reactive[str | None] = reactive(None)
    """Why the control API is unreachable (None while it answers); drives the banner."""
    capabilities: reactive[frozenset[str]] = reactive(frozenset())
    """What the console offers beyond the basics (`scale`, `role_flip`, `replay`, ...); gates bindings."""

    def __init__(
        self,
        client: DashboardClient,
        *,
        owns_cluster: bool = False,
        poll_interval_s: float = 0.5,
        autopoll: bool = True,
        history: int = 240,
    ) -> None:
        super().__init__()
        self.client = client
        """The control-API client (the caller creates and closes it)."""
        self.owns_cluster = owns_cluster
        """True when this dashboard launched the cluster: quitting stops it, so it asks first."""
        self.poll_interval_s = poll_interval_s
        """Seconds between two `/control/state` polls (after the previous one finished)."""
        self.autopoll = autopoll
        """Start the polling and event workers on mount (False in snapshot tests)."""
        self.history = history
        self.state: ConsoleState | None = None
        """The latest snapshot."""
        self.events_live = False
        """Whether the SSE stream is connected (then swaps are logged from it, not from polls)."""
        self.pushed_at = float("-inf")
        """When the event stream last brought a state snapshot (polling pauses while they come)."""
        self._seen: deque[str] = deque(maxlen=512)
        self.swaps = SwapTracker()
        """Which policy swaps were already logged and marked."""

    def compose(self) -> ComposeResult:
        yield DashboardHeader(id="header")
        yield Static("", id="banner")
        with Horizontal(id="top"):
            yield InstanceTable(id="instances")
            yield SloPanel(id="slo")
        with Horizontal(id="charts"):
            yield LoadChart(history=self.history, id="load-chart")
            yield SloChart(history=self.history, id="slo-chart")
        yield AdvisorPanel(id="advisor")
        yield EventLog(id="log")
        yield Footer()

    @property
    def dashboard(self) -> Screen[object]:
        """The dashboard's own screen: App.query_one looks at the active screen, which is a
        modal (policy picker, help, confirm) while one is open and state keeps arriving."""
        return self.screen_stack[0]

    def on_mount(self) -> None:
        header = self.dashboard.query_one(DashboardHeader)
        header.url, header.owns_cluster = self.client.url, self.owns_cluster
        for wid, title in (("instances", "instances"), ("slo", "SLO"), ("advisor", "advisor"), ("log", "events")):
            self.dashboard.query_one(f"#{wid}").border_title = title
        if self.autopoll:
            self.poll_state()
            self.read_events()

    # --- workers ------------------------------------------------------------------------------
    @work(exclusive=True, group="poll-state", exit_on_error=False)
    async def poll_state(self) -> None:
        """Poll `/control/state` while the event stream does not bring snapshots; the next poll
        starts only after this one ends (backoff on errors)."""
        delay, lost = self.poll_interval_s, False
        while True:
            started = time.monotonic()
            if started - self.pushed_at < 2 * self.poll_interval_s:  # the stream keeps us fresh
                await asyncio.sleep(self.poll_interval_s)
                continue
            try:
                state = await self.client.state()
            except (ConnectionLost, ApiError) as e:
                lost, delay = True, min(max(delay * 2, 1.0), 5.0)
                self.post_message(ConnectionChanged(str(e), delay))
                await asyncio.sleep(delay)
                continue
            if lost:
                lost, delay = False, self.poll_interval_s
                self.post_message(ConnectionChanged(None))
            self.post_message(StateArrived(state))
            # a steady cadence: the poll's own latency does not stretch the interval
            await asyncio.sleep(max(0.0, self.poll_interval_s - (time.monotonic() - started)))

    @work(exclusive=True, group="events", exit_on_error=False)
    async def read_events(self) -> None:
        """Follow `/control/events`; reconnect with backoff when the stream ends or fails."""
        delay = 1.0
        while True:
            try:
                async for event in self.client.events():
                    self.events_live, delay = True, 1.0
                    if event.get("type") != "state":
                        self.post_message(ConsoleEvent(event))
                        continue
                    try:
                        pushed = ConsoleState.model_validate(event.get("state"))
                    except ValidationError:
                        continue  # the poll takes over
                    self.pushed_at = time.monotonic()
                    self.post_message(StateArrived(pushed))
            except (ConnectionLost, ApiError):
                pass
            self.events_live, self.pushed_at = False, float("-inf")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10.0)

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        """The one place unexpected worker failures land: log them and restart pollers."""
        if event.state != WorkerState.ERROR or not self.screen_stack:
            return
        worker = event.worker
        self.dashboard.query_one(EventLog).note(f"{worker.name} failed: {worker.error!r}", "bold red")
        restart = {"poll-state": self.poll_state, "events": self.read_events}.get(worker.group)
        if restart is not None:
            self.set_timer(2.0, restart)

    # --- data in ------------------------------------------------------------------------------
    def _not_ready(self, message: Message) -> bool:
        """Messages can arrive before the dashboard is composed (then they are handled after the
        next refresh) or while the app shuts down (then they are dropped)."""
        if not self.screen_stack:
            return True
        if not self.dashboard.query(DashboardHeader):
            self.call_after_refresh(self.post_message, message)
            return True
        return False

    def on_state_arrived(self, message: StateArrived) -> None:
        if self._not_ready(message):
            return
        s, previous = message.state, self.state
        self.state = s
        t = float(s.uptime_s or 0.0)
        restarted = previous is not None and (previous.run_id != s.run_id or t < float(previous.uptime_s or 0.0))
        if restarted:
            self._console_restarted(s)
        instances = s.instances
        self.dashboard.query_one(DashboardHeader).state = s
        self.dashboard.query_one(InstanceTable).show(instances)
        slo = self.dashboard.query_one(SloPanel)
        slo.uptime_s, slo.requests, slo.slo = t, s.requests, s.slo
        decode = {i.id: i.load for i in instances if i.role in ("decode", "both")}
        self.dashboard.query_one(LoadChart).push(t, decode)
        self.dashboard.query_one(SloChart).push(t, s.slo)
        self.dashboard.query_one(AdvisorPanel).show(s.advisor, s.canary)
        caps = {k for k, v in s.capabilities.items() if v}
        if s.replay is not None:
            caps.add("replay")
        if s.canary and s.canary.get("running"):
            caps.add("canary")
        self.capabilities = frozenset(caps)
        if previous is None or restarted:
            self.swaps.prime(s.policy_entries())
        elif not self.events_live:
            for event in self.swaps.between(previous.policy_entries(), s.policy_entries(), t):
                self._show_swap(event, fallback=True)

    def _console_restarted(self, s: ConsoleState) -> None:
        """A new run behind the same URL: its timeline starts over."""
        for chart in (self.dashboard.query_one(LoadChart), self.dashboard.query_one(SloChart)):
            chart.reset()
        self.swaps.reset()
        self.dashboard.query_one(EventLog).note(f"the console restarted: run {s.run_id}", "bold")

    def _show_swap(self, event: dict[str, Any], *, fallback: bool = False) -> None:
        """Log a swap and mark it on both charts (a fallback only if not shown yet)."""
        if not self.swaps.accept(event, fallback=fallback):
            return
        self.dashboard.query_one(EventLog).record(event)
        t = event.get("t")
        if not isinstance(t, int | float):
            t = float(self.state.uptime_s if self.state is not None else 0.0)
        label = f"{event.get('kind')}→{event.get('new')}"
        self.dashboard.query_one(SloChart).add_marker(float(t), label)
        self.dashboard.query_one(LoadChart).add_marker(float(t), label)

    def on_console_event(self, message: ConsoleEvent) -> None:
        if self._not_ready(message):
            return
        event = message.event
        key = json.dumps(event, sort_keys=True, default=str)
        if key in self._seen:  # the stream replays recent history after a reconnect
            return
        self._seen.append(key)
        if event.get("type") == "policy":
            self._show_swap(event)
        else:
            self.dashboard.query_one(EventLog).record(event)

    def on_connection_changed(self, message: ConnectionChanged) -> None:
        if self._not_ready(message):
            return
        log = self.dashboard.query_one(EventLog)
        if message.error is None:
            log.note(f"reconnected to {self.client.url}", "green")
        else:
            if self.connection_error is None:  # log the loss once, not every retry
                log.note(f"connection lost to {self.client.url}: {message.error}", "bold red")
            self.dashboard.query_one("#banner", Static).update(
                f"⚠ connection lost to {self.client.url} — retrying in {message.retry_in_s:.0f}s"
                f"   ({message.error}); the values below are from before the loss"
            )
        self.connection_error = message.error

    def watch_connection_error(self, error: str | None) -> None:
        self.dashboard.query_one("#banner", Static).display = error is not None
        self.screen.set_class(error is not None, "-disconnected")

    def watch_capabilities(self) -> None:
        self.refresh_bindings()

    # --- actions -------------------------------------------------------------------------------
    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        need = requirement(action)
        return need is None or need in self.capabilities

    def get_system_commands(self, screen: Screen[Any]) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        for kind in POLICY_KINDS:
            yield SystemCommand(
                f"Swap {kind} policy",
                f"Pick a {kind} policy and its params",
                partial(self.run_action, f"pick_policy('{kind}')"),
            )
        for split in SPLIT_KINDS:
            yield SystemCommand(
                f"Canary {split.value} policy",
                f"Route a share of new requests under a candidate {split.value} policy, then the verdict",
                partial(self.run_action, f"pick_policy('{split.value}', True)"),
            )
        for a in ACTIONS:
            available = a.requires is None or a.requires in self.capabilities
            if available and action_name(a.action) != "pick_policy":
                yield SystemCommand(a.title, a.help, partial(self.run_action, a.action))

    @work(exclusive=True, group="open-picker", exit_on_error=False)
    async def action_pick_policy(self, kind: str = "routing", as_canary: bool = False) -> None:
        try:
            catalog = await self.client.policies()
        except (ConnectionLost, ApiError) as e:
            self.notify(f"cannot load the policy catalogue: {e}", severity="error")
            return
        apply = partial(self.client.set_policy, source="tui")
        canary = partial(self.client.start_canary, source="tui")
        picker = PolicyPicker(catalog, apply, kind, canary=canary, as_canary=as_canary)
        await self.push_screen(picker, self._swapped)

    def _swapped(self, result: dict[str, Any] | None) -> None:
        if result is None:
            return
        if "plan" in result:  # a canary started (the event stream logs it)
            plan = result["plan"]
            self.notify(
                f"{plan['kind']} {plan['name']} on {plan['share']:.0%} of new requests for {plan['duration_s']:g} s; "
                "x stops it",
                title=f"canary {result.get('id')} started",
            )
            return
        where = f" (pool {result['pool']})" if self.state is not None and len(self.state.pools or {}) > 1 else ""
        self.notify(f"{result.get('kind')}{where}: {result.get('old')} → {result.get('new')}", title="policy swapped")
        if not self.events_live:
            self._show_swap({"type": "policy", **result}, fallback=True)

    def action_stop_canary(self) -> None:
        """Ask, then end the running canary as interrupted: the active policy stays in force for every request."""
        canary = self.state.canary if self.state is not None else None
        running = (canary or {}).get("running")
        if not running:
            self.notify("no canary is running", severity="warning")
            return

        def answered(stop: bool | None) -> None:
            if stop:
                self._stop_canary()

        self.push_screen(
            ConfirmScreen(
                f"Stop canary {running['id']}?",
                f"{canary_view.title(running)}, {canary_view.time_left(running)}, {canary_view.arms(running)}. "
                "Stopping ends it interrupted, without a verdict: every new request goes to the active policy again "
                "(requests already routed under the candidate finish there).",
                "Stop the canary",
                "Keep it running",
            ),
            answered,
        )

    @work(group="control-actions", exit_on_error=False)
    async def _stop_canary(self) -> None:
        try:
            ended = await self.client.stop_canary()
        except (ConnectionLost, ApiError) as e:
            self.notify(f"stop canary failed: {e}", severity="error")
            self.dashboard.query_one(EventLog).note(f"stop canary failed: {e}", "bold red")
            return
        self.notify(f"{ended.get('id')} ended {ended.get('decision')}: {ended.get('reason')}", title="canary stopped")

    def action_sort(self) -> None:
        self.dashboard.query_one(InstanceTable).cycle_sort()

    @work(group="control-actions", exit_on_error=False)
    async def action_scale(self, role: str, delta: int) -> None:
        pool = None  # several pools: the selected instance's
        if self.state is not None and len(self.state.pools or {}) > 1:
            iid = self.dashboard.query_one(InstanceTable).selected_id()
            pool = next((i.pool for i in self.state.instances if i.id == iid), None)
            if pool is None:
                self.notify("select an instance of the pool to scale first", severity="warning")
                return
        where = f" in pool {pool}" if pool else ""
        await self._control(f"scale {role} {delta:+d}{where}", self.client.scale(role, delta, pool))

    @work(group="control-actions", exit_on_error=False)
    async def action_flip_selected(self) -> None:
        table = self.dashboard.query_one(InstanceTable)
        iid = table.selected_id()
        if iid is None:
            self.notify("select an instance in the table first", severity="warning")
            return
        role = table.row_role(iid)
        target = "decode" if role == "prefill" else "prefill"
        await self._control(f"flip {iid} to {target}", self.client.flip(iid, target))

    def action_inspect_selected(self) -> None:
        iid = self.dashboard.query_one(InstanceTable).selected_id()
        if iid is None:
            self.notify("select an instance in the table first", severity="warning")
            return
        self.push_screen(InspectorScreen(self.client, iid))

    @work(group="control-actions", exit_on_error=False)
    async def action_toggle_replay(self) -> None:
        replay = self.state.replay if self.state is not None else None
        paused = replay is not None and (replay.paused or replay.status == "paused")
        verb = "resume" if paused else "pause"
        await self._control(f"replay {verb}", self.client.replay(verb))

    async def _control(self, what: str, call: Awaitable[Any]) -> None:
        try:
            await call
        except (ConnectionLost, ApiError) as e:
            self.notify(f"{what} failed: {e}", severity="error")
            self.dashboard.query_one(EventLog).note(f"{what} failed: {e}", "bold red")
            return
        self.notify(f"{what}: done")

    def action_toggle_theme(self) -> None:
        self.theme = "textual-light" if self.current_theme.dark else "textual-dark"

    def action_help(self) -> None:
        self.push_screen(HelpScreen(set(self.capabilities)))

    async def action_quit(self) -> None:
        if not self.owns_cluster:
            self.exit()
            return

        def answered(choice: str | None) -> None:
            if choice is not None:
                self.exit(choice)

        run_id = self.state.run_id if self.state is not None else None
        self.push_screen(QuitScreen(str(run_id) if run_id else None), answered)
