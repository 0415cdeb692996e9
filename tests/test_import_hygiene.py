"""core/ stays pure: importing all of it loads no UI, HTTP or database library."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import core

BANNED = ["textual", "rich", "typer", "httpx", "starlette", "fastapi", "uvicorn", "sqlmodel", "sqlalchemy", "plotext"]


def test_core_imports_no_ui_http_or_db_library() -> None:
    modules = [m.name for m in pkgutil.walk_packages(core.__path__, "core.")]
    assert "core.sim.engine" in modules and "core.policies.sibyl" in modules
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"print(','.join(b for b in {BANNED!r} if b in sys.modules))\n"
    )
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, check=True)
    assert out.stdout.strip() == "", f"core/ pulled in: {out.stdout.strip()}"
