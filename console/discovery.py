"""Where a local console leaves its URL, run id and token file, so CLI commands find it by themselves."""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from platformdirs import user_data_dir

from adapters.pids import pid_alive
from console.errors import ConsoleError


class ConsoleNotFound(ConsoleError):
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


def _local() -> dict[str, object] | None:
    """The running local console's announcement, or None."""
    try:
        data = json.loads(_file().read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _same_console(a: str, b: str) -> bool:
    """Whether two URLs name the same console (localhost and 127.0.0.1 alike, trailing slash ignored)."""
    def norm(u: str) -> str:
        return u.rstrip("/").replace("://localhost:", "://127.0.0.1:")

    return norm(a) == norm(b)


def locate(url: str | None = None, token: str | None = None) -> ConsoleAddress:
    """--url/--token if given (token also from SIBYL_TOKEN), else the local console's announcement.

    A --url that names the local console without a token uses that console's token file."""
    token = token or os.environ.get("SIBYL_TOKEN")
    data = _local()
    if url:
        if token is None and data is not None and _same_console(url, str(data.get("url", ""))) and pid_alive(int(str(data.get("pid") or 0))):
            with contextlib.suppress(OSError):
                token = Path(str(data["token_file"])).read_text().strip()
        return ConsoleAddress(url.rstrip("/"), token)
    if data is None:
        raise ConsoleNotFound(f"no local console found ({_file()} is missing); start one with `sibyl-console up` or pass --url")
    if not pid_alive(int(str(data.get("pid") or 0))):
        raise ConsoleNotFound(f"the console that wrote {_file()} (pid {data.get('pid')}) is not running; pass --url")
    if token is None:
        try:
            token = Path(str(data["token_file"])).read_text().strip()
        except OSError as e:
            raise ConsoleNotFound(f"cannot read the control token {data['token_file']}: {e.strerror}; pass --token") from None
    run_id = data.get("run_id")
    pid = data.get("pid")
    return ConsoleAddress(str(data["url"]), token, str(run_id) if run_id else None, int(str(pid)) if pid else None)


def local_running() -> bool:
    """Whether a local console is announced and its process is alive."""
    data = _local()
    return data is not None and pid_alive(int(str(data.get("pid") or 0)))
