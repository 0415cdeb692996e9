"""Chat templates as transformers renders them and vLLM feeds them: the Jinja environment and the content format.

`template_environment` is transformers' (utils/chat_template_utils.py: a sandbox with trim_blocks
and lstrip_blocks, `loopcontrols`, the `{% generation %}` block, a `tojson` that does not escape
HTML, `raise_exception` and `strftime_now`). `content_format` is vLLM 0.32's detection
(renderers/hf.py `_detect_content_format`): a template that loops over a message's content gets
each message's content as OpenAI parts ("openai"), any other the text parts joined by newlines
("string").
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterator
from datetime import datetime
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

ContentFormat = Literal["string", "openai"]


class _Generation(jinja2.ext.Extension):
    """transformers' `{% generation %}` block (it marks assistant tokens for a training mask): rendered as is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def template_environment() -> ImmutableSandboxedEnvironment:
    """The Jinja environment transformers renders chat templates in."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


# --- vLLM's content-format detection, on the template's AST -----------------------------------------


def _is_var(node: jinja2.nodes.Node, name: str) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name


def _is_attr(node: jinja2.nodes.Node, name: str, key: str) -> bool:
    if isinstance(node, jinja2.nodes.Getitem):
        return _is_var(node.node, name) and isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_var(node.node, name) and node.attr == key
    return False


def _is_var_or_elems(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    """`name` (or `name.key`), possibly filtered, tested or sliced."""
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _is_var_or_elems(node.node, name, key)
    if isinstance(node, jinja2.nodes.Test):
        return _is_var_or_elems(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _is_var_or_elems(node.node, name, key)
    return _is_attr(node, name, key) if key else _is_var(node, name)


def _aliases(root: jinja2.nodes.Template, name: str) -> list[str]:
    """`name` and every variable assigned from it (transitively)."""
    out, todo = [name], deque([name])
    while todo:
        current = todo.popleft()
        for assign in root.find_all(jinja2.nodes.Assign):
            if _is_var_or_elems(assign.node, current) and isinstance(assign.target, jinja2.nodes.Name):
                out.append(assign.target.name)
                if assign.target.name != current:
                    todo.append(assign.target.name)
    return out


def _message_vars(root: jinja2.nodes.Template) -> Iterator[str]:
    """Loop variables of `{% for message in messages %}` loops (or over an alias of messages)."""
    names = _aliases(root, "messages")
    for loop in root.find_all(jinja2.nodes.For):
        if any(_is_var_or_elems(loop.iter, n) for n in names) and isinstance(loop.target, jinja2.nodes.Name):
            yield loop.target.name


def _loops_over_content(root: jinja2.nodes.Template) -> bool:
    messages = list(_message_vars(root))
    in_macros: set[int] = set()
    macro_params: dict[int, set[str]] = {}  # loops in a macro -> its parameters bound to message content
    for macro in root.find_all(jinja2.nodes.Macro):
        params = {a.name for a in macro.args}
        bound: set[str] = set()
        for call in root.find_all(jinja2.nodes.Call):
            if not (isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(macro.args) and any(_is_var_or_elems(arg, m, "content") for m in messages):
                    bound.add(macro.args[i].name)
            for kw in call.kwargs:
                if kw.key in params and any(_is_var_or_elems(kw.value, m, "content") for m in messages):
                    bound.add(kw.key)
        for loop in macro.find_all(jinja2.nodes.For):
            in_macros.add(id(loop))
            if bound:
                macro_params[id(loop)] = bound
    for loop in root.find_all(jinja2.nodes.For):
        it = loop.iter
        if any(_is_var_or_elems(it, m, "content") for m in messages):
            return True
        if isinstance(it, jinja2.nodes.Name) and it.name in macro_params.get(id(loop), set()):
            return True
        if id(loop) not in in_macros and isinstance(it, jinja2.nodes.Name) and it.name == "content":
            return True
    return False


def content_format(env: jinja2.Environment, template: str) -> ContentFormat:
    """How vLLM hands a message's content to `template`: "openai" parts or a "string"."""
    try:
        return "openai" if _loops_over_content(env.parse(template)) else "string"
    except jinja2.exceptions.TemplateError:
        return "string"
