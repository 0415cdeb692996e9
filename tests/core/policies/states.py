"""Dispatcher states built by hand for the policy tests: a prefix index with held blocks, and running requests."""

from __future__ import annotations

from typing import Any

from core.cache.events import BlockStored
from core.cache.index import CacheIndex
from core.cache.keys import chain_keys
from core.dispatch import Dispatcher
from core.types import Request, Role
from tests.helpers import toy_profile

BS = 16
KEYS = tuple(chain_keys(list(range(640)), BS))  # 40 blocks
"""A 640-token prompt's keys; prompts below use prefixes of it."""


def prefix_cluster(
    policy: str,
    params: dict[str, Any] | None = None,
    *,
    prefill: int = 3,
    decode: int = 3,
    held: dict[str, int] | None = None,
    decode_only: bool = True,
    **kw: Any,
) -> Dispatcher:
    """A dispatcher whose prefix view is an index in which instance i holds held[i] leading blocks."""
    prof = toy_profile(
        prefill_base_s=0.0, prefill_per_token_s=0.001, kv_transfer_per_token_s=0.0001, max_model_len=4096
    )
    d = Dispatcher(prof, policy, params, **kw)
    for i in range(prefill):
        d.add_instance(f"p{i}", Role.PREFILL)
    for i in range(decode):
        d.add_instance(f"d{i}", Role.DECODE)
    index = CacheIndex(ttl_s=None)
    for iid, n in (held or {}).items():
        index.apply(iid, BlockStored(KEYS[:n], None, (), BS))
    d.use_prefix_lookup(index, BS, decode_only=decode_only)
    return d


def prefix_request(rid: str = "r", tokens: int = 640, session: str = "") -> Request:
    """A request whose prompt is the first `tokens` tokens of KEYS' prompt."""
    return Request(rid, 0.0, tokens, 10, prefix_keys=KEYS[: tokens // BS], session=session)


def decode_cluster(n_decode: int, **profile: Any) -> Dispatcher:
    """Round robin over one prefill and `n_decode` decode instances on a toy profile."""
    d = Dispatcher(toy_profile(**profile), "round_robin")
    d.add_instance("p0", Role.PREFILL)
    for k in range(n_decode):
        d.add_instance(f"d{k}", Role.DECODE)
    return d


def run_observed(d: Dispatcher, rid: str, inst: str, *, prompt: int, generated: int, out: int) -> None:
    """A RUNNING request with `generated` tokens observed at t=0 (no drift: rate 0)."""
    t = d.view.table
    i = t.add(rid)
    x = d.index_of(inst)
    t.inst[i], t.state[i], t.l_in[i] = x, 2, prompt
    t.l_obs[i], t.t_obs[i], t.v[i], t.max_out[i] = generated, 0.0, 0.0, out
    d.view.running_n[x] += 1
