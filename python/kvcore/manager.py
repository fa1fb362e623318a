"""The scheduler-facing KV cache manager (SPEC §8).

:class:`KVCacheManager` answers the scheduler's three questions: which prefix of a new request is
already cached (:meth:`~KVCacheManager.get_computed_blocks`), whether a request can get slots for
its next tokens and which blocks they are (:meth:`~KVCacheManager.allocate_slots`), and what to
release when it finishes or is preempted (:meth:`~KVCacheManager.free`). Blocks are int ids.

Examples:
    >>> from kvcore.config import KVCacheConfig, KVCacheGroupSpec
    >>> from kvcore.request import Request
    >>> from kvcore.specs import FullAttentionSpec
    >>> spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype="float16")
    >>> cfg = KVCacheConfig(10, [], [KVCacheGroupSpec(["l0"], spec)])
    >>> mgr = KVCacheManager(cfg, max_model_len=1024, scheduler_block_size=16,
    ...                      hash_block_size=16, enable_caching=False)
    >>> mgr.allocate_slots(Request("r1", list(range(40))), 40).get_block_ids()
    ([1, 2, 3],)
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Concatenate, ParamSpec, TypeVar

from kvcore._native import BlockPool, KVCacheManagerCore
from kvcore.blocks import KVCacheBlocks
from kvcore.coordinator import get_kv_cache_coordinator
from kvcore.errors import InvalidConfigError
from kvcore.specs import (
    FullAttentionSpec,
    get_kv_cache_spec_kind,
    get_kv_cache_spec_sliding_window,
)

if TYPE_CHECKING:
    from kvcore.config import KVCacheConfig
    from kvcore.request import Request

__all__ = ["KVCacheManager", "PrefixCacheStats"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache hit statistics (STAT-1).

    Attributes:
        reset: Whether the prefix cache was reset.
        requests: New requests looked up.
        queries: Tokens of those requests.
        hits: Hit tokens of those requests.
        preempted_requests: Preempted requests looked up again.
        preempted_queries: Tokens of those requests.
        preempted_hits: Hit tokens of those requests.
    """

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        """Adds one lookup to the preempted or to the normal counters (STAT-1).

        Args:
            num_tokens: The request's tokens.
            num_hits: Hit tokens.
            preempted: Whether the request was preempted before.
        """
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits


_T = TypeVar("_T")
_P = ParamSpec("_P")
_M = TypeVar("_M", bound="KVCacheManager")


def _serialized(method: Callable[Concatenate[_M, _P], _T]) -> Callable[Concatenate[_M, _P], _T]:
    """Runs the method under the manager's lock, so that calls from many threads on the
    methods with Python state (pins, the cache-control calls) are serialised. The lock is
    re-entrant: a request property that calls the manager from inside a call is served. The
    core's methods serialise their own calls (``kvcore._native``), the stats' swap and
    recordings included."""

    @functools.wraps(method)
    def call(self: _M, /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        with self._lock:
            return method(self, *args, **kwargs)

    return call


class KVCacheManager(KVCacheManagerCore):
    """Allocates and frees KV cache blocks for requests (SPEC §8).

    The constructor holds the policy: it checks the configuration, picks the coordinator
    (:mod:`kvcore.coordinator`) and its managers, and builds the Rust core the manager
    subclasses (``kvcore._native.KVCacheManagerCore``, typed in ``kvcore/_native.pyi``). The
    per-request calls are the core's methods, one boundary crossing each, for every
    configuration: :meth:`allocate_slots`, :meth:`allocate_slots_batch`, :meth:`free`,
    :meth:`pop_blocks_for_free`, :meth:`get_blocks`, :meth:`get_block_ids`,
    :meth:`get_block_ids_for_computed_tokens`, :meth:`get_num_common_prefix_blocks`,
    :meth:`cache_blocks`, :meth:`remove_skipped_blocks`, :meth:`take_new_block_ids`,
    :meth:`take_events` and :meth:`new_step_starts`. The methods below are the ones with Python
    state (stats, events' group metadata, cache control).

    Attributes:
        max_model_len: Longest sequence.
        enable_caching: Whether prefix caching is on.
        use_eagle: Whether EAGLE/MTP drafting is on.
        log_stats: Whether prefix-cache stats are kept.
        prefix_cache_stats: The current stats, or None without ``log_stats``.
        coordinator: The coordinator (COORD-1).
        num_kv_cache_groups: Number of groups.
        block_pool: The shared pool.
        kv_cache_config: The configuration.
        watermark_blocks: Blocks kept free when admitting waiting requests (MGR-1).
        kv_cache_event_metadata: Per group, the event kind and window (MGR-4).
        empty_kv_cache_blocks: The shared empty result (MGR-3).
    """

    _plain_request_classes: ClassVar[tuple[tuple[type, str], ...]] = ()
    """Request classes the core reads from their instance dicts (and ``__slots__`` of their
    own for the decode fields) instead of by attribute lookup, each with the list attribute
    whose length is ``num_tokens``; ``kvcore.vllm`` names vLLM's ``Request`` and its own
    slotted subclass. The core refuses a class with a descriptor or lookup hook in the way."""

    _stats_class: ClassVar[type[PrefixCacheStats]] = PrefixCacheStats
    """The class of :attr:`prefix_cache_stats`: fields and ``record`` as
    :class:`PrefixCacheStats` (``kvcore.vllm`` names vLLM's, its scheduler's own type)."""

    _event_classes: ClassVar[tuple[type, type, type] | None] = None
    """The classes :meth:`take_events` builds ``(BlockStored, BlockRemoved,
    AllBlocksCleared)`` as, called with the same fields positionally, in the order of kvcore's
    (``__match_args__``); None: kvcore's own. ``kvcore.vllm`` names vLLM's, which its event
    publisher encodes."""

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        scheduler_block_size: int,
        hash_block_size: int,
        max_num_batched_tokens: int | None = None,
        enable_caching: bool = True,
        use_eagle: bool = False,
        log_stats: bool = False,
        enable_kv_cache_events: bool = False,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
        metrics_collector: Any = None,
        watermark: float = 0.0,
        *,
        hash_fn: Callable[[Any], bytes] | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_pinned_fraction: float = 0.5,
        exact_router_events: bool = False,
    ) -> None:
        """Builds the coordinator, its pool and the core (MGR-1..4).

        Args:
            kv_cache_config: The configuration.
            max_model_len: Longest sequence.
            scheduler_block_size: The scheduling granularity.
            hash_block_size: The granularity of ``Request.block_hashes``.
            max_num_batched_tokens: Tokens per step; defaults to ``max_model_len``.
            enable_caching: Whether prefix caching is on.
            use_eagle: Whether EAGLE/MTP drafting is on.
            log_stats: Whether to keep prefix-cache stats.
            enable_kv_cache_events: Whether to queue KV events.
            dcp_world_size: Decode context-parallel world size.
            pcp_world_size: Prefill context-parallel world size.
            metrics_collector: Accepted for compatibility; block metrics are not collected.
            watermark: Fraction of blocks kept free when admitting waiting requests.
            hash_fn: The requests' block-hash function, which :meth:`pin_prefix` hashes
                prompts with (kvcore extension, CC-5).
            clock: Seconds, for retention and pin times to live (kvcore extension, CC-3).
            max_pinned_fraction: At most this fraction of the pool's blocks may be pinned
                (kvcore extension, CC-6).
            exact_router_events: Events that name a hash's first stored copy and its last
                removed one only (kvcore extension, CC-8).

        Raises:
            InvalidConfigError: (AssertionError and ValueError) an inconsistent configuration,
                a negative watermark, a ``max_pinned_fraction`` outside [0, 1] or a clock that
                is not callable.
        """
        if not 0.0 <= max_pinned_fraction <= 1.0:
            raise InvalidConfigError(
                f"max_pinned_fraction must be between 0 and 1, not {max_pinned_fraction}"
            )
        if not callable(clock):
            raise InvalidConfigError(f"clock must be callable, not {clock!r}")
        self._lock = threading.RLock()
        self.max_model_len = max_model_len
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max_model_len
        self.enable_caching = enable_caching
        self.use_eagle = use_eagle
        self.log_stats = log_stats
        self.metrics_collector = metrics_collector
        self.prefix_cache_stats: PrefixCacheStats | None = (
            self._stats_class() if log_stats else None
        )
        self.coordinator = get_kv_cache_coordinator(
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
        self.num_kv_cache_groups = len(kv_cache_config.kv_cache_groups)
        self.block_pool: BlockPool = self.coordinator.block_pool
        self.hash_fn = hash_fn
        self.clock = clock
        self.max_pinned_fraction = max_pinned_fraction
        self.exact_router_events = exact_router_events
        self.block_pool.clock = clock
        self.block_pool.exact_router_events = exact_router_events
        self.kv_cache_config = kv_cache_config
        valid_watermark = watermark >= 0.0  # False for NaN too
        self.watermark_blocks = (
            int(watermark * kv_cache_config.num_blocks) if valid_watermark else 0
        )
        self.kv_cache_event_metadata: tuple[tuple[str, int | None], ...] = tuple(
            (
                get_kv_cache_spec_kind(g.kv_cache_spec).value,
                get_kv_cache_spec_sliding_window(g.kv_cache_spec),
            )
            for g in kv_cache_config.kv_cache_groups
        )
        self.empty_kv_cache_blocks = KVCacheBlocks(
            tuple(() for _ in range(self.num_kv_cache_groups)), self.block_pool
        )
        cfg = self.coordinator.native_config()
        self._init_core(
            self.block_pool,
            cfg.mode,
            cfg.groups,
            cfg.eagle_groups,
            cfg.attention_groups,
            max_model_len,
            self.watermark_blocks,
            scheduler_block_size,
            cfg.retention_interval,
            cfg.dcp_world_size,
            cfg.pcp_world_size,
            cfg.clip,
            KVCacheBlocks,
            self.empty_kv_cache_blocks,
            list(self._plain_request_classes),
            self._event_classes,
        )
        self.coordinator.bind(self)
        # After the core's configuration checks, as the reference checks COORD-2 first.
        if not valid_watermark:
            raise InvalidConfigError(f"watermark must be non-negative, not {watermark}")

    @property
    def usage(self) -> float:
        """The pool usage in [0, 1] (MGR-4, POOL-3)."""
        return self.block_pool.get_usage()

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """Hands back the current stats and starts fresh ones (MGR-30).

        Returns:
            The stats, or None without ``log_stats``.
        """
        if not self.log_stats:
            return None
        # Under the core's lock, as every recording into the stats (`_stats_call`): a per-step
        # call takes no Python lock.
        stats: PrefixCacheStats | None = self._swap_stats(self._stats_class())
        return stats

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Finds the request's longest cached prefix (MGR-6, MGR-7).

        The hit never covers the last token, which must be recomputed for its logits. Lookups
        change no reference count. The search runs in the core (which serialises its own
        calls); the stats are recorded here, under the core's lock (``_stats_call``).

        Args:
            request: The request.

        Returns:
            The hit blocks and the number of hit tokens.
        """
        found: tuple[KVCacheBlocks, int] = self._computed_blocks(request)
        if self.log_stats:
            self._record_lookup(request, found[1])
        return found

    def _record_lookup(self, request: Request, num_hits: int) -> None:
        """Counts one lookup in the current stats (STAT-1), unless caching is off or the
        request skips the prefix cache."""
        if self.enable_caching and not request.skip_reading_prefix_cache:
            num_tokens, preempted = request.num_tokens, request.num_preemptions > 0
            self._stats_call("record", num_tokens, num_hits, preempted)

    @_serialized
    def evict_blocks(self, block_ids: set[int]) -> None:
        """Drops the given blocks' prefix-cache keys (MGR-27, POOL-20).

        Args:
            block_ids: Block ids.
        """
        self.block_pool.evict_blocks(block_ids)

    @_serialized
    def reset_prefix_cache(self) -> bool:
        """Clears the prefix cache if no block is in use (MGR-27, POOL-21).

        Blocks held only by pins do not count as in use: the pins are released (CC-6).

        Returns:
            Whether the cache was cleared.
        """
        if not self.block_pool.reset_prefix_cache():
            return False
        self._stats_call("__setattr__", "reset", True)
        return True

    @_serialized
    def invalidate_prefix_cache(self) -> None:
        """Stops every block cached so far from hitting, while requests run (CC-7).

        Running requests keep their blocks and go on; their later full blocks are cached
        again as usual. Free cached blocks become plain free blocks and pins are released.
        With events on, one ``AllBlocksCleared`` is queued.
        """
        self.block_pool.invalidate_prefix_cache()
        self._stats_call("__setattr__", "reset", True)

    def _prefix_hashes(
        self, token_ids: Sequence[int], lora_request: Any, cache_salt: str | None
    ) -> list[tuple[int, list[bytes]]]:
        """Per group, the block hashes a request with this prompt would have (CC-5)."""
        if self.hash_fn is None:
            raise InvalidConfigError(
                "pin_prefix and unpin_prefix need the requests' block-hash function: build "
                "the manager with hash_fn="
            )
        from kvcore.hashing import get_request_block_hasher
        from kvcore.request import Request

        hbs = self.block_pool.hash_block_size
        probe = Request(
            "kvcore-pin-prefix",
            list(token_ids),
            lora_request=lora_request,
            cache_salt=cache_salt,
            block_hasher=get_request_block_hasher(hbs, self.hash_fn),
        )
        return self._hashes_per_group(probe.block_hashes)

    def _prefix_count(self, per_group: Sequence[int]) -> int:
        """The leading prefix blocks counted in every full-attention group (CC-5)."""
        groups = self.kv_cache_config.kv_cache_groups
        full = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, FullAttentionSpec)]
        chosen = full or list(range(len(groups)))
        unit = min(groups[i].kv_cache_spec.block_size for i in chosen)
        return min(per_group[i] * groups[i].kv_cache_spec.block_size // unit for i in chosen)

    @_serialized
    def pin_prefix(
        self,
        token_ids: Sequence[int],
        *,
        ttl_s: float | None = None,
        lora_request: Any = None,
        cache_salt: str | None = None,
    ) -> int:
        """Keeps the cached leading full blocks of a prompt from being evicted (CC-5, CC-6).

        Every cached copy of each leading block hash is pinned, up to the first hash with no
        cached copy; a partial last block is not pinned. Pinned blocks count as used, so
        :meth:`allocate_slots` refuses rather than evict them. Pinning again moves the pins'
        deadline.

        Args:
            token_ids: The prompt.
            ttl_s: Seconds (by the manager's clock) until the pins lapse; None: no limit.
            lora_request: The LoRA request the prompt is served with, or None.
            cache_salt: The cache salt, or None.

        Returns:
            How many leading prefix blocks are now pinned.

        Raises:
            InvalidConfigError: The manager was built without ``hash_fn``.
            InvalidArgumentError: More than ``max_pinned_fraction`` of the pool would be
                pinned (nothing is pinned), or a bad ``ttl_s``.
        """
        groups = self._prefix_hashes(token_ids, lora_request, cache_salt)
        max_pinned = int(self.max_pinned_fraction * self.kv_cache_config.num_blocks)
        self.block_pool.expire()
        counts = self.block_pool.pin_prefix(groups, ttl_s, max_pinned)
        return self._prefix_count(counts)

    @_serialized
    def unpin_prefix(
        self,
        token_ids: Sequence[int],
        *,
        lora_request: Any = None,
        cache_salt: str | None = None,
    ) -> int:
        """Releases the pins :meth:`pin_prefix` took on a prompt's leading blocks (CC-5).

        Args:
            token_ids: The prompt.
            lora_request: The LoRA request, or None.
            cache_salt: The cache salt, or None.

        Returns:
            How many leading prefix blocks were released.

        Raises:
            InvalidConfigError: The manager was built without ``hash_fn``.
        """
        groups = self._prefix_hashes(token_ids, lora_request, cache_salt)
        return self._prefix_count(self.block_pool.unpin_prefix(groups))

    @property
    def num_pinned_blocks(self) -> int:
        """How many blocks are pinned now (CC-5)."""
        self.block_pool.expire()
        return self.block_pool.num_pinned_blocks

    def create_kv_cache_blocks(self, blocks: tuple[Sequence[int], ...]) -> KVCacheBlocks:
        """Wraps per-group ids; the shared empty instance when all are empty (MGR-3).

        Args:
            blocks: Ids per group.

        Returns:
            The result object.
        """
        return KVCacheBlocks(blocks, self.block_pool) if any(blocks) else self.empty_kv_cache_blocks
