"""KV-cache bookkeeping: blocks, the free queue, block hashing, the block pool and the manager.

Pure CPU bookkeeping: imports nothing but stdlib, xxhash and numpy (never torch or ray).
"""
from tierserve.kvcache.block import BlockHash, BlockId, FreeKVCacheBlockQueue, KVCacheBlock
from tierserve.kvcache.block_pool import BlockPool
from tierserve.kvcache.events import KVEventRecorder, KVTier
from tierserve.kvcache.hashing import HASH_ALGORITHMS, BlockHasher, encode_extra_keys
from tierserve.kvcache.manager import KVCacheManager, PrefixCacheStats
from tierserve.kvcache.tiers import SlotState, SlotTier, TierHit, TierManager, TierSlot, TierStats

__all__ = [
    "BlockHash", "BlockId", "FreeKVCacheBlockQueue", "KVCacheBlock", "BlockPool",
    "KVEventRecorder", "KVTier",
    "BlockHasher", "HASH_ALGORITHMS", "encode_extra_keys", "KVCacheManager", "PrefixCacheStats",
    "SlotState", "SlotTier", "TierHit", "TierManager", "TierSlot", "TierStats",
]
