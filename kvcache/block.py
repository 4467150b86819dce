"""KV-cache blocks and the intrusive free-block queue.

The queue threads its doubly linked list through the blocks themselves (no wrapper nodes), so a
prefix hit can pull a free cached block out of the middle in O(1), and the LRU order is simply
the list order: the head is evicted first.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, NewType, Sequence

BlockHash = NewType("BlockHash", bytes)
BlockId = NewType("BlockId", int)


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: BlockId
    ref_cnt: int = 0
    # Set while the block is in the prefix cache (full and hashed); None otherwise.
    block_hash: BlockHash | None = None
    # The exact bytes that were hashed (parent hash, token ids, extra keys), kept so a hit can be
    # verified against the request's own key; None when verification is off.
    hash_key: bytes | None = None
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None
    # The null block pads block tables; it is never freed, hashed or counted.
    is_null: bool = False
    # The cache salt of the requests that hold it or cached it (None: unsalted); meaningless
    # while the block is plain free (ref count 0, no hash).
    tenant: str | None = None

    def reset_hash(self) -> None:
        self.block_hash = None
        self.hash_key = None

    def __repr__(self) -> str:
        prev_id = self.prev_free.block_id if self.prev_free else None
        next_id = self.next_free.block_id if self.next_free else None
        return (f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, "
                f"cached={self.block_hash is not None}, prev={prev_id}, next={next_id})")


class FreeKVCacheBlockQueue:
    """Doubly linked list of ref-count-0 blocks between two sentinels.

    Invariant: a block is linked (prev_free and next_free set) iff it is in the queue.
    """

    __slots__ = ("num_free_blocks", "_head", "_tail")

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(BlockId(-1))
        self._tail = KVCacheBlock(BlockId(-2))
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def __len__(self) -> int:
        return self.num_free_blocks

    def head(self) -> KVCacheBlock | None:
        """The block evicted first, left in place; None when the queue is empty."""
        block = self._head.next_free
        return None if block is self._tail else block

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free blocks left")
        self._unlink(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, only {self.num_free_blocks} left")
        out = []
        block = self._head.next_free
        for _ in range(n):
            out.append(block)
            nxt = block.next_free
            block.prev_free = block.next_free = None
            block = nxt
        self._head.next_free = block
        block.prev_free = self._head
        self.num_free_blocks -= n
        return out

    def remove_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Unlinks blocks that are all in the queue (remove, looped without a call each)."""
        for block in blocks:
            prev, nxt = block.prev_free, block.next_free
            if prev is None or nxt is None:
                raise RuntimeError(f"block {block.block_id} is not in the free queue")
            prev.next_free = nxt
            nxt.prev_free = prev
            block.prev_free = block.next_free = None
        self.num_free_blocks -= len(blocks)

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise RuntimeError(f"block {block.block_id} is not in the free queue")
        self._unlink(block)

    def append(self, block: KVCacheBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise RuntimeError(f"block {block.block_id} is already in the free queue")
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        last = self._tail.prev_free
        count = 0
        for block in blocks:
            if block.prev_free is not None or block.next_free is not None:
                raise RuntimeError(f"block {block.block_id} is already in the free queue")
            last.next_free = block
            block.prev_free = last
            last = block
            count += 1
        last.next_free = self._tail
        self._tail.prev_free = last
        self.num_free_blocks += count

    def peek_ids(self) -> list[int]:
        """Block ids from head (evicted first) to tail; O(n), for tests and debugging."""
        ids = []
        block = self._head.next_free
        while block is not self._tail:
            ids.append(block.block_id)
            block = block.next_free
        return ids

    def _unlink(self, block: KVCacheBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1
