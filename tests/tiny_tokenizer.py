"""A tiny tokenizer saved as transformers saves a model's (tokenizer.json, tokenizer_config.json with a chat
template), built with the `tokenizers` library alone: for the local-tokenization tests."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, processors

WORDS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "hello", "world", "how", "are", "you", "\n"]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>' }}\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
OPENAI_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>' }}\n"
    "{% for part in m['content'] %}{{ part['text'] }}\n{% endfor %}{% endfor %}"
)
IDS = {w: i for i, w in enumerate(WORDS)}


def tokenizer_dir(folder: Path, template: str | None = TEMPLATE, jinja_file: str | None = None) -> Path:
    """A word-level tokenizer whose post-processor prepends <s> (as Llama's), saved as transformers saves one."""
    tok = Tokenizer(models.WordLevel(vocab=IDS, unk_token="<unk>"))
    tok.add_special_tokens(["<s>", "</s>", "<unk>"])
    tok.add_tokens(["<|user|>", "<|assistant|>", "<|system|>", "\n"])
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", IDS["<s>"])])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config: dict[str, object] = {"bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "</s>"}
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja_file is not None:
        (folder / "chat_template.jinja").write_text(jinja_file)
    return folder
