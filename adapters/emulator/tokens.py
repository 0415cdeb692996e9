"""How the emulator counts prompt text as tokens and what text it generates.

Counting: a token-id list counts as its length; text counts as ⌈UTF-8 bytes / 4⌉ (at least 1),
the usual rule of thumb for BPE tokenizers on English; chat messages count the concatenated
contents plus 4 tokens of template per message. Generation is deterministic: token i of a
request is the text " t<i>" (so outputs through a P/D pair equal single-instance outputs).
"""

from __future__ import annotations

from typing import Any

BYTES_PER_TOKEN = 4
CHAT_TEMPLATE_TOKENS = 4


def count_text(text: str) -> int:
    return max(1, -(-len(text.encode()) // BYTES_PER_TOKEN))


def count_prompt(prompt: Any) -> int | None:
    """Tokens of a completions `prompt` (text, token ids, or a one-element batch); None if invalid."""
    if isinstance(prompt, str):
        return count_text(prompt)
    if isinstance(prompt, list) and prompt:
        if all(isinstance(x, int) for x in prompt):
            return len(prompt)
        if len(prompt) == 1:
            return count_prompt(prompt[0])
    return None


def count_messages(messages: Any) -> int | None:
    if not isinstance(messages, list) or not messages:
        return None
    total = 0
    for m in messages:
        if not isinstance(m, dict):
            return None
        content = m.get("content", "")
        if isinstance(content, list):  # OpenAI content parts
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        total += count_text(str(content)) + CHAT_TEMPLATE_TOKENS
    return total


def token_text(i: int) -> str:
    return f" t{i}"
