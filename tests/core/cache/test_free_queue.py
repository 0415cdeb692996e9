"""The free queue in runs: the same order as an ordered dict of blocks under the same calls, and bounded upkeep."""

from __future__ import annotations

import random
from collections import OrderedDict

import numpy as np
import pytest

from core.cache.free_queue import FreeQueue


def ids(*blocks: int) -> np.ndarray:
    return np.array(blocks, dtype=np.intp)


def test_a_fresh_queue_hands_out_blocks_in_order_and_never_the_null_block() -> None:
    q = FreeQueue(6)
    assert len(q) == 5 and q.order() == [1, 2, 3, 4, 5]
    assert q.take(2).tolist() == [1, 2] and q.order() == [3, 4, 5]
    with pytest.raises(ValueError, match="cannot take 4"):
        q.take(4)
    assert q.take(0).tolist() == []


def test_pushes_removals_and_takes_keep_the_lru_order() -> None:
    q = FreeQueue(8)  # 1..7
    taken = q.take(5)  # 1..5 in use; 6, 7 free
    assert taken.tolist() == [1, 2, 3, 4, 5]
    q.push_back(ids(3, 2))  # cached, tail first
    q.push_front(ids(5, 4))  # uncached: reused first, 5 at the head
    assert q.order() == [5, 4, 6, 7, 3, 2]
    q.remove(ids(6, 3))  # hits on free cached blocks leave from the middle
    assert q.order() == [5, 4, 7, 2] and len(q) == 4
    assert q.take(3).tolist() == [5, 4, 7]
    q.push_back(ids(6))
    assert q.order() == [2, 6]
    q.push_back(ids(3))
    assert q.take(3).tolist() == [2, 6, 3] and len(q) == 0 and q.order() == []


def test_random_calls_match_an_ordered_dict_and_dead_entries_stay_bounded() -> None:
    rng = random.Random(11)
    n = 40
    q = FreeQueue(n)
    model: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, n))
    out: list[int] = []  # blocks not in the queue
    for _ in range(5000):
        op = rng.random()
        if op < 0.25 and model:
            k = rng.randint(1, len(model))
            want = [model.popitem(last=False)[0] for _ in range(k)]
            assert q.take(k).tolist() == want
            out += want
        elif op < 0.5 and model:  # touch some free blocks (most of the time no takes: dead entries pile up)
            gone = rng.sample(list(model), rng.randint(1, min(4, len(model))))
            for b in gone:
                del model[b]
            q.remove(np.array(gone, dtype=np.intp))
            out += gone
        elif out:
            rng.shuffle(out)
            k = rng.randint(1, len(out))
            back, out = out[:k], out[k:]
            if op < 0.8:
                q.push_back(np.array(back, dtype=np.intp))
                model.update(OrderedDict.fromkeys(back))
            else:
                q.push_front(np.array(back, dtype=np.intp))
                for b in reversed(back):
                    model[b] = None
                    model.move_to_end(b, last=False)
        assert len(q) == len(model)
        assert q.order() == list(model)
        assert q.entries <= 2 * n + 64 + n


def test_a_prefix_hit_and_freed_again_and_again_is_compacted_not_piled_up() -> None:
    q = FreeQueue(11)  # 1..10
    hot = q.take(3)  # a prefix in use
    for _ in range(200):  # freed, hit while free, freed again: no block is ever taken, every push a new run
        q.push_back(hot[::-1].copy())
        q.remove(hot)
    assert q.entries <= 2 * 11 + 64
    q.push_back(hot[::-1].copy())
    assert q.order() == [4, 5, 6, 7, 8, 9, 10, 3, 2, 1] and len(q) == 10
    assert q.take(10).tolist() == [4, 5, 6, 7, 8, 9, 10, 3, 2, 1]
