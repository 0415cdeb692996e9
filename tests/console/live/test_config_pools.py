"""`[[pools]]` and `[lora]` in the console's configuration: one pool entry stands for the top-level cluster, adapters
are checked where they are defined, and what does not load names the file, the line and the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from console.live.config import load_config, parse_lora_adapters
from core.errors import ConfigError


def adapter(root: Path, name: str) -> Path:
    d = root / name
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"r": 8}))
    return d


def write(tmp: Path, name: str, text: str) -> Path:
    path = tmp / name
    path.write_text(text)
    return path


def test_one_pool_is_the_consoles_cluster_and_its_adapters_join_lora(tmp_path: Path) -> None:
    sql, chat = adapter(tmp_path, "sql"), adapter(tmp_path, "chat")
    path = write(
        tmp_path,
        "c.toml",
        f'[lora]\nadapters = {{ chat = "{chat}" }}\n\n[[pools]]\nmodel = "llama"\nprefill = 1\ndecode = 3\n'
        f'profile = "cpu-tiny-llama"\n[pools.adapters]\nsql = "{sql}"\n',
    )
    cfg = load_config(path, {})
    assert (cfg.served_model_name, cfg.prefill, cfg.decode, cfg.profile) == ("llama", 1, 3, "cpu-tiny-llama")
    assert cfg.pool_name == "llama" and cfg.lora.adapters == {"chat": str(chat), "sql": str(sql)}
    assert cfg.emulator.enable_lora  # adapters configured: emulated instances serve LoRA
    assert load_config(None, {}).pool_name == "sibyl-model" and not load_config(None, {}).emulator.enable_lora


def test_a_bad_pool_field_names_the_file_line_and_field(tmp_path: Path) -> None:
    path = write(tmp_path, "c.toml", '[[pools]]\nmodel = "a"\n\n[[pools]]\nmodel = "b"\nprefill = 0\n')
    with pytest.raises(ConfigError, match=r"c\.toml:6: field 'pools\.1\.prefill': Input should be greater"):
        load_config(path, {})
    path = write(tmp_path, "c.toml", '[[pools]]\nmodel = "a"\nreplicas = 2\n')
    with pytest.raises(ConfigError, match=r"c\.toml:3: field 'pools\.0\.replicas': Extra inputs"):
        load_config(path, {})
    path = write(tmp_path, "c.yaml", "pools:\n  - model: a\n  - model: b\n    decode: x\n")
    with pytest.raises(ConfigError, match=r"c\.yaml:4: field 'pools\.1\.decode'"):
        load_config(path, {})


def test_names_used_twice_name_the_pool_entry(tmp_path: Path) -> None:
    path = write(tmp_path, "c.toml", '[[pools]]\nmodel = "a"\n\n[[pools]]\nname = "a"\nmodel = "b"\n')
    with pytest.raises(ConfigError, match=r"c\.toml:4: field 'pools\.1': .*pool name 'a' is already a pool name"):
        load_config(path, {})


def test_an_adapter_without_its_config_names_the_file_line_and_adapter(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    path = write(tmp_path, "c.toml", f'backend = "emulator"\n[lora]\nadapters = {{ sql = "{empty}" }}\n')
    with pytest.raises(ConfigError, match=r"c\.toml:3: field 'lora\.adapters': .*adapter 'sql': .* no adapter_config"):
        load_config(path, {})
    path = write(tmp_path, "c.toml", f'[[pools]]\nmodel = "a"\n[pools.adapters]\nok = "{empty}"\nbad = "/nowhere"\n')
    with pytest.raises(ConfigError, match=r"c\.toml:4: field 'pools\.0\.adapters': Value error, adapter 'ok'"):
        load_config(path, {})


def test_lora_adapter_flags(tmp_path: Path) -> None:
    assert parse_lora_adapters(["a=/x", " b = /y "]) == {"a": "/x", "b": "/y"}
    with pytest.raises(ConfigError, match="expected NAME=PATH"):
        parse_lora_adapters(["/just/a/path"])
    sql = adapter(tmp_path, "sql")
    cfg = load_config(None, {"lora.adapters": {"sql": str(sql)}, "lora.max_loras": 3})
    assert cfg.lora.adapters == {"sql": str(sql)} and cfg.max_loras() == 3


def test_the_slots_per_instance_follow_the_engines_flags() -> None:
    assert load_config(None, {"emulator.max_loras": 2}).max_loras() == 2
    assert load_config(None, {"emulator.max_loras": 2, "emulator.max_cpu_loras": 5}).max_loras() == 5
    vllm = {"backend": "vllm", "vllm.extra_args": ["--enable-lora", "--max-loras", "4"]}
    assert load_config(None, vllm).max_loras() == 4
    assert load_config(None, {**vllm, "vllm.extra_args": ["--max-cpu-loras=6"]}).max_loras() == 6
    assert load_config(None, {"backend": "vllm"}).max_loras() == 1


def test_the_advisor_pool_is_one_of_the_pools_and_a_wrong_one_names_the_file_line_and_pools(tmp_path: Path) -> None:
    pools = '[[pools]]\nmodel = "a"\n\n[[pools]]\nmodel = "org/b"\nname = "b"\n'
    assert load_config(write(tmp_path, "c.toml", f'[advisor]\npool = "b"\n\n{pools}'), {}).advisor.pool == "b"
    assert load_config(write(tmp_path, "c.toml", pools), {}).advisor.pool is None  # the first pool's
    path = write(tmp_path, "c.toml", f'[advisor]\nenabled = true\npool = "org/b"\n\n{pools}')  # a model, not a name
    with pytest.raises(ConfigError, match=r"c\.toml:3: field 'advisor\.pool': .*no pool 'org/b'; pools: a, b$"):
        load_config(path, {})
    one = write(tmp_path, "one.toml", '[advisor]\npool = "x"\n')  # one pool: the served model's name
    with pytest.raises(ConfigError, match=r"one\.toml:2: field 'advisor\.pool': .*pools: sibyl-model$"):
        load_config(one, {})
    assert load_config(write(tmp_path, "ok.toml", '[advisor]\npool = "m"\n'), {"served_model_name": "m"}).advisor.pool
