"""A trace's per-request columns as the simulator's event loop reads them, and the Request each row becomes."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from core.sim.cluster.cache import SimCache
from core.types import Request


class TraceRows:
    """Arrivals (sorted), prompt and output tokens (at least 1), and the optional per-row priority,
    tenant, SLO class, session and LoRA adapter. Python lists beside the arrays: scalar access in the event loop
    is several times cheaper than NumPy's."""

    def __init__(
        self,
        arrivals: np.ndarray,
        prompt_tokens: np.ndarray,
        output_tokens: np.ndarray,
        priorities: np.ndarray | None = None,
        tenants: Sequence[str] | None = None,
        slo_classes: Sequence[str] | None = None,
        sessions: Sequence[str] | None = None,
        lora: Sequence[str | None] | None = None,
    ) -> None:
        if not np.all(np.diff(arrivals) >= 0):
            raise ValueError("arrivals must be sorted")
        self.arrival = np.asarray(arrivals, dtype=float)
        self.prompt = np.asarray(prompt_tokens, dtype=np.int64)
        self.out = np.maximum(np.asarray(output_tokens, dtype=np.int64), 1)
        self.arr_l: list[float] = self.arrival.tolist()
        self.prompt_l: list[int] = self.prompt.tolist()
        self.out_l: list[int] = self.out.tolist()
        self.prio_l: list[int] | None = None if priorities is None else np.asarray(priorities, dtype=np.int64).tolist()
        self.tenant_l: list[str] | None = None if tenants is None else list(tenants)
        self.slo_l: list[str] | None = None if slo_classes is None else list(slo_classes)
        self.session_l: list[str] | None = None if sessions is None else list(sessions)
        self.lora_l: list[str | None] | None = None if lora is None or not any(lora) else list(lora)
        plain = priorities is None and tenants is None and slo_classes is None and sessions is None
        self._plain = plain and self.lora_l is None

    def request(self, i: int, cache: SimCache | None) -> Request:
        """Row i as the dispatcher sees it; with a KV cache its prefix keys (`cache.arrive`, under its adapter)."""
        if cache is None and self._plain:
            return Request(i, self.arr_l[i], self.prompt_l[i], self.out_l[i])
        lora = None if self.lora_l is None else self.lora_l[i]
        return Request(
            i,
            self.arr_l[i],
            self.prompt_l[i],
            self.out_l[i],
            slo_class="default" if self.slo_l is None else self.slo_l[i],
            priority=0 if self.prio_l is None else self.prio_l[i],
            tenant="" if self.tenant_l is None else self.tenant_l[i],
            prefix_keys=() if cache is None else cache.arrive(i, self.prompt_l[i], lora),
            session="" if self.session_l is None else self.session_l[i],
            lora=lora,
        )
