"""The state exchange between gateway shards (benchmarks/gateway_shards.py): which shard owns a
request, what one shard publishes (its in-flight rows, prefill backlog, finished lengths), what it
knows of the others, and the merged request table a decision reads."""

from __future__ import annotations

import hashlib
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from core.request_table import RequestTable

COLUMNS = (
    "l_in", "l_obs", "t_obs", "v", "tau", "arrival", "decode_start", "max_out", "ttft_slo",
    "tpot_slo", "inst", "prefill", "state", "rank",
)  # fmt: skip
"""Every column of core.request_table.RequestTable (the simulation copies them all)."""

EXCHANGE_ROW = np.dtype(
    [
        ("request_id", "<u8"),
        ("decode", "<i2"),
        ("prefill", "<i2"),
        ("state", "u1"),
        ("prompt_tokens", "<u4"),
        ("max_tokens", "<u4"),
        ("generated", "<f4"),
        ("observed_at", "<f8"),
        ("rate", "<f4"),
        ("handoff_at", "<f8"),
    ]
)
"""One in-flight row on the wire, packed: what SIBYL reads of a row (45 bytes)."""
FINISHED_ROW = np.dtype([("output_tokens", "<u4"), ("decode_s", "<f4")])
"""One finished request on the wire: it feeds the survival and decode-rate estimators (8 bytes)."""
BACKLOG_BYTES = 4
"""Per instance and exchange: the sender's remaining prefill work there (float32 seconds)."""

_M64 = (1 << 64) - 1


def shard_of(rid: Hashable, k: int) -> int:
    """The shard that owns a request: a 64-bit mix (splitmix64) of an integer id, blake2b of any
    other, modulo K. Stable across processes (no hash randomisation)."""
    if k == 1:
        return 0
    if isinstance(rid, int | np.integer):
        x = (int(rid) + 0x9E3779B97F4A7C15) & _M64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
        x ^= x >> 31
    else:
        x = int.from_bytes(hashlib.blake2b(str(rid).encode(), digest_size=8).digest(), "little")
    return x % k


@dataclass
class Snapshot:
    """What one shard publishes at an exchange, as of time `t`."""

    t: float
    n: int
    cols: dict[str, np.ndarray]
    """Its own in-flight rows (every table column)."""
    running_n: np.ndarray
    pending_n: np.ndarray
    prefill_n: np.ndarray
    backlog: np.ndarray
    """Seconds of prefill work it projects left on each instance at `t`."""
    finished: list[tuple[int, float]]
    """(output tokens, decode seconds or -1) of what it finished since the previous exchange."""


@dataclass
class Foreign:
    """What one shard knows of all the others: their snapshots, merged."""

    t: float
    m: int
    cols: dict[str, np.ndarray]
    running_n: np.ndarray
    pending_n: np.ndarray
    prefill_n: np.ndarray
    backlog: np.ndarray


@dataclass
class Pushed:
    """A routing decision one shard pushed to the others at once (the `push` variant)."""

    origin: int
    at: float
    """When it was routed (its prefill work joins the instance's queue then)."""
    visible_at: float
    """When the others have it (`at` + the push latency)."""
    row: dict[str, float]
    prefill: int
    decode: int
    prefill_s: float


class MergedTable(RequestTable):
    """A read-only request table for one decision: the shard's own rows, then the other shards'
    rows as of the last exchange. Only the columns are filled (policies read columns); it does not
    call RequestTable.__init__, which would allocate columns it replaces at once."""

    def __init__(self, own: RequestTable, foreign: Foreign) -> None:
        n0 = own.n
        self.n = self.capacity = n0 + foreign.m
        self.ids = []
        self.row = {}
        for name in COLUMNS:
            setattr(self, name, np.concatenate((getattr(own, name)[:n0], foreign.cols[name])))
