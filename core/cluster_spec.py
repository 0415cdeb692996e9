"""Parse cluster shapes like "4P64D" (prefill and decode instance counts)."""

from __future__ import annotations

import re

from core.errors import ConfigError

_SHAPE = re.compile(r"^\s*(\d+)\s*[pP]\s*(\d+)\s*[dD]\s*$")


def parse_cluster(text: str) -> tuple[int, int]:
    """ "4P64D" → (4, 64); both counts must be at least 1."""
    m = _SHAPE.match(text)
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise ConfigError(f"--cluster {text!r}: expected <prefill>P<decode>D with counts >= 1, e.g. 4P64D")
    return int(m.group(1)), int(m.group(2))
