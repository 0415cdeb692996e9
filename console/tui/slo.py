"""The SLO panel: TTFT/TPOT/joint attainment, percentiles, goodput and errors, last 60 s and run."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.console import RenderableType
from rich.table import Table
from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from console.tui.fmt import ms, palette_for, pct


def _targets(slo: Mapping[str, Any]) -> str:
    classes = slo.get("classes") or {}
    parts = []
    for name, c in classes.items():
        label = "" if len(classes) == 1 else f"{name}: "
        parts.append(f"{label}TTFT≤{c.get('ttft_s', 0):g}s TPOT≤{c.get('tpot_s', 0) * 1000:g}ms")
    return "  ".join(parts)


class SloPanel(Widget):
    """Attainment and latency summary; the app sets `slo`, `requests` and `uptime_s` each refresh."""

    slo: reactive[dict[str, Any] | None] = reactive(None, always_update=True)
    """The `slo` object of the state snapshot: classes, window_s, window {...}, run {...}."""
    requests: reactive[dict[str, Any]] = reactive(dict, always_update=True)
    """The `requests` object of the snapshot: in_flight, total, failed."""
    uptime_s: reactive[float] = reactive(0.0)
    """Console uptime, to turn run totals into a goodput."""

    def watch_slo(self, slo: dict[str, Any] | None) -> None:
        self.border_subtitle = _targets(slo or {})

    def render(self) -> RenderableType:
        p = palette_for(self.app)
        slo = self.slo or {}
        w: Mapping[str, Any] = slo.get("window") or {}
        r: Mapping[str, Any] = slo.get("run") or {}
        window_s = slo.get("window_s", 60)
        t = Table(box=None, expand=True, pad_edge=False, show_edge=False)
        t.add_column("", style="bold", no_wrap=True)
        t.add_column(f"last {window_s:g}s", justify="right", no_wrap=True)
        t.add_column("run", justify="right", no_wrap=True)

        def att(label: str, key: str) -> None:
            a, b = w.get(key), r.get(key)
            t.add_row(label, Text(pct(a), style=p.attainment(a)), Text(pct(b), style=p.attainment(b)))

        att("attainment", "attainment")
        att("TTFT met", "ttft_attainment")
        att("TPOT met", "tpot_attainment")
        t.add_row("TTFT p50/p99 ms", f"{ms(w.get('ttft_p50'))}/{ms(w.get('ttft_p99'))}", f"{ms(r.get('ttft_p50'))}/{ms(r.get('ttft_p99'))}")
        t.add_row("TPOT p50/p99 ms", f"{ms(w.get('tpot_p50'))}/{ms(w.get('tpot_p99'))}", f"{ms(r.get('tpot_p50'))}/{ms(r.get('tpot_p99'))}")
        t.add_row("goodput req/s", _rate(w.get("goodput_req_s")), _rate(self._run_goodput(r)))
        t.add_row("requests", str(w.get("requests", "-")), str(self.requests.get("total", r.get("requests", "-"))))
        failed_w, failed_r = w.get("failed") or 0, self.requests.get("failed", r.get("failed")) or 0
        t.add_row(
            "errors",
            Text(str(failed_w), style=p.bad if failed_w else ""),
            Text(str(failed_r), style=p.bad if failed_r else ""),
        )
        t.add_row("in flight", "", str(self.requests.get("in_flight", "-")))
        return t

    def _run_goodput(self, run: Mapping[str, Any]) -> float | None:
        att, n = run.get("attainment"), run.get("requests")
        if att is None or not n or self.uptime_s <= 0:
            return None
        return float(att) * float(n) / self.uptime_s


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"
