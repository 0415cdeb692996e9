"""The in-memory request trace: arrival times and token lengths as NumPy columns."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from core.errors import TraceError
from core.traces.sessions import DEFAULT_MIN_SHARED_BLOCKS, derive_sessions
from core.types import Request


@dataclass
class Trace:
    """A sequence of requests sorted by arrival, column-wise.

    ``arrivals`` are seconds (float64, non-decreasing); file traces start at 0.0. Token counts
    are int64 and at least 1. ``hash_ids`` holds Mooncake prefix-block hashes (block size 512)
    when the source has them; ``session`` is a session id per row (int64) when known or derived
    (:meth:`with_sessions`, from the hash ids). ``skipped`` counts source rows the reader dropped on purpose
    (BurstGPT failure rows); ``source`` says where the rows came from and with which parameters.
    """

    name: str
    arrivals: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    slo_class: list[str] | None = None
    priority: np.ndarray | None = None
    hash_ids: list[list[int]] | None = None
    source: str = ""
    skipped: int = 0
    session: np.ndarray | None = None
    lora: list[str | None] | None = None
    """The LoRA adapter each row runs under (None: the base model), from a trace's ``lora`` column or a
    synthetic mix (:meth:`with_lora`, core/traces/lora.py)."""

    def __post_init__(self) -> None:
        self.arrivals = np.asarray(self.arrivals, dtype=np.float64).reshape(-1)
        self.prompt_tokens = np.asarray(self.prompt_tokens, dtype=np.int64).reshape(-1)
        self.output_tokens = np.asarray(self.output_tokens, dtype=np.int64).reshape(-1)
        n = len(self.arrivals)
        if self.priority is not None:
            self.priority = np.asarray(self.priority, dtype=np.int64).reshape(-1)
        if self.session is not None:
            self.session = np.asarray(self.session, dtype=np.int64).reshape(-1)
        columns: dict[str, int | None] = {
            "prompt_tokens": len(self.prompt_tokens),
            "output_tokens": len(self.output_tokens),
            "slo_class": None if self.slo_class is None else len(self.slo_class),
            "priority": None if self.priority is None else len(self.priority),
            "hash_ids": None if self.hash_ids is None else len(self.hash_ids),
            "session": None if self.session is None else len(self.session),
            "lora": None if self.lora is None else len(self.lora),
        }
        for column, length in columns.items():
            if length is not None and length != n:
                raise TraceError(f"trace {self.name!r}: column {column!r} has {length} rows, arrivals has {n}")
        if n and not np.all(np.isfinite(self.arrivals)):
            raise TraceError(f"trace {self.name!r}: arrivals contain NaN or infinity")
        if n > 1 and np.any(np.diff(self.arrivals) < 0):
            raise TraceError(f"trace {self.name!r}: arrivals are not sorted (non-decreasing)")
        if n and (self.prompt_tokens.min() < 1 or self.output_tokens.min() < 1):
            raise TraceError(f"trace {self.name!r}: token counts must be >= 1")

    def __len__(self) -> int:
        return len(self.arrivals)

    # -- selection and time transforms ------------------------------------------------------

    def _take(self, index: np.ndarray, arrivals: np.ndarray, note: str) -> Trace:
        """A new trace of the rows at ``index`` (sorted positions) with the given arrivals."""
        idx = [int(i) for i in index]
        return replace(
            self,
            arrivals=arrivals,
            prompt_tokens=self.prompt_tokens[index],
            output_tokens=self.output_tokens[index],
            slo_class=None if self.slo_class is None else [self.slo_class[i] for i in idx],
            priority=None if self.priority is None else self.priority[index],
            hash_ids=None if self.hash_ids is None else [self.hash_ids[i] for i in idx],
            session=None if self.session is None else self.session[index],
            lora=None if self.lora is None else [self.lora[i] for i in idx],
            source=f"{self.source} | {note}" if self.source else note,
        )

    def window(self, start: float = 0.0, duration: float | None = None, limit: int | None = None) -> Trace:
        """Rows with ``start <= arrival < start + duration`` (all later rows when ``duration`` is
        None), at most the first ``limit`` of them, re-based so the first kept arrival is 0."""
        if duration is not None and duration < 0:
            raise TraceError(f"window duration must be >= 0, got {duration}")
        if limit is not None and limit < 0:
            raise TraceError(f"window limit must be >= 0, got {limit}")
        lo = int(np.searchsorted(self.arrivals, start, side="left"))
        hi = len(self) if duration is None else int(np.searchsorted(self.arrivals, start + duration, side="left"))
        hi = max(lo, hi)
        if limit is not None:
            hi = min(hi, lo + limit)
        index = np.arange(lo, hi)
        arrivals = self.arrivals[lo:hi]
        if len(arrivals):
            arrivals = arrivals - arrivals[0]
        note = f"window(start={start:g}, duration={duration}, limit={limit})"
        return self._take(index, arrivals.copy(), note)

    def scale_time(self, factor: float) -> Trace:
        """Multiply every arrival by ``factor`` (< 1 compresses time: the rate grows by 1/factor)."""
        if not (factor > 0 and math.isfinite(factor)):
            raise TraceError(f"time scale factor must be a positive finite number, got {factor}")
        return self._take(np.arange(len(self)), self.arrivals * factor, f"scale_time({factor:g})")

    def with_rate(self, rate: float) -> Trace:
        """Rescale arrivals so that :meth:`mean_rate` becomes ``rate`` requests per second."""
        if not (rate > 0 and math.isfinite(rate)):
            raise TraceError(f"target rate must be a positive finite number, got {rate}")
        current = self.mean_rate()
        if len(self) < 2:
            return self._take(np.arange(len(self)), self.arrivals.copy(), f"with_rate({rate:g})")
        if current == math.inf:
            raise TraceError(
                f"trace {self.name!r}: all {len(self)} arrivals are at the same instant, so it has no rate to rescale"
            )
        factor = current / rate
        return self._take(np.arange(len(self)), self.arrivals * factor, f"with_rate({rate:g})")

    def with_sessions(self, min_shared_blocks: int | None = None) -> Trace:
        """This trace with a ``session`` column derived from its hash ids
        (:func:`core.traces.sessions.derive_sessions`); unchanged when it has no hash ids."""
        if self.hash_ids is None:
            return self
        n = DEFAULT_MIN_SHARED_BLOCKS if min_shared_blocks is None else min_shared_blocks
        return replace(self, session=derive_sessions(self.hash_ids, n))

    def with_lora(self, adapters: list[str | None], note: str = "") -> Trace:
        """This trace with ``adapters`` as its ``lora`` column (one per row; None: the base model)."""
        source = f"{self.source} | {note}" if self.source and note else (note or self.source)
        return replace(self, lora=list(adapters), source=source)

    # -- views ------------------------------------------------------------------------------

    @property
    def span_s(self) -> float:
        """Last minus first arrival, seconds (0 for fewer than two rows)."""
        if len(self) < 2:
            return 0.0
        return float(self.arrivals[-1] - self.arrivals[0])

    def mean_rate(self) -> float:
        """Mean arrival rate as 1 / mean inter-arrival time, i.e. (count − 1) / span.

        0.0 for fewer than two rows; infinity when every arrival is at the same instant.
        """
        n = len(self)
        if n < 2:
            return 0.0
        span = self.span_s
        return math.inf if span <= 0 else (n - 1) / span

    def requests(self, id_prefix: str = "r") -> Iterator[Request]:
        """The rows as :class:`core.types.Request` objects (``max_tokens`` = output tokens)."""
        arrivals = self.arrivals.tolist()
        prompts = self.prompt_tokens.tolist()
        outputs = self.output_tokens.tolist()
        priorities = self.priority.tolist() if self.priority is not None else None
        for i, arrival in enumerate(arrivals):
            yield Request(
                id=f"{id_prefix}{i}",
                arrival=arrival,
                prompt_tokens=prompts[i],
                max_tokens=outputs[i],
                slo_class=self.slo_class[i] if self.slo_class is not None else "default",
                priority=priorities[i] if priorities is not None else 0,
                lora=self.lora[i] if self.lora is not None else None,
            )

    def summary(self) -> dict[str, Any]:
        """Count, span, mean rate, prompt/output mean, p50, p99, max (linear percentiles), skipped."""
        out: dict[str, Any] = {
            "name": self.name,
            "count": len(self),
            "span_s": self.span_s,
            "mean_rate": self.mean_rate(),
        }
        for label, column in (("prompt", self.prompt_tokens), ("output", self.output_tokens)):
            if len(column):
                p50, p99 = np.percentile(column, [50.0, 99.0])
                out[f"{label}_mean"] = float(column.mean())
                out[f"{label}_p50"] = float(p50)
                out[f"{label}_p99"] = float(p99)
                out[f"{label}_max"] = int(column.max())
            else:
                out.update({f"{label}_{k}": 0.0 for k in ("mean", "p50", "p99")})
                out[f"{label}_max"] = 0
        out["skipped"] = self.skipped
        return out
