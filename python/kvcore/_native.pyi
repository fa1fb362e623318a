"""Type stubs of the native extension ``kvcore._native``."""

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, Self, final, overload

from typing_extensions import disjoint_base

if TYPE_CHECKING:
    from kvcore.blocks import KVCacheBlocks

__all__ = [
    "AllBlocksCleared",
    "ArgumentOverflowError",
    "ArgumentTypeError",
    "BlockIdError",
    "BlockList",
    "BlockPool",
    "BlockRemoved",
    "BlockStateError",
    "BlockStored",
    "DoubleFreeError",
    "InvalidArgumentError",
    "InvalidConfigError",
    "InvariantViolationError",
    "KVCacheBlockView",
    "KVCacheBlocksBase",
    "KVCacheEvent",
    "KVCacheManagerCore",
    "KvcoreError",
    "MissingBlocksError",
    "NoFreeBlocksError",
    "PlainRequestBase",
    "RequestBlockHasher",
    "RequestCore",
    "Retention",
    "TokenIds",
    "UnsupportedError",
    "__version__",
    "append_output_token_ids_batch",
    "digest",
    "encode_event_batch",
    "hash_block_tokens",
    "hash_object",
    "hash_request_blocks",
    "msgpack_encode",
    "register_extra_keys_fn",
]
__version__: str

class KvcoreError(Exception):
    """Base class of every exception kvcore raises."""

class BlockIdError(KvcoreError, IndexError, AssertionError):
    """A block id outside the pool."""

class NoFreeBlocksError(KvcoreError, ValueError):
    """More blocks were asked for than are free (SPEC POOL-5)."""

class DoubleFreeError(KvcoreError, ValueError):
    """A block was freed more often than it was referenced."""

class BlockStateError(KvcoreError, RuntimeError):
    """A block is in a state the operation cannot accept (SPEC POOL-9)."""

class InvalidArgumentError(KvcoreError, ValueError, AssertionError):
    """An argument violates a precondition the reference asserts."""

class ArgumentTypeError(KvcoreError, TypeError, AttributeError):
    """An argument of a type kvcore does not take. Also an AttributeError: the reference fails on such an argument with one or the other, when it looks the object's attributes or methods up."""

class ArgumentOverflowError(KvcoreError, OverflowError, ValueError):
    """An int argument outside the range kvcore represents (a group id beyond 32 bits)."""

class InvariantViolationError(KvcoreError, AssertionError):
    """A call that breaks a manager invariant where the reference asserts, e.g. prefix hits for a request that is already running (SPEC COORD-5)."""

class MissingBlocksError(InvalidArgumentError, IndexError):
    """A request holds fewer blocks than the call needs, e.g. caching blocks it was never given (the reference fails indexing its block list)."""

class InvalidConfigError(KvcoreError, ValueError, AssertionError):
    """An inconsistent KV cache configuration (block sizes, groups, specs). The reference asserts on most of these (COORD-2, COORD-7, COORD-9, SPEC-1) and raises ValueError on others (CFG-2, the retention interval); this class satisfies both handlers."""

class UnsupportedError(KvcoreError, NotImplementedError):
    """An operation the configuration does not support, where the reference raises NotImplementedError (prefix-cache lookups of cross-attention groups, XATTN-1)."""

@final
class KVCacheBlockView:
    """A snapshot of one block's state (SPEC BLK-1)."""

    @property
    def block_id(self) -> int: ...
    @property
    def ref_cnt(self) -> int: ...
    @property
    def block_hash(self) -> bytes | None: ...
    @property
    def block_hash_num_tokens(self) -> int | None: ...
    @property
    def is_null(self) -> bool: ...

@final
class BlockList:
    """The read-only sequence behind ``BlockPool.blocks``."""

    def __len__(self) -> int: ...
    @overload
    def __getitem__(self, index: int, /) -> KVCacheBlockView: ...
    @overload
    def __getitem__(self, index: slice, /) -> list[KVCacheBlockView]: ...

@final
class Retention:
    """A validated retention priority (0..100, default 50) and time to live in seconds."""

    def __new__(cls, priority: int | None = None, ttl_s: float | None = None) -> Retention: ...
    @property
    def priority(self) -> int: ...
    @property
    def ttl_s(self) -> float | None: ...
    @property
    def is_default(self) -> bool: ...

@final
class BlockPool:
    """The KV-cache block pool (SPEC §4). A block is its ``int`` id; block 0 is null."""

    def __new__(
        cls,
        num_gpu_blocks: int,
        enable_caching: bool,
        hash_block_size: int,
        enable_kv_cache_events: bool = False,
        metrics_collector: None = None,
    ) -> BlockPool: ...
    @property
    def num_gpu_blocks(self) -> int: ...
    @property
    def enable_caching(self) -> bool: ...
    @property
    def hash_block_size(self) -> int: ...
    @property
    def enable_kv_cache_events(self) -> bool: ...
    @property
    def null_block(self) -> int: ...
    @property
    def blocks(self) -> BlockList: ...
    def get_num_free_blocks(self) -> int: ...
    def get_usage(self) -> float: ...
    def get_new_blocks(self, num_blocks: int) -> list[int]: ...
    def touch(self, blocks: Iterable[int]) -> None: ...
    def free_blocks(
        self, ordered_blocks: Iterable[int], retention: Retention | None = None
    ) -> None: ...
    @property
    def clock(self) -> Callable[[], float] | None:
        """The clock deadlines are read from; None means ``time.monotonic``."""
    @clock.setter
    def clock(self, clock: Callable[[], float] | None) -> None: ...
    @property
    def exact_router_events(self) -> bool:
        """Events naming a key's first stored block and its last removed one only."""
    @exact_router_events.setter
    def exact_router_events(self, on: bool) -> None: ...
    def expire(self) -> None:
        """Applies the retention and pin deadlines the clock says are due."""
    def pin_prefix(
        self,
        groups: Iterable[tuple[int, Iterable[bytes]]],
        ttl_s: float | None = None,
        max_pinned: int = ...,
    ) -> list[int]: ...
    def unpin_prefix(self, groups: Iterable[tuple[int, Iterable[bytes]]]) -> list[int]: ...
    @property
    def num_pinned_blocks(self) -> int: ...
    def are_pinned(self, block_ids: Iterable[int]) -> list[bool]: ...
    def invalidate_prefix_cache(self) -> None: ...
    def cache_full_blocks(
        self,
        request: Any,
        blocks: Sequence[int],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: Sequence[bool] | None = None,
    ) -> None: ...
    def cache_partial_block(
        self,
        request: Any,
        block: int,
        num_tokens: int,
        kv_cache_group_id: int,
        block_size: int,
    ) -> bytes | None: ...
    def get_cached_block(
        self, block_hash: bytes, kv_cache_group_ids: Iterable[int]
    ) -> list[int] | None: ...
    def longest_cached_prefix(
        self,
        block_hashes: Sequence[bytes],
        max_num_blocks: int,
        kv_cache_group_ids: Sequence[int],
        stride: int = 1,
    ) -> list[list[int]]: ...
    def last_aligned_hit(
        self,
        block_hashes: Sequence[bytes],
        max_num_blocks: int,
        kv_cache_group_ids: Sequence[int],
        block_size: int,
        alignment_tokens: int,
    ) -> tuple[int, list[int]] | None:
        """The Mamba hit search (SPEC MAMBA-2) in one call."""
    def sliding_window_hit(
        self,
        block_hashes: Sequence[bytes],
        max_num_blocks: int,
        kv_cache_group_ids: Sequence[int],
        need: int,
        block_size: int,
        alignment_tokens: int,
        drop_eagle_block: bool,
    ) -> list[list[int]]:
        """The sliding-window hit search (SPEC SWA-3) in one call."""
    def evict_blocks(self, block_ids: Iterable[int]) -> None: ...
    def reset_prefix_cache(self) -> bool: ...
    def take_events(self) -> list[BlockStored | BlockRemoved | AllBlocksCleared]: ...
    def record_block_ops(self, on: bool) -> None:
        """Starts or stops recording the operations a block-metrics collector follows."""
    def take_block_ops(self) -> list[tuple[int, int]]:
        """``(kind, block_id)`` in pool order: 0 allocated, 1 accessed, 2 evicted, 3 reset."""
    def get_all_free_block_ids(self) -> list[int]: ...
    def get_ref_cnts(self, block_ids: Iterable[int]) -> list[int]: ...
    def count_evictable(self, block_ids: Iterable[int]) -> int: ...
    def get_block_hashes(self, block_ids: Iterable[int]) -> list[bytes | None]: ...
    def check_invariants(self) -> None: ...
    def __len__(self) -> int: ...

@final
class _ManagedRequest(Protocol):
    """What the manager core reads from a request (a ``kvcore.Request`` or vLLM's): the id and
    token counts, the status (admission's watermark), the prompt length (window groups), the
    block hashes (caching) and, for events, the fields a ``BlockStored`` carries."""

    @property
    def request_id(self) -> str: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_computed_tokens(self) -> int: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def block_hashes(self) -> Sequence[bytes]: ...
    @property
    def skip_reading_prefix_cache(self) -> bool: ...

_NativeGroup = tuple[str, int, int, bool, int | None]

@disjoint_base
class KVCacheManagerCore:
    """The request-level calls of every KV cache configuration (``kvcore-core``'s
    ``coordinator::Coordinator``); ``kvcore.KVCacheManager`` subclasses it."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Self: ...
    def _init_core(
        self,
        pool: BlockPool,
        mode: Literal["no_prefix_cache", "unitary", "hybrid"] | str,
        groups: Sequence[_NativeGroup],
        eagle_groups: Sequence[bool],
        attention_groups: Sequence[tuple[list[int], bool, bool]],
        max_model_len: int,
        watermark_blocks: int,
        scheduler_block_size: int,
        retention_interval: int | None,
        dcp_world_size: int,
        pcp_world_size: int,
        clip: Sequence[bool],
        blocks_cls: type[KVCacheBlocks],
        empty: KVCacheBlocks,
        plain_requests: list[tuple[type, str]] = ...,
        event_classes: tuple[type, type, type] | None = None,
    ) -> None: ...
    def _computed_blocks(self, request: _ManagedRequest) -> tuple[KVCacheBlocks, int]: ...
    @property
    def _num_plain_hints(self) -> int:
        """How many plain requests' table keys and slot hints the manager keeps."""
    def allocate_slots(
        self,
        request: _ManagedRequest,
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
        """Gives the request slots for its next tokens (ALLOC-1..13): the new blocks (the
        shared empty instance when none), or None when the pool has too few free blocks."""
    @overload
    def allocate_slots_batch(
        self,
        requests: Sequence[_ManagedRequest],
        num_new_tokens: Sequence[int],
        num_lookahead_tokens: int = 0,
        allow_none: Literal[False] = False,
    ) -> list[tuple[list[int], ...]]: ...
    @overload
    def allocate_slots_batch(
        self,
        requests: Sequence[_ManagedRequest],
        num_new_tokens: Sequence[int],
        num_lookahead_tokens: int = 0,
        allow_none: bool = False,
    ) -> list[tuple[list[int], ...] | None]:
        """``allocate_slots(r, n, num_lookahead_tokens=...)`` for each pair in order, stopping
        at the first request that does not fit: each result is its ``get_block_ids(allow_none)``."""
    def take_events(self) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
        """The pool's events in emission order, each ``BlockStored`` with its group's spec kind
        and window from ``kv_cache_event_metadata`` (MGR-24), built as the ``event_classes``
        given to ``_init_core``."""
    def free(self, request: _ManagedRequest) -> None:
        """Frees the request's blocks, group by group, tail first (MGR-20; its retention
        attributes, when it has them: CC-1)."""
    def _free_retained(self, request: _ManagedRequest, retention: Retention) -> None:
        """:meth:`free` with an explicit retention (CC-1)."""
    def pop_blocks_for_free(self, request: _ManagedRequest) -> list[int]:
        """Forgets the request without freeing; all its blocks, group by group (MGR-21)."""
    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """The request's blocks per group (MGR-25)."""
    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids per group, as new lists (MGR-25)."""
    def get_block_ids_for_computed_tokens(
        self, request_id: str, num_computed_tokens: int
    ) -> tuple[list[int], ...]:
        """Block ids covering the first ``num_computed_tokens`` tokens (MGR-26)."""
    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Per group, the leading blocks every tracked request shares (MGR-22, FA-2)."""
    def cache_blocks(self, request: _ManagedRequest, num_computed_tokens: int) -> None:
        """Caches the request's full blocks when caching is on (MGR-27)."""
    def remove_skipped_blocks(
        self, request_id: str, total_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        """Frees blocks outside the attention windows (MGR-22)."""
    def take_new_block_ids(self) -> list[int]:
        """Drains the ids allocated since the last call, group by group (MGR-29)."""
    def new_step_starts(self) -> None:
        """Signals a new scheduler step (MGR-30)."""
    def _swap_stats(self, fresh: Any) -> Any:
        """Replaces ``prefix_cache_stats`` by ``fresh``, returning the old stats, under the
        core's lock (MGR-30)."""
    def _stats_call(self, method: str, *args: Any) -> None:
        """Calls ``prefix_cache_stats.<method>(*args)`` under the core's lock, unless the
        stats are None (STAT-1)."""
    def coordinator_find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_cache_hit_length: int
    ) -> tuple[tuple[list[int], ...], int]: ...
    def coordinator_find_longest_cache_hit_per_group(
        self, block_hashes: Sequence[bytes], max_cache_hit_length: int
    ) -> tuple[tuple[list[int], ...], list[int]]: ...
    @property
    def num_uncached_common_prefix_tokens(self) -> int: ...
    def coordinator_get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[Sequence[int]],
        num_encoder_tokens: int,
        total_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
    ) -> int: ...
    def coordinator_allocate_new_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[Sequence[int]],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None: ...
    def coordinator_allocate_new_blocks(
        self,
        request_id: str,
        num_tokens: int,
        num_tokens_main_model: int,
        num_encoder_tokens: int = 0,
    ) -> tuple[list[int], ...]: ...
    def coordinator_cache_blocks(
        self, request: _ManagedRequest, num_computed_tokens: int
    ) -> None: ...
    def coordinator_free(self, request_id: str, retention: Retention | None = None) -> None: ...
    def coordinator_pop_blocks_for_free(self, request_id: str) -> list[int]: ...
    def group_num_requests(self, group: int) -> int: ...
    def group_blocks(self, group: int, request_id: str) -> list[int] | None: ...
    def group_num_cached_blocks(self, group: int, request_id: str) -> int | None: ...
    def group_request_ids(self, group: int) -> list[str]: ...
    def group_sink_blocks(self, group: int) -> list[int]: ...
    def check_invariants(self) -> None: ...
    def _hashes_per_group(self, block_hashes: Sequence[bytes]) -> list[tuple[int, list[bytes]]]:
        """Per group, its hashes: every ``block_size / hash_block_size``-th (RH-3)."""
    @property
    def num_groups(self) -> int: ...

@disjoint_base
class KVCacheBlocksBase:
    """Storage and ``get_block_ids`` of ``kvcore.blocks.KVCacheBlocks`` (SPEC §7)."""

    blocks: tuple[Sequence[int], ...]
    block_pool: Any
    def __new__(cls, blocks: Iterable[Sequence[int]], block_pool: Any = None) -> Self: ...
    @overload
    def get_block_ids(self, allow_none: Literal[False] = False) -> tuple[list[int], ...]: ...
    @overload
    def get_block_ids(self, allow_none: bool) -> tuple[list[int], ...] | None: ...

@final
class TokenIds(Sequence[int]):
    """A live, read-only view of a request's token ids (all of them, or the outputs)."""

    def __len__(self) -> int: ...
    @overload
    def __getitem__(self, index: int, /) -> int: ...
    @overload
    def __getitem__(self, index: slice, /) -> list[int]: ...
    def __eq__(self, other: object, /) -> bool: ...
    def __ne__(self, other: object, /) -> bool: ...
    def index(self, value: Any, start: int = 0, stop: int | None = None) -> int: ...
    def count(self, value: Any) -> int: ...

@disjoint_base
class PlainRequestBase:
    """Native base of a plain request class (``kvcore.vllm.Request``): where the manager keeps
    the request's table key and slot hints. Takes and ignores any constructor arguments."""

    def __new__(cls, *_args: Any, **_kwargs: Any) -> Self: ...
    @staticmethod
    def _serve_append(cls: type, fallback: Callable[[Any, Any], None]) -> None:
        """Has ``append_output_token_ids`` serve ``cls``; ``fallback`` serves other classes."""
    def append_output_token_ids(self, token_ids: Any) -> None:
        """vLLM's ``Request.append_output_token_ids``, natively, for the class it serves."""

@disjoint_base
class RequestCore:
    """Native base of ``kvcore.request.Request``: the fields every step reads or writes."""

    request_id: str
    num_tokens: int
    num_computed_tokens: int
    num_prompt_tokens: int
    status: Any
    block_hashes: list[bytes]
    @property
    def _all_token_ids(self) -> TokenIds: ...
    @_all_token_ids.setter
    def _all_token_ids(self, value: Iterable[int]) -> None: ...
    @property
    def _output_token_ids(self) -> TokenIds: ...
    @_output_token_ids.setter
    def _output_token_ids(self, value: Iterable[int]) -> None: ...
    _next_hash_at: int
    _block_hasher: Any
    _hash_block_size: int | None
    def __new__(cls, *args: Any, **kwargs: Any) -> Self: ...
    @property
    def all_token_ids(self) -> TokenIds: ...
    @property
    def output_token_ids(self) -> TokenIds: ...
    @property
    def num_output_tokens(self) -> int: ...
    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None: ...
    def update_block_hashes(self) -> None: ...

def append_output_token_ids_batch(
    requests: Sequence[Any], token_ids: Sequence[int | Iterable[int]]
) -> None:
    """``requests[i].append_output_token_ids(token_ids[i])`` for every ``i``, in one call.

    Raises:
        ValueError: The sequences differ in length (nothing is appended).
        TypeError: An entry is neither an int nor iterable; the requests before it keep their
            tokens, as in the loop.
    """

# --- events ---

def encode_event_batch(
    ts: float, events: list[Any] | tuple[Any, ...], data_parallel_rank: int | None = None
) -> bytes:
    """Encodes ``[ts, [events], data_parallel_rank]`` as msgpack (SPEC WIRE-2, WIRE-3).

    Events are recognised by class name (``BlockStored``, ``BlockRemoved``,
    ``AllBlocksCleared``); their field values may be None, bool, int, float, str, bytes,
    bytearray, list or tuple (exact types), nested.

    Raises:
        TypeError: An unknown event class or value type, or ``events`` not a list or tuple.
        OverflowError: An int outside ``[-2**63, 2**64 - 1]``.
        RecursionError: Values nested more than 1000 deep.
    """

def msgpack_encode(obj: object) -> bytes:
    """Encodes one value with the msgpack forms of SPEC WIRE-3.

    Raises:
        TypeError: A value of another type.
        OverflowError: An int outside ``[-2**63, 2**64 - 1]``.
        RecursionError: Values nested more than 1000 deep.
    """

# --- hashing ---

def hash_object(hash_fn_name: str, obj: object) -> bytes | None:
    """``fn(obj)`` natively, or None when ``obj`` needs the Python serialiser."""

def digest(hash_fn_name: str, data: bytes) -> bytes:
    """Digests serialised bytes with the function's digest (SHA-256 or XXH3-128 big-endian)."""

def hash_block_tokens(
    hash_fn_name: str, none_hash: bytes, parent: object, tokens: object, extra: object
) -> bytes | None:
    """One block hash (SPEC HASH-11), or None when an argument needs the Python serialiser."""

@final
class RequestBlockHasher:
    """``hasher(request)`` for the four native hash functions (SPEC RH-1)."""

    @property
    def hash_block_size(self) -> int: ...
    def __new__(
        cls,
        hash_fn_name: str,
        hash_block_size: int,
        none_hash: Callable[[], bytes],
        fallback: Callable[[Any], Any],
        list_view: tuple[type, str] | None = None,
    ) -> RequestBlockHasher: ...
    def __call__(self, request: Any) -> list[bytes]: ...

def hash_request_blocks(
    hash_fn_name: str,
    none_hash: bytes,
    parent: bytes | None,
    token_ids: tuple[int, ...],
    block_size: int,
    extras: list[tuple[object, ...] | None] | None = None,
) -> list[bytes] | None:
    """Chained hashes of the full windows of ``token_ids`` (SPEC RH-1), GIL released."""

@disjoint_base
class KVCacheEvent:
    """Base class of every KV cache event (SPEC EVT-1)."""

    def __new__(cls) -> KVCacheEvent: ...

@final
class BlockStored(KVCacheEvent):
    """Blocks entered the prefix cache (SPEC EVT-1, POOL-17, POOL-30)."""

    __match_args__ = (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
    )
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None
    group_idx: int | None
    kv_cache_spec_kind: str | None
    kv_cache_spec_sliding_window: int | None
    def __new__(
        cls,
        block_hashes: list[int | bytes],
        parent_block_hash: int | bytes | None,
        token_ids: list[int],
        block_size: int,
        lora_id: int | None,
        medium: str | None,
        lora_name: str | None,
        extra_keys: list[tuple[Any, ...] | None] | None = None,
        group_idx: int | None = None,
        kv_cache_spec_kind: str | None = None,
        kv_cache_spec_sliding_window: int | None = None,
    ) -> BlockStored: ...
    def __eq__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...
    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]: ...

@final
class BlockRemoved(KVCacheEvent):
    """A key left the prefix cache (SPEC EVT-1, POOL-6)."""

    __match_args__ = ("block_hashes", "medium", "group_idx")
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None
    def __new__(
        cls,
        block_hashes: list[int | bytes],
        medium: str | None,
        group_idx: int | None = None,
    ) -> BlockRemoved: ...
    def __eq__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...
    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]: ...

@final
class AllBlocksCleared(KVCacheEvent):
    """The whole prefix cache was cleared (SPEC EVT-1, POOL-21)."""

    __match_args__ = ()

    def __new__(cls) -> AllBlocksCleared: ...
    def __eq__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...
    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]: ...

def register_extra_keys_fn(func: Callable[[Any, int, int, int], tuple[Any, int]]) -> None:
    """Registers the extra-key function KV events use (``kvcore.hashing`` does, on import)."""
