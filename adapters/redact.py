"""Keep secrets out of what is stored or logged: run records, launch logs, event streams."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

SECRET = re.compile(
    r"(?:^|[-_])(?:token|secret|password|passwd|api[-_]?key|credentials?|authorization)$", re.IGNORECASE
)
"""A name that says its value is a secret: HF_TOKEN, --admin-token, --api-key, password; not
max_num_batched_tokens (the word must end the name)."""
HIDDEN = "***"


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    """Environment variables with secret-looking names shown as ***."""
    return {k: HIDDEN if SECRET.search(k) else v for k, v in env.items()}


def redact_args(args: list[str]) -> list[str]:
    """Command-line arguments with the values of secret-looking flags (`--x y` and `--x=y`) hidden."""
    out: list[str] = []
    hide_next = False
    for a in args:
        if hide_next:
            out.append(HIDDEN)
            hide_next = False
        elif a.startswith("-") and "=" in a and SECRET.search(a.split("=", 1)[0].lstrip("-")):
            out.append(a.split("=", 1)[0] + "=" + HIDDEN)
        elif a.startswith("-") and SECRET.search(a.lstrip("-")):
            out.append(a)
            hide_next = True
        else:
            out.append(a)
    return out


def redact_config(data: Any) -> Any:
    """A JSON-like config with secret-looking keys' values hidden, and `extra_args`/`extra_env` redacted."""
    if isinstance(data, dict):
        out: dict[str, Any] = {}
        for k, v in data.items():
            if k == "extra_args" and isinstance(v, list):
                out[k] = redact_args([str(x) for x in v])
            elif k == "extra_env" and isinstance(v, dict):
                out[k] = redact_env({str(a): str(b) for a, b in v.items()})
            elif SECRET.search(str(k)) and isinstance(v, str):
                out[k] = HIDDEN
            else:
                out[k] = redact_config(v)
        return out
    if isinstance(data, list):
        return [redact_config(x) for x in data]
    return data
