"""The engine's tokenizer inside the gateway: a model's tokenizer.json and chat template, applied as vLLM does.

vLLM's `/tokenize` (and its completions and chat endpoints) encode a text prompt with the model's
tokenizer and `add_special_tokens=True`, and a chat by rendering the tokenizer's chat template
(transformers' Jinja environment, `add_generation_prompt` true unless asked otherwise, the special
tokens as template variables) and encoding the result with `add_special_tokens=False`: a template
that wants a BOS writes `{{ bos_token }}` itself. `LocalTokenizer` does the same with the
`tokenizers` library and jinja2, without transformers or a round trip to an instance. What it cannot
reproduce exactly (tool calls, multimodal parts, `continue_final_message`, a request's own template)
it declines (`None`), and the caller asks an instance's `/tokenize` instead. Wrong ids would only
cost cache hits, never a wrong answer: the engine tokenizes the request itself.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import Tokenizer

from adapters.chat_template import ContentFormat, content_format, template_environment

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
"""transformers' special-token attributes, passed to the chat template as variables."""
BILLING_HEADER = "x-anthropic-billing-header"
"""vLLM drops a system text part starting with this (Claude Code's per-request header): not done here."""
DECLINED_FIELDS = ("chat_template", "continue_final_message", "documents", "tools", "mm_processor_kwargs")
"""Chat body fields that change the rendering in ways this module does not reproduce (the instance does)."""


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


class LocalTokenizer:
    """A model's tokenizer and chat template, giving the token ids vLLM's `/tokenize` gives."""

    def __init__(self, tokenizer: Tokenizer, config: dict[str, Any], chat_template: str | None, source: str) -> None:
        self.tokenizer = tokenizer
        self.source = source
        """Where it was loaded from (for `status`)."""
        tokenizer.no_truncation()
        tokenizer.no_padding()
        tokenizer.encode("warm up")  # the library's first encode sets things up: not on a request's path
        named = config.get("extra_special_tokens")  # transformers 5: a dict of named extras joins the variables
        names = [*SPECIAL_TOKEN_NAMES, *(named if isinstance(named, dict) else ())]
        self.special: dict[str, str] = {}
        """The special tokens transformers passes to the template (`special_tokens_map`)."""
        for name in names:
            text = _token_text(config.get(name, named.get(name) if isinstance(named, dict) else None))
            if text is not None:
                self.special[name] = text
        self.env = template_environment()
        self.template_text = chat_template
        self.template = self.env.from_string(chat_template) if chat_template else None
        self.format: ContentFormat = content_format(self.env, chat_template) if chat_template else "string"
        """How messages' content reaches the template (vLLM's detection)."""
        self.developer_role = chat_template is not None and (
            '"developer"' in chat_template or "'developer'" in chat_template
        )
        """Whether the template knows the developer role (vLLM rewrites it to system otherwise: not done here)."""

    @classmethod
    def load(cls, path: str | Path) -> LocalTokenizer:
        """From a model directory (tokenizer.json, tokenizer_config.json, chat_template.jinja) or a
        tokenizer.json file (the files beside it are read too). Raises OSError or ValueError."""
        p = Path(path).expanduser()
        folder, file = (p, p / "tokenizer.json") if p.is_dir() else (p.parent, p)
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {p}")
        tokenizer = Tokenizer.from_file(str(file))
        config: dict[str, Any] = {}
        if (folder / "tokenizer_config.json").is_file():
            config = json.loads((folder / "tokenizer_config.json").read_text())
        if (folder / "special_tokens_map.json").is_file():  # legacy files: merged under tokenizer_config's
            for name, value in json.loads((folder / "special_tokens_map.json").read_text()).items():
                config.setdefault(name, value)
        template = config.get("chat_template")
        if (folder / "chat_template.jinja").is_file():  # what transformers saves since 4.43, and prefers
            template = (folder / "chat_template.jinja").read_text()
        elif isinstance(template, list):  # named templates: the default one (tools are declined anyway)
            template = next(
                (t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None
            )
        return cls(tokenizer, config, template if isinstance(template, str) else None, str(file))

    # --- text ---------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    # --- chat ---------------------------------------------------------------------------------
    def render_chat(self, messages: Sequence[Any], add_generation_prompt: bool = True, **kwargs: Any) -> str | None:
        """The chat rendered as the engine renders it, or None when it would not be exact here."""
        if self.template is None:
            return None
        conversation = self.conversation(messages)
        if conversation is None:
            return None
        variables = {**self.special, **kwargs}
        variables.update(messages=conversation, tools=None, documents=None, add_generation_prompt=add_generation_prompt)
        return self.template.render(**variables)

    def conversation(self, messages: Sequence[Any]) -> list[dict[str, Any]] | None:
        """Messages as vLLM hands them to the template: text parts joined by newlines ("string") or a
        list of text parts ("openai"); None for anything else (images, tool calls, tool results)."""
        out = []
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or set(m) - {"role", "content", "name"}:
                return None
            if m["role"] == "developer" and not self.developer_role:
                return None
            content = m.get("content")
            if content is None:
                texts: list[str] = []
            elif isinstance(content, str):
                texts = [content]
            elif isinstance(content, list) and all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                texts = [p["text"] for p in content]
            else:
                return None
            if m["role"] == "system" and any(t.startswith(BILLING_HEADER) for t in texts):
                return None
            msg: dict[str, Any] = {"role": m["role"]}
            msg["content"] = (
                "\n".join(texts) if self.format == "string" else [{"type": "text", "text": t} for t in texts]
            )
            if isinstance(m.get("name"), str):
                msg["name"] = m["name"]
            out.append(msg)
        return out

    # --- a request body -----------------------------------------------------------------------
    def token_ids(self, body: dict[str, Any]) -> list[int] | None:
        """The ids the engine will compute for a completions or chat body with a text prompt or
        messages; None when this tokenizer cannot say (the caller asks `/tokenize`)."""
        if "messages" in body:
            messages, kwargs = body["messages"], body.get("chat_template_kwargs") or {}
            if any(body.get(k) for k in (*DECLINED_FIELDS, "add_special_tokens")):
                return None  # add_special_tokens: vLLM 0.32 tokenizes inside apply_chat_template, without them
            if (
                not isinstance(messages, list)
                or not isinstance(kwargs, dict)
                or {"chat_template", "tokenize"} & set(kwargs)
            ):
                return None
            try:
                text = self.render_chat(messages, bool(body.get("add_generation_prompt", True)), **kwargs)
            except (jinja2.exceptions.TemplateError, TypeError, ValueError):
                return None  # the engine answers this request with its own error
            return None if text is None else self.encode(text, add_special_tokens=False)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.encode(prompt, add_special_tokens=bool(body.get("add_special_tokens", True)))
        return None
