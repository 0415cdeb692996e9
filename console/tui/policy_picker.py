"""The policy picker: kind → registered policy → params form → swap now, or start a canary, through the control API."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, OptionList, RadioSet, Select, Static
from textual.widgets.option_list import Option

from console.tui.canary_form import CanaryAsk, CanaryForm, canary_rules, check, refusal
from console.tui.client import ApiError, ConnectionLost
from console.tui.params_form import ParamsForm

ApplyFn = Callable[..., Awaitable[dict[str, Any]]]
"""Swaps a policy: (kind, name, params[, pool=NAME]) → the API's {kind, old, new, params, source}."""
CanaryFn = Callable[..., Awaitable[dict[str, Any]]]
"""Starts a canary: (kind, name, params, share as typed, duration_s[, pool=NAME]) → the API's {id, plan, ...}."""


class PolicyPicker(ModalScreen[dict[str, Any] | None]):
    """Dismisses with the swap the console confirmed ({kind, old, new, ...}), the canary it started ({id, plan, ...}),
    or None when cancelled."""

    BINDINGS = [
        Binding("escape", "cancel", "Cancel", id="picker.cancel"),
        Binding("ctrl+s", "apply", "Apply", id="picker.apply"),
    ]

    def __init__(
        self,
        catalog: Mapping[str, Any],
        apply: ApplyFn,
        kind: str = "routing",
        *,
        canary: CanaryFn | None = None,
        as_canary: bool = False,
    ) -> None:
        super().__init__()
        self.available: list[Mapping[str, Any]] = list(catalog.get("available") or [])
        """Every registered policy: {kind, name, summary, params_schema, defaults}."""
        self.pools: Mapping[str, Mapping[str, Any]] = catalog.get("pools") or {}
        """Each pool's active policies (several pools: the picker acts on the one chosen)."""
        self.pool: str | None = next(iter(self.pools)) if len(self.pools) > 1 else None
        """The pool being edited (None: the console runs one pool)."""
        self.active: Mapping[str, Any] = self.pools[self.pool] if self.pool else catalog.get("active") or {}
        """The active policy of each kind (of the chosen pool): {kind: {name, params}}."""
        self._apply_fn = apply
        self._canary_fn = canary
        """Starts a canary (None: the picker only swaps)."""
        self.as_canary = as_canary and canary is not None
        """Open with `canary` chosen rather than `swap now`."""
        kinds = list(dict.fromkeys(str(p["kind"]) for p in self.available))
        self.kinds = kinds
        """Kinds that have at least one registered policy."""
        self.kind = kind if kind in kinds else (kinds[0] if kinds else kind)
        """The kind being edited."""
        self.policy: Mapping[str, Any] | None = None
        """The highlighted policy's catalogue entry."""

    def compose(self) -> ComposeResult:
        with Vertical(id="picker"):
            yield Static("Swap a policy, or canary it" if self._canary_fn else "Swap a policy", id="picker-title")
            with Horizontal(id="picker-top"):
                if self.pool is not None:
                    yield Select(
                        [(f"pool {p}", p) for p in self.pools],
                        value=self.pool,
                        allow_blank=False,
                        id="picker-pool",
                        compact=True,
                    )
                yield Select(
                    [(k, k) for k in self.kinds], value=self.kind, allow_blank=False, id="picker-kind", compact=True
                )
                yield Static("", id="picker-active")
            yield OptionList(id="picker-policies")
            yield Static("", id="picker-summary")
            yield VerticalScroll(id="picker-form")
            if self._canary_fn is not None:
                yield CanaryForm(self.as_canary, id="picker-canary")
            yield Static("", id="picker-error")
            with Horizontal(id="picker-buttons"):
                yield Button("Apply (ctrl+s)", variant="primary", id="picker-apply", compact=True)
                yield Button("Cancel (esc)", id="picker-cancel", compact=True)

    def on_mount(self) -> None:
        self._fill_policies()
        self.query_one("#picker-policies", OptionList).focus()
        self._mode_changed()

    @property
    def canary_form(self) -> CanaryForm | None:
        return self.query("#picker-canary").first(CanaryForm) if self._canary_fn is not None else None

    @property
    def canary_chosen(self) -> bool:
        """Whether Apply starts a canary rather than swapping."""
        form = self.canary_form
        return form is not None and form.canary

    @on(RadioSet.Changed, "#picker-mode")
    def _mode_changed(self) -> None:
        label = "Start canary (ctrl+s)" if self.canary_chosen else "Apply (ctrl+s)"
        self.query_one("#picker-apply", Button).label = label
        self.query_one("#picker-error", Static).update("")
        self._check_split()

    @work(exclusive=True, group="picker-split", exit_on_error=False)
    async def _check_split(self) -> None:
        """With canary chosen: say at once why this kind cannot be canaried, in the console's words."""
        form = self.canary_form
        if form is None or not form.canary:
            return
        rules = await canary_rules()
        if form.canary:
            form.query_one("#canary-note", Static).update(refusal(rules, self.kind) or "")

    def _policies(self) -> list[Mapping[str, Any]]:
        return [p for p in self.available if p["kind"] == self.kind]

    def _fill_policies(self) -> None:
        active = (self.active.get(self.kind) or {}).get("name")
        ol = self.query_one("#picker-policies", OptionList)
        ol.clear_options()
        policies = self._policies()
        ol.add_options(
            Option(f"{'● ' if p['name'] == active else '  '}{p['name']}  —  {p.get('summary', '')}", id=str(p["name"]))
            for p in policies
        )
        self.query_one("#picker-active", Static).update(f"active: {active or '-'}")
        names = [p["name"] for p in policies]
        ol.highlighted = names.index(active) if active in names else (0 if names else None)
        if ol.highlighted is not None:
            self._show_policy(policies[ol.highlighted])

    @on(Select.Changed, "#picker-kind")
    def _kind_changed(self, event: Select.Changed) -> None:
        if isinstance(event.value, str) and event.value != self.kind:
            self.kind = event.value
            self._fill_policies()
            self._check_split()

    @on(Select.Changed, "#picker-pool")
    def _pool_changed(self, event: Select.Changed) -> None:
        if isinstance(event.value, str) and event.value != self.pool:
            self.pool = event.value
            self.active = self.pools[event.value]
            self._fill_policies()
            self._check_split()

    @on(OptionList.OptionHighlighted, "#picker-policies")
    def _policy_highlighted(self, event: OptionList.OptionHighlighted) -> None:
        chosen = [p for p in self._policies() if p["name"] == event.option.id]
        if chosen and chosen[0] is not self.policy:
            self._show_policy(chosen[0])

    @on(OptionList.OptionSelected, "#picker-policies")
    def _policy_selected(self, event: OptionList.OptionSelected) -> None:
        """Enter on a policy moves to its first parameter (or to Apply when it has none)."""
        form = self.query("#picker-form ParamsForm").first(ParamsForm)
        editors = [w for w in form.query("Input, Select, Switch") if w.can_focus]
        (editors[0] if editors else self.query_one("#picker-apply", Button)).focus()

    def _show_policy(self, policy: Mapping[str, Any]) -> None:
        self.policy = policy
        active = self.active.get(self.kind) or {}
        values = dict(policy.get("defaults") or {})
        if active.get("name") == policy["name"]:
            values.update(active.get("params") or {})
        self.query_one("#picker-summary", Static).update(f"{policy['name']}: {policy.get('summary', '')}")
        self.query_one("#picker-error", Static).update("")
        holder = self.query_one("#picker-form", VerticalScroll)
        holder.remove_children()
        holder.mount(ParamsForm(policy.get("params_schema") or {}, values))

    @on(Button.Pressed, "#picker-apply")
    def _apply_pressed(self) -> None:
        self.action_apply()

    @on(Button.Pressed, "#picker-cancel")
    def _cancel_pressed(self) -> None:
        self.action_cancel()

    def action_cancel(self) -> None:
        self.dismiss(None)

    def action_apply(self) -> None:
        if self.policy is None:
            return
        form = self.query_one("#picker-form ParamsForm", ParamsForm)
        params, errors = form.values()
        form.show_errors(errors)
        if errors:
            self.query_one("#picker-error", Static).update("fix the fields marked above")
            return
        if self.canary_chosen:
            self.query_one("#picker-error", Static).update("checking…")
            self._start_canary(self.kind, str(self.policy["name"]), params)
            return
        self.query_one("#picker-error", Static).update("applying…")
        self._apply(self.kind, str(self.policy["name"]), params)

    @work(exclusive=True, group="picker-apply", exit_on_error=False)
    async def _apply(self, kind: str, name: str, params: dict[str, Any]) -> None:
        if self.pool is None:
            await self._send(self._apply_fn(kind, name, params))
        else:
            await self._send(self._apply_fn(kind, name, params, pool=self.pool))

    async def _send(self, call: Awaitable[Any], canary: CanaryAsk | None = None) -> None:
        """Await the picker's control call: close with its result, or show the console's refusal under the
        fields it names (the params', and the share's or duration's for a `canary`) and below the form."""
        error = self.query_one("#picker-error", Static)
        try:
            result = await call
        except ApiError as e:
            form = self.query_one("#picker-form ParamsForm", ParamsForm)
            form.show_errors(form.fields_named_in(e.message))
            if canary is not None and self.canary_form is not None:
                named = self.canary_form.fields_named_in(e.message)
                self.canary_form.show(CanaryAsk(canary.share, canary.duration_s, None, named))
            error.update(f"the console refused ({e.status}): {e.message}")
            return
        except ConnectionLost as e:
            error.update(f"cannot reach the console: {e}; try again when it is back")
            return
        self.dismiss(result)

    @work(exclusive=True, group="picker-apply", exit_on_error=False)
    async def _start_canary(self, kind: str, name: str, params: dict[str, Any]) -> None:
        """Check the share, duration and kind as the console and `policy canary` do, then start it on the chosen pool
        (one pool: the console's) through the control API; its refusal is shown under the field it names (a param's,
        the share's) or below."""
        error, form = self.query_one("#picker-error", Static), self.canary_form
        if form is None or self._canary_fn is None:
            return
        rules = await canary_rules()
        ask = check(rules, kind, *form.texts())
        form.show(ask)
        if not ask.ok:
            error.update(ask.refusal or "fix the fields marked above; no canary was started")
            return
        error.update("starting the canary…")
        pool = {} if self.pool is None else {"pool": self.pool}
        await self._send(self._canary_fn(kind, name, params, ask.share, ask.duration_s, **pool), canary=ask)
