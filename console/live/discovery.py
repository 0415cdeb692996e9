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
    db: Path | None = None
    """The run store the console records into (local consoles only)."""
    token_file: Path | None = None


def _run_file(run_id: str) -> Path:
    return runs_dir() / run_id / "console.json"


def announce(url: str, token_file: Path, run_id: str, db: Path | None = None) -> Path:
    """Say where this process's console listens: in its run directory (so `tui RUN` and `down RUN`
    find any running console) and as the machine's latest console (what commands use by default)."""
    data = json.dumps(
        {
            "url": url,
            "token_file": str(token_file),
            "run_id": run_id,
            "pid": os.getpid(),
            "db": str(db) if db is not None else None,
        }
    )
    for path in (_run_file(run_id), _file()):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(data)
    return _file()


def withdraw(run_id: str | None = None) -> None:
    """Remove this process's announcements (the latest one only if it is still this process's)."""
    if run_id is not None:
        _run_file(run_id).unlink(missing_ok=True)
    try:
        data = json.loads(_file().read_text())
    except (OSError, ValueError):
        return
    if data.get("pid") == os.getpid():
        _file().unlink(missing_ok=True)


def running() -> list[ConsoleAddress]:
    """Every local console whose process is alive, newest first (by announcement time)."""
    found: list[tuple[float, ConsoleAddress]] = []
    for path in runs_dir().glob("*/console.json"):
        try:
            data = json.loads(path.read_text())
            when = path.stat().st_mtime
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and pid_alive(int(str(data.get("pid") or 0))):
            found.append((when, _address(data, token=None)))
    return [a for _, a in sorted(found, key=lambda x: -x[0])]


def _address(data: dict[str, object], token: str | None) -> ConsoleAddress:
    run_id, pid, db = data.get("run_id"), data.get("pid"), data.get("db")
    return ConsoleAddress(
        str(data["url"]),
        token,
        str(run_id) if run_id else None,
        int(str(pid)) if pid else None,
        Path(str(db)) if db else None,
        Path(str(data["token_file"])) if data.get("token_file") else None,
    )


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


def locate(url: str | None = None, token: str | None = None, run: str | None = None) -> ConsoleAddress:
    """--url/--token if given (token also from SIBYL_TOKEN), else the local console of run `run`, else
    the machine's latest local console.

    A --url that names the local console without a token uses that console's token file."""
    token = token or os.environ.get("SIBYL_TOKEN")
    data = _local()
    if url:
        if (
            token is None
            and data is not None
            and _same_console(url, str(data.get("url", "")))
            and pid_alive(int(str(data.get("pid") or 0)))
        ):
            with contextlib.suppress(OSError):
                token = Path(str(data["token_file"])).read_text().strip()
        return ConsoleAddress(url.rstrip("/"), token)
    where = _file()
    if run is not None:
        where = _run_file(run)
        try:
            data = json.loads(where.read_text())
        except (OSError, ValueError):
            live = ", ".join(a.run_id or "?" for a in running()) or "none"
            raise ConsoleNotFound(f"no running console of run {run} on this machine (running: {live})") from None
    if data is None:
        raise ConsoleNotFound(
            f"no local console found ({where} is missing); start one with `sibyl-console up` or pass --url"
        )
    if not pid_alive(int(str(data.get("pid") or 0))):
        raise ConsoleNotFound(f"the console that wrote {where} (pid {data.get('pid')}) is not running; pass --url")
    if token is None:
        try:
            token = Path(str(data["token_file"])).read_text().strip()
        except OSError as e:
            raise ConsoleNotFound(
                f"cannot read the control token {data['token_file']}: {e.strerror}; pass --token"
            ) from None
    return _address(data, token)


def local_running() -> bool:
    """Whether a local console is announced and its process is alive."""
    data = _local()
    return data is not None and pid_alive(int(str(data.get("pid") or 0)))
