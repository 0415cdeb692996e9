"""Where the run store lives by default."""

from __future__ import annotations

import os
from pathlib import Path

from platformdirs import user_data_dir


def default_db_path() -> Path:
    """$SIBYL_DB, else <user data dir>/sibyl-console/runs.db."""
    env = os.environ.get("SIBYL_DB")
    if env:
        return Path(env)
    return Path(os.environ.get("SIBYL_HOME") or user_data_dir("sibyl-console")) / "runs.db"
