"""A prefill profile in round numbers for the prefill-projection tests, and its step time by hand."""

from __future__ import annotations

from typing import Any

from tests.helpers import toy_profile


def profile(**kw: Any) -> Any:
    """Round numbers: a step 10 ms + 1 ms a sequence, prefill 5 ms once a step + 10 µs a token
    (+ 1e-8 s a token² where asked), a 2048-token budget."""
    base: dict[str, Any] = dict(
        decode_step_base_s=0.010,
        decode_step_per_seq_s=0.001,
        prefill_base_s=0.005,
        prefill_per_token_s=0.00001,
        max_num_batched_tokens=2048,
        block_size=16,
    )
    return toy_profile(**{**base, **kw})


def step(seqs: int, tokens: float) -> float:
    """One prefill step by hand: 10 ms + 1 ms·seqs + 5 ms + 10 µs·tokens."""
    return 0.010 + 0.001 * seqs + 0.005 + 0.00001 * tokens
