"""When the advisor models the prefix cache in coarse blocks: the operator's rule (`[advisor] coarse_*`) and the
worker's record of what its last advices cost.

The exact cache model costs CPU in proportion to the prompt blocks a window holds; merging `blocks` engine blocks
into one modelled block (`advise(..., key_blocks=blocks)`, see console/advisor/simulate.py) divides that cost, at
a measured price in accuracy (docs/advisor.md). The rule, read top to bottom:

1. a window without prefix keys has no cache to model: exact (nothing to coarsen);
2. `blocks = 1`: always exact;
3. a cluster of more instances than `above_instances` (when set): coarse;
4. after an exact advice that took more than `budget_s` CPU seconds (`coarse_cpu_share` × `period_s`): coarse;
5. after a coarse advice: exact again once an exact one is estimated to fit the budget again, the estimate being
   the coarse advice's CPU seconds times what the last exact advice cost over the coarse one after it (the two
   windows overlap by all but one period); without such a pair, exact is tried again.

Each choice says why, and the advice carries it (`cache_model`, `cache_why`).
"""

from __future__ import annotations

from dataclasses import dataclass

EXACT = "exact prefix blocks"
NO_KEYS = "no prefix keys in the window: no cache to model"


def cache_label(key_blocks: int) -> str:
    """How an advice names its cache model: "exact prefix blocks" or "coarse prefix blocks (×8)"."""
    return EXACT if key_blocks <= 1 else f"coarse prefix blocks (×{key_blocks})"


@dataclass(frozen=True)
class CoarseRule:
    """The operator's rule (the module docstring's steps 2-4)."""

    blocks: int = 8
    """Engine blocks per modelled block when coarse (1: never coarse)."""
    above_instances: int | None = None
    """Always coarse for a cluster of more instances than this (None: by CPU only)."""
    budget_s: float | None = None
    """CPU seconds an exact advice may take before the next ones go coarse (None: never by CPU)."""


class CoarseChooser:
    """The rule applied advice after advice, in the worker process (`choose` before an advice, `record` after)."""

    def __init__(self, rule: CoarseRule) -> None:
        self.rule = rule
        self.last: tuple[int, float] | None = None
        """(key_blocks, CPU seconds) of the latest advice on a window with prefix keys."""
        self.ratio: float | None = None
        """The latest exact advice's CPU seconds over the coarse advice's right after it (at least 1)."""

    def choose(self, n_instances: int, has_keys: bool) -> tuple[int, str]:
        """The next advice's key_blocks (1: exact) and why."""
        rule = self.rule
        if not has_keys:
            return 1, NO_KEYS
        if rule.blocks <= 1:
            return 1, "coarse_blocks = 1: always exact"
        if rule.above_instances is not None and n_instances > rule.above_instances:
            return rule.blocks, f"{n_instances} instances > coarse_above_instances = {rule.above_instances}"
        if rule.budget_s is None or self.last is None:
            return 1, "exact unless an advice takes more than its budget"
        budget = f"the budget of {rule.budget_s:.1f} CPU s (coarse_cpu_share × period_s)"
        blocks, cpu_s = self.last
        if blocks <= 1:
            if cpu_s > rule.budget_s:
                return rule.blocks, f"the last exact advice took {cpu_s:.1f} CPU s, more than {budget}"
            return 1, f"the last exact advice took {cpu_s:.1f} CPU s, within {budget}"
        if self.ratio is None:
            return 1, "no exact advice to compare a coarse one with: trying exact"
        estimate = cpu_s * self.ratio
        how = f"about {estimate:.1f} CPU s (the last coarse advice's {cpu_s:.1f} s × {self.ratio:.2f})"
        if estimate > rule.budget_s:
            return rule.blocks, f"an exact advice would take {how}, more than {budget}"
        return 1, f"an exact advice would take {how}, within {budget}"

    def record(self, key_blocks: int, cpu_s: float, has_keys: bool) -> None:
        """An advice took `cpu_s` CPU seconds with this key_blocks (a window without prefix keys says nothing
        about the cache model's cost, and is not recorded)."""
        if not has_keys:
            return
        if key_blocks > 1 and self.last is not None and self.last[0] <= 1 and cpu_s > 0:
            self.ratio = max(self.last[1] / cpu_s, 1.0)
        self.last = (key_blocks, cpu_s)
