"""The live console's config: TOML/YAML files, flag overrides, clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from console.live.config import load_config, parse_attach
from core.errors import ConfigError


def test_toml_file_with_flag_overrides(tmp_path: Path) -> None:
    f = tmp_path / "console.toml"
    f.write_text(
        'prefill = 1\ndecode = 8\npolicy = "least_load"\nparams = { by = "tokens" }\n'
        "[slo.interactive]\nttft_s = 0.5\ntpot_s = 0.05\n"
    )
    cfg = load_config(f, {"decode": 3, "port": None})
    assert (cfg.prefill, cfg.decode, cfg.policy, cfg.params, cfg.port) == (1, 3, "least_load", {"by": "tokens"}, 8000)
    assert cfg.slo["interactive"].ttft_s == 0.5 and cfg.slo["default"].tpot_s == 0.1


def test_yaml_file(tmp_path: Path) -> None:
    f = tmp_path / "console.yaml"
    f.write_text("backend: vllm\nattach:\n  prefill: [http://10.0.0.1:8100]\n  decode: [http://10.0.0.2:8200]\n")
    cfg = load_config(f, {})
    assert cfg.attach == {"prefill": ["http://10.0.0.1:8100"], "decode": ["http://10.0.0.2:8200"]}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("prefil = 2\n", "field 'prefil': Extra inputs are not permitted (allowed keys: backend, prefill"),
        ("decode = 0\n", "field 'decode'"),
        ('backend = "tpu"\n', "field 'backend'"),
        ("attach = { gpu = ['http://x'] }\n", "unknown role"),
        ("prefill = [\n", "invalid TOML"),
    ],
)
def test_bad_files_name_the_file_and_field(tmp_path: Path, text: str, message: str) -> None:
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match="bad.toml") as e:
        load_config(f, {})
    assert message in str(e.value)


def test_attach_syntax() -> None:
    assert parse_attach("prefill=http://a:1,http://b:2;decode=http://c:3") == {
        "prefill": ["http://a:1", "http://b:2"],
        "decode": ["http://c:3"],
    }
    with pytest.raises(ConfigError, match="role=URL"):
        parse_attach("http://a:1")
    with pytest.raises(ConfigError, match=r"\.toml, \.yaml"):
        load_config(Path(__file__), {})
