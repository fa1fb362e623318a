"""Coordinators: one block pool, one manager per KV cache group (SPEC §9).

:func:`get_kv_cache_coordinator` picks the coordinator (COORD-1): caching off → no prefix cache,
one group → unitary, several groups → hybrid (a fixed-point lookup over the attention groups,
COORD-11). A coordinator holds the configuration's policy: it checks the block sizes and the
retention interval, builds the pool, chooses each group's manager (SPEC-1) and, for hybrid
models, which groups are looked up together (COORD-9). Its per-call algorithms (hit search and
the fixed point, counting, allocating, caching, skipping, freeing) run in the Rust core that
:class:`kvcore.KVCacheManager` builds from it (``kvcore._native.KVCacheManagerCore``); the
methods here call them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from kvcore._native import BlockPool, Retention
from kvcore.errors import InvalidConfigError, InvariantViolationError
from kvcore.single_type import (
    NativeGroup,
    SingleTypeKVCacheManager,
    get_manager_class,
)
from kvcore.specs import (
    AttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)

if TYPE_CHECKING:
    from kvcore._native import KVCacheManagerCore
    from kvcore.config import KVCacheConfig
    from kvcore.request import Request

__all__ = [
    "HybridKVCacheCoordinator",
    "KVCacheCoordinator",
    "KVCacheCoordinatorNoPrefixCache",
    "NativeConfig",
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


class NativeConfig(NamedTuple):
    """What :meth:`kvcore._native.KVCacheManagerCore._init_core` is built from."""

    mode: str
    groups: list[NativeGroup]
    eagle_groups: list[bool]
    attention_groups: list[tuple[list[int], bool, bool]]
    retention_interval: int | None
    dcp_world_size: int
    pcp_world_size: int
    clip: list[bool]


class KVCacheCoordinator:
    """Shared coordinator logic (COORD-2..6).

    Attributes:
        kv_cache_config: The configuration.
        max_model_len: Longest sequence.
        enable_caching: Whether prefix caching is on.
        scheduler_block_size: The scheduling granularity.
        block_pool: The shared pool.
        eagle_group_ids: Groups whose hits drop the EAGLE block.
        retention_interval: Sparse retention interval, or None (RET-1).
        single_type_managers: One view per group, in group order (after :meth:`bind`).
    """

    mode = "no_prefix_cache"
    """The core's coordinator (``kvcore-core``'s ``coordinator::Mode``)."""

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
        """Builds the pool, chooses the managers and checks the retention interval (COORD-2).

        The block sizes are checked by the core the manager builds from :meth:`native_config`
        (``Coordinator::new``: COORD-2's divisibility, COORD-7's and COORD-9's sizes).

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
            InvalidConfigError: A spec without manager, or a bad retention interval.
        """
        groups = kv_cache_config.kv_cache_groups
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.scheduler_block_size = scheduler_block_size
        self.metrics_collector = metrics_collector
        self.dcp_world_size = dcp_world_size
        self.pcp_world_size = pcp_world_size
        if not isinstance(kv_cache_config.num_blocks, int) or kv_cache_config.num_blocks <= 0:
            raise InvalidConfigError(
                f"num_blocks must be a positive int, not {kv_cache_config.num_blocks!r}"
            )
        self.block_pool = BlockPool(
            kv_cache_config.num_blocks, enable_caching, hash_block_size, enable_kv_cache_events
        )
        self.eagle_group_ids: set[int] = {i for i, g in enumerate(groups) if g.is_eagle_group}
        if use_eagle and not self.eagle_group_ids:
            self.eagle_group_ids = set(range(len(groups)))
        self._manager_classes = [get_manager_class(g.kv_cache_spec) for g in groups]
        self._native_groups = [
            cls.native_group(g.kv_cache_spec, max_num_batched_tokens, max_model_len)
            for cls, g in zip(self._manager_classes, groups, strict=True)
        ]
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
        self._eagle_flags = [self._group_uses_eagle(i) for i in range(len(groups))]
        self._core: KVCacheManagerCore | None = None
        self.single_type_managers: tuple[SingleTypeKVCacheManager, ...] = ()

    def _group_uses_eagle(self, group_id: int) -> bool:
        """Whether the group's hits drop the EAGLE block (the hybrid coordinator marks every
        member of an attention group with an EAGLE member, COORD-9)."""
        return group_id in self.eagle_group_ids

    def _attention_groups(self) -> list[tuple[list[int], bool, bool]]:
        """The hybrid coordinator's attention groups, as the core takes them."""
        return []

    def native_config(self) -> NativeConfig:
        """The configuration the manager's core is built from."""
        clip = [
            isinstance(g.kv_cache_spec, AttentionSpec)
            and not isinstance(g.kv_cache_spec, CrossAttentionSpec | EncoderOnlyAttentionSpec)
            for g in self.kv_cache_config.kv_cache_groups
        ]
        return NativeConfig(
            self.mode,
            self._native_groups,
            self._eagle_flags,
            self._attention_groups(),
            self.retention_interval,
            self.dcp_world_size,
            self.pcp_world_size,
            clip,
        )

    def bind(self, core: KVCacheManagerCore) -> None:
        """Attaches the core built from :meth:`native_config` (by the manager)."""
        self._core = core
        cp = self.dcp_world_size * self.pcp_world_size
        self.single_type_managers = tuple(
            cls(
                g.kv_cache_spec,
                i,
                g.kv_cache_spec.block_size * cp,
                self._eagle_flags[i],
                self._native_groups[i][4],
                core,
            )
            for i, (cls, g) in enumerate(
                zip(self._manager_classes, self.kv_cache_config.kv_cache_groups, strict=True)
            )
        )

    @property
    def core(self) -> KVCacheManagerCore:
        """The manager core this coordinator's calls run in."""
        if self._core is None:
            raise InvariantViolationError("the coordinator has no manager core yet")
        return self._core

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
        return self.core.coordinator_get_num_blocks_to_allocate(
            request_id,
            num_tokens,
            new_computed_blocks,
            num_encoder_tokens,
            total_computed_tokens,
            num_tokens_main_model,
            apply_admission_cap,
        )

    def allocate_new_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: tuple[Sequence[int], ...],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        """Adds hits to every group, then allocates external-token blocks (COORD-5).

        Raises:
            InvariantViolationError: Hits were given for a running request.
        """
        self.core.coordinator_allocate_new_computed_blocks(
            request_id, new_computed_blocks, num_local_computed_tokens, num_external_computed_tokens
        )

    def allocate_new_blocks(
        self,
        request_id: str,
        num_tokens: int,
        num_tokens_main_model: int,
        num_encoder_tokens: int = 0,
    ) -> tuple[list[int], ...]:
        """Gives every group enough slots; returns the new ids per group (COORD-3)."""
        return self.core.coordinator_allocate_new_blocks(
            request_id, num_tokens, num_tokens_main_model, num_encoder_tokens
        )

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Caches the request's full blocks in every group (COORD-6, COORD-10)."""
        self.core.coordinator_cache_blocks(request, num_computed_tokens)

    def free(self, request_id: str, retention: Retention | None = None) -> None:
        """Frees the request in every group, in group order (MGR-20; retention: CC-1)."""
        self.core.coordinator_free(request_id, retention)

    def pop_blocks_for_free(self, request_id: str) -> list[int]:
        """Forgets the request; returns all its blocks, group by group (MGR-21)."""
        return self.core.coordinator_pop_blocks_for_free(request_id)

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """One common-prefix block count per group (MGR-22)."""
        return self.core.get_num_common_prefix_blocks(running_request_id)

    def remove_skipped_blocks(
        self, request_id: str, total_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        """Frees blocks outside every group's attention window (MGR-22)."""
        self.core.remove_skipped_blocks(request_id, total_computed_tokens, num_prompt_tokens)

    def get_blocks(self, request_id: str) -> tuple[list[int], ...]:
        """Each group's block ids for the request, or [] (COORD-6)."""
        return self.core.get_block_ids(request_id)

    def new_step_starts(self) -> None:
        """Forwards the step start to every manager (MGR-30)."""
        self.core.new_step_starts()

    def find_longest_cache_hit(
        self, block_hashes: list[bytes], max_cache_hit_length: int
    ) -> tuple[tuple[list[int], ...], int]:
        """Longest prefix hit over all groups (COORD-7, COORD-8, COORD-11).

        Args:
            block_hashes: The request's hashes at the hash block size.
            max_cache_hit_length: Longest hit in tokens.

        Returns:
            The hit block ids per group and the hit length in tokens.
        """
        return self.core.coordinator_find_longest_cache_hit(block_hashes, max_cache_hit_length)


class KVCacheCoordinatorNoPrefixCache(KVCacheCoordinator):
    """Coordinator with prefix caching off; any number of groups (COORD-8)."""

    mode = "no_prefix_cache"

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
        self.num_single_type_manager = len(kv_cache_config.kv_cache_groups)


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """Coordinator of a single group (COORD-7).

    Attributes:
        kv_cache_spec: The group's spec.
        block_size: ``spec.block_size * dcp * pcp``.
    """

    mode = "unitary"

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
        """Builds the coordinator; see :class:`KVCacheCoordinator` (the core refuses a block
        size other than the hash block size with caching on, COORD-7)."""
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


class HybridKVCacheCoordinator(KVCacheCoordinator):
    """Coordinator of several groups of different specs (COORD-9..12).

    Attributes:
        hash_block_size: The granularity of ``Request.block_hashes``.
        attention_groups: Equal-spec groups, full-attention kinds first.
    """

    mode = "hybrid"

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
        """Builds the coordinator and its attention groups (COORD-9; the core refuses group
        sizes the hash block size does not divide and context parallelism).

        Raises:
            InvalidConfigError: Equal specs with different managers, or fewer than two
                attention groups.
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
        self.verify_and_split_kv_cache_groups()

    def verify_and_split_kv_cache_groups(self) -> None:
        """Merges groups with equal specs into attention groups (COORD-9)."""
        attention_groups: list[SpecGroup] = []
        for i, g in enumerate(self.kv_cache_config.kv_cache_groups):
            manager_cls = self._manager_classes[i]
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
        self.attention_groups = attention_groups
        eagle_groups = {gid for ag in attention_groups if ag.use_eagle for gid in ag.group_ids}
        self._eagle_flags = [i in eagle_groups for i in range(len(self._eagle_flags))]

    def _attention_groups(self) -> list[tuple[list[int], bool, bool]]:
        return [
            (list(ag.group_ids), ag.use_eagle, isinstance(ag.spec, FullAttentionSpec))
            for ag in self.attention_groups
        ]

    @property
    def num_uncached_common_prefix_tokens(self) -> int:
        """Set by each lookup: the longest hit seen minus the hit kept (COORD-11)."""
        return self.core.num_uncached_common_prefix_tokens

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
        blocks, lengths = self.core.coordinator_find_longest_cache_hit_per_group(
            block_hashes, max_cache_hit_length
        )
        return blocks, tuple(lengths)


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
