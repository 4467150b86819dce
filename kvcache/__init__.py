"""KV-cache bookkeeping: blocks, the free queue, block hashing, the block pool, the manager, and
the KV tiers' index and policy.

Pure CPU bookkeeping: imports nothing but stdlib, xxhash and numpy (never torch or ray).
"""
from tierserve.kvcache.block import BlockHash, BlockId, FreeKVCacheBlockQueue, KVCacheBlock
from tierserve.kvcache.block_pool import BlockPool
from tierserve.kvcache.events import KVEventRecorder, KVTier
from tierserve.kvcache.hashing import HASH_ALGORITHMS, BlockHasher, encode_extra_keys
from tierserve.kvcache.manager import KVCacheManager, PrefixCacheStats
from tierserve.kvcache.tier_index import (
    ASYNC_KINDS, CopyKind, CpuSlot, CpuTier, SlotState, SsdEntry, SsdTier, TierIndex,
)
from tierserve.kvcache.tier_policy import (
    PREEMPTION_MODES, CopyBatch, CostModel, TierAdmission, TierHit, TierPolicy, TierStats,
)

__all__ = [
    "BlockHash", "BlockId", "FreeKVCacheBlockQueue", "KVCacheBlock", "BlockPool",
    "KVEventRecorder", "KVTier",
    "BlockHasher", "HASH_ALGORITHMS", "encode_extra_keys", "KVCacheManager", "PrefixCacheStats",
    "ASYNC_KINDS", "CopyKind", "CpuSlot", "CpuTier", "SlotState", "SsdEntry", "SsdTier",
    "TierIndex", "PREEMPTION_MODES", "CopyBatch", "CostModel", "TierAdmission", "TierHit",
    "TierPolicy", "TierStats",
]
