"""KV-cache domain: our block keys, KV events, one instance's prefix-cached block pool,
and an index of many instances' caches."""

from core.cache.block_pool import Allocation, CacheStats, PrefixBlockPool, RequestId
from core.cache.events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from core.cache.index import CacheIndex, InstanceId, PrefixLookup
from core.cache.keys import ROOT_KEY, BlockKey, ExtraKey, chain_keys, extra_int, num_full_blocks

__all__ = [
    "MEDIUM_GPU",
    "ROOT_KEY",
    "AllBlocksCleared",
    "Allocation",
    "BlockKey",
    "BlockRemoved",
    "BlockStored",
    "CacheIndex",
    "CacheStats",
    "ExtraKey",
    "InstanceId",
    "KVEvent",
    "PrefixBlockPool",
    "PrefixLookup",
    "RequestId",
    "chain_keys",
    "extra_int",
    "num_full_blocks",
]
