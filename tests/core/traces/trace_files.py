"""The trace tests' files: committed slices and fixtures under tests/data/traces, the complete traces in
../shared/traces (and a mark that skips a test when they are absent), and helpers that read and write trace files."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from core.traces import Trace, read_trace

SHARED = Path(__file__).resolve().parents[4] / "shared" / "traces"
DATA = Path(__file__).resolve().parents[2] / "data" / "traces"
AZURE = SHARED / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv"
MOONCAKE_CONV = SHARED / "mooncake_fast25" / "conversation_trace.jsonl"
MOONCAKE_SYN = SHARED / "mooncake_fast25" / "synthetic_trace.jsonl"
SERVEGEN = SHARED / "servegen_deepseek_r1"
SERVEGEN_SAMPLE = DATA / "servegen_sample"
# committed slices of the real traces (first rows / a few whole ServeGen clients)
AZURE_SLICE = DATA / "azure_conv_first1000.csv"
MOONCAKE_CONV_SLICE = DATA / "mooncake_conversation_first500.jsonl"
MOONCAKE_SYN_SLICE = DATA / "mooncake_synthetic_first500.jsonl"
SERVEGEN_SLICE = DATA / "servegen_deepseek_r1_slice"
SERVEGEN_SLICE_CLIENTS = (25, 33, 39)

needs_shared = pytest.mark.skipif(
    not SHARED.is_dir(),
    reason=f"optional full-trace check: {SHARED} is absent (the slices under tests/data cover it)",
)


def timed_read(path: Path, **kwargs: object) -> tuple[Trace, float]:
    """The trace `read_trace` reads from `path`, and the seconds the read took."""
    t0 = time.perf_counter()
    trace = read_trace(path, **kwargs)  # type: ignore[arg-type]
    return trace, time.perf_counter() - t0


def write_bytes(tmp: str, name: str, data: bytes) -> Path:
    """`data` written to the file `name` in the folder `tmp`."""
    path = Path(tmp) / name
    path.write_bytes(data)
    return path
