"""A form generated from a policy's params JSON schema: bool → Switch, enum → Select, else Input."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widget import Widget
from textual.widgets import Input, Label, Select, Static, Switch


@dataclass(frozen=True)
class Field:
    """One parameter as the form understands it."""

    name: str
    title: str
    description: str
    kind: str
    """boolean | enum | integer | number | string | json"""
    nullable: bool
    choices: tuple[Any, ...]
    schema: Mapping[str, Any]


def _resolve(prop: Mapping[str, Any], defs: Mapping[str, Any]) -> tuple[Mapping[str, Any], bool]:
    nullable = False
    if "$ref" in prop:
        prop = {**defs.get(str(prop["$ref"]).rsplit("/", 1)[-1], {}), **{k: v for k, v in prop.items() if k != "$ref"}}
    for key in ("anyOf", "oneOf"):
        if key in prop:
            alts = [a for a in prop[key] if a.get("type") != "null"]
            nullable = len(alts) < len(prop[key])
            if len(alts) == 1:
                inner, _ = _resolve(alts[0], defs)
                prop = {**inner, **{k: v for k, v in prop.items() if k != key}}
    return prop, nullable


def fields_of(schema: Mapping[str, Any]) -> list[Field]:
    """The form fields of a pydantic JSON schema, in declaration order."""
    defs = schema.get("$defs") or {}
    out = []
    for name, raw in (schema.get("properties") or {}).items():
        prop, nullable = _resolve(raw, defs)
        t = prop.get("type")
        if "enum" in prop:
            kind = "enum"
        elif t in ("boolean", "integer", "number", "string"):
            kind = str(t)
        else:
            kind = "json"
        out.append(
            Field(
                name,
                str(prop.get("title") or name),
                str(prop.get("description") or ""),
                kind,
                nullable,
                tuple(prop.get("enum") or ()),
                prop,
            )
        )
    return out


def _check_range(f: Field, x: float) -> str | None:
    s = f.schema
    if "minimum" in s and x < s["minimum"]:
        return f"must be ≥ {s['minimum']}"
    if "maximum" in s and x > s["maximum"]:
        return f"must be ≤ {s['maximum']}"
    if "exclusiveMinimum" in s and x <= s["exclusiveMinimum"]:
        return f"must be > {s['exclusiveMinimum']}"
    if "exclusiveMaximum" in s and x >= s["exclusiveMaximum"]:
        return f"must be < {s['exclusiveMaximum']}"
    return None


def parse_value(f: Field, text: str) -> tuple[Any, str | None]:
    """(value, error) of an Input's text under the field's type and bounds."""
    text = text.strip()
    if not text:
        return (None, None) if f.nullable else (None, "required")
    try:
        if f.kind == "integer":
            value: Any = int(text)
        elif f.kind == "number":
            value = float(text)
        elif f.kind == "json":
            value = json.loads(text)
        else:
            value = text
    except ValueError:
        return None, {"integer": "expected a whole number", "number": "expected a number"}.get(f.kind, "expected JSON")
    if f.kind in ("integer", "number"):
        return value, _check_range(f, float(value))
    return value, None


class ParamsForm(Vertical):
    """The widgets of one policy's params; `values()` validates locally, `show_errors()` marks fields."""

    def __init__(self, schema: Mapping[str, Any], values: Mapping[str, Any], *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.fields = fields_of(schema)
        """The parameters, in schema order."""
        self._initial = dict(values)

    def compose(self) -> ComposeResult:
        if not self.fields:
            yield Static("This policy takes no parameters.", classes="param-none")
        for f in self.fields:
            value = self._initial.get(f.name, f.schema.get("default"))
            with Horizontal(classes="param-row"):
                yield Label(f.title, classes="param-label")
                yield self._editor(f, value)
                if f.kind == "boolean":
                    yield Static("on" if value else "off", id=f"param-{f.name}-state", classes="param-state")
                yield Static(f.description, classes="param-help")
            yield Static("", id=f"param-{f.name}-error", classes="param-error")

    def _editor(self, f: Field, value: Any) -> Widget:
        wid = f"param-{f.name}"
        if f.kind == "boolean":
            return Switch(bool(value), id=wid)
        if f.kind == "enum":
            options = [(str(c), c) for c in f.choices]
            initial = value if value in f.choices else Select.NULL
            return Select(
                options, value=initial, allow_blank=f.nullable or initial is Select.NULL, id=wid, compact=True
            )
        text = "" if value is None else (json.dumps(value) if f.kind == "json" else str(value))
        input_type = {"integer": "integer", "number": "number"}.get(f.kind, "text")
        return Input(text, type=input_type, placeholder=f.kind, id=wid, compact=True)  # type: ignore[arg-type]

    def on_switch_changed(self, event: Switch.Changed) -> None:
        if event.switch.id:
            self.query_one(f"#{event.switch.id}-state", Static).update("on" if event.value else "off")

    def values(self) -> tuple[dict[str, Any], dict[str, str]]:
        """(params, errors by field name) from the current widgets."""
        params: dict[str, Any] = {}
        errors: dict[str, str] = {}
        for f in self.fields:
            widget = self.query_one(f"#param-{f.name}")
            if isinstance(widget, Switch):
                params[f.name] = widget.value
            elif isinstance(widget, Select):
                if widget.value is Select.NULL:
                    if not f.nullable:
                        errors[f.name] = "choose one of " + ", ".join(map(str, f.choices))
                    params[f.name] = None
                else:
                    params[f.name] = widget.value
            elif isinstance(widget, Input):
                value, error = parse_value(f, widget.value)
                params[f.name] = value
                if error:
                    errors[f.name] = error
        return params, errors

    def show_errors(self, errors: Mapping[str, str]) -> None:
        for f in self.fields:
            label = self.query_one(f"#param-{f.name}-error", Static)
            label.update(errors.get(f.name, ""))
            label.display = f.name in errors

    def fields_named_in(self, message: str) -> dict[str, str]:
        """Map a server error such as `by: Input should be ...` onto the fields it names."""
        out = {}
        for f in self.fields:
            m = re.search(r"(?:^|[:;]\s*)" + re.escape(f.name) + r"(?:\.\w+)*:\s*([^;()]+)", message)
            if m:
                out[f.name] = m.group(1).strip()
        return out
