"""Per-attention-type block managers (SPEC §10–15).

One manager serves one KV cache group. It keeps, per request, the list of block ids the request
holds (``req_to_blocks``) and how many leading blocks caching has already processed
(``num_cached_block``; a request listed there is "running"). Blocks are ints; every pool call
takes or returns whole lists of ids, so the per-block work happens in the Rust pool.

The manager class of a spec is found along the spec's class hierarchy (SPEC-1, see
:func:`get_manager_class`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kvcore.errors import InvalidConfigError, InvariantViolationError
from kvcore.specs import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    HiddenStateCacheSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    RSWASpec,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    TQFullAttentionSpec,
)

if TYPE_CHECKING:
    from kvcore._native import Retention
    from kvcore.request import Request

__all__ = [
    "BlockPoolLike",
    "ChunkedLocalAttentionManager",
    "CrossAttentionManager",
    "FullAttentionManager",
    "MambaManager",
    "RSWAManager",
    "SingleTypeKVCacheManager",
    "SinkFullAttentionManager",
    "SlidingWindowManager",
    "get_manager_class",
    "get_manager_for_kv_cache_spec",
    "spec_manager_map",
]


class BlockPoolLike(Protocol):
    """The part of ``kvcore.BlockPool`` the managers use (SPEC §4)."""

    @property
    def null_block(self) -> int:
        """Id of the null block (0)."""
        ...

    @property
    def hash_block_size(self) -> int:
        """Tokens per block hash."""
        ...

    @property
    def num_gpu_blocks(self) -> int:
        """Blocks in the pool."""
        ...

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """Pops ``num_blocks`` free blocks (POOL-5, POOL-6)."""
        ...

    def touch(self, block_ids: list[int]) -> None:
        """Takes a reference on each block (POOL-9)."""
        ...

    def free_blocks(self, ordered_block_ids: list[int], retention: Retention | None = None) -> None:
        """Drops a reference on each block (POOL-10; retention: CC-1)."""
        ...

    def cache_full_blocks(
        self,
        request: Any,
        blocks: list[int],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: list[bool] | None = None,
    ) -> None:
        """Enters full blocks into the prefix cache (POOL-13..17)."""
        ...

    def get_cached_block(
        self, block_hash: bytes, kv_cache_group_ids: list[int]
    ) -> list[int] | None:
        """Looks a hash up in every given group (POOL-4)."""
        ...

    def last_aligned_hit(
        self,
        block_hashes: Sequence[bytes],
        max_num_blocks: int,
        kv_cache_group_ids: list[int],
        block_size: int,
        alignment_tokens: int,
    ) -> tuple[int, list[int]] | None:
        """The Mamba hit search (MAMBA-2)."""
        ...

    def sliding_window_hit(
        self,
        block_hashes: Sequence[bytes],
        max_num_blocks: int,
        kv_cache_group_ids: list[int],
        need: int,
        block_size: int,
        alignment_tokens: int,
        drop_eagle_block: bool,
    ) -> list[list[int]]:
        """The sliding-window hit search (SWA-3)."""
        ...

    def get_num_free_blocks(self) -> int:
        """Free blocks (POOL-2)."""
        ...

    def get_ref_cnts(self, block_ids: list[int]) -> list[int]:
        """Reference counts of the given blocks."""
        ...

    def get_block_hashes(self, block_ids: list[int]) -> list[bytes | None]:
        """Primary keys of the given blocks."""
        ...

    def count_evictable(self, block_ids: list[int]) -> int:
        """How many of the given blocks sit in the free queue (ref 0, not null)."""
        ...

    def longest_cached_prefix(
        self,
        block_hashes: Sequence[bytes],
        max_num_blocks: int,
        kv_cache_group_ids: list[int],
        stride: int = 1,
    ) -> list[list[int]]:
        """FA-1's left-to-right walk in one call: hits per group up to the first miss."""
        ...

    def get_usage(self) -> float:
        """Fraction of non-null blocks in use (POOL-3)."""
        ...

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Drops the keys of the given blocks (POOL-20)."""
        ...

    def reset_prefix_cache(self) -> bool:
        """Clears the prefix cache when no block is in use (POOL-21)."""
        ...

    def take_events(self) -> list[Any]:
        """Drains the queued KV events (POOL-22)."""
        ...


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# MGR-29: only managers whose spec is exactly one of these types record new block ids.
_RECORDING_SPEC_TYPES: frozenset[type[KVCacheSpec]] = frozenset(
    {FullAttentionSpec, TQFullAttentionSpec, MLAAttentionSpec, HiddenStateCacheSpec}
)

HitBlocks = tuple[list[int], ...]
"""Per-group lists of hit block ids, as returned by ``find_longest_cache_hit``."""


class SingleTypeKVCacheManager:
    """Base manager: the bookkeeping shared by every attention type (STM-1..12).

    Attributes:
        kv_cache_spec: The group's spec.
        block_size: ``spec.block_size * dcp * pcp`` (STM-1).
        block_pool: The shared pool.
        enable_caching: Whether prefix caching is on.
        kv_cache_group_id: The group id.
        scheduler_block_size: The scheduling granularity (a multiple of ``block_size``).
        req_to_blocks: Request id to its block ids (a default-dict, as in the reference).
        num_cached_block: Request id to the number of leading blocks caching processed.
        new_block_ids: Ids allocated since the last :meth:`take_new_block_ids` (MGR-29).
        use_eagle: Whether this group's hits drop the EAGLE block (set by the coordinator).
    """

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        block_pool: BlockPoolLike,
        enable_caching: bool,
        kv_cache_group_id: int,
        scheduler_block_size: int,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
        max_admission_blocks_per_request: int | None = None,
    ) -> None:
        """Builds the manager of one group.

        Args:
            kv_cache_spec: The group's spec.
            block_pool: The shared block pool.
            enable_caching: Whether prefix caching is on.
            kv_cache_group_id: The group id.
            scheduler_block_size: The scheduling granularity.
            dcp_world_size: Decode context-parallel world size.
            pcp_world_size: Prefill context-parallel world size.
            max_admission_blocks_per_request: The admission cap (SWA-1, CLA-1), or None.
        """
        self.scheduler_block_size = scheduler_block_size
        self.block_size = kv_cache_spec.block_size * dcp_world_size * pcp_world_size
        self.dcp_world_size = dcp_world_size
        self.pcp_world_size = pcp_world_size
        self.kv_cache_spec = kv_cache_spec
        self.block_pool = block_pool
        self.enable_caching = enable_caching
        self._max_admission_blocks_per_request = max_admission_blocks_per_request
        self.new_block_ids: list[int] = []
        self.req_to_blocks: defaultdict[str, list[int]] = defaultdict(list)
        self.num_cached_block: dict[str, int] = {}
        self.kv_cache_group_id = kv_cache_group_id
        self._null_block = block_pool.null_block
        self._records_new_ids = type(kv_cache_spec) in _RECORDING_SPEC_TYPES
        self.use_eagle = False

    # ----------------------------------------------------------------------------------------
    # Capacity and allocation

    def _num_evictable(self, block_ids: Sequence[int]) -> int:
        """Counts the blocks that sit in the free queue (``ref_cnt == 0``, not null)."""
        if not block_ids:
            return 0
        ids = block_ids if isinstance(block_ids, list) else list(block_ids)
        return self.block_pool.count_evictable(ids)

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[int],
        total_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
    ) -> int:
        """Blocks an allocation of ``num_tokens`` slots would take from the free queue (STM-2).

        Args:
            request_id: The request id.
            num_tokens: Tokens that need a slot, already allocated ones included.
            new_computed_blocks: Prefix-cache hits not yet added to the request.
            total_computed_tokens: Local plus external computed tokens.
            num_tokens_main_model: Tokens of the main model (without lookahead).
            apply_admission_cap: Clamp to the admission cap (SWA-1, CLA-1).

        Returns:
            New blocks plus hits that are currently evictable.

        Raises:
            InvariantViolationError: Hits were given for a running request.
        """
        bs = self.block_size
        num_required = -(-num_tokens // bs)
        cap = self._max_admission_blocks_per_request
        if apply_admission_cap and cap is not None and cap < num_required:
            num_required = cap
        blocks = self.req_to_blocks.get(request_id)
        have = len(blocks) if blocks is not None else 0
        if request_id in self.num_cached_block:
            if new_computed_blocks:
                raise InvariantViolationError("a running request cannot have new prefix hits")
            return num_required - have if num_required > have else 0
        num_skipped_blocks = self.get_num_skipped_tokens(total_computed_tokens) // bs
        num_new = num_required - max(num_skipped_blocks, len(new_computed_blocks) + have)
        if num_new < 0:
            num_new = 0
        start = num_skipped_blocks - have
        hits = new_computed_blocks[start:] if start > 0 else new_computed_blocks
        return num_new + self._num_evictable(hits)

    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[int],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        """Adds prefix-cache hits to a request that holds no blocks yet (STM-4).

        Args:
            request_id: The request id.
            new_computed_blocks: The hits.
            num_local_computed_tokens: Local computed tokens, hits included.
            num_external_computed_tokens: Tokens computed by a KV connector.

        Raises:
            InvariantViolationError: The request already holds blocks, or hits were given with
                caching off.
        """
        req_blocks = self.req_to_blocks[request_id]
        if req_blocks:
            raise InvariantViolationError(f"request {request_id!r} already holds blocks")
        total = num_local_computed_tokens + num_external_computed_tokens
        num_skipped_blocks = self.get_num_skipped_tokens(total) // self.block_size
        hits = new_computed_blocks
        if num_skipped_blocks > 0:
            hits = new_computed_blocks[num_skipped_blocks:]
        hit_list = hits if isinstance(hits, list) else list(hits)
        if self.enable_caching:
            if hit_list:
                self.block_pool.touch(hit_list)
        elif hit_list:
            raise InvariantViolationError("prefix hits given while prefix caching is off")
        if num_skipped_blocks > 0:
            req_blocks.extend([self._null_block] * num_skipped_blocks)
        req_blocks.extend(hit_list)
        self.num_cached_block[request_id] = len(req_blocks)

    def allocate_external_computed_blocks(
        self,
        request_id: str,
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        """Allocates blocks for tokens a KV connector computed (STM-5).

        Args:
            request_id: The request id.
            num_local_computed_tokens: Local computed tokens.
            num_external_computed_tokens: Tokens computed by the connector.
        """
        total = num_local_computed_tokens + num_external_computed_tokens
        num_skipped = self.get_num_skipped_tokens(total)
        ext = num_external_computed_tokens
        if num_skipped > 0:
            ext = min(total - num_skipped, ext)
        if ext <= 0:
            return
        req_blocks = self.req_to_blocks[request_id]
        n = _cdiv(total, self.block_size) - len(req_blocks)
        if n <= 0:
            return
        new_blocks = self.block_pool.get_new_blocks(n)
        req_blocks.extend(new_blocks)
        if self._records_new_ids:
            self.new_block_ids.extend(new_blocks)

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> list[int]:
        """Gives the request at least ``num_tokens`` slots (STM-3).

        Args:
            request_id: The request id.
            num_tokens: Tokens that need a slot, already allocated ones included.
            num_tokens_main_model: Tokens of the main model (without lookahead).

        Returns:
            The newly allocated block ids, in allocation order.
        """
        req_blocks = self.req_to_blocks[request_id]
        n = -(-num_tokens // self.block_size) - len(req_blocks)
        if n <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(n)
        req_blocks.extend(new_blocks)
        if self._records_new_ids:
            self.new_block_ids.extend(new_blocks)
        return new_blocks

    def take_new_block_ids(self) -> list[int]:
        """Drains the ids recorded since the last call (MGR-29)."""
        ids = self.new_block_ids
        self.new_block_ids = []
        return ids

    # ----------------------------------------------------------------------------------------
    # Caching

    def cache_blocks(
        self, request: Request, num_tokens: int, retention_interval: int | None = None
    ) -> None:
        """Enters the request's newly full blocks into the prefix cache (STM-6).

        Args:
            request: The request.
            num_tokens: Tokens to cover, already cached ones included.
            retention_interval: Sparse retention interval (RET-1), or None.
        """
        request_id = request.request_id
        num_cached = self.num_cached_block.get(request_id, 0)
        num_full = num_tokens // self.block_size
        if num_cached >= num_full:
            return
        mask = self.reachable_block_mask(
            num_cached,
            num_full,
            self.scheduler_block_size,
            self.kv_cache_spec,
            self.use_eagle,
            retention_interval,
            request.num_prompt_tokens,
        )
        self.block_pool.cache_full_blocks(
            request,
            self.req_to_blocks[request_id],
            num_cached,
            num_full,
            self.block_size,
            self.kv_cache_group_id,
            mask,
        )
        self.num_cached_block[request_id] = num_full

    @classmethod
    def reachable_block_mask(
        cls,
        start_block: int,
        end_block: int,
        alignment_tokens: int | None,
        kv_cache_spec: KVCacheSpec,
        use_eagle: bool,
        retention_interval: int | None = None,
        num_prompt_tokens: int | None = None,
    ) -> list[bool] | None:
        """Which of the blocks ``[start_block, end_block)`` to cache; None caches all.

        Args:
            start_block: First block.
            end_block: One past the last block.
            alignment_tokens: Hit granularity, or None.
            kv_cache_spec: The spec.
            use_eagle: Whether hits drop the EAGLE block.
            retention_interval: Sparse retention interval, or None.
            num_prompt_tokens: Prompt length, or None.

        Returns:
            None (the base caches every block).
        """
        return None

    # ----------------------------------------------------------------------------------------
    # Freeing

    def pop_blocks_for_free(self, request_id: str) -> list[int]:
        """Forgets the request and returns its blocks in allocation order (STM-10)."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_block.pop(request_id, None)
        return blocks

    def free(self, request_id: str, retention: Retention | None = None) -> None:
        """Frees the request's blocks, tail first (STM-10, MGR-20); unknown ids are a no-op.

        ``retention`` (CC-1) places the cached ones in the eviction order.
        """
        blocks = self.pop_blocks_for_free(request_id)
        if blocks:
            blocks.reverse()
            self.block_pool.free_blocks(blocks, retention)

    def _remove_blocks_in_range(self, request_id: str, first_block: int, last_block: int) -> None:
        """Frees ``[first_block, last_block)`` back to front, replacing them by null (STM-8)."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None or first_block >= last_block:
            return
        last_block = min(last_block, len(blocks))
        null = self._null_block
        freed: list[int] = []
        for i in range(last_block - 1, first_block - 1, -1):
            b = blocks[i]
            if b == null:
                break
            freed.append(b)
            blocks[i] = null
        if freed:
            self.block_pool.free_blocks(freed)

    def remove_skipped_blocks(
        self, request_id: str, total_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        """Frees the blocks the attention no longer reads (STM-7).

        Args:
            request_id: The request id.
            total_computed_tokens: Local plus external computed tokens.
            num_prompt_tokens: Prompt length (used by R-SWA only).
        """
        num_skipped = self.get_num_skipped_tokens(total_computed_tokens)
        if num_skipped <= 0:
            return
        blocks = self.req_to_blocks[request_id]
        n = min(num_skipped // self.block_size, len(blocks))
        self._remove_blocks_in_range(request_id, 0, n)

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens outside the attention window after ``num_computed_tokens`` (STM-9: 0)."""
        return 0

    def new_step_starts(self) -> None:
        """Called at the start of each scheduler step (STM-9: nothing)."""
        return None

    # ----------------------------------------------------------------------------------------
    # Lookup

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        """Leading blocks shared by every request (STM-12: 0 unless full attention)."""
        return 0

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[bytes],
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: BlockPoolLike,
        kv_cache_spec: KVCacheSpec,
        drop_eagle_block: bool,
        alignment_tokens: int,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
    ) -> HitBlocks:
        """Longest cached prefix of at most ``max_length`` tokens, per group.

        Args:
            block_hashes: The request's hashes at this spec's block size.
            max_length: Longest hit, in tokens.
            kv_cache_group_ids: Groups looked up together (all share the spec).
            block_pool: The pool.
            kv_cache_spec: The spec.
            drop_eagle_block: Drop the last matched block (EAGLE-1).
            alignment_tokens: The hit length must be a multiple of this.
            dcp_world_size: Decode context-parallel world size.
            pcp_world_size: Prefill context-parallel world size.

        Returns:
            One list of hit block ids per group (null ids for skipped blocks).
        """
        raise NotImplementedError


def _pop_all(lists: HitBlocks) -> None:
    for blocks in lists:
        blocks.pop()


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full attention (§11): prefix hits scan left to right; blocks kept until free."""

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[bytes],
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: BlockPoolLike,
        kv_cache_spec: KVCacheSpec,
        drop_eagle_block: bool,
        alignment_tokens: int,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
    ) -> HitBlocks:
        """Left-to-right prefix scan that stops at the first miss (FA-1)."""
        if not isinstance(kv_cache_spec, FullAttentionSpec | ChunkedLocalAttentionSpec):
            raise InvariantViolationError(
                "FullAttentionManager serves full and chunked-local attention specs only"
            )
        block_size = kv_cache_spec.block_size * dcp_world_size * pcp_world_size
        max_blocks = max_length // block_size
        computed: HitBlocks = (
            tuple(block_pool.longest_cached_prefix(block_hashes, max_blocks, kv_cache_group_ids))
            if max_blocks > 0
            else tuple([] for _ in kv_cache_group_ids)
        )
        if drop_eagle_block and computed and computed[0]:
            _pop_all(computed)
        if computed and block_size != alignment_tokens:
            while len(computed[0]) * block_size % alignment_tokens:
                _pop_all(computed)
        return computed

    def remove_skipped_blocks(
        self, request_id: str, total_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        """Full attention skips nothing (STM-7 with STM-9's zero)."""
        return None

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        """Leading blocks whose ref count equals the number of tracked requests (FA-2)."""
        blocks = self.req_to_blocks[running_request_id]
        if not blocks:
            return 0
        num_reqs = len(self.req_to_blocks)
        n = 0
        for r in self.block_pool.get_ref_cnts(blocks):
            if r != num_reqs:
                break
            n += 1
        return n


class RSWAManager(FullAttentionManager):
    """Reference sliding-window attention: frees decode blocks behind the window (RSWA-1)."""

    def __init__(self, kv_cache_spec: KVCacheSpec, *args: Any, **kwargs: Any) -> None:
        """Builds the manager; see :class:`SingleTypeKVCacheManager`."""
        super().__init__(kv_cache_spec, *args, **kwargs)
        if not isinstance(kv_cache_spec, RSWASpec):
            raise InvalidConfigError("RSWAManager needs an RSWASpec")
        self.rswa_window: int = kv_cache_spec.rswa_window

    def remove_skipped_blocks(
        self, request_id: str, total_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        """Frees the gap between the prompt and the decode window (RSWA-1)."""
        if num_prompt_tokens is None:
            return
        bs = self.block_size
        first = -(-num_prompt_tokens // bs)
        window_start = max(num_prompt_tokens, total_computed_tokens - self.rswa_window)
        self._remove_blocks_in_range(request_id, first, window_start // bs)


class SinkFullAttentionManager(FullAttentionManager):
    """Full attention with reserved sink blocks (SINK-1, the intended behaviour).

    At construction the manager takes ``sink_len / block_size`` blocks off the front of the free
    queue; they never return to it.

    Attributes:
        sink_blocks: The reserved block ids.
    """

    def __init__(self, kv_cache_spec: KVCacheSpec, *args: Any, **kwargs: Any) -> None:
        """Builds the manager and reserves the sink blocks.

        Raises:
            InvalidConfigError: ``sink_len`` is not a positive multiple of the block size.
        """
        super().__init__(kv_cache_spec, *args, **kwargs)
        sink_len = getattr(kv_cache_spec, "sink_len", None)
        if sink_len is None or sink_len <= 0 or sink_len % self.block_size:
            raise InvalidConfigError(
                f"sink_len={sink_len} must be a positive multiple of block_size={self.block_size}"
            )
        # The pool has no "off the queue at ref 0" state, so the sink blocks are taken as
        # ordinary allocations: out of the queue for good, counted as used (ref_cnt 1, where
        # the intended design leaves 0).
        self.sink_blocks: list[int] = self.block_pool.get_new_blocks(sink_len // self.block_size)


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Sliding-window attention (§12).

    Attributes:
        sliding_window: The window in tokens.
    """

    def __init__(self, kv_cache_spec: KVCacheSpec, *args: Any, **kwargs: Any) -> None:
        """Builds the manager; see :class:`SingleTypeKVCacheManager`."""
        super().__init__(kv_cache_spec, *args, **kwargs)
        if not isinstance(kv_cache_spec, SlidingWindowSpec):
            raise InvalidConfigError("SlidingWindowManager needs a SlidingWindowSpec")
        self.sliding_window = kv_cache_spec.sliding_window

    @staticmethod
    def _contiguous_blocks_for_hit(window: int, block_size: int, use_eagle: bool) -> int:
        return _cdiv(window - 1, block_size) + (1 if use_eagle else 0)

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[bytes],
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: BlockPoolLike,
        kv_cache_spec: KVCacheSpec,
        drop_eagle_block: bool,
        alignment_tokens: int,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
    ) -> HitBlocks:
        """Right-to-left scan for a run of hits that covers the window (SWA-3)."""
        if not isinstance(kv_cache_spec, SlidingWindowSpec):
            raise InvariantViolationError("SlidingWindowManager serves sliding-window specs only")
        if dcp_world_size != 1 or pcp_world_size != 1:
            raise InvariantViolationError("sliding-window lookups need dcp == pcp == 1")
        bs = kv_cache_spec.block_size
        need = cls._contiguous_blocks_for_hit(kv_cache_spec.sliding_window, bs, drop_eagle_block)
        # The scan runs in the pool, in one call (BlockPool.sliding_window_hit).
        return tuple(
            block_pool.sliding_window_hit(
                block_hashes,
                max_length // bs,
                kv_cache_group_ids,
                need,
                bs,
                alignment_tokens,
                drop_eagle_block,
            )
        )

    @classmethod
    def reachable_block_mask(
        cls,
        start_block: int,
        end_block: int,
        alignment_tokens: int | None,
        kv_cache_spec: KVCacheSpec,
        use_eagle: bool,
        retention_interval: int | None = None,
        num_prompt_tokens: int | None = None,
    ) -> list[bool] | None:
        """Caches only the blocks a window-aligned hit can reach (SWA-4)."""
        if alignment_tokens is None:
            return None
        if not isinstance(kv_cache_spec, SlidingWindowSpec):
            raise InvariantViolationError("SlidingWindowManager serves sliding-window specs only")
        bs = kv_cache_spec.block_size
        if alignment_tokens % bs:
            raise InvariantViolationError("alignment must be a multiple of the block size")
        need = cls._contiguous_blocks_for_hit(kv_cache_spec.sliding_window, bs, use_eagle)
        shift = 1 if use_eagle else 0
        mask = [False] * (end_block - start_block)
        if retention_interval is None:
            segment: int | None = alignment_tokens
        elif retention_interval == 0:
            segment = None
        else:
            segment = retention_interval
        if segment is not None:
            per = segment // bs
            if need >= per:
                return None
            for i in range(start_block, end_block):
                if i >= shift and (i - shift) % per >= per - need:
                    mask[i - start_block] = True
        if retention_interval is not None and num_prompt_tokens is not None:
            latest = (num_prompt_tokens - 1) // alignment_tokens * alignment_tokens
            prompt_end = latest // bs + shift
            for i in range(max(start_block, prompt_end - need), min(end_block, prompt_end)):
                mask[i - start_block] = True
        return mask

    def remove_skipped_blocks(
        self, request_id: str, total_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        """STM-7 with SWA-2, returning early when the last skipped block is already null."""
        num_skipped = total_computed_tokens - self.sliding_window + 1
        if num_skipped <= 0:
            return
        blocks = self.req_to_blocks[request_id]
        n = num_skipped // self.block_size
        if n > len(blocks):
            n = len(blocks)
        # STM-8 walks back from n-1 and stops at the first null: nothing to do then.
        if n > 0 and blocks[n - 1] != self._null_block:
            self._remove_blocks_in_range(request_id, 0, n)

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens before the window (SWA-2)."""
        return max(0, num_computed_tokens - self.sliding_window + 1)


class ChunkedLocalAttentionManager(SingleTypeKVCacheManager):
    """Chunked local attention (§13).

    Attributes:
        attention_chunk_size: Tokens per chunk.
    """

    def __init__(self, kv_cache_spec: KVCacheSpec, *args: Any, **kwargs: Any) -> None:
        """Builds the manager; see :class:`SingleTypeKVCacheManager`."""
        super().__init__(kv_cache_spec, *args, **kwargs)
        if not isinstance(kv_cache_spec, ChunkedLocalAttentionSpec):
            raise InvalidConfigError("ChunkedLocalAttentionManager needs a ChunkedLocal spec")
        self.attention_chunk_size = kv_cache_spec.attention_chunk_size

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[bytes],
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: BlockPoolLike,
        kv_cache_spec: KVCacheSpec,
        drop_eagle_block: bool,
        alignment_tokens: int,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
    ) -> HitBlocks:
        """Nulls before the current chunk, then consecutive hits (CLA-3)."""
        if not isinstance(kv_cache_spec, ChunkedLocalAttentionSpec):
            raise InvariantViolationError("ChunkedLocalAttentionManager serves chunked specs only")
        if drop_eagle_block:
            raise InvariantViolationError("eagle is not supported with chunked local attention")
        if dcp_world_size != 1 or pcp_world_size != 1:
            raise InvariantViolationError("chunked local lookups need dcp == pcp == 1")
        bs = kv_cache_spec.block_size
        if bs != alignment_tokens:
            raise InvariantViolationError(
                "chunked local attention needs alignment equal to its block size"
            )
        chunk = kv_cache_spec.attention_chunk_size
        max_blocks = max_length // bs
        start = (max_length // chunk * chunk) // bs if max_length > 0 else 0
        null = block_pool.null_block
        # The forward scan from the chunk's first block runs in the pool, in one call.
        hits = block_pool.longest_cached_prefix(
            list(block_hashes[start:max_blocks]), max(max_blocks - start, 0), kv_cache_group_ids
        )
        return tuple([null] * start + h for h in hits)

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens before the current chunk (CLA-2)."""
        return num_computed_tokens // self.attention_chunk_size * self.attention_chunk_size


class MambaManager(SingleTypeKVCacheManager):
    """Mamba state blocks (§14), in mode ``none``, ``align`` or ``all``.

    Attributes:
        mamba_cache_mode: The mode.
        num_speculative_blocks: Extra blocks for speculative decoding.
        cached_blocks_this_step: Keys cached during the current step (MAMBA-6).
        last_state_block_idx: Align mode: index of the state block of two steps ago.
    """

    def __init__(self, kv_cache_spec: KVCacheSpec, *args: Any, **kwargs: Any) -> None:
        """Builds the manager; see :class:`SingleTypeKVCacheManager`."""
        super().__init__(kv_cache_spec, *args, **kwargs)
        if not isinstance(kv_cache_spec, MambaSpec):
            raise InvalidConfigError("MambaManager needs a MambaSpec")
        self.cached_blocks_this_step: set[bytes] = set()
        self.mamba_cache_mode = kv_cache_spec.mamba_cache_mode
        self.num_speculative_blocks: int = kv_cache_spec.num_speculative_blocks
        self._align = self.mamba_cache_mode == "align"
        self.last_state_block_idx: dict[str, int] = {}
        self._allocated_block_reqs: set[str] = set()

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[bytes],
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: BlockPoolLike,
        kv_cache_spec: KVCacheSpec,
        drop_eagle_block: bool,
        alignment_tokens: int,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
    ) -> HitBlocks:
        """The last aligned hit, padded with nulls in front (MAMBA-2)."""
        if not isinstance(kv_cache_spec, MambaSpec):
            raise InvariantViolationError("MambaManager serves Mamba specs only")
        if dcp_world_size != 1 or pcp_world_size != 1:
            raise InvariantViolationError("Mamba lookups need dcp == pcp == 1")
        bs = kv_cache_spec.block_size
        null = block_pool.null_block
        # The right-to-left scan runs in the pool, in one call.
        found = block_pool.last_aligned_hit(
            block_hashes, max_length // bs, kv_cache_group_ids, bs, alignment_tokens
        )
        if found is None:
            return tuple([] for _ in kv_cache_group_ids)
        i, hit = found
        return tuple([null] * i + [b] for b in hit)

    @classmethod
    def reachable_block_mask(
        cls,
        start_block: int,
        end_block: int,
        alignment_tokens: int | None,
        kv_cache_spec: KVCacheSpec,
        use_eagle: bool,
        retention_interval: int | None = None,
        num_prompt_tokens: int | None = None,
    ) -> list[bool] | None:
        """Sparse state retention (MAMBA-7)."""
        if retention_interval is None or alignment_tokens is None:
            return None
        bs = kv_cache_spec.block_size
        mask = [False] * (end_block - start_block)
        if retention_interval != 0:
            per = retention_interval // bs
            if per <= 1:
                return None
            first = (start_block + per) // per * per - 1
            for i in range(first - start_block, len(mask), per):
                mask[i] = True
        if num_prompt_tokens is not None:
            latest = (num_prompt_tokens - 1) // alignment_tokens * alignment_tokens
            boundary = latest // bs - 1
            if start_block <= boundary < end_block:
                mask[boundary - start_block] = True
        return mask

    def remove_skipped_blocks(
        self, request_id: str, total_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        """Frees states no longer needed (MAMBA-3)."""
        n = max(0, total_computed_tokens - self.num_speculative_blocks)
        SingleTypeKVCacheManager.remove_skipped_blocks(self, request_id, n, num_prompt_tokens)
        if self._align:
            last = self.last_state_block_idx.get(request_id)
            if last is not None and last < _cdiv(n, self.block_size) - 1:
                blocks = self.req_to_blocks[request_id]
                b = blocks[last]
                if b != self._null_block:
                    self.block_pool.free_blocks([b])
                    blocks[last] = self._null_block

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[int],
        total_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
    ) -> int:
        """Blocks needed, delaying hits cached in this step (MAMBA-4)."""
        if new_computed_blocks and self.cached_blocks_this_step:
            key = self.block_pool.get_block_hashes([new_computed_blocks[-1]])[0]
            if key in self.cached_blocks_this_step:
                return self.block_pool.num_gpu_blocks + 1
        ns = self.num_speculative_blocks
        if not self._align:
            if ns > 0:
                num_tokens += self.kv_cache_spec.block_size * ns
            return super().get_num_blocks_to_allocate(
                request_id,
                num_tokens,
                new_computed_blocks,
                total_computed_tokens,
                num_tokens_main_model,
                apply_admission_cap,
            )
        required = _cdiv(num_tokens_main_model, self.block_size) + ns
        num_new = required - len(new_computed_blocks) - len(self.req_to_blocks[request_id])
        if num_new > 0:
            num_new = 1 if request_id in self._allocated_block_reqs else 1 + ns
        return num_new + self._num_evictable(new_computed_blocks)

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> list[int]:
        """Allocates state blocks (MAMBA-5)."""
        ns = self.num_speculative_blocks
        if not self._align:
            if ns > 0:
                num_tokens += self.block_size * ns
            return super().allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)
        req_blocks = self.req_to_blocks[request_id]
        required = _cdiv(num_tokens_main_model, self.block_size) + ns
        if required <= len(req_blocks):
            return []
        prev = len(req_blocks)
        seen = request_id in self._allocated_block_reqs
        if seen:
            self.last_state_block_idx[request_id] = prev - 1 - ns
        elif prev > 0:
            self.last_state_block_idx[request_id] = prev - 1
        num_skipped = required - ns - 1
        null = self._null_block
        if prev < num_skipped:
            req_blocks.extend([null] * (num_skipped - prev))
        if seen:
            for j in range(prev - ns, prev):
                if j >= num_skipped:
                    break
                req_blocks.append(req_blocks[j])
                req_blocks[j] = null
        n = required - len(req_blocks)
        if n > (1 if seen else ns + 1):
            raise InvariantViolationError(f"Mamba align mode would allocate {n} blocks at once")
        if n > 0:
            req_blocks.extend(self.block_pool.get_new_blocks(n))
        self._allocated_block_reqs.add(request_id)
        return req_blocks[prev:]

    def pop_blocks_for_free(self, request_id: str) -> list[int]:
        """Forgets the request, align-mode state included (MAMBA-8)."""
        if self._align:
            self._allocated_block_reqs.discard(request_id)
            self.last_state_block_idx.pop(request_id, None)
        return super().pop_blocks_for_free(request_id)

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """All but the last computed token (MAMBA-1)."""
        return num_computed_tokens - 1

    def cache_blocks(
        self, request: Request, num_tokens: int, retention_interval: int | None = None
    ) -> None:
        """STM-6, then remembers the keys cached in this step (MAMBA-6)."""
        request_id = request.request_id
        before = self.num_cached_block.get(request_id, 0)
        super().cache_blocks(request, num_tokens, retention_interval)
        after = self.num_cached_block.get(request_id, 0)
        if after > before:
            null = self._null_block
            ids = [b for b in self.req_to_blocks[request_id][before:after] if b != null]
            if ids:
                for key in self.block_pool.get_block_hashes(ids):
                    if key is not None:
                        self.cached_blocks_this_step.add(key)

    def new_step_starts(self) -> None:
        """Clears the keys cached in the previous step (MAMBA-6)."""
        self.cached_blocks_this_step.clear()


class CrossAttentionManager(SingleTypeKVCacheManager):
    """Cross-attention of encoder-decoder models (XATTN-1): allocated once, never cached."""

    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[int],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        """Requires empty hits and does nothing (XATTN-1)."""
        if new_computed_blocks:
            raise InvariantViolationError("cross-attention has no prefix hits")

    def allocate_external_computed_blocks(
        self,
        request_id: str,
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        """Does nothing (XATTN-1)."""
        return None

    def cache_blocks(
        self, request: Request, num_tokens: int, retention_interval: int | None = None
    ) -> None:
        """Always raises: caching must be off for encoder-decoder models (XATTN-1).

        Raises:
            ValueError: Always.
        """
        raise ValueError("cross-attention blocks are never cached; disable prefix caching")

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[bytes],
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: BlockPoolLike,
        kv_cache_spec: KVCacheSpec,
        drop_eagle_block: bool,
        alignment_tokens: int,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
    ) -> HitBlocks:
        """Always raises (XATTN-1).

        Raises:
            NotImplementedError: Always.
        """
        if not isinstance(kv_cache_spec, CrossAttentionSpec):
            raise InvariantViolationError("CrossAttentionManager serves cross-attention only")
        raise NotImplementedError("cross-attention does not support prefix caching")


spec_manager_map: dict[type[KVCacheSpec], type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager,
    TQFullAttentionSpec: FullAttentionManager,
    MLAAttentionSpec: FullAttentionManager,
    HiddenStateCacheSpec: FullAttentionManager,
    RSWASpec: RSWAManager,
    SinkFullAttentionSpec: SinkFullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    SlidingWindowMLASpec: SlidingWindowManager,
    ChunkedLocalAttentionSpec: ChunkedLocalAttentionManager,
    MambaSpec: MambaManager,
    CrossAttentionSpec: CrossAttentionManager,
}
"""SPEC-1: spec class to manager class; subclasses resolve along their MRO."""


def get_manager_class(kv_cache_spec: KVCacheSpec) -> type[SingleTypeKVCacheManager]:
    """Finds the manager class of a spec along its class hierarchy (SPEC-1).

    Args:
        kv_cache_spec: The spec.

    Returns:
        The manager class.

    Raises:
        InvalidConfigError: (an AssertionError) the spec has no manager (EncoderOnly,
            UniformType, unknown classes).
    """
    for base in type(kv_cache_spec).__mro__:
        cls = spec_manager_map.get(base)
        if cls is not None:
            return cls
    raise InvalidConfigError(f"no manager for KV cache spec {type(kv_cache_spec).__name__}")


def get_manager_for_kv_cache_spec(
    kv_cache_spec: KVCacheSpec,
    max_num_batched_tokens: int,
    max_model_len: int,
    **kwargs: Any,
) -> SingleTypeKVCacheManager:
    """Builds the manager of one group, with the admission cap of its spec (SPEC-1, SWA-1, CLA-1).

    Args:
        kv_cache_spec: The group's spec.
        max_num_batched_tokens: Tokens per scheduler step.
        max_model_len: Longest sequence.
        **kwargs: The manager constructor's other arguments.

    Returns:
        The manager.

    Raises:
        InvalidConfigError: The spec has no manager.
    """
    cls = get_manager_class(kv_cache_spec)
    if isinstance(kv_cache_spec, SlidingWindowSpec | ChunkedLocalAttentionSpec):
        kwargs["max_admission_blocks_per_request"] = kv_cache_spec.max_admission_blocks_per_request(
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len
        )
    manager: SingleTypeKVCacheManager = cls(kv_cache_spec, **kwargs)
    return manager
