"""How the emulator counts prompts as tokens and what text it generates.

Counting (there is no tokenizer): a token-id list counts as its length; text counts as
⌈UTF-8 bytes / 4⌉ tokens (at least 1), the usual rule of thumb for BPE tokenizers on English;
a chat request counts the text of every message plus 4 template tokens per message and 3 for the
assistant turn's header. Generation is deterministic: token i of every output is the text
" t<i>", so a P/D pair returns exactly what a single instance returns. A prompt that ends with
the emulator's own first n tokens (" t0 t1 … t<n-1>") is continued at token n, the way a model
continues its own text: that is how a request recomputed elsewhere after its decode instance
died (prompt + tokens already streamed) carries on without a repeated or missing token. Its
tokenizer gives its own output tokens ids of their own (OWN_TOKEN_BASE + i), so a token-id prompt
that ends with ids OWN_TOKEN_BASE + 0 … n−1 continues at token n too.
"""

from __future__ import annotations

import re
import zlib
from functools import lru_cache
from typing import Any

BYTES_PER_TOKEN = 4
CHAT_TOKENS_PER_MESSAGE = 4
CHAT_TOKENS_FOR_REPLY = 3


def count_text(text: str) -> int:
    return max(1, -(-len(text.encode()) // BYTES_PER_TOKEN))


def count_prompt(prompt: Any) -> int | None:
    """Tokens of a completions `prompt` (text, token ids, or a one-element batch); None if invalid."""
    if isinstance(prompt, str):
        return count_text(prompt) if prompt else None
    if isinstance(prompt, list) and prompt:
        if all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in prompt):
            return len(prompt)
        if len(prompt) == 1:
            return count_prompt(prompt[0])
    return None


def count_messages(messages: Any) -> int | None:
    """Tokens of a chat `messages` list; None if it is not a non-empty list of message objects."""
    if not isinstance(messages, list) or not messages:
        return None
    total = CHAT_TOKENS_FOR_REPLY
    for m in messages:
        if not isinstance(m, dict):
            return None
        content = m.get("content") or ""
        if isinstance(content, list):  # OpenAI content parts
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        total += CHAT_TOKENS_PER_MESSAGE + (count_text(str(content)) if content else 0)
    return total


VOCAB = 32000
"""Text pieces map to ids below this (crc32 of each 4-byte piece, as /tokenize has always answered)."""
TEMPLATE_BASE = 32000
"""Ids of the chat template's own tokens (above every text id)."""
_ROLES = {"system": 1, "user": 2, "assistant": 3, "tool": 4, "developer": 5}


def text_ids(text: str) -> list[int]:
    """Stand-in token ids of a text: one per 4-byte UTF-8 piece (so ``len == count_text(text)``)."""
    raw = text.encode()
    crc = zlib.crc32
    return [crc(raw[i : i + 4]) % VOCAB for i in range(0, len(raw), 4)] or [0]


def _content(m: dict[str, Any]) -> str:
    content = m.get("content") or ""
    if isinstance(content, list):
        content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content)


def chat_ids(messages: list[Any]) -> list[int]:
    """Stand-in ids of a chat as the template renders it: per message a 4-token header (its role
    among them) and its text, then the assistant turn's 3-token header; ``len == count_messages``."""
    out: list[int] = []
    for m in messages:
        role = _ROLES.get(str(m.get("role")), 6)
        out += [TEMPLATE_BASE, TEMPLATE_BASE + 10 + role, TEMPLATE_BASE + 7, TEMPLATE_BASE + 8]
        content = _content(m)
        if content:
            out += text_ids(content)
    return out + [TEMPLATE_BASE, TEMPLATE_BASE + 10 + _ROLES["assistant"], TEMPLATE_BASE + 7]


def prompt_ids(prompt: Any) -> list[int] | None:
    """Token ids of a completions `prompt` (ids as given, text as `text_ids`); None if invalid."""
    if isinstance(prompt, str):
        return text_ids(prompt) if prompt else None
    if isinstance(prompt, list) and prompt:
        if all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in prompt):
            return list(prompt)
        if len(prompt) == 1:
            return prompt_ids(prompt[0])
    return None


@lru_cache(maxsize=65536)
def token_json(i: int) -> bytes:
    """Token i's text as a JSON string literal."""
    return b'" t%d"' % i


def output_text(n: int, start: int = 0) -> str:
    """Generated tokens start … start + n − 1."""
    return "".join(f" t{i}" for i in range(start, start + n))


OWN_TOKEN_BASE = 1_000_000
"""Id of generated token " t0" in the emulator's tokenizer (" t<i>" is OWN_TOKEN_BASE + i)."""
_OWN_TEXT = re.compile(r"(?: t\d+)+")
_LAST_TOKEN = re.compile(r" t(\d+)$")


def own_token_ids(text: str) -> list[int] | None:
    """The ids of a text made only of generated tokens (" t3 t4" → [base+3, base+4]), else None."""
    if not text or _OWN_TEXT.fullmatch(text) is None:
        return None
    return [OWN_TOKEN_BASE + int(t) for t in text.split(" t")[1:]]


def continued_from_ids(ids: list[int]) -> int:
    """n when a token-id prompt ends with the ids of the first n generated tokens, else 0."""
    if not ids or ids[-1] < OWN_TOKEN_BASE:
        return 0
    n = ids[-1] - OWN_TOKEN_BASE + 1
    return n if len(ids) >= n and ids[-n:] == list(range(OWN_TOKEN_BASE, OWN_TOKEN_BASE + n)) else 0


def continued_from(text: str) -> int:
    """n when `text` ends with the first n generated tokens (" t0 … t<n-1>"), else 0."""
    m = _LAST_TOKEN.search(text[-16:])
    if m is None:
        return 0
    n = int(m.group(1)) + 1
    return n if text.endswith(output_text(n)) else 0
