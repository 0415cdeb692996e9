"""The SLO panel: TTFT/TPOT/joint attainment, percentiles, goodput and errors, last 60 s and run."""

from __future__ import annotations

from rich.console import RenderableType
from rich.table import Table
from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from console.live.state import RequestCounts, SloSnapshot, SloStats
from console.tui.fmt import ms, palette_for, pct


def _targets(slo: SloSnapshot) -> str:
    classes = slo.classes
    parts = []
    for name, c in classes.items():
        label = "" if len(classes) == 1 else f"{name}: "
        parts.append(f"{label}TTFT≤{c.ttft_s:g}s TPOT≤{c.tpot_s * 1000:g}ms")
    return "  ".join(parts)


class SloPanel(Widget):
    """Attainment and latency summary; the app sets `slo`, `requests` and `uptime_s` each refresh."""

    slo: reactive[SloSnapshot | None] = reactive(None, always_update=True)
    """The `slo` object of the state snapshot: classes, window_s, window {...}, run {...}."""
    requests: reactive[RequestCounts] = reactive(RequestCounts, always_update=True)
    """The `requests` object of the snapshot: in_flight, total, failed."""
    uptime_s: reactive[float] = reactive(0.0)
    """Console uptime, to turn run totals into a goodput."""

    def watch_slo(self, slo: SloSnapshot | None) -> None:
        self.border_subtitle = _targets(slo or SloSnapshot())

    def render(self) -> RenderableType:
        p = palette_for(self.app)
        slo = self.slo or SloSnapshot()
        w, r = slo.window, slo.run
        window_s = slo.window_s
        t = Table(box=None, expand=True, pad_edge=False, show_edge=False)
        t.add_column("", style="bold", no_wrap=True)
        t.add_column(f"last {window_s:g}s", justify="right", no_wrap=True)
        t.add_column("run", justify="right", no_wrap=True)

        def att(label: str, key: str) -> None:
            a, b = getattr(w, key), getattr(r, key)
            t.add_row(label, Text(pct(a), style=p.attainment(a)), Text(pct(b), style=p.attainment(b)))

        att("attainment", "attainment")
        att("TTFT met", "ttft_attainment")
        att("TPOT met", "tpot_attainment")
        t.add_row("TTFT p50/p99 ms", f"{ms(w.ttft_p50)}/{ms(w.ttft_p99)}", f"{ms(r.ttft_p50)}/{ms(r.ttft_p99)}")
        t.add_row("TPOT p50/p99 ms", f"{ms(w.tpot_p50)}/{ms(w.tpot_p99)}", f"{ms(r.tpot_p50)}/{ms(r.tpot_p99)}")
        if w.tpot_unknown or r.tpot_unknown:  # whole replies: TPOT not measured, left out of TPOT met
            t.add_row("no TPOT (whole)", _count(w.tpot_unknown), _count(r.tpot_unknown))
        t.add_row("goodput req/s", _rate(w.goodput_req_s), _rate(self._run_goodput(r)))
        total = self.requests.total if self.requests.total is not None else r.requests
        t.add_row("requests", _count(w.requests), _count(total))
        failed_w = w.failed or 0
        failed_r = (self.requests.failed if self.requests.failed is not None else r.failed) or 0
        t.add_row(
            "errors",
            Text(str(failed_w), style=p.bad if failed_w else ""),
            Text(str(failed_r), style=p.bad if failed_r else ""),
        )
        t.add_row("in flight", "", _count(self.requests.in_flight))
        return t

    def _run_goodput(self, run: SloStats) -> float | None:
        att, n = run.attainment, run.requests
        if att is None or not n or self.uptime_s <= 0:
            return None
        return float(att) * float(n) / self.uptime_s


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _count(n: int | None) -> str:
    return "-" if n is None else str(n)
