"""Per-attention-type block managers (SPEC §10–15): which rules a group's spec gets, and views
of each group's state.

One manager serves one KV cache group. Its state (per request, the block ids it holds and how
many leading blocks caching has processed) and its rules (hit search, blocks to allocate,
allocate, cache, skip, free) live in the Rust core (``kvcore._native.KVCacheManagerCore``,
``rust/kvcore-core/src/single_type.rs``). This module holds the policy the core is built from:
the manager class of a spec, found along the spec's class hierarchy (SPEC-1,
:func:`get_manager_class`), and the native group each class describes
(:meth:`SingleTypeKVCacheManager.native_group`). A coordinator's ``single_type_managers`` are
instances: read-only views of the group's state in the core.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, ClassVar

from kvcore.errors import InvalidConfigError
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
    from kvcore._native import KVCacheManagerCore

__all__ = [
    "ChunkedLocalAttentionManager",
    "CrossAttentionManager",
    "FullAttentionManager",
    "MambaManager",
    "NativeGroup",
    "RSWAManager",
    "SingleTypeKVCacheManager",
    "SinkFullAttentionManager",
    "SlidingWindowManager",
    "get_manager_class",
    "spec_manager_map",
]

NativeGroup = tuple[str, int, int, bool, int | None]
"""A group as the core is built from it: ``(kind, parameter, spec block size, records new block
ids, admission cap in blocks or None)``."""

# MGR-29: only managers whose spec is exactly one of these types record new block ids.
_RECORDING_SPEC_TYPES: frozenset[type[KVCacheSpec]] = frozenset(
    {FullAttentionSpec, TQFullAttentionSpec, MLAAttentionSpec, HiddenStateCacheSpec}
)


class _Table(Mapping[str, list[int]]):
    """``req_to_blocks``: request id to a copy of its block ids in one group."""

    def __init__(self, core: KVCacheManagerCore, group: int) -> None:
        self._core = core
        self._group = group

    def __getitem__(self, request_id: str) -> list[int]:
        blocks = self._core.group_blocks(self._group, request_id)
        if blocks is None:
            raise KeyError(request_id)
        return blocks

    def __iter__(self) -> Iterator[str]:
        return iter(self._core.group_request_ids(self._group))

    def __len__(self) -> int:
        return self._core.group_num_requests(self._group)

    def __contains__(self, request_id: object) -> bool:
        return isinstance(request_id, str) and (
            self._core.group_blocks(self._group, request_id) is not None
        )


class _Cached(Mapping[str, int]):
    """``num_cached_block``: running request id to its number of cached leading blocks."""

    def __init__(self, core: KVCacheManagerCore, group: int) -> None:
        self._core = core
        self._group = group

    def __getitem__(self, request_id: str) -> int:
        n = self._core.group_num_cached_blocks(self._group, request_id)
        if n is None:
            raise KeyError(request_id)
        return n

    def __iter__(self) -> Iterator[str]:
        core, g = self._core, self._group
        return iter([r for r in core.group_request_ids(g) if r in self])

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, request_id: object) -> bool:
        return isinstance(request_id, str) and (
            self._core.group_num_cached_blocks(self._group, request_id) is not None
        )


class SingleTypeKVCacheManager:
    """One group's manager: a view of its state in the native core (STM-1..12).

    Attributes:
        kv_cache_spec: The group's spec.
        kv_cache_group_id: The group id.
        block_size: ``spec.block_size * dcp * pcp`` (STM-1).
        use_eagle: Whether this group's hits drop the EAGLE block.
        admission_cap: The admission cap in blocks (SWA-1, CLA-1), or None.
    """

    kind: ClassVar[str] = "full"
    """The native group kind (``rust/kvcore-core/src/single_type.rs``, ``Kind``)."""

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        kv_cache_group_id: int,
        block_size: int,
        use_eagle: bool,
        admission_cap: int | None,
        core: KVCacheManagerCore,
    ) -> None:
        """A view of group ``kv_cache_group_id`` of ``core``."""
        self.kv_cache_spec = kv_cache_spec
        self.kv_cache_group_id = kv_cache_group_id
        self.block_size = block_size
        self.use_eagle = use_eagle
        self.admission_cap = admission_cap
        self._core = core

    @property
    def req_to_blocks(self) -> Mapping[str, list[int]]:
        """Request id to (a copy of) its block ids."""
        return _Table(self._core, self.kv_cache_group_id)

    @property
    def num_cached_block(self) -> Mapping[str, int]:
        """Running request id to the number of leading blocks caching processed."""
        return _Cached(self._core, self.kv_cache_group_id)

    @classmethod
    def native_parameter(cls, kv_cache_spec: KVCacheSpec) -> int:
        """The kind's parameter (window, chunk, sink length, speculative blocks), else 0."""
        return 0

    @classmethod
    def native_group(
        cls, kv_cache_spec: KVCacheSpec, max_num_batched_tokens: int, max_model_len: int
    ) -> NativeGroup:
        """The core's description of a group with this manager (SWA-1, CLA-1's cap).

        Raises:
            InvalidConfigError: The spec does not fit this manager.
        """
        cap = None
        if isinstance(kv_cache_spec, SlidingWindowSpec | ChunkedLocalAttentionSpec):
            cap = kv_cache_spec.max_admission_blocks_per_request(
                max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len
            )
        return (
            cls.kind,
            cls.native_parameter(kv_cache_spec),
            kv_cache_spec.block_size,
            type(kv_cache_spec) in _RECORDING_SPEC_TYPES,
            cap,
        )


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full attention (§11): prefix hits scan left to right; blocks kept until free."""

    kind = "full"


class RSWAManager(FullAttentionManager):
    """Reference sliding-window attention: frees decode blocks behind the window (RSWA-1)."""

    kind = "reference_sliding_window"

    @classmethod
    def native_parameter(cls, kv_cache_spec: KVCacheSpec) -> int:
        """The decode window."""
        if not isinstance(kv_cache_spec, RSWASpec):
            raise InvalidConfigError("RSWAManager needs an RSWASpec")
        return kv_cache_spec.rswa_window


class SinkFullAttentionManager(FullAttentionManager):
    """Full attention with reserved sink blocks (SINK-1, the intended behaviour).

    At construction the core takes ``sink_len / block_size`` blocks off the front of the free
    queue; they never return to it (the pool has no "off the queue at ref 0" state, so they
    count as used, with ref_cnt 1 where the intended design leaves 0).
    """

    kind = "sink"

    @classmethod
    def native_parameter(cls, kv_cache_spec: KVCacheSpec) -> int:
        """The sink length in tokens."""
        return int(getattr(kv_cache_spec, "sink_len", 0) or 0)

    @property
    def sink_blocks(self) -> list[int]:
        """The reserved block ids."""
        return self._core.group_sink_blocks(self.kv_cache_group_id)


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Sliding-window attention (§12)."""

    kind = "sliding_window"

    @classmethod
    def native_parameter(cls, kv_cache_spec: KVCacheSpec) -> int:
        """The window in tokens."""
        if not isinstance(kv_cache_spec, SlidingWindowSpec):
            raise InvalidConfigError("SlidingWindowManager needs a SlidingWindowSpec")
        return kv_cache_spec.sliding_window


class ChunkedLocalAttentionManager(SingleTypeKVCacheManager):
    """Chunked local attention (§13)."""

    kind = "chunked_local"

    @classmethod
    def native_parameter(cls, kv_cache_spec: KVCacheSpec) -> int:
        """Tokens per chunk."""
        if not isinstance(kv_cache_spec, ChunkedLocalAttentionSpec):
            raise InvalidConfigError("ChunkedLocalAttentionManager needs a ChunkedLocal spec")
        return kv_cache_spec.attention_chunk_size


class MambaManager(SingleTypeKVCacheManager):
    """Mamba state blocks (§14), in mode ``none``, ``align`` or ``all``."""

    kind = "mamba"

    @classmethod
    def native_group(
        cls, kv_cache_spec: KVCacheSpec, max_num_batched_tokens: int, max_model_len: int
    ) -> NativeGroup:
        """The core's description: the mode in the kind, the speculative blocks as parameter."""
        if not isinstance(kv_cache_spec, MambaSpec):
            raise InvalidConfigError("MambaManager needs a MambaSpec")
        mode = kv_cache_spec.mamba_cache_mode
        if mode not in ("none", "all", "align"):
            raise InvalidConfigError(f"unknown mamba_cache_mode {mode!r}")
        return (
            f"mamba_{mode}",
            kv_cache_spec.num_speculative_blocks,
            kv_cache_spec.block_size,
            False,
            None,
        )


class CrossAttentionManager(SingleTypeKVCacheManager):
    """Cross-attention of encoder-decoder models (XATTN-1): allocated once, never cached."""

    kind = "cross_attention"


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
