"""How a simulated prefill instance forms its next batch from its queue, and when that batch ends.

Prefill instances serve their queue FIFO: in ps mode one prompt at a time, for
profile.prefill_time(l); in iteration mode, as vLLM's scheduler does, the waiting prompts that fit
one step's token budget (profile.max_num_batched_tokens) and running slots go together, in
prefill_base_s plus each prompt's own cost plus the engine step the batch runs in (step_time(n,
prompt tokens), as the emulator and `calibrate` count it), and all end with the batch (unchunked:
a longer prompt runs alone). In both, a batch of n requests leaves the instance
n·prefill_host_per_request_s of host work that the next batch waits for. With a KV cache
(core/sim/cluster/cache.py) each prompt computes only its tokens not cached on the instance.
"""

from __future__ import annotations

from collections import deque

from core.perf import PerfProfile
from core.sim.cluster.cache import SimCache
from core.sim.cluster.result import Mode


def next_prefill_batch(
    queue: deque[int],
    x: int,
    *,
    profile: PerfProfile,
    mode: Mode,
    cache: SimCache | None,
    prompts: list[int],
    now: float,
    host_free: float,
) -> tuple[list[int], float, float]:
    """Take instance x's next batch off its `queue`: the head and, in iteration mode, the prompts
    behind it while they fit the step's token budget and running slots (vLLM schedules waiting
    prompts into one step; a prompt longer than the budget runs alone, unchunked). `host_free` is
    when the host work of the instance's previous batch ends. Returns the batch, when it ends, and
    when its own host work ends."""
    p = profile
    head = queue.popleft()
    batch = [head]
    # the tokens each prompt computes: all of them, or (with the cache) its uncached part here
    lens = [prompts[head] if cache is None else cache.prefill(x, head, prompts[head])]
    tokens = lens[0]
    if mode == "iteration":
        while queue and len(batch) < p.max_num_seqs:
            nxt = queue[0]
            c = prompts[nxt] if cache is None else cache.would_compute(x, nxt, prompts[nxt])
            if tokens + c > p.max_num_batched_tokens:
                break
            queue.popleft()
            if cache is not None:
                c = cache.prefill(x, nxt, prompts[nxt])
            tokens += c
            batch.append(nxt)
            lens.append(c)
    begin = max(now, host_free)  # the previous batch's host work comes first
    end = begin + (p.prefill_time(lens[0]) if len(batch) == 1 else p.prefill_batch_time(lens))
    if mode == "iteration":  # the engine step the batch runs in, which samples its first tokens
        end += p.step_time(len(batch), float(tokens))
    return batch, end, end + p.prefill_host_per_request_s * len(batch)
