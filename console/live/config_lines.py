"""Where a configuration error is: the line of a key (as pydantic locates it) in a TOML or YAML file's text."""

from __future__ import annotations

import re

import yaml

_TOML_PART = r"""(?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*')"""
_TOML_KEY = re.compile(rf"^\s*({_TOML_PART}(?:\s*\.\s*{_TOML_PART})*)\s*=")


def _toml_parts(dotted: str) -> list[str]:
    return [p.strip().strip("\"'") for p in re.findall(r"""[A-Za-z0-9_-]+|"[^"]*"|'[^']*'""", dotted)]


def line_of(text: str, loc: tuple[str | int, ...], suffix: str) -> int | None:
    """The 1-based line of the key at `loc` (as pydantic reports it: keys and list indices) in a TOML or
    YAML file's text; the line of the deepest part found (an inline table's line for a key in it)."""
    if not loc:
        return None
    if suffix in (".yaml", ".yml"):
        return _yaml_line(text, loc)
    want = tuple(str(x) for x in loc)
    best, best_len = None, 0
    table: list[str] = []
    arrays: dict[tuple[str, ...], int] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if line.startswith("[["):
            name = tuple(_toml_parts(line.strip("[] ")))
            arrays[name] = arrays.get(name, -1) + 1
            table = [*name, str(arrays[name])]
            path = table
        elif line.startswith("["):
            name = tuple(_toml_parts(line.strip("[] ")))
            head = next((k for k in arrays if name[: len(k)] == k), None)  # a sub-table of an array's last entry
            table = [*head, str(arrays[head]), *name[len(head) :]] if head else list(name)
            path = table
        elif (m := _TOML_KEY.match(raw)) is not None:
            path = [*table, *_toml_parts(m.group(1))]
        else:
            continue
        k = 0
        while k < min(len(path), len(want)) and path[k] == want[k]:
            k += 1
        if k == len(path) and k > best_len:
            best, best_len = n, k
    return best


def _yaml_line(text: str, loc: tuple[str | int, ...]) -> int | None:
    try:
        node = yaml.compose(text)
    except yaml.YAMLError:
        return None
    line = None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            found = next(((k, v) for k, v in node.value if str(k.value) == str(part)), None)
            if found is None:
                break
            line, node = found[0].start_mark.line + 1, found[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            break
    return line
