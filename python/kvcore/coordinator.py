"""Coordinators: one block pool, one manager per KV cache group (SPEC §9).

:func:`get_kv_cache_coordinator` picks the coordinator (COORD-1): caching off → no prefix cache,
one group → unitary, several groups → hybrid (a fixed-point lookup over the attention groups,
COORD-11).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from kvcore._native import BlockPool, Retention
from kvcore.errors import (
    InvalidArgumentError,
    InvalidConfigError,
    InvariantViolationError,
    MissingBlocksError,
)
from kvcore.single_type import (
    BlockPoolLike,
    CrossAttentionManager,
    FullAttentionManager,
    SingleTypeKVCacheManager,
    get_manager_for_kv_cache_spec,
)
from kvcore.specs import FullAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec

if TYPE_CHECKING:
    from kvcore.config import KVCacheConfig
    from kvcore.request import Request

__all__ = [
    "HybridKVCacheCoordinator",
    "KVCacheCoordinator",
    "KVCacheCoordinatorNoPrefixCache",
    "SpecGroup",
    "UnitaryKVCacheCoordinator",
    "get_kv_cache_coordinator",
    "read_retention_interval",
]

RETENTION_ENV = "VLLM_PREFIX_CACHE_RETENTION_INTERVAL"


def read_retention_interval() -> int | None:
    """Reads the prefix-cache retention interval from the environment (COORD-2, RET-1).

    Returns:
        None when ``VLLM_PREFIX_CACHE_RETENTION_INTERVAL`` is unset, else its int value.

    Raises:
        InvalidConfigError: (a ValueError) the value is not an integer.
    """
    raw = os.environ.get(RETENTION_ENV)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise InvalidConfigError(f"{RETENTION_ENV}={raw!r} is not an integer") from None


def hashes_at_block_size(
    block_hashes: list[bytes], block_size: int, hash_block_size: int
) -> list[bytes]:
    """The hashes at ``block_size``: every k-th hash of ``hash_block_size`` windows (RH-3)."""
    if block_size == hash_block_size:
        return block_hashes
    k = block_size // hash_block_size
    return block_hashes[k - 1 :: k]


def _new_block_pool(
    num_gpu_blocks: int, enable_caching: bool, hash_block_size: int, enable_kv_cache_events: bool
) -> BlockPoolLike:
    pool: BlockPoolLike = BlockPool(
        num_gpu_blocks, enable_caching, hash_block_size, enable_kv_cache_events
    )
    return pool


class KVCacheCoordinator:
    """Shared coordinator logic (COORD-2..6).

    Attributes:
        kv_cache_config: The configuration.
        max_model_len: Longest sequence.
        enable_caching: Whether prefix caching is on.
        scheduler_block_size: The scheduling granularity.
        block_pool: The shared pool.
        eagle_group_ids: Groups whose hits drop the EAGLE block.
        single_type_managers: One manager per group, in group order.
        retention_interval: Sparse retention interval, or None (RET-1).
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        max_num_batched_tokens: int,
        use_eagle: bool,
        enable_caching: bool,
        enable_kv_cache_events: bool,
        dcp_world_size: int,
        pcp_world_size: int,
        scheduler_block_size: int,
        hash_block_size: int,
        metrics_collector: Any = None,
    ) -> None:
        """Checks the block sizes, builds the pool and the managers (COORD-2).

        Args:
            kv_cache_config: The configuration.
            max_model_len: Longest sequence.
            max_num_batched_tokens: Tokens per scheduler step.
            use_eagle: Whether EAGLE/MTP drafting is on.
            enable_caching: Whether prefix caching is on.
            enable_kv_cache_events: Whether the pool queues KV events.
            dcp_world_size: Decode context-parallel world size.
            pcp_world_size: Prefill context-parallel world size.
            scheduler_block_size: The scheduling granularity.
            hash_block_size: The granularity of ``Request.block_hashes``.
            metrics_collector: Accepted for signature compatibility; block metrics (MET-1) are
                not collected.

        Raises:
            InvalidConfigError: Block sizes that do not divide, a spec without manager, or a bad
                retention interval.
        """
        groups = kv_cache_config.kv_cache_groups
        if (
            hash_block_size <= 0
            or scheduler_block_size <= 0
            or scheduler_block_size % hash_block_size
            or any(scheduler_block_size % g.kv_cache_spec.block_size for g in groups)
        ):
            raise InvalidConfigError(
                f"scheduler_block_size={scheduler_block_size} must be a multiple of "
                f"hash_block_size={hash_block_size} and of every group block size "
                f"{[g.kv_cache_spec.block_size for g in groups]}"
            )
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.scheduler_block_size = scheduler_block_size
        self.metrics_collector = metrics_collector
        if not isinstance(kv_cache_config.num_blocks, int) or kv_cache_config.num_blocks <= 0:
            raise InvalidConfigError(
                f"num_blocks must be a positive int, not {kv_cache_config.num_blocks!r}"
            )
        self.block_pool = _new_block_pool(
            kv_cache_config.num_blocks, enable_caching, hash_block_size, enable_kv_cache_events
        )
        self.eagle_group_ids: set[int] = {i for i, g in enumerate(groups) if g.is_eagle_group}
        if use_eagle and not self.eagle_group_ids:
            self.eagle_group_ids = set(range(len(groups)))
        self.single_type_managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            get_manager_for_kv_cache_spec(
                g.kv_cache_spec,
                max_num_batched_tokens,
                max_model_len,
                block_pool=self.block_pool,
                enable_caching=enable_caching,
                kv_cache_group_id=i,
                dcp_world_size=dcp_world_size,
                pcp_world_size=pcp_world_size,
                scheduler_block_size=scheduler_block_size,
            )
            for i, g in enumerate(groups)
        )
        self.retention_interval = read_retention_interval()
        if self.retention_interval is not None:
            if not any(isinstance(g.kv_cache_spec, SlidingWindowSpec | MambaSpec) for g in groups):
                raise InvalidConfigError(
                    f"{RETENTION_ENV} is set but no sliding-window or Mamba group uses it"
                )
            if self.retention_interval < 0 or self.retention_interval % scheduler_block_size:
                raise InvalidConfigError(
                    f"{RETENTION_ENV}={self.retention_interval} must be non-negative and a "
                    f"multiple of scheduler_block_size={scheduler_block_size}"
                )
        self._is_xattn = tuple(
            isinstance(m, CrossAttentionManager) for m in self.single_type_managers
        )
        self._has_xattn = any(self._is_xattn)
        # Managers whose remove_skipped_blocks can do anything (STM-7, RSWA-1, MAMBA-3).
        self._skippers = tuple(
            m
            for m in self.single_type_managers
            if not (
                type(m).remove_skipped_blocks is FullAttentionManager.remove_skipped_blocks
                or (
                    type(m).remove_skipped_blocks is SingleTypeKVCacheManager.remove_skipped_blocks
                    and type(m).get_num_skipped_tokens
                    is SingleTypeKVCacheManager.get_num_skipped_tokens
                )
            )
        )

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: tuple[Sequence[int], ...],
        num_encoder_tokens: int,
        total_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
    ) -> int:
        """Sums the managers' needs (COORD-3).

        Args:
            request_id: The request id.
            num_tokens: Tokens that need a slot.
            new_computed_blocks: Hits per group.
            num_encoder_tokens: Encoder tokens (cross-attention groups).
            total_computed_tokens: Local plus external computed tokens.
            num_tokens_main_model: Tokens of the main model.
            apply_admission_cap: Apply the admission caps.

        Returns:
            The number of blocks the allocation takes from the free queue.
        """
        total = 0
        if not self._has_xattn:
            for i, m in enumerate(self.single_type_managers):
                total += m.get_num_blocks_to_allocate(
                    request_id,
                    num_tokens,
                    new_computed_blocks[i],
                    total_computed_tokens,
                    num_tokens_main_model,
                    apply_admission_cap,
                )
            return total
        for i, m in enumerate(self.single_type_managers):
            if self._is_xattn[i]:
                total += m.get_num_blocks_to_allocate(
                    request_id, num_encoder_tokens, [], 0, num_encoder_tokens, apply_admission_cap
                )
            else:
                total += m.get_num_blocks_to_allocate(
                    request_id,
                    num_tokens,
                    new_computed_blocks[i],
                    total_computed_tokens,
                    num_tokens_main_model,
                    apply_admission_cap,
                )
        return total

    def allocate_new_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: tuple[Sequence[int], ...],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        """Adds hits to every group, then allocates external-token blocks (COORD-5).

        Args:
            request_id: The request id.
            new_computed_blocks: Hits per group.
            num_local_computed_tokens: Local computed tokens.
            num_external_computed_tokens: Tokens computed by a KV connector.

        Raises:
            InvariantViolationError: Hits were given for a running request.
        """
        managers = self.single_type_managers
        if any(request_id in m.num_cached_block for m in managers):
            if any(new_computed_blocks):
                raise InvariantViolationError("a running request cannot have new prefix hits")
            return
        for i, m in enumerate(managers):
            m.add_local_computed_blocks(
                request_id,
                new_computed_blocks[i],
                num_local_computed_tokens,
                num_external_computed_tokens,
            )
        if num_external_computed_tokens > 0:
            for m in managers:
                m.allocate_external_computed_blocks(
                    request_id, num_local_computed_tokens, num_external_computed_tokens
                )

    def allocate_new_blocks(
        self,
        request_id: str,
        num_tokens: int,
        num_tokens_main_model: int,
        num_encoder_tokens: int = 0,
    ) -> tuple[list[int], ...]:
        """Gives every group enough slots; returns the new ids per group (COORD-3)."""
        if not self._has_xattn:
            return tuple(
                m.allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)
                for m in self.single_type_managers
            )
        return tuple(
            m.allocate_new_blocks(
                request_id, num_encoder_tokens if x else num_tokens, num_tokens_main_model
            )
            for m, x in zip(self.single_type_managers, self._is_xattn, strict=True)
        )

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Caches the request's full blocks in every group (COORD-6)."""
        for m in self.single_type_managers:
            m.cache_blocks(request, num_computed_tokens, self.retention_interval)

    def cache_lengths(self, num_computed_tokens: int) -> list[int]:
        """The token count :meth:`cache_blocks` caches up to in each group."""
        return [num_computed_tokens] * len(self.single_type_managers)

    def check_cacheable(
        self,
        request: Request,
        num_computed_tokens: int,
        held: bool = True,
        hits: tuple[Sequence[int], ...] = (),
    ) -> None:
        """Raises, before anything changes, where :meth:`cache_blocks` would fail part-way.

        A group caching ``f`` full blocks needs ``f`` blocks and ``f`` hashes at its block size
        (SPEC POOL-14, POOL-15); the reference checks group by group, after caching the
        groups before (and, inside ``allocate_slots``, after allocating).

        Args:
            request: The request.
            num_computed_tokens: Tokens to cover.
            held: Check the blocks held as well as the hashes (off before an allocation).
            hits: Prefix hits about to be added (they count as cached, STM-4).

        Raises:
            InvalidArgumentError: A group lacks the blocks or the hashes.
        """
        request_id = request.request_id
        num_hashes = len(request.block_hashes)
        hbs = self.block_pool.hash_block_size
        lengths = self.cache_lengths(num_computed_tokens)
        for i, (m, n) in enumerate(zip(self.single_type_managers, lengths, strict=True)):
            bs = m.block_size
            full = n // bs
            cached = m.num_cached_block.get(request_id)
            if cached is None:
                cached = len(hits[i]) if i < len(hits) else 0
            if cached >= full:
                continue
            if held:
                blocks = m.req_to_blocks.get(request_id)
                have = len(blocks) if blocks is not None else 0
                if have < full:
                    raise MissingBlocksError(
                        f"request {request_id!r} holds {have} blocks in group "
                        f"{m.kv_cache_group_id}, fewer than the {full} full ones"
                    )
            if num_hashes // (bs // hbs) < full:
                raise InvalidArgumentError(
                    f"request {request_id!r} has {num_hashes} block hashes, too few for its "
                    f"{full} full blocks of {bs} tokens"
                )

    def free(self, request_id: str, retention: Retention | None = None) -> None:
        """Frees the request in every group, in group order (MGR-20; retention: CC-1)."""
        for m in self.single_type_managers:
            m.free(request_id, retention)

    def pop_blocks_for_free(self, request_id: str) -> list[int]:
        """Forgets the request; returns all its blocks, group by group (MGR-21)."""
        out: list[int] = []
        for m in self.single_type_managers:
            out.extend(m.pop_blocks_for_free(request_id))
        return out

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """One common-prefix block count per group (MGR-22)."""
        return [
            m.get_num_common_prefix_blocks(running_request_id) for m in self.single_type_managers
        ]

    def remove_skipped_blocks(
        self, request_id: str, total_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        """Frees blocks outside every group's attention window (MGR-22)."""
        for m in self._skippers:
            m.remove_skipped_blocks(request_id, total_computed_tokens, num_prompt_tokens)

    def get_blocks(self, request_id: str) -> tuple[list[int], ...]:
        """Each group's live block list for the request, or [] (COORD-6)."""
        return tuple(m.req_to_blocks.get(request_id) or [] for m in self.single_type_managers)

    def new_step_starts(self) -> None:
        """Forwards the step start to every manager (MGR-30)."""
        for m in self.single_type_managers:
            m.new_step_starts()

    def find_longest_cache_hit(
        self, block_hashes: list[bytes], max_cache_hit_length: int
    ) -> tuple[tuple[list[int], ...], int]:
        """Longest prefix hit over all groups.

        Args:
            block_hashes: The request's hashes at the hash block size.
            max_cache_hit_length: Longest hit in tokens.

        Returns:
            The hit block ids per group and the hit length in tokens.
        """
        raise NotImplementedError


class KVCacheCoordinatorNoPrefixCache(KVCacheCoordinator):
    """Coordinator with prefix caching off; any number of groups (COORD-8)."""

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        max_num_batched_tokens: int,
        use_eagle: bool,
        enable_kv_cache_events: bool,
        dcp_world_size: int,
        pcp_world_size: int,
        scheduler_block_size: int,
        hash_block_size: int,
        metrics_collector: Any = None,
    ) -> None:
        """Builds the pool and managers with caching off; see :class:`KVCacheCoordinator`."""
        super().__init__(
            kv_cache_config,
            max_model_len,
            max_num_batched_tokens,
            use_eagle,
            False,
            enable_kv_cache_events,
            dcp_world_size,
            pcp_world_size,
            scheduler_block_size,
            hash_block_size,
            metrics_collector,
        )
        self.num_single_type_manager = len(self.single_type_managers)

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """One 0 per group (COORD-8)."""
        return [0] * self.num_single_type_manager

    def find_longest_cache_hit(
        self, block_hashes: list[bytes], max_cache_hit_length: int
    ) -> tuple[tuple[list[int], ...], int]:
        """No hits: one empty list per group and 0 (COORD-8)."""
        return tuple([] for _ in range(self.num_single_type_manager)), 0


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """Coordinator of a single group (COORD-7).

    Attributes:
        kv_cache_spec: The group's spec.
        block_size: ``spec.block_size * dcp * pcp``.
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        max_num_batched_tokens: int,
        use_eagle: bool,
        enable_caching: bool,
        enable_kv_cache_events: bool,
        dcp_world_size: int,
        pcp_world_size: int,
        scheduler_block_size: int,
        hash_block_size: int,
        metrics_collector: Any = None,
    ) -> None:
        """Builds the coordinator; see :class:`KVCacheCoordinator`.

        Raises:
            InvalidConfigError: Caching is on and the block size differs from the hash block
                size, or there is not exactly one group.
        """
        super().__init__(
            kv_cache_config,
            max_model_len,
            max_num_batched_tokens,
            use_eagle,
            enable_caching,
            enable_kv_cache_events,
            dcp_world_size,
            pcp_world_size,
            scheduler_block_size,
            hash_block_size,
            metrics_collector,
        )
        self.kv_cache_spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        self.block_size = self.kv_cache_spec.block_size * dcp_world_size * pcp_world_size
        self.dcp_world_size = dcp_world_size
        self.pcp_world_size = pcp_world_size
        if enable_caching and hash_block_size != self.block_size:
            raise InvalidConfigError(
                f"one group needs hash_block_size ({hash_block_size}) == block_size "
                f"({self.block_size})"
            )
        if len(kv_cache_config.kv_cache_groups) != 1:
            raise InvalidConfigError("the unitary coordinator needs exactly one group")
        self._drop_eagle = 0 in self.eagle_group_ids
        self.single_type_managers[0].use_eagle = self._drop_eagle
        self._manager_cls = type(self.single_type_managers[0])

    def find_longest_cache_hit(
        self, block_hashes: list[bytes], max_cache_hit_length: int
    ) -> tuple[tuple[list[int], ...], int]:
        """Delegates to the group's manager class (COORD-7)."""
        hit = self._manager_cls.find_longest_cache_hit(
            block_hashes,
            max_cache_hit_length,
            [0],
            self.block_pool,
            self.kv_cache_spec,
            self._drop_eagle,
            self.block_size,
            self.dcp_world_size,
            self.pcp_world_size,
        )
        return hit, len(hit[0]) * self.block_size


class SpecGroup(NamedTuple):
    """Groups with equal specs, looked up together (COORD-9).

    Attributes:
        spec: The shared spec.
        group_ids: Member group ids.
        manager_cls: Their manager class.
        use_eagle: Whether any member is an EAGLE group.
    """

    spec: KVCacheSpec
    group_ids: list[int]
    manager_cls: type[SingleTypeKVCacheManager]
    use_eagle: bool


class HybridKVCacheCoordinator(KVCacheCoordinator):
    """Coordinator of several groups of different specs (COORD-9..12).

    Attributes:
        hash_block_size: The granularity of ``Request.block_hashes``.
        attention_groups: Equal-spec groups, full-attention kinds first.
        num_uncached_common_prefix_tokens: Set by each lookup (COORD-11).
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        max_num_batched_tokens: int,
        use_eagle: bool,
        enable_caching: bool,
        enable_kv_cache_events: bool,
        dcp_world_size: int,
        pcp_world_size: int,
        scheduler_block_size: int,
        hash_block_size: int,
        metrics_collector: Any = None,
    ) -> None:
        """Builds the coordinator and its attention groups (COORD-9).

        Raises:
            InvalidConfigError: A group size the hash block size does not divide, context
                parallelism, equal specs with different managers, or fewer than two attention
                groups.
        """
        super().__init__(
            kv_cache_config,
            max_model_len,
            max_num_batched_tokens,
            use_eagle,
            enable_caching,
            enable_kv_cache_events,
            dcp_world_size,
            pcp_world_size,
            scheduler_block_size,
            hash_block_size,
            metrics_collector,
        )
        self.hash_block_size = hash_block_size
        groups = kv_cache_config.kv_cache_groups
        if any(g.kv_cache_spec.block_size % hash_block_size for g in groups):
            raise InvalidConfigError("every group block size must be divisible by hash_block_size")
        if dcp_world_size != 1 or pcp_world_size != 1:
            raise InvalidConfigError("hybrid KV cache groups do not support dcp/pcp > 1")
        self.verify_and_split_kv_cache_groups()

    def verify_and_split_kv_cache_groups(self) -> None:
        """Merges groups with equal specs into attention groups (COORD-9)."""
        attention_groups: list[SpecGroup] = []
        for i, g in enumerate(self.kv_cache_config.kv_cache_groups):
            manager_cls = type(self.single_type_managers[i])
            spec = g.kv_cache_spec
            eagle = i in self.eagle_group_ids
            for idx, ag in enumerate(attention_groups):
                if ag.spec == spec:
                    if manager_cls is not ag.manager_cls:
                        raise InvalidConfigError("equal specs must use the same manager class")
                    ag.group_ids.append(i)
                    if eagle and not ag.use_eagle:
                        attention_groups[idx] = ag._replace(use_eagle=True)
                    break
            else:
                attention_groups.append(SpecGroup(spec, [i], manager_cls, eagle))
        if len(attention_groups) < 2:
            raise InvalidConfigError("the hybrid coordinator needs at least two attention groups")
        attention_groups.sort(key=lambda ag: not isinstance(ag.spec, FullAttentionSpec))
        for ag in attention_groups:
            if ag.use_eagle:
                for gid in ag.group_ids:
                    self.single_type_managers[gid].use_eagle = True
        self.attention_groups = attention_groups
        self._simple = len(attention_groups) == 2 and isinstance(
            attention_groups[0].spec, FullAttentionSpec
        )

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Caches up to the scheduler-aligned length, plus the EAGLE block (COORD-10)."""
        lengths = self.cache_lengths(num_computed_tokens)
        for m, n in zip(self.single_type_managers, lengths, strict=True):
            m.cache_blocks(request, n, self.retention_interval)

    def cache_lengths(self, num_computed_tokens: int) -> list[int]:
        """The scheduler-aligned length per group, plus the EAGLE block (COORD-10)."""
        sbs = self.scheduler_block_size
        aligned = num_computed_tokens // sbs * sbs
        out = []
        for m in self.single_type_managers:
            n = aligned
            if m.use_eagle and aligned > 0:
                n = min(num_computed_tokens, aligned + m.block_size)
            out.append(n)
        return out

    def _hashes_for(self, spec: KVCacheSpec, block_hashes: list[bytes]) -> list[bytes]:
        """The hashes at ``spec.block_size`` (RH-3)."""
        return hashes_at_block_size(block_hashes, spec.block_size, self.hash_block_size)

    def find_longest_cache_hit(
        self, block_hashes: list[bytes], max_cache_hit_length: int
    ) -> tuple[tuple[list[int], ...], int]:
        """Fixed point over the attention groups (COORD-11)."""
        num_groups = len(self.kv_cache_config.kv_cache_groups)
        hit_length = max_cache_hit_length
        longest = 0
        res: list[list[int] | None] = [None] * num_groups
        verified: set[int] = set()
        pool = self.block_pool
        sbs = self.scheduler_block_size
        while True:
            cur = hit_length
            for idx, (spec, gids, cls, eagle) in enumerate(self.attention_groups):
                is_full = isinstance(spec, FullAttentionSpec)
                if is_full and res[gids[0]] is not None:
                    cur = cur // spec.block_size * spec.block_size
                    continue
                drop = eagle and idx not in verified
                max_len = min(cur + spec.block_size, max_cache_hit_length) if drop else cur
                hit = cls.find_longest_cache_hit(
                    self._hashes_for(spec, block_hashes), max_len, gids, pool, spec, drop, sbs
                )
                new = len(hit[0]) * spec.block_size
                if drop:
                    verified.add(idx)
                elif new < cur:
                    verified.clear()
                cur = new
                for gid, blocks in zip(gids, hit, strict=False):
                    res[gid] = blocks
                if cur > longest:
                    longest = cur
            if cur >= hit_length:
                break
            hit_length = cur
            if self._simple:
                break
        first = self.attention_groups[0]
        if isinstance(first.spec, FullAttentionSpec):
            n = hit_length // first.spec.block_size
            for gid in first.group_ids:
                kept = res[gid]
                if kept is not None:
                    del kept[n:]
        self.num_uncached_common_prefix_tokens = longest - hit_length
        return tuple([] if b is None else b for b in res), hit_length

    def find_longest_cache_hit_per_group(
        self, block_hashes: list[bytes], max_cache_hit_length: int
    ) -> tuple[tuple[list[int], ...], tuple[int, ...]]:
        """Looks every attention group up on its own (COORD-12).

        Args:
            block_hashes: The request's hashes at the hash block size.
            max_cache_hit_length: Longest hit in tokens.

        Returns:
            The hit block ids per group and the hit length per group.
        """
        num_groups = len(self.kv_cache_config.kv_cache_groups)
        blocks_out: list[list[int]] = [[] for _ in range(num_groups)]
        lengths = [0] * num_groups
        for spec, gids, cls, eagle in self.attention_groups:
            hit = cls.find_longest_cache_hit(
                self._hashes_for(spec, block_hashes),
                max_cache_hit_length,
                gids,
                self.block_pool,
                spec,
                eagle,
                self.scheduler_block_size,
            )
            n = len(hit[0]) * spec.block_size
            for gid, group_blocks in zip(gids, hit, strict=False):
                blocks_out[gid] = group_blocks
                lengths[gid] = n
        return tuple(blocks_out), tuple(lengths)


def get_kv_cache_coordinator(
    kv_cache_config: KVCacheConfig,
    max_model_len: int,
    max_num_batched_tokens: int,
    use_eagle: bool,
    enable_caching: bool,
    enable_kv_cache_events: bool,
    dcp_world_size: int,
    pcp_world_size: int,
    scheduler_block_size: int,
    hash_block_size: int,
    metrics_collector: Any = None,
) -> KVCacheCoordinator:
    """Picks and builds the coordinator (COORD-1).

    Args:
        kv_cache_config: The configuration.
        max_model_len: Longest sequence.
        max_num_batched_tokens: Tokens per scheduler step.
        use_eagle: Whether EAGLE/MTP drafting is on.
        enable_caching: Whether prefix caching is on.
        enable_kv_cache_events: Whether the pool queues KV events.
        dcp_world_size: Decode context-parallel world size.
        pcp_world_size: Prefill context-parallel world size.
        scheduler_block_size: The scheduling granularity.
        hash_block_size: The granularity of ``Request.block_hashes``.
        metrics_collector: Accepted for compatibility (not used).

    Returns:
        No-prefix-cache when caching is off, unitary for one group, else hybrid.
    """
    if not enable_caching:
        return KVCacheCoordinatorNoPrefixCache(
            kv_cache_config,
            max_model_len,
            max_num_batched_tokens,
            use_eagle,
            enable_kv_cache_events,
            dcp_world_size,
            pcp_world_size,
            scheduler_block_size,
            hash_block_size,
            metrics_collector,
        )
    cls: type[KVCacheCoordinator] = (
        UnitaryKVCacheCoordinator
        if len(kv_cache_config.kv_cache_groups) == 1
        else HybridKVCacheCoordinator
    )
    return cls(
        kv_cache_config,
        max_model_len,
        max_num_batched_tokens,
        use_eagle,
        enable_caching,
        enable_kv_cache_events,
        dcp_world_size,
        pcp_world_size,
        scheduler_block_size,
        hash_block_size,
        metrics_collector,
    )
