"""Secrets stay out of what is stored and logged; binding wider than loopback is a deliberate act."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx

from adapters.ports import is_loopback
from adapters.redact import redact_args, redact_config, redact_env
from adapters.store import RunStore
from tests.procs import FIXED_PROFILE, kill_children, start_console


def test_secret_flags_and_variables_are_hidden_and_nothing_else() -> None:
    assert redact_args(["--admin-token", "abc", "--max-num-batched-tokens", "8192", "--api-key=zz", "-x", "1"]) == [
        "--admin-token",
        "***",
        "--max-num-batched-tokens",
        "8192",
        "--api-key=***",
        "-x",
        "1",
    ]
    assert redact_env({"HF_TOKEN": "hf_x", "VLLM_CPU_KVCACHE_SPACE": "1", "MAX_TOKENS": "3"}) == {
        "HF_TOKEN": "***",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "MAX_TOKENS": "3",
    }
    assert redact_config(
        {"a": {"password": "p", "max_num_batched_tokens": 8}, "vllm": {"extra_env": {"HF_TOKEN": "s"}}}
    ) == {"a": {"password": "***", "max_num_batched_tokens": 8}, "vllm": {"extra_env": {"HF_TOKEN": "***"}}}


def test_loopback_addresses() -> None:
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.5.0.1", "::1", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.5", "gateway.example"))


def test_tokens_never_reach_the_run_store_and_the_token_file_is_private(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        f'prefill = 1\ndecode = 1\nprofile = "{FIXED_PROFILE}"\n'
        '[emulator]\nextra_args = ["--admin-token", "s3cret-admin"]\n'
    )
    con = start_console(tmp_path, str(cfg))
    try:
        url = con.state()["instances"][1]["url"]
        assert httpx.get(url + "/admin/info", timeout=5).status_code == 401  # the token is in force
        assert (
            httpx.get(url + "/admin/info", headers={"Authorization": "Bearer s3cret-admin"}, timeout=5).status_code
            == 200
        )
        con.stop()
        run = RunStore(con.db).get_run(con.run_id)
        assert json.dumps(run.config).count("s3cret") == 0 and "***" in json.dumps(run.config)
        assert con.token not in Path(con.db).read_bytes().decode(errors="replace")
        assert oct(os.stat(con.run_dir / "token").st_mode & 0o777) == "0o600"
    finally:
        con.stop()
        kill_children(con.home)
