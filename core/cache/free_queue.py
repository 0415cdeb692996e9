"""A block pool's LRU free queue kept as runs of block ids (numpy arrays), so that a request's blocks move in one step.

The queue is the order vLLM's ``FreeKVCacheBlockQueue`` keeps: blocks are taken from the head, a freed
request's cached blocks join the tail and its uncached ones the head, and a hit on a free cached block
takes it out of the middle. Per block in Python that is most of a simulation's time with prefix keys
(a 12k-token prompt is ~750 blocks, moved several times per request), so here each push is one run,
a removal from the middle only marks the block (its run keeps a dead entry, skipped when the head
reaches it), and taking n blocks reads whole runs with numpy. The order is exactly that of an ordered
dict of blocks under the same calls; ``order()`` lists it.

A block is in the queue iff its stamp equals the stamp of a run that lists it (every push makes a new
run with a new stamp, so a block freed, touched and freed again is live only in its latest run).
When dead entries outnumber the live ones by far, the runs are compacted into one.
"""

from __future__ import annotations

from collections import deque

import numpy as np

BlockIds = np.ndarray
"""A 1-D integer array of block ids."""
EMPTY: BlockIds = np.zeros(0, dtype=np.intp)
_OUT = -1
"""A block's stamp when it is not in the queue."""


class _Run:
    """Block ids pushed together, the index of the first entry not yet passed, and the run's stamp."""

    __slots__ = ("ids", "start", "stamp")

    def __init__(self, ids: BlockIds, stamp: int) -> None:
        self.ids = ids
        self.start = 0
        self.stamp = stamp


class FreeQueue:
    """Blocks ``1 .. num_blocks - 1`` in eviction order (head first), all free at the start; block 0 (vLLM's
    null block) is never in it."""

    def __init__(self, num_blocks: int) -> None:
        self._stamp = np.zeros(num_blocks, dtype=np.int64)
        self._stamp[0] = _OUT
        self._runs: deque[_Run] = deque()
        """Head run first."""
        self._next = 1
        self._live = num_blocks - 1
        self._entries = 0
        """Entries the runs still list from their index on, dead ones included."""
        self._limit = 2 * num_blocks + 64
        """Above this many entries, compact."""
        if num_blocks > 1:
            self._runs.append(_Run(np.arange(1, num_blocks, dtype=np.intp), 0))
            self._entries = num_blocks - 1

    def __len__(self) -> int:
        return self._live

    @property
    def entries(self) -> int:
        """Entries the runs still list, dead ones included (compaction keeps them under about twice the blocks)."""
        return self._entries

    def order(self) -> list[int]:
        """Block ids in eviction order (head first)."""
        return [int(b) for b in self._live_parts()]

    def take(self, n: int) -> BlockIds:
        """Take the first ``n`` blocks (n <= len(self)), head first."""
        if n <= 0:
            return EMPTY
        if n > self._live:
            raise ValueError(f"cannot take {n} blocks, {self._live} are free")
        stamp_of, runs = self._stamp, self._runs
        parts: list[BlockIds] = []
        need = n
        while need:
            run = runs[0]
            ids, start, stamp = run.ids, run.start, run.stamp
            size = len(ids)
            window = need
            while True:  # look at just enough of the run: usually every entry is live
                end = min(start + window, size)
                chunk = ids[start:end]
                alive = stamp_of[chunk] == stamp
                found = int(np.count_nonzero(alive))
                if found >= need or end == size:
                    break
                window = 2 * window + need - found
            if found <= need:  # all of the chunk's live blocks
                got = chunk if found == len(chunk) else chunk[alive]
                passed = len(chunk)
            else:
                live = np.flatnonzero(alive)
                got, passed = chunk[live[:need]], int(live[need - 1]) + 1
            parts.append(got)
            need -= len(got)
            self._entries -= passed
            if start + passed == size:
                runs.popleft()
            else:
                run.start = start + passed
        out = parts[0] if len(parts) == 1 else np.concatenate(parts)
        stamp_of[out] = _OUT
        self._live -= n
        return out

    def remove(self, blocks: BlockIds) -> None:
        """Take these blocks (each in the queue, no repeats) out of it, wherever they are."""
        self._stamp[blocks] = _OUT
        self._live -= len(blocks)

    def push_back(self, blocks: BlockIds) -> None:
        """Append blocks (none in the queue, no repeats) at the tail, in this order."""
        self._push(blocks).append(self._run(blocks))

    def push_front(self, blocks: BlockIds) -> None:
        """Put blocks (none in the queue, no repeats) at the head, ``blocks[0]`` first."""
        self._push(blocks).appendleft(self._run(blocks))

    # ---- internals -----------------------------------------------------------------------------
    def _run(self, blocks: BlockIds) -> _Run:
        stamp = self._next
        self._next += 1
        self._stamp[blocks] = stamp
        return _Run(blocks, stamp)

    def _push(self, blocks: BlockIds) -> deque[_Run]:
        if self._entries + len(blocks) > self._limit:
            self._compact()
        self._live += len(blocks)
        self._entries += len(blocks)
        return self._runs

    def _live_parts(self) -> BlockIds:
        parts = []
        for run in self._runs:
            rest = run.ids[run.start :]
            parts.append(rest[self._stamp[rest] == run.stamp])
        return np.concatenate(parts) if parts else EMPTY

    def _compact(self) -> None:
        """One run of the live entries, in order (the caller's push follows)."""
        live = self._live_parts()
        self._runs.clear()
        self._entries = len(live)
        if len(live):
            self._runs.append(self._run(live))
