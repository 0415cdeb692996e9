"""ServeGen per-client workload distributions (rates, inter-arrival laws, length PMFs) sampled into a trace."""

from __future__ import annotations

import ast
import json
import math
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from core.errors import TraceError
from core.traces.model import Trace

DEFAULT_WINDOW_S = 600.0
"""Length of one rate window of a ``chunk-<id>-trace.csv`` when the file has a single row."""

_TRACE_FILE = re.compile(r"^chunk-(\d+)-trace\.csv$")
_TRACE_FIELDS = ("window_start_s", "rate", "cv", "pattern", "arg1", "arg2")
_PATTERNS = ("gamma", "weibull", "exponential")


@dataclass(frozen=True)
class _Window:
    """One row of a client's trace CSV: traffic during [start, start + length)."""

    line: int
    start: float
    rate: float
    pattern: str  # lower case; "" = no traffic
    shape: float


@dataclass(frozen=True)
class _Pmf:
    values: np.ndarray  # int64, sorted
    cdf: np.ndarray  # float64, last = 1.0

    def sample(self, u: np.ndarray) -> np.ndarray:
        idx = np.searchsorted(self.cdf, u, side="right")
        return self.values[np.minimum(idx, len(self.values) - 1)]


def _client_files(folder: Path) -> dict[int, Path]:
    files: dict[int, Path] = {}
    for p in folder.glob("chunk-*-trace.csv"):
        m = _TRACE_FILE.match(p.name)
        if m is not None:
            files[int(m.group(1))] = p
    return files


def _trace_error(path: Path, line: int, field: str, message: str) -> TraceError:
    return TraceError(f"{path.name}:{line}: field '{field}': {message}")


def _read_windows(path: Path) -> tuple[list[_Window], float]:
    """The rows of one ``chunk-<id>-trace.csv`` and the window length (seconds)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}: cannot read ({exc})") from exc
    windows: list[_Window] = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        cells = [c.strip() for c in raw.split(",")]
        if len(cells) < len(_TRACE_FIELDS):
            raise _trace_error(path, lineno, _TRACE_FIELDS[len(cells)], "missing")
        nums: dict[str, float] = {}
        for i, field in enumerate(_TRACE_FIELDS):
            if field == "pattern":
                continue
            try:
                nums[field] = float(cells[i])
            except ValueError:
                nums[field] = math.nan
            if not math.isfinite(nums[field]) or (field != "cv" and nums[field] < 0):
                raise _trace_error(path, lineno, field, f"expected a non-negative number, got {cells[i]!r}")
        pattern = cells[3].lower()
        rate = nums["rate"]
        if pattern and rate > 0:
            if pattern not in _PATTERNS:
                raise _trace_error(
                    path,
                    lineno,
                    "pattern",
                    f"expected one of Gamma, Weibull, Exponential or empty, got {cells[3]!r}",
                )
            if pattern != "exponential" and not nums["arg1"] > 0:
                raise _trace_error(path, lineno, "arg1", f"expected a positive shape, got {cells[4]!r}")
        else:
            pattern = ""
        windows.append(_Window(lineno, nums["window_start_s"], rate, pattern, nums["arg1"]))
    if not windows:
        raise TraceError(f"{path}: file is empty")
    starts = [w.start for w in windows]
    if any(b <= a for a, b in zip(starts, starts[1:], strict=False)):
        bad = next(i for i in range(1, len(starts)) if starts[i] <= starts[i - 1])
        raise _trace_error(
            path,
            windows[bad].line,
            "window_start_s",
            f"expected increasing window starts, got {starts[bad]:g} after {starts[bad - 1]:g}",
        )
    length = starts[1] - starts[0] if len(starts) > 1 else DEFAULT_WINDOW_S
    return windows, length


@lru_cache(maxsize=8)
def _load_dataset(path_str: str, mtime_ns: int) -> tuple[str, dict[str, dict[str, str]]]:
    """(raw text, parsed JSON) of one ``chunk-<id>-dataset.json``; cached per file version."""
    path = Path(path_str)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}: cannot read ({exc})") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{path.name}:{exc.lineno}: invalid JSON ({exc.msg})") from exc
    if not isinstance(data, dict) or not data or not all(isinstance(v, dict) for v in data.values()):
        raise TraceError(f"{path.name}: expected a non-empty object of 6-hour windows, each an object")
    return text, data


def _json_line(text: str, window_key: str, field: str) -> int:
    """1-based line of ``field`` inside window ``window_key`` of a pretty-printed JSON file."""
    at = text.find(f'"{window_key}"')
    at = text.find(f'"{field}"', max(at, 0))
    return text.count("\n", 0, at) + 1 if at >= 0 else 1


@lru_cache(maxsize=1024)
def _load_pmf(path_str: str, mtime_ns: int, window_key: str, field: str) -> _Pmf | None:
    """The PMF ``field`` of window ``window_key`` (None when the window holds no data)."""
    path = Path(path_str)
    text, data = _load_dataset(path_str, mtime_ns)

    def fail(message: str) -> TraceError:
        line = _json_line(text, window_key, field)
        return TraceError(f"{path.name}:{line}: window '{window_key}' field '{field}': {message}")

    raw = data[window_key].get(field)
    if not isinstance(raw, str):
        raise fail(f"expected a string holding a dict literal, got {str(raw)[:40]!r}")
    try:
        pmf = ast.literal_eval(raw)
    except (ValueError, SyntaxError, MemoryError, RecursionError) as exc:
        raise fail(f"not a Python dict literal ({type(exc).__name__}): {raw[:40]!r}") from exc
    if not isinstance(pmf, dict):
        raise fail(f"expected a dict {{tokens: probability}}, got {raw[:40]!r}")
    if not pmf:
        return None
    keys = list(pmf)
    probs = list(pmf.values())
    if not all(isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in keys):
        bad = next(k for k in keys if not (isinstance(k, int) and k >= 1))
        raise fail(f"expected positive integer token counts as keys, got {bad!r}")
    if not all(isinstance(q, int | float) and math.isfinite(q) and q >= 0 for q in probs):
        bad = next(q for q in probs if not (isinstance(q, int | float) and q >= 0))
        raise fail(f"expected non-negative probabilities, got {bad!r}")
    values = np.asarray(keys, dtype=np.int64)
    weights = np.asarray(probs, dtype=np.float64)
    order = np.argsort(values, kind="stable")
    values, weights = values[order], weights[order]
    total = float(weights.sum())
    if not total > 0:
        raise fail("probabilities sum to 0")
    cdf = np.cumsum(weights) / total
    cdf[-1] = 1.0
    return _Pmf(values, cdf)


def _gaps(window: _Window, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` inter-arrival gaps of the window's law, rescaled to mean 1 / rate."""
    if window.pattern == "gamma":
        k = window.shape
        return rng.gamma(k, 1.0 / (window.rate * k), size=n)
    if window.pattern == "weibull":
        k = window.shape
        return rng.weibull(k, size=n) / (window.rate * math.gamma(1.0 + 1.0 / k))
    return rng.exponential(1.0 / window.rate, size=n)


def _window_arrivals(window: _Window, length: float, rng: np.random.Generator) -> np.ndarray:
    """Arrival times in [start, start + length): renewal process started at the window start."""
    expected = window.rate * length
    batch = max(16, int(1.25 * expected) + 16)
    parts: list[np.ndarray] = []
    t = 0.0
    while t < length:
        cum = t + np.cumsum(_gaps(window, batch, rng))
        parts.append(cum)
        t = float(cum[-1])
    offsets = np.concatenate(parts)
    return window.start + offsets[offsets < length]


def _parse_clients(clients: list[str] | None, available: dict[int, Path], folder: Path) -> list[int]:
    if clients is None:
        return sorted(available)
    chosen: list[int] = []
    for c in clients:
        text = str(c).strip()
        m = re.fullmatch(r"(?:chunk-)?(\d+)", text)
        if m is None or int(m.group(1)) not in available:
            ids = sorted(available)
            raise TraceError(
                f"{folder}: unknown ServeGen client {c!r}; the folder has clients "
                f"{ids[0]}..{ids[-1]} ({len(ids)} chunk-<id>-trace.csv files)"
            )
        if int(m.group(1)) not in chosen:
            chosen.append(int(m.group(1)))
    return sorted(chosen)


def read_servegen(
    folder: str | Path,
    *,
    seed: int = 0,
    duration_s: float = 600.0,
    start_s: float = 0.0,
    clients: list[str] | None = None,
    limit: int | None = None,
) -> Trace:
    """Sample requests from a ServeGen folder over [start_s, start_s + duration_s).

    For each client (``clients`` as ids like ``"12"`` or ``"chunk-12"``; default all) and each
    rate window overlapping the range, inter-arrival gaps are drawn from the window's Gamma /
    Weibull law with its shape kept and its scale rescaled so the mean rate equals the window's
    rate (a renewal process restarted at each window start); input and output lengths are drawn
    by inverse CDF from the PMFs of the 6-hour dataset window holding each arrival.
    ``reason_ratio`` is not used. Each (client, window) has its own random stream derived from
    (seed, client, window row), so a request sampled for a window does not depend on the range
    asked for. Clients are merged and sorted by arrival; arrivals are re-based so the first is
    0.0 (``source`` records its time of day).
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise TraceError(f"ServeGen trace path must be a folder of chunk-<id>-trace.csv files: {folder}")
    if not (duration_s > 0 and math.isfinite(duration_s)):
        raise TraceError(f"servegen duration must be a positive number of seconds, got {duration_s}")
    if not (start_s >= 0 and math.isfinite(start_s)):
        raise TraceError(f"servegen start must be a non-negative number of seconds, got {start_s}")
    available = _client_files(folder)
    if not available:
        raise TraceError(f"{folder}: no chunk-<id>-trace.csv files (not a ServeGen folder)")
    chosen = _parse_clients(clients, available, folder)
    end_s = start_s + duration_s
    arrival_parts: list[np.ndarray] = []
    prompt_parts: list[np.ndarray] = []
    output_parts: list[np.ndarray] = []
    covered_until = 0.0
    for client in chosen:
        trace_path = available[client]
        windows, length = _read_windows(trace_path)
        covered_until = max(covered_until, windows[-1].start + length)
        active = [w for w in windows if w.pattern and w.start < end_s and w.start + length > start_s]
        if not active:
            continue
        dataset_path = trace_path.with_name(f"chunk-{client}-dataset.json")
        if not dataset_path.is_file():
            raise TraceError(f"{trace_path.name}: its dataset file {dataset_path.name} is missing")
        mtime = dataset_path.stat().st_mtime_ns
        _, data = _load_dataset(str(dataset_path), mtime)
        try:
            keys = sorted(data, key=float)
            key_starts = np.asarray([float(k) for k in keys])
        except ValueError as exc:
            raise TraceError(f"{dataset_path.name}: window keys must be start seconds, got {list(data)[:4]}") from exc
        for w in active:
            rng = np.random.default_rng([seed, client, w.line])
            t = _window_arrivals(w, length, rng)
            u_in = rng.random(len(t))
            u_out = rng.random(len(t))
            keep = (t >= start_s) & (t < end_s)
            t, u_in, u_out = t[keep], u_in[keep], u_out[keep]
            if not len(t):
                continue
            slot = np.clip(np.searchsorted(key_starts, t, side="right") - 1, 0, len(keys) - 1)
            p = np.empty(len(t), dtype=np.int64)
            o = np.empty(len(t), dtype=np.int64)
            for s in np.unique(slot):
                key = keys[int(s)]
                sel = slot == s
                pmf_in = _load_pmf(str(dataset_path), mtime, key, "input_tokens")
                pmf_out = _load_pmf(str(dataset_path), mtime, key, "output_tokens")
                if pmf_in is None or pmf_out is None:
                    raise TraceError(
                        f"{dataset_path.name}: window '{key}' has no length distribution, but "
                        f"{trace_path.name}:{w.line} has traffic at {w.start:g} s"
                    )
                p[sel] = pmf_in.sample(u_in[sel])
                o[sel] = pmf_out.sample(u_out[sel])
            arrival_parts.append(t)
            prompt_parts.append(p)
            output_parts.append(o)
    if start_s >= covered_until:
        raise TraceError(f"{folder}: servegen start {start_s:g} s is past the end of the trace ({covered_until:g} s)")
    if arrival_parts:
        arrivals = np.concatenate(arrival_parts)
        prompts = np.concatenate(prompt_parts)
        outputs = np.concatenate(output_parts)
        order = np.argsort(arrivals, kind="stable")
        arrivals, prompts, outputs = arrivals[order], prompts[order], outputs[order]
    else:
        arrivals = np.zeros(0)
        prompts = outputs = np.zeros(0, dtype=np.int64)
    if limit is not None:
        arrivals, prompts, outputs = arrivals[:limit], prompts[:limit], outputs[:limit]
    origin = float(arrivals[0]) if len(arrivals) else start_s
    client_text = "all" if clients is None else ",".join(str(c) for c in chosen)
    source = (
        f"{folder} (ServeGen sample: clients={client_text} ({len(chosen)}), "
        f"start={start_s:g}s duration={duration_s:g}s seed={seed}; "
        f"arrival 0 is t={origin:.3f}s of the trace)"
    )
    return Trace(
        name=f"servegen:{folder.name}",
        arrivals=arrivals - origin,
        prompt_tokens=prompts,
        output_tokens=outputs,
        source=source,
    )
