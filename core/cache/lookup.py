"""Longest-prefix lookups over the cache index's holder masks: by learned runs, by a grid, by a walk."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from itertools import accumulate, compress, repeat, takewhile
from operator import and_, ne

from core.cache.keys import BlockKey

InstanceId = str | int

_MAX_REPAIRS = 4
"""Runs a lookup finds by bisection where a hint is stale, before it reads the rest by the grid."""
_MAX_UNHINTED = 2
"""Of those, runs without a hint (a chain not looked up before reads by the grid after two)."""


class _Hole(Exception):
    """A stretch of a lookup where the holders' masks do not shrink along the chain."""


class ChainLookups:
    """The lookups of ``CacheIndex.match`` (see there), on the index's state below."""

    _holders: dict[BlockKey, int]  # block key -> the mask of the slots holding it
    _ids: list[InstanceId | None]  # slot -> instance
    _bits: list[int]  # slot -> its single-bit mask
    _slot: dict[InstanceId, int]
    _owner: dict[int, InstanceId]  # single-bit mask -> the instance in that slot
    _runs: dict[BlockKey, int]  # run hints: held key -> how many keys above it share its mask

    def _match_runs(self, keys: Sequence[BlockKey], n: int, first: int, last: int) -> dict[InstanceId, int]:
        """The lookup by run hints, from the chain's last held key back to its first; where a hint
        is missing or stale, the grid lookup of the keys above, whose runs it then learns.

        A run is a stretch of the chain whose keys have the same holders; a hint on a run's last
        key says how far back the run starts. It is used only when the run's first key has that
        mask and the key above it another: an instance without holes is in a mask for exactly
        its leading keys, so it cannot drop out inside a stretch whose two ends have the same
        mask, and the depth found at a checked run start is exact; an instance with holes gets
        the deepest such start it drops out at: one past a key it holds, at a key it lacks (so at
        least its first missing one), as from the grid.
        """
        holders = self._holders
        get = holders.get
        ids = self._ids
        out: dict[InstanceId, int] = {}
        p, mask = n - 1, last
        if not mask:  # nobody holds the last key: start from the last one somebody holds
            p = bisect_left(keys, True, 1, n, key=lambda k: k not in holders) - 1
            mask = get(keys[p], 0)
        done = mask & first  # the instances given a depth: the deepest wins (a hole reads as held)
        self._emit(done, p + 1, ids, out)
        runs = self._runs
        hint = runs.get
        owner = self._owner
        repairs, unhinted = _MAX_REPAIRS, _MAX_UNHINTED
        while mask != first:
            d = hint(keys[p])
            s = p - d if d is not None and 0 <= d < p else 0
            above = get(keys[s - 1], 0) if s else mask
            if above == mask or (d and get(keys[s]) != mask):  # no hint, or a stale one
                if not repairs or (not s and not unhinted):
                    break
                repairs -= 1
                unhinted -= not s
                s = self._run_start(keys, p, mask, s)
                if not s:
                    break
                above = get(keys[s - 1], 0)
                if above == mask:
                    break
                runs[keys[p]] = p - s
            gone = above & ~mask & first & ~done  # the instances holding key s − 1 but not key s
            done |= gone
            iid = owner.get(gone)
            if iid is not None:
                out[iid] = s
            elif gone:
                self._emit(gone, s, ids, out)
            p, mask = s - 1, above
        else:
            return out
        # keys[: p + 1] by the grid; the instances still in mask hold key p and got their depths above
        rest = self._match_grid(keys, p + 1, first, mask)
        self._learn(keys, rest)
        rest.update(out)
        return rest

    def _run_start(self, keys: Sequence[BlockKey], p: int, mask: int, hinted: int) -> int:
        """By bisection, the first key of the run of ``mask`` that ends at key ``p`` (a stale hint's
        start, ``hinted``, still says on which side of it the run starts); 0 if there is none."""
        holders = self._holders
        lo, hi = 0, p
        if hinted:
            if holders.get(keys[hinted]) == mask:
                hi = hinted
            else:
                lo = hinted + 1
        try:  # the masks decrease along the chain, so their negations increase
            s = bisect_left(keys, -mask, lo, hi, key=lambda k: -holders[k])
        except KeyError:  # a key nobody holds under held ones: a hole
            return 0
        return s if holders.get(keys[s]) == mask else 0

    def _learn(self, keys: Sequence[BlockKey], depths: dict[InstanceId, int]) -> None:
        """Hint each run a lookup found: the key at depth − 1 (held: every lookup's depth is one past
        a key the instance holds) ends a run that starts at the depth before."""
        runs = self._runs
        start = 0
        for depth in sorted(set(depths.values())):
            runs[keys[depth - 1]] = depth - 1 - start
            start = depth

    def _match_grid(self, keys: Sequence[BlockKey], n: int, first: int, last: int) -> dict[InstanceId, int]:
        """The lookup of ``keys[:n]`` by a grid of its keys and bisections between them (see ``match``)."""
        holders = self._holders
        get = holders.get
        ids = self._ids
        out: dict[InstanceId, int] = {}
        # The grid: every stride-th key, with key −1 read as first and key n − 1 as last; a stretch
        # is the keys (a, b] between two grid keys whose masks differ. bisect_left needs ascending
        # values, so it reads the masks in reverse chain order (key p at rev[n − 1 − p]): the
        # stretch is rev[lo:hi] and key a is rev[top] (grid has one more item than the others).
        stride = 1 << max((2 * n // first.bit_count()).bit_length() - 1, 0)
        grid = [first, *map(get, keys[stride - 1 : n - 1 : stride], repeat(0)), last]
        ends = grid[1:]
        rev = keys[n - 1 :: -1]
        mask_of = holders.__getitem__  # KeyError for a key nobody holds
        held = holders.__contains__
        owner = self._owner
        for top, start, end in compress(zip(range(n, 0, -stride), grid, ends, strict=False), map(ne, grid, ends)):
            hi, mask = top, start
            lo = hi - stride if hi > stride else 0
            try:
                tail = 0
                if not end:  # nobody holds key b: stop the stretch at the last key somebody holds
                    tail = bisect_left(rev, True, lo, hi, key=held)
                    if tail == hi:  # nor key a + 1
                        self._emit(mask & first, n - hi, ids, out)
                        continue
                    lo = tail
                    end = mask_of(rev[tail])
                while mask != end:
                    # rev[i]: the last key whose mask is still mask (rev[hi] if none later; i < n, as
                    # key 0's mask is first); rev[i − 1]: the next key
                    i = bisect_left(rev, mask, lo, hi, key=mask_of)
                    if i == lo or mask_of(rev[i]) != mask:
                        raise _Hole
                    nxt = mask_of(rev[i - 1])
                    gone = mask ^ nxt  # nxt < mask: one bit means it is mask's
                    iid = owner.get(gone)
                    if iid is not None:
                        out[iid] = n - i
                    else:
                        self._emit(gone & mask & first, n - i, ids, out)
                    mask, hi = nxt, i - 1
                if tail:
                    self._emit(end & first, n - tail, ids, out)
            except (KeyError, _Hole):  # the masks grow somewhere in the stretch: read it key by key
                a = n - 1 - top
                vals = [start, *map(get, keys[a + 1 : min(a + 1 + stride, n)], repeat(0))]
                for q in compress(range(1, len(vals)), map(ne, vals, vals[1:])):
                    self._emit(vals[q - 1] & ~vals[q] & first, a + q, ids, out)
        self._emit(last & first, n, ids, out)
        if len(out) > first.bit_count():  # the one-bit shortcut took instances without the first block
            bits, slot = self._bits, self._slot
            out = {i: d for i, d in out.items() if bits[slot[i]] & first}
        return out

    def _match_walk(self, keys: Sequence[BlockKey]) -> dict[InstanceId, int]:
        get = self._holders.get
        running = list(takewhile(bool, accumulate(map(get, keys, repeat(0)), and_)))
        if not running:
            return {}
        out: dict[InstanceId, int] = {}
        ids = self._ids
        prev = running[0]
        start = 0
        index = running.index
        for value in dict.fromkeys(running):
            if value == prev:
                continue
            start = index(value, start)
            self._emit(prev & ~value, start, ids, out)
            prev = value
        self._emit(prev, len(running), ids, out)
        return out

    @staticmethod
    def _emit(mask: int, depth: int, ids: list[InstanceId | None], out: dict[InstanceId, int]) -> None:
        while mask:
            low = mask & -mask
            iid = ids[low.bit_length() - 1]
            if iid is not None:
                out[iid] = depth
            mask ^= low
