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
from typing import (
    TYPE_CHECKING,
    Any,
    ClassVar,
    Concatenate,
    Literal,
    ParamSpec,
    TypeVar,
    cast,
    overload,
)

from kvcore._native import BlockPool, NoFreeBlocksError, Retention
from kvcore.blocks import KVCacheBlocks
from kvcore.coordinator import (
    HybridKVCacheCoordinator,
    get_kv_cache_coordinator,
    hashes_at_block_size,
)
from kvcore.errors import (
    ArgumentTypeError,
    InvalidArgumentError,
    InvalidConfigError,
    InvariantViolationError,
)
from kvcore.events import BlockStored, KVCacheEvent
from kvcore.request import RequestStatus
from kvcore.single_type import FullAttentionManager, SingleTypeKVCacheManager
from kvcore.specs import (
    AttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    get_kv_cache_spec_kind,
    get_kv_cache_spec_sliding_window,
)

if TYPE_CHECKING:
    from kvcore.config import KVCacheConfig
    from kvcore.request import Request

__all__ = ["KVCacheManager", "PrefixCacheStats"]

logger = logging.getLogger(__name__)

_NOT_RUNNING = object()
_WAITING = RequestStatus.WAITING
_PREEMPTED = RequestStatus.PREEMPTED


class _SkipUndo:
    """What ALLOC-6 (``remove_skipped_blocks``) is about to change for one request, so that a
    refused allocation can put it back: the entries it may create and the blocks it may free
    (freeing appends them to the free queue's ends; touching them takes them out again and
    restores their counts, leaving the queue as it was)."""

    __slots__ = ("had", "managers", "request_id", "saved")

    def __init__(
        self,
        request_id: str,
        managers: Sequence[SingleTypeKVCacheManager],
        skippers: Sequence[SingleTypeKVCacheManager],
    ) -> None:
        self.request_id = request_id
        self.managers = managers
        self.had = [request_id in m.req_to_blocks for m in managers]
        self.saved = [(m, list(m.req_to_blocks.get(request_id, ()))) for m in skippers]

    def restore(self, pool: Any) -> None:
        """Takes the freed blocks back and drops the entries created."""
        rid = self.request_id
        freed: list[int] = []
        for m, old in self.saved:
            cur = m.req_to_blocks.get(rid)
            if cur is None:
                continue
            freed.extend(a for a, b in zip(old, cur, strict=False) if a != b)
            cur[:] = old
        if freed:
            pool.touch(freed)
        for m, present in zip(self.managers, self.had, strict=True):
            if not present and not m.req_to_blocks.get(rid, True):
                del m.req_to_blocks[rid]


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
    Python path (the coordinators check capacity, then allocate, in separate pool calls) are
    serialised. The lock is re-entrant: a request property that calls the manager from inside
    a call is served. The native path serialises its own calls (``kvcore._native``)."""

    @functools.wraps(method)
    def call(self: _M, /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        with self._lock:
            return method(self, *args, **kwargs)

    return call


class KVCacheManager:
    """Allocates and frees KV cache blocks for requests (SPEC §8).

    With a single full-attention group (the common case) the per-request calls run in Rust
    (``kvcore._native.UnitaryFullAttention``); other configurations run the Python
    coordinators of :mod:`kvcore.coordinator`. Set the class attribute
    ``use_native_fast_path = False`` before construction to force the Python path.

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

    use_native_fast_path: ClassVar[bool] = True
    """Route a single full-attention group to the Rust manager (see the class docs)."""

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
        """Builds the coordinator, its pool and managers (MGR-1..4).

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
        self.prefix_cache_stats: PrefixCacheStats | None = PrefixCacheStats() if log_stats else None
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
        self.block_pool = self.coordinator.block_pool
        self.hash_fn = hash_fn
        self.clock = clock
        self.max_pinned_fraction = max_pinned_fraction
        self.exact_router_events = exact_router_events
        # The native pool's cache-control surface (kvcore extensions).
        self._pool = cast(BlockPool, self.block_pool)
        self._pool.clock = clock
        self._pool.exact_router_events = exact_router_events
        self.kv_cache_config = kv_cache_config
        if not watermark >= 0.0:
            raise InvalidConfigError(f"watermark must be non-negative, not {watermark}")
        self.watermark_blocks = int(watermark * kv_cache_config.num_blocks)
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
        self._empty_blocks = self.empty_kv_cache_blocks.blocks
        managers = self.coordinator.single_type_managers
        single_full = (
            managers[0]
            if len(managers) == 1 and type(managers[0]) is FullAttentionManager
            else None
        )
        # Decode fast path over groups that keep the base allocation and caching rules.
        base = SingleTypeKVCacheManager
        simple = all(
            type(m).get_num_blocks_to_allocate is base.get_num_blocks_to_allocate
            and type(m).allocate_new_blocks is base.allocate_new_blocks
            and type(m).cache_blocks is base.cache_blocks
            for m in managers
        )
        coordinator = self.coordinator
        self._hybrid_sbs = (
            coordinator.scheduler_block_size
            if isinstance(coordinator, HybridKVCacheCoordinator)
            else 0
        )
        self._retention = coordinator.retention_interval
        self._skippers = coordinator._skippers
        self._decode_groups: tuple[
            tuple[SingleTypeKVCacheManager, int, dict[str, int], dict[str, list[int]], int], ...
        ] = (
            tuple(
                (
                    m,
                    m.block_size,
                    m.num_cached_block,
                    m.req_to_blocks,
                    m.block_size if self._hybrid_sbs and m.use_eagle else 0,
                )
                for m in managers
            )
            if simple and managers
            else ()
        )
        self._native: Any = None
        if single_full is not None and self.use_native_fast_path:
            self._install_native(single_full)
        self._clip_sizes = tuple(
            g.kv_cache_spec.block_size
            if isinstance(g.kv_cache_spec, AttentionSpec)
            and not isinstance(g.kv_cache_spec, CrossAttentionSpec | EncoderOnlyAttentionSpec)
            else None
            for g in kv_cache_config.kv_cache_groups
        )

    def _install_native(self, stm: FullAttentionManager) -> None:
        """Routes the per-request calls of a single full-attention group to Rust.

        ``kvcore._native.UnitaryFullAttention`` owns the request state of that configuration
        and answers each call in one boundary crossing. Its bound methods replace this
        instance's methods, so a call costs no Python frame of its own. The Python coordinator
        stays for construction checks and the pool; its managers then hold no requests.
        """
        from kvcore._native import BlockPool, UnitaryFullAttention

        native = UnitaryFullAttention(
            cast(BlockPool, self.block_pool),
            stm.block_size,
            stm._records_new_ids,
            self.max_model_len,
            self.watermark_blocks,
            stm.use_eagle,
            KVCacheBlocks,
            self.empty_kv_cache_blocks,
            stm.kv_cache_spec.block_size,
        )
        self._native = native
        names = [
            "allocate_slots",
            "allocate_slots_batch",
            "free",
            "pop_blocks_for_free",
            "get_blocks",
            "get_block_ids",
            "get_block_ids_for_computed_tokens",
            "take_new_block_ids",
        ]
        if self.enable_caching:
            # COORD-8: without caching the count is always 0, which the Python path returns.
            names.append("get_num_common_prefix_blocks")
        if not self.log_stats:
            names.append("get_computed_blocks")
        for name in names:
            setattr(self, name, getattr(native, name))

    @property
    def usage(self) -> float:
        """The pool usage in [0, 1] (MGR-4, POOL-3)."""
        return self.block_pool.get_usage()

    @_serialized
    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """Hands back the current stats and starts fresh ones (MGR-30).

        Returns:
            The stats, or None without ``log_stats``.
        """
        if not self.log_stats:
            return None
        stats = self.prefix_cache_stats
        self.prefix_cache_stats = PrefixCacheStats()
        return stats

    @_serialized
    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Finds the request's longest cached prefix (MGR-6, MGR-7).

        The hit never covers the last token, which must be recomputed for its logits. Lookups
        change no reference count.

        Args:
            request: The request.

        Returns:
            The hit blocks and the number of hit tokens.
        """
        if self._native is not None:
            found: tuple[KVCacheBlocks, int] = self._native.get_computed_blocks(request)
            stats = self.prefix_cache_stats
            if stats is not None and self.enable_caching and not request.skip_reading_prefix_cache:
                stats.record(request.num_tokens, found[1], request.num_preemptions > 0)
            return found
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return self.empty_kv_cache_blocks, 0
        num_tokens = request.num_tokens
        if num_tokens <= 0:
            # The reference's walk over ``num_tokens - 1`` tokens raises ValueError (islice).
            raise InvalidArgumentError("a request without tokens has no prefix to look up")
        blocks, num_hit = self.coordinator.find_longest_cache_hit(
            request.block_hashes, num_tokens - 1
        )
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.record(num_tokens, num_hit, request.num_preemptions > 0)
        return self.create_kv_cache_blocks(blocks), num_hit

    @_serialized
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
    ) -> KVCacheBlocks | None:
        """Gives the request slots for its next tokens (ALLOC-1..13).

        Args:
            request: The request.
            num_new_tokens: Tokens to compute this step, draft tokens included.
            num_new_computed_tokens: Prefix-hit tokens found by :meth:`get_computed_blocks`.
            new_computed_blocks: The hit blocks, or None.
            num_lookahead_tokens: Speculative slots to allocate (never cached).
            num_external_computed_tokens: Tokens a KV connector computed.
            delay_cache_blocks: Skip caching this step (P/D transfers).
            num_encoder_tokens: Encoder tokens (cross-attention groups).
            full_sequence_must_fit: Admission gate: fail unless the whole sequence fits.
            reserved_blocks: Free blocks to leave for other sequences.
            has_scheduled_reqs: Whether the watermark applies.

        Returns:
            The newly allocated blocks (the shared empty instance when none), or None when the
            pool has too few free blocks.

        Raises:
            InvalidArgumentError: (a ValueError) zero new tokens without external tokens, a
                negative count, or hits for the wrong number of groups.
            InvariantViolationError: (an AssertionError) hits for a running request.
        """
        ext = num_external_computed_tokens
        try:
            negative = (
                num_new_tokens
                | num_new_computed_tokens
                | num_lookahead_tokens
                | ext
                | num_encoder_tokens
                | reserved_blocks
            ) < 0
        except TypeError:
            raise ArgumentTypeError("token and block counts must be ints") from None
        if num_new_tokens == 0 and ext == 0:
            raise InvalidArgumentError(
                "num_new_tokens must be > 0 when there are no external computed tokens"
            )
        if negative:
            raise InvalidArgumentError("token and block counts must be non-negative")
        self._pool.expire()
        request_id = request.request_id
        empty = self._empty_blocks
        if new_computed_blocks is None:
            ncb = empty
        else:
            ncb = new_computed_blocks.blocks
            if ncb is not empty:
                self._check_new_computed_blocks(request_id, ncb)
        local = request.num_computed_tokens + num_new_computed_tokens
        max_model_len = self.max_model_len
        total = local + ext
        if total > max_model_len:
            total = max_model_len
        wm = (
            self.watermark_blocks
            if has_scheduled_reqs and (request.status == _WAITING or request.status == _PREEMPTED)
            else 0
        )
        main = total + num_new_tokens
        need_slot = main + num_lookahead_tokens
        if need_slot > max_model_len:
            need_slot = max_model_len

        if ncb is empty and not ext and not full_sequence_must_fit and self._decode_groups:
            out = self._allocate_running(
                request, request_id, total, main, need_slot, wm, reserved_blocks, delay_cache_blocks
            )
            if out is not _NOT_RUNNING:
                return out  # type: ignore[return-value]

        coordinator = self.coordinator
        managers = coordinator.single_type_managers
        # Refusals the reference makes part-way (after freeing, touching or allocating) are
        # made here, before anything changes.
        if self._skippers and local + ext > max_model_len:
            # A window group pads its skipped blocks with that many null entries (STM-4):
            # the reference builds a list of the size, kvcore refuses the count.
            raise InvalidArgumentError(
                f"computed tokens ({local + ext}) beyond max_model_len ({max_model_len}) with "
                "sliding-window groups"
            )
        if num_new_computed_tokens and ncb is empty and self._skippers:
            # A window's skipped blocks are padded from the hits (STM-4): computed tokens
            # without them make STM-2 undercount what ALLOC-9 then allocates, after ALLOC-6
            # has freed blocks outside the window.
            raise InvalidArgumentError(
                "num_new_computed_tokens must come with the hit blocks it counts"
            )
        if (ncb is not empty or ext > 0) and not any(
            request_id in m.num_cached_block for m in managers
        ):
            for m in managers:
                if m.req_to_blocks.get(request_id):
                    raise InvariantViolationError(
                        f"request {request_id!r} holds blocks and cannot take prefix hits or "
                        "external tokens"
                    )
        if self.enable_caching and not delay_cache_blocks:
            num_tokens = request.num_tokens
            coordinator.check_cacheable(
                request, main if main < num_tokens else num_tokens, False, ncb
            )
        if full_sequence_must_fit:
            full = request.num_tokens
            if full > max_model_len:
                full = max_model_len
            need = coordinator.get_num_blocks_to_allocate(
                request_id, full, ncb, num_encoder_tokens, total, full, True
            )
            if need + wm > self.block_pool.get_num_free_blocks():
                return None

        # ``need`` (STM-2) may undercount what is then allocated: external-token blocks
        # (STM-5) are not capped by max_model_len, and a window group's skipped blocks are
        # padded only from hits for a request that is not running. The reference then fails
        # in get_new_blocks after ALLOC-6's frees, touching hits or allocating earlier
        # groups; kvcore checks first and, refusing, undoes ALLOC-6.
        undo: _SkipUndo | None = None
        if ext > 0 or (
            self._skippers and not any(request_id in m.num_cached_block for m in managers)
        ):
            undo = _SkipUndo(request_id, managers, self._skippers)
        coordinator.remove_skipped_blocks(request_id, total, request.num_prompt_tokens)
        need = coordinator.get_num_blocks_to_allocate(
            request_id, need_slot, ncb, num_encoder_tokens, local + ext, main
        )
        if need + wm > self.block_pool.get_num_free_blocks() - reserved_blocks:
            return None
        if undo is not None:
            try:
                self._check_allocation_fits(
                    request_id, ncb, local, ext, need_slot, ncb is not empty or ext > 0
                )
            except NoFreeBlocksError:
                undo.restore(self.block_pool)
                raise
        if ncb is not empty or ext > 0:
            coordinator.allocate_new_computed_blocks(request_id, ncb, local, ext)
        new_blocks = coordinator.allocate_new_blocks(
            request_id, need_slot, main, num_encoder_tokens
        )
        if self.enable_caching and not delay_cache_blocks:
            num_tokens = request.num_tokens
            coordinator.cache_blocks(request, main if main < num_tokens else num_tokens)
        return self.create_kv_cache_blocks(new_blocks)

    def _check_allocation_fits(
        self,
        request_id: str,
        ncb: tuple[Sequence[int], ...],
        local: int,
        ext: int,
        need_slot: int,
        computed: bool,
    ) -> None:
        """Raises NoFreeBlocksError, changing nothing, when touching the hits (STM-4), the
        external-token blocks (STM-5) and the new blocks (STM-3) would need more blocks than
        are free. ``computed``: whether ALLOC-8 will add hits or external tokens. Groups whose
        allocation rules are not the base ones are not simulated."""
        managers = self.coordinator.single_type_managers
        running = any(request_id in m.num_cached_block for m in managers)
        base = SingleTypeKVCacheManager
        pool = self.block_pool
        null = pool.null_block
        touched: set[int] = set()
        pops = 0
        total = local + ext
        for i, m in enumerate(managers):
            if (
                type(m).allocate_new_blocks is not base.allocate_new_blocks
                or type(m).add_local_computed_blocks is not base.add_local_computed_blocks
                or type(m).allocate_external_computed_blocks
                is not base.allocate_external_computed_blocks
            ):
                return
            bs = m.block_size
            blocks = m.req_to_blocks.get(request_id)
            length = len(blocks) if blocks is not None else 0
            if computed and not running:
                skipped = max(m.get_num_skipped_tokens(total) // bs, 0)
                hits = list(ncb[i][skipped:] if skipped > 0 else ncb[i])
                if self.enable_caching and hits:
                    for b, r in zip(hits, pool.get_ref_cnts(hits), strict=True):
                        if r == 0 and b != null:
                            touched.add(b)
                length = skipped + len(hits)
                sk = m.get_num_skipped_tokens(total)
                e = min(total - sk, ext) if sk > 0 else ext
                if e > 0:
                    n = -(-total // bs) - length
                    if n > 0:
                        pops += n
                        length += n
            n = -(-need_slot // bs) - length
            if n > 0:
                pops += n
        free = pool.get_num_free_blocks() - len(touched)
        if pops > free:
            raise NoFreeBlocksError(f"Cannot get {pops} free blocks from the pool ({free} free)")

    def _allocate_running(
        self,
        request: Request,
        request_id: str,
        total: int,
        main: int,
        need_slot: int,
        wm: int,
        reserved_blocks: int,
        delay_cache_blocks: bool,
    ) -> KVCacheBlocks | object | None:
        """ALLOC-6..12 for a request running in every group, without hits or external tokens.

        Exact for managers that keep the base STM-2/STM-3/STM-6 (all but Mamba and
        cross-attention): STM-2's running branch reduces to ``max(cdiv(n, bs) - held, 0)``,
        the groups' STM-3 allocations are popped in one pool call and split in group order
        (the same blocks, evictions and events as one call per group), and STM-6 is called only
        for groups with newly full blocks (it returns early for the others).

        Returns:
            As :meth:`allocate_slots`, or ``_NOT_RUNNING`` when some group does not list the
            request as running (the caller then takes the general path).
        """
        groups = self._decode_groups
        for _m, _bs, cached, _tables, _eagle in groups:
            if request_id not in cached:
                return _NOT_RUNNING
        if self.enable_caching and not delay_cache_blocks:
            num_tokens = request.num_tokens
            self.coordinator.check_cacheable(
                request, main if main < num_tokens else num_tokens, False
            )
        for skipper in self._skippers:
            skipper.remove_skipped_blocks(request_id, total, request.num_prompt_tokens)
        need = 0
        for _m, bs, _cached, tables, _eagle in groups:
            n = -(-need_slot // bs) - len(tables[request_id])
            if n > 0:
                need += n
        pool = self.block_pool
        if (need or wm or reserved_blocks) and (
            need + wm > pool.get_num_free_blocks() - reserved_blocks
        ):
            return None
        result: KVCacheBlocks = self.empty_kv_cache_blocks
        if need:
            fresh = pool.get_new_blocks(need)
            per_group: list[list[int]] = []
            pos = 0
            for m, bs, _cached, tables, _eagle in groups:
                blocks = tables[request_id]
                n = -(-need_slot // bs) - len(blocks)
                if n > 0:
                    chunk = fresh if n == need else fresh[pos : pos + n]
                    pos += n
                    blocks.extend(chunk)
                    if m._records_new_ids:
                        m.new_block_ids.extend(chunk)
                    per_group.append(chunk)
                else:
                    per_group.append([])
            result = KVCacheBlocks(tuple(per_group), pool)
        if self.enable_caching and not delay_cache_blocks:
            num_tokens = request.num_tokens
            to_cache = main if main < num_tokens else num_tokens
            sbs = self._hybrid_sbs
            if sbs:
                aligned = to_cache // sbs * sbs
                for m, bs, cached, _tables, eagle_bs in groups:
                    n = aligned
                    if eagle_bs and aligned > 0:
                        n = min(to_cache, aligned + eagle_bs)
                    if cached[request_id] < n // bs:
                        m.cache_blocks(request, n, self._retention)
            else:
                for m, bs, cached, _tables, _eagle in groups:
                    if cached[request_id] < to_cache // bs:
                        m.cache_blocks(request, to_cache, self._retention)
        return result

    @overload
    def allocate_slots_batch(
        self,
        requests: Sequence[Request],
        num_new_tokens: Sequence[int],
        num_lookahead_tokens: int = 0,
        allow_none: Literal[False] = False,
    ) -> list[tuple[list[int], ...]]: ...

    @overload
    def allocate_slots_batch(
        self,
        requests: Sequence[Request],
        num_new_tokens: Sequence[int],
        num_lookahead_tokens: int = 0,
        allow_none: bool = False,
    ) -> list[tuple[list[int], ...] | None]: ...

    def allocate_slots_batch(
        self,
        requests: Sequence[Request],
        num_new_tokens: Sequence[int],
        num_lookahead_tokens: int = 0,
        allow_none: bool = False,
    ) -> list[tuple[list[int], ...]] | list[tuple[list[int], ...] | None]:
        """Allocates for a batch of running requests in one call (kvcore extension).

        Equivalent to ``allocate_slots(r, n, num_lookahead_tokens=num_lookahead_tokens)`` for
        each ``(r, n)`` in order, stopping at the first request that does not fit: the same
        decisions, blocks and events as that loop, at one boundary crossing per batch for the
        single full-attention configuration. A scheduler calls it for its running requests
        and, when it comes back short, preempts and calls again from the request that failed.

        Args:
            requests: Requests that already hold blocks (no new prefix hits).
            num_new_tokens: Tokens to compute this step, one count per request.
            num_lookahead_tokens: Speculative lookahead slots, the same for every request.
            allow_none: Give None instead of empty lists for a request that got no new block
                (as ``get_block_ids(allow_none=True)``, which is what a scheduler sends on:
                most decode steps allocate nothing).

        Returns:
            ``allocate_slots(...).get_block_ids(allow_none)`` of each request that fit, in
            order. A result shorter than ``requests`` means ``requests[len(result)]`` got None
            from ``allocate_slots`` and the ones after it were not tried.

        Raises:
            InvalidArgumentError: The two sequences differ in length, or a count is not
                positive (checked for every request before any is allocated); or a request is
                refused as by ``allocate_slots``, and the requests before it stay allocated,
                as in the loop.
            ArgumentTypeError: A count is not an int.
        """
        if len(requests) != len(num_new_tokens):
            raise InvalidArgumentError(
                f"{len(requests)} requests but {len(num_new_tokens)} token counts"
            )
        for n in num_new_tokens:
            if not isinstance(n, int):
                raise ArgumentTypeError(f"num_new_tokens must be ints, not {type(n).__name__}")
            if n <= 0:
                # ALLOC-1 (zero) and negative counts, for every request before any is allocated.
                raise InvalidArgumentError(f"num_new_tokens must be positive, got {n}")
        out: list[tuple[list[int], ...] | None] = []
        with self._lock:  # one step: no other thread's call in between
            for request, n in zip(requests, num_new_tokens, strict=True):
                blocks = self.allocate_slots(request, n, num_lookahead_tokens=num_lookahead_tokens)
                if blocks is None:
                    break
                out.append(blocks.get_block_ids(allow_none=allow_none))
        return out

    def _check_new_computed_blocks(self, request_id: str, ncb: tuple[Sequence[int], ...]) -> None:
        """Rejects hits of the wrong shape, or for a running request, before any mutation."""
        if len(ncb) != self.num_kv_cache_groups:
            raise InvalidArgumentError(
                f"new_computed_blocks has {len(ncb)} groups, the manager has "
                f"{self.num_kv_cache_groups}"
            )
        if any(ncb) and any(
            request_id in m.num_cached_block for m in self.coordinator.single_type_managers
        ):
            raise InvariantViolationError(
                f"request {request_id!r} is running and cannot take new prefix hits"
            )

    @_serialized
    def free(self, request: Request) -> None:
        """Frees the request's blocks, group by group, tail first (MGR-20).

        The request's ``retention_priority`` and ``retention_ttl_s``, when it has them, place
        its cached blocks in the eviction order (kvcore extension, CC-1..2).

        Args:
            request: The request; an unknown one is a no-op.

        Raises:
            InvalidArgumentError: A retention out of range; nothing is freed.
            ArgumentTypeError: A retention of the wrong type; nothing is freed.
        """
        priority = getattr(request, "retention_priority", None)
        ttl_s = getattr(request, "retention_ttl_s", None)
        if priority is None and ttl_s is None:
            self.coordinator.free(request.request_id)
        else:
            self.coordinator.free(request.request_id, Retention(priority, ttl_s))

    @_serialized
    def remove_skipped_blocks(
        self, request_id: str, total_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        """Frees blocks outside the attention windows (MGR-22).

        Args:
            request_id: The request id.
            total_computed_tokens: Local plus external computed tokens.
            num_prompt_tokens: Prompt length (R-SWA), or None.

        Raises:
            ArgumentTypeError: A count that is not an int.
        """
        if not isinstance(total_computed_tokens, int) or not isinstance(
            num_prompt_tokens, int | None
        ):
            raise ArgumentTypeError("token counts must be ints")
        self.coordinator.remove_skipped_blocks(request_id, total_computed_tokens, num_prompt_tokens)

    @_serialized
    def pop_blocks_for_free(self, request: Request) -> list[int]:
        """Forgets the request without freeing; returns its blocks (MGR-21).

        The caller must later pass them, reversed, to ``block_pool.free_blocks``.

        Args:
            request: The request.

        Returns:
            All its block ids, group by group, in allocation order.
        """
        return self.coordinator.pop_blocks_for_free(request.request_id)

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
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True

    @_serialized
    def invalidate_prefix_cache(self) -> None:
        """Stops every block cached so far from hitting, while requests run (CC-7).

        Running requests keep their blocks and go on; their later full blocks are cached
        again as usual. Free cached blocks become plain free blocks and pins are released.
        With events on, one ``AllBlocksCleared`` is queued.
        """
        self._pool.invalidate_prefix_cache()
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True

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
        hashes = list(probe.block_hashes)
        return [
            (gid, hashes_at_block_size(hashes, g.kv_cache_spec.block_size, hbs))
            for gid, g in enumerate(self.kv_cache_config.kv_cache_groups)
        ]

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
        self._pool.expire()
        counts = self._pool.pin_prefix(groups, ttl_s, max_pinned)
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
        return self._prefix_count(self._pool.unpin_prefix(groups))

    @property
    def num_pinned_blocks(self) -> int:
        """How many blocks are pinned now (CC-5)."""
        self._pool.expire()
        return self._pool.num_pinned_blocks

    @_serialized
    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Per group, the leading blocks every tracked request shares (MGR-22, FA-2).

        Args:
            running_request_id: Any running request.

        Returns:
            One count per group.
        """
        return self.coordinator.get_num_common_prefix_blocks(running_request_id)

    @_serialized
    def take_events(self) -> list[KVCacheEvent]:
        """Takes the pool's events, annotating ``BlockStored`` with the group kind (MGR-24).

        Returns:
            The events in emission order.
        """
        events: list[KVCacheEvent] = self.block_pool.take_events()
        meta = self.kv_cache_event_metadata
        for event in events:
            if not isinstance(event, BlockStored) or event.group_idx is None:
                continue
            gid = event.group_idx
            if gid < 0 or gid >= len(meta):
                logger.warning("Group index %s not in KV cache metadata", gid)
                continue
            event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window = meta[gid]
        return events

    @_serialized
    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """The request's blocks per group (MGR-25); callers must not mutate the lists.

        Args:
            request_id: The request id; an unknown one gives the empty instance.

        Returns:
            The blocks.
        """
        return self.create_kv_cache_blocks(self.coordinator.get_blocks(request_id))

    @_serialized
    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids per group, as new lists (MGR-25)."""
        return self.get_blocks(request_id).get_block_ids()

    @_serialized
    def get_block_ids_for_computed_tokens(
        self, request_id: str, num_computed_tokens: int
    ) -> tuple[list[int], ...]:
        """Block ids covering the first ``num_computed_tokens`` tokens (MGR-26).

        Args:
            request_id: The request id.
            num_computed_tokens: Computed tokens.

        Returns:
            Per group, ``cdiv(n, block_size)`` ids for attention groups; the whole list for
            Mamba, cross-attention and encoder-only groups.

        Raises:
            InvalidArgumentError: A negative count (the reference slices oddly).
            ArgumentTypeError: A count that is not an int.
        """
        if not isinstance(num_computed_tokens, int):
            raise ArgumentTypeError("num_computed_tokens must be an int")
        if num_computed_tokens < 0:
            raise InvalidArgumentError(
                f"num_computed_tokens must be non-negative, got {num_computed_tokens}"
            )
        out: list[list[int]] = []
        for ids, bs in zip(self.get_block_ids(request_id), self._clip_sizes, strict=True):
            out.append(ids if bs is None else ids[: -(-num_computed_tokens // bs)])
        return tuple(out)

    @_serialized
    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Caches the request's full blocks when caching is on (MGR-27).

        Args:
            request: The request.
            num_computed_tokens: Tokens to cover, cached ones included.
        """
        if self.enable_caching:
            if self._native is not None:
                self._native.cache_blocks(request, num_computed_tokens)
            else:
                if not isinstance(num_computed_tokens, int):
                    raise ArgumentTypeError(
                        "num_computed_tokens must be an int, not "
                        f"{type(num_computed_tokens).__name__}"
                    )
                self.coordinator.check_cacheable(request, num_computed_tokens)
                self.coordinator.cache_blocks(request, num_computed_tokens)

    def create_kv_cache_blocks(self, blocks: tuple[Sequence[int], ...]) -> KVCacheBlocks:
        """Wraps per-group ids; the shared empty instance when all are empty (MGR-3).

        Args:
            blocks: Ids per group.

        Returns:
            The result object.
        """
        return KVCacheBlocks(blocks, self.block_pool) if any(blocks) else self.empty_kv_cache_blocks

    @_serialized
    def take_new_block_ids(self) -> list[int]:
        """Drains the ids allocated since the last call, group by group (MGR-29)."""
        ids: list[int] = []
        for m in self.coordinator.single_type_managers:
            ids.extend(m.take_new_block_ids())
        return ids

    @_serialized
    def new_step_starts(self) -> None:
        """Signals a new scheduler step (MGR-30)."""
        self.coordinator.new_step_starts()
