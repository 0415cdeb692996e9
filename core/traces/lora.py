"""LoRA adapters per trace row: a seeded Zipf mix over N adapter names, and the check a trace's `lora` value passes."""

from __future__ import annotations

import re

import numpy as np

from core.errors import TraceError

ADAPTER_NAME = re.compile(r"[^\s,]+")
"""An adapter name as a trace may give it: no whitespace, no comma (vLLM's `vllm:lora_requests_info` joins
the adapters' names with commas, so a name holding one could not be told apart there)."""

MIX_SEED_OFFSET = 0x10_2A
"""Added to the run's seed for the mix's own generator: the same --seed draws the same arrivals and
lengths with or without a mix."""


def adapter_names(count: int) -> list[str]:
    """The synthetic adapters' names, most popular first: lora-00, lora-01, ... (zero-padded to sort)."""
    width = max(2, len(str(max(count - 1, 0))))
    return [f"lora-{k:0{width}d}" for k in range(count)]


def zipf_weights(count: int, skew: float) -> np.ndarray:
    """Zipf(skew) over `count` ranks: weight of rank k (1-based) ∝ k^-skew, normalised (skew 0: uniform)."""
    if count < 1:
        raise TraceError(f"--lora-adapters must be >= 1, got {count}")
    if not (skew >= 0 and np.isfinite(skew)):
        raise TraceError(f"--lora-skew must be a finite number >= 0, got {skew}")
    w = np.arange(1, count + 1, dtype=np.float64) ** -skew
    out: np.ndarray = w / w.sum()
    return out


def zipf_mix(requests: int, count: int, skew: float, seed: int = 0) -> list[str | None]:
    """An adapter for each of `requests` rows, drawn independently from Zipf(skew) over `count` adapters
    (adapter_names), with a generator seeded from `seed` alone."""
    weights = zipf_weights(count, skew)
    names = adapter_names(count)
    rng = np.random.default_rng(seed + MIX_SEED_OFFSET)
    ranks = rng.choice(count, size=requests, p=weights)
    return [names[k] for k in ranks.tolist()]


def adapter_value(raw: object) -> str | None:
    """A trace's `lora` value: the adapter's name, or None for the base model (empty, null). ValueError
    (its message says why) for anything else."""
    if raw is None:
        return None
    if not isinstance(raw, str):
        raise ValueError(f"expected an adapter name (a string) or empty, got {str(raw)[:40]!r}")
    name = raw.strip()
    if not name:
        return None
    if not ADAPTER_NAME.fullmatch(name):
        raise ValueError(f"an adapter name has no whitespace or comma, got {name[:40]!r}")
    return name
