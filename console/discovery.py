"""Where a local console leaves its URL, run id and token file, so CLI commands find it by themselves."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from platformdirs import user_data_dir

from adapters.pids import pid_alive
from core.errors import SibylError


class ConsoleNotFound(SibylError):
    """No running local console, and no --url given."""


def data_dir() -> Path:
    return Path(os.environ.get("SIBYL_HOME") or user_data_dir("sibyl-console"))


def runs_dir() -> Path:
    return data_dir() / "runs"


def _file() -> Path:
    return data_dir() / "console.json"


@dataclass
class ConsoleAddress:
    url: str
    token: str | None
    run_id: str | None = None
    pid: int | None = None


def announce(url: str, token_file: Path, run_id: str) -> Path:
    path = _file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"url": url, "token_file": str(token_file), "run_id": run_id, "pid": os.getpid()}))
    return path


def withdraw() -> None:
    try:
        data = json.loads(_file().read_text())
    except (OSError, ValueError):
        return
    if data.get("pid") == os.getpid():
        _file().unlink(missing_ok=True)


def locate(url: str | None = None, token: str | None = None) -> ConsoleAddress:
    """--url/--token if given (token also from SIBYL_TOKEN), else the local console's announcement."""
    token = token or os.environ.get("SIBYL_TOKEN")
    if url:
        return ConsoleAddress(url.rstrip("/"), token)
    try:
        data = json.loads(_file().read_text())
    except (OSError, ValueError):
        raise ConsoleNotFound(f"no local console found ({_file()} is missing); start one with `sibyl-console up` or pass --url") from None
    if not pid_alive(int(data.get("pid", 0))):
        raise ConsoleNotFound(f"the console that wrote {_file()} (pid {data.get('pid')}) is not running; pass --url")
    if token is None:
        try:
            token = Path(data["token_file"]).read_text().strip()
        except OSError as e:
            raise ConsoleNotFound(f"cannot read the control token {data['token_file']}: {e.strerror}; pass --token") from None
    return ConsoleAddress(data["url"], token, data.get("run_id"), data.get("pid"))
