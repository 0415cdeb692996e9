"""Readers for request-trace files (Mooncake JSONL, Azure 2023 CSV, BurstGPT CSV) and format detection."""

from __future__ import annotations

import csv
import io
import json
import math
import re
from collections.abc import Callable
from datetime import date
from pathlib import Path
from typing import Any

import numpy as np

from core.errors import TraceError
from core.traces.lora import adapter_value
from core.traces.model import Trace

FORMATS = ("mooncake", "azure", "burstgpt", "servegen")

_FORMAT_HELP = (
    "mooncake (JSON Lines with timestamp/input_length/output_length), "
    "azure (CSV header TIMESTAMP,ContextTokens,GeneratedTokens), "
    "burstgpt (CSV header with Timestamp, Request tokens, Response tokens), "
    "servegen (a folder of chunk-<id>-trace.csv + chunk-<id>-dataset.json)"
)

_SERVEGEN_FILE = re.compile(r"^chunk-(\d+)-(trace\.csv|dataset\.json)$")

_INT64_MAX = 2**63 - 1
"""Token counts live in int64 columns: a larger count is an error in the row, not an overflow."""


# -- shared helpers --------------------------------------------------------------------------


def _row_error(path: Path, line: int, field: str, message: str) -> TraceError:
    return TraceError(f"{path.name}:{line}: field '{field}': {message}")


def _read_text(path: Path) -> str:
    """The whole file as text; TraceError if it is missing, unreadable, not UTF-8 or empty."""
    if not path.exists():
        raise TraceError(f"trace file not found: {path}")
    if path.is_dir():
        raise TraceError(f"{path} is a folder, not a trace file")
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    except OSError as exc:
        raise TraceError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    if not text.strip():
        raise TraceError(f"{path}: file is empty")
    return text


def _parse_positive_int(raw: str, path: Path, line: int, field: str) -> int:
    text = raw.strip()
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= _INT64_MAX:
        raise _row_error(path, line, field, f"expected a positive integer, got {raw!r}")
    return value


def _parse_nonnegative_int(raw: str, path: Path, line: int, field: str) -> int:
    text = raw.strip()
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= _INT64_MAX:
        raise _row_error(path, line, field, f"expected a non-negative integer, got {raw!r}")
    return value


def _parse_seconds(raw: str, path: Path, line: int, field: str) -> float:
    try:
        value = float(raw.strip())
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise _row_error(path, line, field, f"expected a non-negative number of seconds, got {raw!r}")
    return value


def _parse_lora(raw: object, path: Path, line: int) -> str | None:
    """A row's `lora` value (core/traces/lora.py): the adapter, or None for the base model."""
    try:
        return adapter_value(raw)
    except ValueError as exc:
        raise _row_error(path, line, "lora", str(exc)) from None


def _csv_lora(row: list[str], index: int, path: Path, line: int) -> str | None:
    """A CSV row's adapter: its `lora` cell (a row ending before that column, or a file without it: the base model)."""
    return _parse_lora(row[index], path, line) if 0 <= index < len(row) else None


def _sorted_order(arrivals: np.ndarray) -> np.ndarray | None:
    """A stable sorting permutation, or None when the arrivals are already non-decreasing."""
    if len(arrivals) < 2 or bool(np.all(np.diff(arrivals) >= 0)):
        return None
    return np.argsort(arrivals, kind="stable")


def _build(
    name: str,
    path: Path,
    arrivals: list[float],
    prompts: list[int],
    outputs: list[int],
    hash_ids: list[list[int]] | None = None,
    note: str = "",
    skipped: int = 0,
    lora: list[str | None] | None = None,
) -> Trace:
    """A trace re-based so the first arrival is 0.0, stably sorted when the file was not; `lora` is kept
    when any row names an adapter."""
    if lora is not None and not any(lora):
        lora = None
    arr = np.asarray(arrivals, dtype=np.float64)
    p = np.asarray(prompts, dtype=np.int64)
    o = np.asarray(outputs, dtype=np.int64)
    order = _sorted_order(arr)
    if order is not None:
        arr, p, o = arr[order], p[order], o[order]
        if hash_ids is not None:
            hash_ids = [hash_ids[int(i)] for i in order]
        if lora is not None:
            lora = [lora[int(i)] for i in order]
        note = f"{note}; rows re-sorted by arrival" if note else "rows re-sorted by arrival"
    if len(arr):
        arr = arr - arr[0]
    source = str(path) + (f" ({note})" if note else "")
    return Trace(
        name=name,
        arrivals=arr,
        prompt_tokens=p,
        output_tokens=o,
        hash_ids=hash_ids,
        source=source,
        skipped=skipped,
        lora=lora,
    )


class _Rows:
    """A csv reader whose errors (a field over the csv module's size limit) are TraceErrors."""

    def __init__(self, text: str, path: Path) -> None:
        self._reader = csv.reader(io.StringIO(text))
        self._path = path

    @property
    def line_num(self) -> int:
        return self._reader.line_num

    def __iter__(self) -> _Rows:
        return self

    def __next__(self) -> list[str]:
        try:
            return next(self._reader)
        except csv.Error as exc:
            raise TraceError(f"{self._path.name}:{self._reader.line_num}: {exc}") from exc


def _csv_rows(text: str, path: Path) -> tuple[list[str], int, _Rows]:
    """(header fields, header line number, reader positioned after the header)."""
    reader = _Rows(text, path)
    for header in reader:
        if any(cell.strip() for cell in header):
            return [cell.strip() for cell in header], reader.line_num, reader
    raise TraceError(f"{path}: no header line (only empty CSV cells)")


def _column_index(header: list[str], wanted: str, path: Path, line: int, required: bool = True) -> int:
    lowered = [h.lower() for h in header]
    if wanted.lower() in lowered:
        return lowered.index(wanted.lower())
    if required:
        raise _row_error(path, line, wanted, f"missing from the header {','.join(header)!r}")
    return -1


# -- Mooncake --------------------------------------------------------------------------------


def _json_positive_int(value: Any, path: Path, line: int, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _row_error(path, line, field, f"expected a positive integer, got {value!r}")
    if isinstance(value, float) and not value.is_integer():
        raise _row_error(path, line, field, f"expected a positive integer, got {value!r}")
    if not 1 <= value <= _INT64_MAX:
        raise _row_error(path, line, field, f"expected a positive integer, got {value!r}")
    return int(value)


def read_mooncake(path: str | Path, *, limit: int | None = None) -> Trace:
    """A Mooncake FAST'25 JSONL trace: ``timestamp`` (ms), ``input_length``, ``output_length``,
    ``hash_ids`` (prefix blocks of 512 tokens). Arrivals are seconds from the first row.

    ``hash_ids`` is kept when any row has it (rows without it get an empty list). An optional ``lora``
    (an adapter's name; null or empty: the base model) is the row's LoRA adapter.
    """
    path = Path(path)
    text = _read_text(path)
    arrivals: list[float] = []
    prompts: list[int] = []
    outputs: list[int] = []
    hashes: list[list[int]] = []
    adapters: list[str | None] = []
    any_hashes = False
    for lineno, raw in enumerate(text.splitlines(), start=1):
        if limit is not None and len(arrivals) >= limit:
            break
        line = raw.strip()
        if not line:
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{path.name}:{lineno}: invalid JSON ({exc.msg} at column {exc.colno})") from exc
        except ValueError as exc:  # a number with more digits than int() converts (4300)
            raise TraceError(f"{path.name}:{lineno}: invalid JSON ({exc})") from exc
        if not isinstance(row, dict):
            raise TraceError(f"{path.name}:{lineno}: expected a JSON object, got {line[:40]!r}")
        for field in ("timestamp", "input_length", "output_length"):
            if field not in row:
                raise _row_error(path, lineno, field, "missing")
        ts = row["timestamp"]
        try:  # an integer beyond float range is an error in the row, like infinity
            ms = float(ts) if isinstance(ts, int | float) and not isinstance(ts, bool) else math.nan
        except OverflowError:
            ms = math.inf
        if not (math.isfinite(ms) and ms >= 0):
            raise _row_error(path, lineno, "timestamp", f"expected non-negative milliseconds, got {str(ts)[:40]!r}")
        arrivals.append(ms / 1000.0)
        prompts.append(_json_positive_int(row["input_length"], path, lineno, "input_length"))
        outputs.append(_json_positive_int(row["output_length"], path, lineno, "output_length"))
        adapters.append(_parse_lora(row.get("lora"), path, lineno))
        ids = row.get("hash_ids")
        if ids is None:
            hashes.append([])
            continue
        if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in ids):
            raise _row_error(path, lineno, "hash_ids", f"expected a list of integers, got {str(ids)[:40]!r}")
        any_hashes = True
        hashes.append(ids)
    return _build(
        f"mooncake:{path.name}",
        path,
        arrivals,
        prompts,
        outputs,
        hash_ids=hashes if any_hashes else None,
        lora=adapters,
    )


# -- Azure LLM inference trace 2023 ----------------------------------------------------------

_AZURE_TS = re.compile(r"\s*(\d{4}-\d{2}-\d{2})[ T](\d{2}):(\d{2}):(\d{2}(?:\.\d*)?)\s*$")


def read_azure(path: str | Path, *, limit: int | None = None) -> Trace:
    """An Azure LLM inference 2023 CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``).

    Timestamps are wall-clock text with up to 7 fractional digits, no time zone; arrivals are
    seconds from the first row (kept exact to 100 ns by splitting day and time of day). An optional
    ``lora`` column names each row's LoRA adapter (empty: the base model).
    """
    path = Path(path)
    text = _read_text(path)
    header, header_line, reader = _csv_rows(text, path)
    i_ts = _column_index(header, "TIMESTAMP", path, header_line)
    i_in = _column_index(header, "ContextTokens", path, header_line)
    i_out = _column_index(header, "GeneratedTokens", path, header_line)
    i_lora = _column_index(header, "lora", path, header_line, required=False)
    names = {i_ts: "TIMESTAMP", i_in: "ContextTokens", i_out: "GeneratedTokens"}
    width = max(names) + 1
    adapters: list[str | None] = []
    day_numbers: dict[str, int] = {}
    days: list[int] = []
    seconds: list[float] = []
    prompts: list[int] = []
    outputs: list[int] = []
    for row in reader:
        if limit is not None and len(prompts) >= limit:
            break
        if not row or not any(cell.strip() for cell in row):
            continue
        line = reader.line_num
        if len(row) < width:
            raise _row_error(path, line, names[min(i for i in names if i >= len(row))], "missing")
        raw_ts = row[i_ts]
        m = _AZURE_TS.match(raw_ts)
        day: int | None = None
        if m is not None:
            day = day_numbers.get(m.group(1))
            if day is None:
                try:
                    day = date.fromisoformat(m.group(1)).toordinal()
                except ValueError:
                    day = None
                else:
                    day_numbers[m.group(1)] = day
        if m is None or day is None or int(m.group(2)) > 23 or int(m.group(3)) > 59:
            raise _row_error(
                path,
                line,
                "TIMESTAMP",
                f"expected a time like '2023-11-16 18:15:46.6805900', got {raw_ts!r}",
            )
        days.append(day)
        seconds.append(int(m.group(2)) * 3600 + int(m.group(3)) * 60 + float(m.group(4)))
        prompts.append(_parse_positive_int(row[i_in], path, line, "ContextTokens"))
        outputs.append(_parse_positive_int(row[i_out], path, line, "GeneratedTokens"))
        adapters.append(_csv_lora(row, i_lora, path, line))
    if not prompts:
        raise TraceError(f"{path}: no data rows after the header")
    day_arr = np.asarray(days, dtype=np.int64)
    sec_arr = np.asarray(seconds, dtype=np.float64)
    arrivals = (day_arr - day_arr[0]).astype(np.float64) * 86400.0 + (sec_arr - sec_arr[0])
    return _build(f"azure:{path.name}", path, arrivals.tolist(), prompts, outputs, lora=adapters)


# -- BurstGPT --------------------------------------------------------------------------------


def read_burstgpt(path: str | Path, *, limit: int | None = None) -> Trace:
    """A BurstGPT CSV (``Timestamp`` s, ``Model``, ``Request tokens``, ``Response tokens``,
    ``Total tokens``, ``Log Type``; v3 adds ``Session ID``, ``Elapsed time``), columns by name.

    Rows with 0 response tokens are failed requests in BurstGPT: they are dropped, and so are
    rows with 0 request tokens. ``Trace.skipped`` counts both; ``Trace.source`` breaks it down. An
    optional ``lora`` column names each row's LoRA adapter (empty: the base model).
    """
    path = Path(path)
    text = _read_text(path)
    header, header_line, reader = _csv_rows(text, path)
    i_ts = _column_index(header, "Timestamp", path, header_line)
    i_in = _column_index(header, "Request tokens", path, header_line)
    i_out = _column_index(header, "Response tokens", path, header_line)
    i_lora = _column_index(header, "lora", path, header_line, required=False)
    names = {i_ts: "Timestamp", i_in: "Request tokens", i_out: "Response tokens"}
    width = max(names) + 1
    adapters: list[str | None] = []
    arrivals: list[float] = []
    prompts: list[int] = []
    outputs: list[int] = []
    failed = 0
    no_prompt = 0
    for row in reader:
        if limit is not None and len(prompts) >= limit:
            break
        if not row or not any(cell.strip() for cell in row):
            continue
        line = reader.line_num
        if len(row) < width:
            raise _row_error(path, line, names[min(i for i in names if i >= len(row))], "missing")
        ts = _parse_seconds(row[i_ts], path, line, "Timestamp")
        n_in = _parse_nonnegative_int(row[i_in], path, line, "Request tokens")
        n_out = _parse_nonnegative_int(row[i_out], path, line, "Response tokens")
        adapter = _csv_lora(row, i_lora, path, line)
        if n_out == 0:
            failed += 1
            continue
        if n_in == 0:
            no_prompt += 1
            continue
        arrivals.append(ts)
        prompts.append(n_in)
        outputs.append(n_out)
        adapters.append(adapter)
    if not prompts:
        raise TraceError(
            f"{path}: no usable rows ({failed} failed rows with 0 response tokens, {no_prompt} with 0 request tokens)"
        )
    note = f"skipped {failed} failed rows with 0 response tokens and {no_prompt} rows with 0 request tokens"
    return _build(
        f"burstgpt:{path.name}",
        path,
        arrivals,
        prompts,
        outputs,
        note=note,
        skipped=failed + no_prompt,
        lora=adapters,
    )


# -- detection and dispatch ------------------------------------------------------------------


def _unknown(path: Path, why: str) -> TraceError:
    return TraceError(f"{path}: unknown trace format ({why}); known formats: {_FORMAT_HELP}")


def detect_format(path: str | Path) -> str:
    """The format of ``path`` (one of :data:`FORMATS`), judged by content: a folder of
    ``chunk-*-trace.csv`` files is ServeGen; otherwise the first line of the file decides
    (a JSON object with Mooncake keys, or an Azure / BurstGPT CSV header)."""
    path = Path(path)
    if not path.exists():
        raise TraceError(f"trace file not found: {path}")
    if path.is_dir():
        if any(path.glob("chunk-*-trace.csv")):
            return "servegen"
        raise _unknown(path, "a folder without chunk-<id>-trace.csv files")
    if _SERVEGEN_FILE.match(path.name):
        return "servegen"
    try:
        with path.open("rb") as fh:
            head = fh.read(1 << 16)
    except OSError as exc:
        raise TraceError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    text = head.decode("utf-8-sig", errors="replace")
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    if not first:
        raise TraceError(f"{path}: file is empty")
    if first.startswith("{"):
        try:
            row = json.loads(first)
        except ValueError:  # JSONDecodeError, or a number too long for int()
            row = None
        if isinstance(row, dict) and {"timestamp", "input_length", "output_length"} <= set(row):
            return "mooncake"
        raise _unknown(path, f"first line is not a Mooncake JSON object: {first[:60]!r}")
    cells = {cell.strip().lower() for cell in next(csv.reader([first]))}
    if {"timestamp", "contexttokens", "generatedtokens"} <= cells:
        return "azure"
    if {"timestamp", "request tokens", "response tokens"} <= cells:
        return "burstgpt"
    raise _unknown(path, f"unrecognised first line {first[:60]!r}")


def read_trace(
    path: str | Path,
    format: str = "auto",
    *,
    seed: int = 0,
    servegen_duration_s: float = 600.0,
    servegen_start_s: float = 0.0,
    servegen_clients: list[str] | None = None,
    limit: int | None = None,
) -> Trace:
    """Load a trace file (or a ServeGen folder) as a :class:`Trace`.

    ``format`` is ``"auto"`` (see :func:`detect_format`) or one of :data:`FORMATS`. ``limit``
    keeps the first ``limit`` rows (file order; for ServeGen, the earliest sampled arrivals).
    ``seed`` and the ``servegen_*`` options only matter for ServeGen, which is sampled (see
    :func:`core.traces.servegen.read_servegen`). A ServeGen ``chunk-<id>-trace.csv`` path
    selects that one client from its folder unless ``servegen_clients`` is given.
    """
    path = Path(path)
    if limit is not None and limit < 0:
        raise TraceError(f"limit must be >= 0, got {limit}")
    fmt = format.strip().lower()
    if fmt == "auto":
        fmt = detect_format(path)
    elif fmt not in FORMATS:
        raise TraceError(f"unknown trace format {format!r}; use 'auto' or one of: {_FORMAT_HELP}")
    elif not path.exists():
        raise TraceError(f"trace file not found: {path}")
    if fmt == "servegen":
        from core.traces.servegen import read_servegen

        folder, clients = path, servegen_clients
        m = _SERVEGEN_FILE.match(path.name)
        if path.is_file() and m is not None:
            folder = path.parent
            clients = clients if clients is not None else [m.group(1)]
        return read_servegen(
            folder,
            seed=seed,
            duration_s=servegen_duration_s,
            start_s=servegen_start_s,
            clients=clients,
            limit=limit,
        )
    readers: dict[str, Callable[..., Trace]] = {
        "mooncake": read_mooncake,
        "azure": read_azure,
        "burstgpt": read_burstgpt,
    }
    return readers[fmt](path, limit=limit)
