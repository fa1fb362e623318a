"""The allocation result handed to the scheduler (SPEC §7, KVB-1..4).

A block is its int id. ``KVCacheBlocks.blocks[g]`` is the sequence of ids of KV cache group
``g``; the manager hands out a shared empty instance (one empty tuple per group) when nothing was
allocated (MGR-3).

Examples:
    >>> a = KVCacheBlocks(([1, 2], [3]))
    >>> (a + KVCacheBlocks(([4], ()))).get_block_ids()
    ([1, 2, 4], [3])
    >>> a.new_empty().get_block_ids(allow_none=True) is None
    True
"""

from __future__ import annotations

from typing import Protocol

from kvcore._native import KVCacheBlocksBase
from kvcore.errors import InvalidArgumentError, InvariantViolationError

__all__ = ["BlockHashSource", "KVCacheBlocks"]


class BlockHashSource(Protocol):
    """What :meth:`KVCacheBlocks.get_unhashed_block_ids` needs from the block pool."""

    @property
    def null_block(self) -> int:
        """Id of the null block."""
        ...

    def get_block_hashes(self, block_ids: list[int]) -> list[bytes | None]:
        """Primary keys of the given blocks (None when unhashed)."""
        ...


class KVCacheBlocks(KVCacheBlocksBase):
    """Block ids per KV cache group (KVB-1).

    ``KVCacheBlocks(blocks, block_pool=None)``. Storage, equality (on ``blocks`` and the exact
    class), ``repr`` and :meth:`get_block_ids` (KVB-2) are native
    (``kvcore._native.KVCacheBlocksBase``): the scheduler calls ``get_block_ids`` on every
    result. Instances are unhashable, like the reference's dataclass.

    Attributes:
        blocks: One sequence of block ids per group (a tuple).
        block_pool: The pool the ids belong to; needed only by the ``get_unhashed_*`` methods,
            which read hash state from it. Not part of equality.
    """

    __slots__ = ()
    __hash__ = None  # type: ignore[assignment]

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        """Concatenates group by group into lists (KVB-1)."""
        return KVCacheBlocks(
            tuple([*a, *b] for a, b in zip(self.blocks, other.blocks, strict=False)),
            self.block_pool if self.block_pool is not None else other.block_pool,
        )

    def _pool(self) -> BlockHashSource:
        pool: BlockHashSource | None = self.block_pool
        if pool is None:
            raise InvalidArgumentError(
                "this KVCacheBlocks has no block_pool; hash state is unknown"
            )
        return pool

    def get_unhashed_block_ids(self) -> list[int]:
        """Returns the ids without a primary key, null block included (KVB-3).

        Returns:
            Ids of the single group's blocks whose ``block_hash`` is None.

        Raises:
            AssertionError: There is not exactly one group.
        """
        if len(self.blocks) != 1:
            raise InvariantViolationError("get_unhashed_block_ids supports exactly one group")
        ids = [*self.blocks[0]]
        if not ids:
            return []
        hashes = self._pool().get_block_hashes(ids)
        return [b for b, h in zip(ids, hashes, strict=True) if h is None]

    def get_unhashed_block_ids_all_groups(self) -> list[list[int]]:
        """Returns, per group, the ids without a primary key, null blocks excluded (KVB-3)."""
        out: list[list[int]] = []
        pool = None
        for group in self.blocks:
            ids = [*group]
            if not ids:
                out.append([])
                continue
            if pool is None:
                pool = self._pool()
            null = pool.null_block
            hashes = pool.get_block_hashes(ids)
            out.append([b for b, h in zip(ids, hashes, strict=True) if h is None and b != null])
        return out

    def new_empty(self) -> KVCacheBlocks:
        """Returns an instance with one empty tuple per group (KVB-4)."""
        return KVCacheBlocks(tuple(() for _ in self.blocks), self.block_pool)
