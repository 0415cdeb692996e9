"""What a decision record costs per sampled request: the dispatcher's request path with records off and on
(every request sampled), and the recorder's work for them (rows and the SQLite insert), in thread CPU time.

The gateway benchmark (`gateway_bench --decisions-off-too`) measures the same end to end, but on a
shared two-core machine its req/s moves by more than the records cost; this one isolates the work.
Usage: python -m benchmarks.decision_record_cost [--requests 2000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from adapters.store import RunStore
from adapters.store.recorder import decision_row
from core.decision_log import DecisionLog
from core.decision_records import Record
from core.dispatch import Dispatcher
from core.perf import get_profile
from core.types import Request, Role


def run(records: bool, decode: int, n: int, policy: str) -> tuple[float, float]:
    """(request path µs, recorder µs) per request: route, prefill end, decode start, finish."""
    d = Dispatcher(get_profile("h20-qwen3-32b"), policy)
    d.add_instance("p0", Role.PREFILL)
    for i in range(decode):
        d.add_instance(f"d{i}", Role.DECODE)
    buf: list[Record] = []
    if records:
        d.use_decisions(DecisionLog(max_per_s=10**9, sink=buf.extend))
    with tempfile.TemporaryDirectory() as tmp:
        store = RunStore(Path(tmp) / "runs.db")
        run_id = store.create_run(kind="live", backend="bench")
        start, rec, now = time.thread_time(), 0.0, 0.0
        for k in range(n):
            now += 1e-4
            d.route(Request(k, now, 100, 20), now)
            d.on_prefill_end(k, now)
            d.on_decode_start(k, now)
            if k >= 32:  # 32 requests decode at any time
                d.on_finish(k - 32, now, 20)
            if k % 250 == 249 and buf:  # as the recorder thread flushes
                t = time.thread_time()
                store.add_decisions(run_id, [decision_row(r) for r in buf])
                buf.clear()
                rec += time.thread_time() - t
        total = time.thread_time() - start
        store.close()
    return (total - rec) / n * 1e6, rec / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--policy", default="sibyl")
    args = ap.parse_args()
    print(f"{'shape':<6} {'path off µs':>12} {'path on µs':>11} {'added µs':>9} {'recorder µs':>12}")
    for decode in (1, 2, 4):
        off = [run(False, decode, args.requests, args.policy) for _ in range(args.repeat)]
        on = [run(True, decode, args.requests, args.policy) for _ in range(args.repeat)]
        p_off = statistics.median(p for p, _ in off)
        p_on = statistics.median(p for p, _ in on)
        rec = statistics.median(r for _, r in on)
        print(f"1P{decode}D   {p_off:>12.1f} {p_on:>11.1f} {p_on - p_off:>9.1f} {rec:>12.1f}")


if __name__ == "__main__":
    main()
