"""Time-series charts (textual-plotext): per-decode-instance load, and P99 TPOT with attainment."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from typing import Any, Literal

from textual.app import RenderResult
from textual.timer import Timer
from textual_plotext import PlotextPlot

from console.live.state import SloSnapshot

LINE_COLORS: tuple[tuple[int, int, int], ...] = (
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (127, 127, 127),
    (188, 189, 34),
    (23, 190, 207),
)
"""Mid-saturation line colours that stay visible on both dark and light backgrounds."""
MARKER_COLOR = (148, 103, 189)


class TimeChart(PlotextPlot):
    """A chart over console uptime with vertical, labelled markers (policy swaps)."""

    min_replot_s = 1.0
    """Re-plot at most this often: plotting is the costliest part of a refresh, trends need less."""

    def __init__(self, *, history: int = 240, id: str | None = None) -> None:
        super().__init__(id=id)
        self.history = history
        """How many samples each series keeps (the x range shown)."""
        self._markers: deque[tuple[float, str]] = deque(maxlen=32)
        self._version = 0
        self._cache: tuple[tuple[Any, ...], RenderResult] | None = None
        self._last_plot = 0.0
        self._pending: Timer | None = None

    def changed(self) -> None:
        """New data: re-plot soon (at most every `min_replot_s`; other repaints reuse the plot)."""
        self._version += 1
        wait = self._last_plot + self.min_replot_s - time.monotonic()
        if wait <= 0 or not self.is_mounted:
            self.refresh()
        elif self._pending is None:
            self._pending = self.set_timer(wait, self._flush)

    def _flush(self) -> None:
        self._pending = None
        self.refresh()

    def add_marker(self, t: float, label: str) -> None:
        """A vertical line at uptime `t` labelled `label` (e.g. `routing→least_load`)."""
        self._markers.append((t, label))
        self.changed()

    def reset(self) -> None:
        """Forget every sample and marker (the console behind the URL restarted)."""
        self._markers.clear()
        self._clear_data()
        self.changed()

    def _clear_data(self) -> None:
        """Drop the chart's samples; LoadChart and SloChart each override this."""
        raise NotImplementedError(f"{type(self).__name__} must override _clear_data")

    def markers(self) -> list[tuple[float, str]]:
        return list(self._markers)

    def _draw_markers(self, xmin: float, xmax: float, y: float, yside: str = "left") -> None:
        plt = self.plt
        middle = (xmin + xmax) / 2
        for t, label in list(self._markers):
            if xmin <= t <= xmax:
                plt.vertical_line(t, color=MARKER_COLOR)
                # labels grow away from the nearer edge so they are not cut off
                align: Literal["left", "right"] = "left" if t <= middle else "right"
                plt.text(label, x=t, y=y, color=MARKER_COLOR, alignment=align, yside=yside)

    def _draw(self) -> None:
        """Plot the samples; LoadChart and SloChart each override this."""
        raise NotImplementedError(f"{type(self).__name__} must override _draw")

    def render(self) -> RenderResult:
        key = (self._version, self.size, self.app.theme)
        if self._cache is None or self._cache[0] != key:
            self.plt.clear_figure()
            self._draw()
            self._cache = (key, super().render())
            self._last_plot = time.monotonic()
        return self._cache[1]

    def budget(self) -> int:
        """How many points per line are worth drawing at the current width (2 per cell)."""
        return max(20, 2 * (self.size.width - 8))


def downsample(points: list[tuple[float, float]], budget: int) -> list[tuple[float, float]]:
    """At most `budget` points: each bucket keeps its largest value (spikes stay visible)."""
    if len(points) <= budget:
        return points
    step = len(points) / budget
    out = []
    for b in range(budget):
        bucket = points[int(b * step) : max(int((b + 1) * step), int(b * step) + 1)]
        out.append(max(bucket, key=lambda p: p[1]))
    return out


class LoadChart(TimeChart):
    """Projected load of each decode instance over time; only the busiest lines when many."""

    max_lines = 16
    """At most this many instances are drawn: the busiest over the last few samples."""

    def __init__(self, *, history: int = 240, id: str | None = None) -> None:
        super().__init__(history=history, id=id)
        self._series: dict[str, deque[tuple[float, float]]] = {}

    def _clear_data(self) -> None:
        self._series.clear()

    def push(self, t: float, loads: Mapping[str, float]) -> None:
        """Append one sample per instance at uptime `t`; instances not in `loads` age out."""
        for iid, value in loads.items():
            self._series.setdefault(iid, deque(maxlen=self.history)).append((t, value))
        horizon = t - 2 * self.history
        for iid in [i for i, s in self._series.items() if s and s[-1][0] < horizon]:
            del self._series[iid]
        self.changed()

    def shown(self) -> list[str]:
        """Ids of the instances drawn, busiest first."""
        series = {iid: list(s)[-10:] for iid, s in self._series.items()}
        busiest = sorted(series, key=lambda i: (-sum(v for _, v in series[i]) / max(1, len(series[i])), i))
        return busiest[: self.max_lines]

    def _draw(self) -> None:
        plt = self.plt
        shown = self.shown()
        extra = len(self._series) - len(shown)
        plt.title(
            f"decode load ({len(shown)} busiest of {len(self._series)})" if extra > 0 else "decode load (projected)"
        )
        plt.xlabel("uptime s")
        data = {iid: downsample(list(self._series[iid]), self.budget()) for iid in shown}
        xs_all = [t for pts in data.values() for t, _ in pts]
        if not xs_all:
            return
        ymax = 1.0
        for n, iid in enumerate(sorted(data)):
            pts = data[iid]
            ymax = max(ymax, max(v for _, v in pts))
            label = iid if len(data) <= 8 else None
            plt.plot([t for t, _ in pts], [v for _, v in pts], color=LINE_COLORS[n % len(LINE_COLORS)], label=label)
        plt.ylim(0, ymax * 1.15)
        self._draw_markers(min(xs_all), max(xs_all), ymax * 1.1)


class SloChart(TimeChart):
    """P99 TPOT (ms, left axis) and joint SLO attainment (% , right axis) of the last window."""

    def __init__(self, *, history: int = 240, id: str | None = None) -> None:
        super().__init__(history=history, id=id)
        self._tpot: deque[tuple[float, float]] = deque(maxlen=history)
        self._att: deque[tuple[float, float]] = deque(maxlen=history)
        self.tpot_limit_ms: float | None = None
        """The TPOT target, drawn as a horizontal line when known."""

    def _clear_data(self) -> None:
        self._tpot.clear()
        self._att.clear()

    def push(self, t: float, slo: SloSnapshot) -> None:
        """Append the window's P99 TPOT and attainment at uptime `t` (missing values are skipped)."""
        window = slo.window
        if window.tpot_p99 is not None:
            self._tpot.append((t, float(window.tpot_p99) * 1000))
        if window.attainment is not None:
            self._att.append((t, float(window.attainment) * 100))
        classes = slo.classes
        default = classes.get("default") or next(iter(classes.values()), None)
        if default and default.tpot_s:
            self.tpot_limit_ms = float(default.tpot_s) * 1000
        self.changed()

    def _draw(self) -> None:
        plt = self.plt
        plt.title("P99 TPOT (ms, left) and SLO attainment (%, right), last 60 s window")
        plt.xlabel("uptime s")
        tpot, att = downsample(list(self._tpot), self.budget()), downsample(list(self._att), self.budget())
        xs = [t for t, _ in tpot] + [t for t, _ in att]
        if not xs:
            return
        top = max([v for _, v in tpot] + [self.tpot_limit_ms or 0.0, 1.0])
        if tpot:
            plt.plot([t for t, _ in tpot], [v for _, v in tpot], color=LINE_COLORS[0], label="P99 TPOT ms")
        if att:
            plt.plot(
                [t for t, _ in att], [v for _, v in att], color=LINE_COLORS[2], label="attainment %", yside="right"
            )
        if self.tpot_limit_ms is not None:
            plt.horizontal_line(self.tpot_limit_ms, color=LINE_COLORS[3])
        plt.ylim(0, top * 1.25)
        plt.ylim(0, 110, yside="right")  # type: ignore[arg-type]  # plotext annotates yside wrongly
        self._draw_markers(min(xs), max(xs), top * 1.18)
