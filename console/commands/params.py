"""Policy params from the command line: `--param [policy.]key=value` and `--params-json [policy=]{...}`.

What `status --json`, `policy list --json` and `/control/state` print passes back unchanged: a
value that is a JSON object, list or null (or the Python `None`, `{...}` and `[...]` that `status`
prints) is parsed; any other value stays text for the policy's params model to type ("32" becomes
an int, "true" a bool), as before.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Iterable
from typing import Any

from core.errors import PolicyError

NULLS = ("null", "None")
"""Values that mean "no value" (JSON's and Python's spelling)."""


def param_value(text: str, where: str) -> Any:
    """One `--param` value: JSON (or a Python literal) for an object, list, null or quoted string;
    anything else as the text it is. `where` names the option in an error."""
    s = text.strip()
    if s in NULLS:
        return None
    if not s or s[0] not in '{["':
        return text
    try:
        return json.loads(s)
    except ValueError:
        pass
    try:
        return ast.literal_eval(s)  # the Python form `status` prints: {'a': None, 'b': True}
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        raise PolicyError(f"{where}: {s!r} is neither JSON nor a Python literal") from None


def _params_object(text: str) -> tuple[str, dict[str, Any]]:
    """One `--params-json` value, `{...}` or `policy={...}` → (policy or "", params)."""
    s = text.strip()
    policy = ""
    if not s.startswith("{"):
        policy, sep, s = s.partition("=")
        policy, s = policy.strip(), s.strip()
        if not sep or not policy:
            raise PolicyError(f"--params-json {text!r}: expected '{{...}}' or 'policy={{...}}'")
    try:
        value = json.loads(s)
    except ValueError as e:
        raise PolicyError(f"--params-json {text!r}: not JSON ({e})") from None
    if not isinstance(value, dict):
        raise PolicyError(f"--params-json {text!r}: expected a JSON object, got {type(value).__name__}")
    return policy, value


def policy_params(param: Iterable[str] = (), params_json: Iterable[str] = ()) -> dict[str, dict[str, Any]]:
    """`--params-json` then `--param` (which wins, key by key) → {policy: {key: value}}; the policy is
    "" for an unprefixed `key=value` or a bare `{...}` (each command says where those go)."""
    out: dict[str, dict[str, Any]] = {}
    for text in params_json:
        policy, values = _params_object(text)
        out.setdefault(policy, {}).update(values)
    for item in param:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise PolicyError(f"--param {item!r}: expected key=value or policy.key=value")
        policy, dot, field = key.rpartition(".")
        out.setdefault(policy if dot else "", {})[field] = param_value(value, f"--param {key}")
    return out


def params_for(assigned: dict[str, dict[str, Any]], name: str) -> dict[str, Any]:
    """The params a policy called `name` gets: the unprefixed ones, then its own on top."""
    return {**assigned.get("", {}), **assigned.get(name, {})}
