"""The SQLite run store: runs, requests, policy events, instance samples and events, advisor events."""

from adapters.store.paths import default_db_path
from adapters.store.recorder import RunRecorder
from adapters.store.schema import ADVISOR_EVENTS
from adapters.store.store import RunInfo, RunStore, StoreError

__all__ = ["ADVISOR_EVENTS", "RunInfo", "RunRecorder", "RunStore", "StoreError", "default_db_path"]
