"""The gateway's local tokenizer (adapters/tokenizer.py) on a tokenizer the test builds: text prompts with the
post-processor's BOS, chats through the chat template (transformers' environment, vLLM's content formats) with
no second BOS, what it declines, and the console's prefix keys from it (console/live/prefix.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from adapters.tokenizer import LocalTokenizer
from console.live.config import PrefixSettings
from console.live.prefix import PrefixIndex, default_tokenizer
from core.cache.keys import chain_keys
from core.dispatch import Dispatcher
from core.perf import get_profile
from tests.tiny_tokenizer import IDS, OPENAI_TEMPLATE, TEMPLATE, tokenizer_dir


def _ids(*words: str) -> list[int]:
    return [IDS[w] for w in words]


def test_a_text_prompt_gets_the_bos_of_the_post_processor(tmp_path: Path) -> None:
    tok = LocalTokenizer.load(tokenizer_dir(tmp_path))
    assert tok.token_ids({"prompt": "hello world"}) == _ids("<s>", "hello", "world")
    assert tok.token_ids({"prompt": ["hello world"]}) == _ids("<s>", "hello", "world")
    assert tok.token_ids({"prompt": "hello", "add_special_tokens": False}) == _ids("hello")
    assert tok.token_ids({"prompt": [1, 2]}) is None  # token ids are not this module's business


def test_a_chat_renders_its_template_once_with_one_bos(tmp_path: Path) -> None:
    tok = LocalTokenizer.load(tokenizer_dir(tmp_path))
    messages = [{"role": "user", "content": "hello world"}]
    assert tok.render_chat(messages) == "<s><|user|>\nhello world\n<|assistant|>\n"
    assert tok.token_ids({"messages": messages}) == _ids(
        "<s>", "<|user|>", "\n", "hello", "world", "\n", "<|assistant|>", "\n"
    )
    no_prompt = tok.token_ids({"messages": messages, "add_generation_prompt": False})
    assert no_prompt == _ids("<s>", "<|user|>", "\n", "hello", "world", "\n")
    # text parts are joined by newlines for a template that reads content as a string (vLLM's "string" format)
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]}]
    assert tok.render_chat(parts) == "<s><|user|>\nhello\nworld\n<|assistant|>\n"


def test_a_template_that_loops_over_content_gets_the_openai_parts(tmp_path: Path) -> None:
    tok = LocalTokenizer.load(tokenizer_dir(tmp_path, OPENAI_TEMPLATE))
    assert tok.format == "openai"
    assert tok.render_chat([{"role": "user", "content": "how are you"}]) == "<s><|user|>\nhow are you\n"


def test_chat_template_jinja_wins_over_tokenizer_config_and_a_file_path_loads_its_folder(tmp_path: Path) -> None:
    folder = tokenizer_dir(tmp_path, TEMPLATE, jinja_file="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    tok = LocalTokenizer.load(folder / "tokenizer.json")
    assert tok.render_chat([{"role": "user", "content": "hello"}]) == "hello"
    assert tok.source == str(folder / "tokenizer.json")


def test_what_it_cannot_reproduce_exactly_goes_to_the_instance(tmp_path: Path) -> None:
    tok = LocalTokenizer.load(tokenizer_dir(tmp_path))
    user = {"role": "user", "content": "hello"}
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
    declined = [
        {"messages": [user], "tools": [{"type": "function", "function": {"name": "f"}}]},
        {"messages": [user], "continue_final_message": True},
        {"messages": [user], "chat_template": "{{ messages }}"},
        {"messages": [image]},
        {"messages": [{"role": "assistant", "content": None, "tool_calls": []}]},
        {"messages": "hello"},
    ]
    assert [tok.token_ids(b) for b in declined] == [None] * len(declined)
    bad_template = LocalTokenizer.load(tokenizer_dir(tmp_path / "raises", "{{ raise_exception('no system role') }}"))
    assert bad_template.token_ids({"messages": [user]}) is None
    without = LocalTokenizer.load(tokenizer_dir(tmp_path / "none", None))
    assert without.token_ids({"messages": [user]}) is None and without.token_ids({"prompt": "hello"}) == _ids(
        "<s>", "hello"
    )


def _index(tmp_path: Path, tokenize: str, tokenizer: str | None) -> PrefixIndex:
    dispatcher = Dispatcher(get_profile("h20-qwen3-32b"), "prefix_aware", {})
    settings = PrefixSettings(source="approximate", tokenize=tokenize, block_size=2)  # type: ignore[arg-type]
    return PrefixIndex(settings, dispatcher, 16, tokenizer)


def test_the_console_keys_text_and_chat_prompts_locally_without_an_await(tmp_path: Path) -> None:
    folder = str(tokenizer_dir(tmp_path))
    index = _index(tmp_path, "auto", folder)
    body = {"prompt": "hello world how are you"}
    assert index.known_keys(body) == tuple(chain_keys(_ids("<s>", "hello", "world", "how", "are", "you"), 2))
    chat = {"messages": [{"role": "user", "content": "hello"}]}
    assert index.known_keys(chat) == tuple(chain_keys(LocalTokenizer.load(folder).token_ids(chat) or [], 2))
    assert index.known_keys(body, tokenize=False) == ()  # a cache-blind policy: no tokenizing at all
    declined = {"messages": [{"role": "user", "content": "hello"}], "tools": [{"type": "function"}]}
    assert index.known_keys(declined) is None  # auto: the instance's /tokenize
    snap = index.snapshot()
    assert snap["tokenizer"] == str(Path(folder) / "tokenizer.json") and snap["local_tokenize_ms_mean"] > 0
    assert _index(tmp_path, "local", folder).known_keys(declined) == ()  # local only: unkeyed
    assert _index(tmp_path, "instance", folder).known_keys(body) is None  # always the instance
    assert _index(tmp_path, "auto", None).known_keys(body) is None  # no tokenizer known
    with pytest.raises(ValueError, match="does not load"):
        PrefixIndex(
            PrefixSettings(tokenizer=str(tmp_path / "missing")),
            Dispatcher(get_profile("h20-qwen3-32b"), "sibyl", {}),
            16,
        )


def test_backend_vllm_defaults_to_the_model_directorys_tokenizer(tmp_path: Path) -> None:
    folder = str(tokenizer_dir(tmp_path))
    assert default_tokenizer("vllm", folder, []) == folder
    assert default_tokenizer("vllm", folder, ["--tokenizer=other"]) is None  # vLLM loads another one
    assert default_tokenizer("vllm", folder, ["--chat-template", "t.jinja"]) is None
    assert default_tokenizer("emulator", folder, []) is None
    assert default_tokenizer("vllm", "meta-llama/Llama-3.1-8B", []) is None  # a hub id: /tokenize
