"""KV-cache events of one instance, field for field the shape of vLLM's
BlockStored/BlockRemoved/AllBlocksCleared, keyed by our own block keys."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from core.cache.keys import BlockKey

MEDIUM_GPU = "GPU"
"""vLLM's name for the device tier (``vllm.distributed.kv_events.MEDIUM_GPU``)."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks became cached, in chain order.

    ``keys[0]``'s parent is ``parent_key`` (None: the chain starts at the prompt's first block);
    each later key's parent is the key before it. ``token_ids`` holds ``block_size`` tokens per
    key, concatenated, as vLLM sends them, so a consumer can recompute keys of its own.
    """

    keys: tuple[BlockKey, ...]
    parent_key: BlockKey | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None

    def blocks(self) -> list[tuple[BlockKey, tuple[int, ...]]]:
        """Each key with its own block's token ids."""
        bs = self.block_size
        return [(k, self.token_ids[i * bs : (i + 1) * bs]) for i, k in enumerate(self.keys)]


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Cached blocks were evicted (their keys are no longer held by the instance)."""

    keys: tuple[BlockKey, ...]
    medium: str | None = MEDIUM_GPU


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The instance dropped its whole prefix cache (``/reset_prefix_cache``, a restart)."""


KVEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared
"""Any one of the three events, in the order the instance emitted them."""
