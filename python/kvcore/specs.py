"""KV cache specs (SPEC §16): what one group of layers needs from the block manager.

Specs are frozen, slotted dataclasses. Two specs are equal iff they have the same class and equal
values in every field (SPEC-2); the hybrid coordinator merges groups with equal specs (COORD-9).
The manager reads only ``block_size`` and the per-kind fields listed in SPEC-2; the rest (head
counts, dtypes, ...) exist so that equality and page sizes match the reference.

``dtype`` may be a ``torch.dtype`` or a string such as ``"float16"``: kvcore never imports torch.

Examples:
    >>> spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="float16")
    >>> get_kv_cache_spec_kind(spec).value
    'full_attention'
    >>> spec.head_size_v
    128
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

__all__ = [
    "AttentionSpec",
    "ChunkedLocalAttentionSpec",
    "CrossAttentionSpec",
    "EncoderOnlyAttentionSpec",
    "FullAttentionSpec",
    "HiddenStateCacheSpec",
    "KVCacheSpec",
    "KVCacheSpecKind",
    "MLAAttentionSpec",
    "MambaSpec",
    "RSWASpec",
    "SinkFullAttentionSpec",
    "SlidingWindowMLASpec",
    "SlidingWindowSpec",
    "TQFullAttentionSpec",
    "UniformTypeKVCacheSpecs",
    "dtype_size",
    "get_kv_cache_spec_kind",
    "get_kv_cache_spec_sliding_window",
]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


_DTYPE_SIZES = {
    "float64": 8,
    "double": 8,
    "int64": 8,
    "float32": 4,
    "float": 4,
    "int32": 4,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "int16": 2,
    "uint8": 1,
    "int8": 1,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


def dtype_size(dtype: Any) -> int:
    """Returns the size in bytes of one element of ``dtype``.

    Args:
        dtype: A ``torch.dtype`` (or anything with ``itemsize``) or a dtype name such as
            ``"float16"`` or ``"torch.bfloat16"``.

    Returns:
        The element size in bytes.

    Raises:
        ValueError: The dtype name is unknown.
    """
    itemsize = getattr(dtype, "itemsize", None)
    if isinstance(itemsize, int):
        return itemsize
    name = str(dtype).removeprefix("torch.")
    try:
        return _DTYPE_SIZES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}") from None


class KVCacheSpecKind(StrEnum):
    """The attention kind reported in KV events (SPEC-3)."""

    FULL_ATTENTION = "full_attention"
    MLA_ATTENTION = "mla_attention"
    SLIDING_WINDOW = "sliding_window"
    SLIDING_WINDOW_MLA = "sliding_window_mla"
    MAMBA = "mamba"
    CHUNKED_LOCAL_ATTENTION = "chunked_local_attention"
    SINK_FULL_ATTENTION = "sink_full_attention"
    ENCODER_ONLY_ATTENTION = "encoder_only_attention"
    CROSS_ATTENTION = "cross_attention"
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """Base of every spec.

    Attributes:
        block_size: Tokens per block.
    """

    block_size: int

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of this spec."""
        raise NotImplementedError(f"{type(self).__name__} has no page size")


@dataclass(frozen=True, slots=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    """Base of the attention specs.

    Attributes:
        num_kv_heads: KV heads per layer.
        head_size: Size of one head.
        dtype: Element type (a ``torch.dtype`` or its name).
        kv_quant_mode: KV quantization mode (0 = none), carried for equality only.
        page_size_padded: Padded page size in bytes, or None.
        indexes_kv_by_block_stride: Layout flag, carried for equality only.
    """

    num_kv_heads: int
    head_size: int
    dtype: Any
    kv_quant_mode: int = 0
    page_size_padded: int | None = None
    indexes_kv_by_block_stride: bool = False

    @property
    def real_page_size_bytes(self) -> int:
        """Unpadded bytes of one block (K and V)."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * dtype_size(self.dtype)

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block, padding included."""
        real = self.real_page_size_bytes
        if self.page_size_padded is not None:
            if self.page_size_padded < real:
                raise ValueError("page_size_padded is smaller than the real page size")
            return self.page_size_padded
        return real


@dataclass(frozen=True, slots=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Full (causal) attention: one block per ``block_size`` tokens, kept until the end.

    Attributes:
        head_size_v: Size of a V head; defaults to ``head_size``.
        sliding_window: Window computed by the model runner (not used by the manager).
        attention_chunk_size: Chunk size computed by the model runner (not used).
        non_causal: Whether the layer attends non-causally.
    """

    head_size_v: int = None  # type: ignore[assignment]
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    non_causal: bool = False

    def __post_init__(self) -> None:
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self.head_size)

    @property
    def real_page_size_bytes(self) -> int:
        """Unpadded bytes of one block (K and V)."""
        return (
            self.block_size
            * self.num_kv_heads
            * (self.head_size + self.head_size_v)
            * dtype_size(self.dtype)
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class TQFullAttentionSpec(FullAttentionSpec):
    """Full attention with a TQ-quantized page layout (never equal to a plain Full spec).

    Attributes:
        tq_slot_size: Bytes per token and head, 0 for the plain layout.
    """

    tq_slot_size: int = 0

    @property
    def real_page_size_bytes(self) -> int:
        """Unpadded bytes of one block."""
        if self.tq_slot_size > 0:
            return self.block_size * self.num_kv_heads * self.tq_slot_size
        return (
            self.block_size
            * self.num_kv_heads
            * (self.head_size + self.head_size_v)
            * dtype_size(self.dtype)
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention (a full-attention kind, reported as ``mla_attention``).

    Attributes:
        cache_dtype_str: Cache dtype name, or None.
        alignment: Page alignment in bytes, or None.
        compress_ratio: Token compression ratio (1 = none).
        model_version: Model-specific layout tag, or None.
    """

    cache_dtype_str: str | None = None
    alignment: int | None = None
    compress_ratio: int = 1
    model_version: str | None = None

    @property
    def real_page_size_bytes(self) -> int:
        """Unpadded bytes of one block (a single latent per token)."""
        storage = self.block_size // self.compress_ratio
        return storage * self.num_kv_heads * self.head_size * dtype_size(self.dtype)


@dataclass(frozen=True, slots=True, kw_only=True)
class HiddenStateCacheSpec(MLAAttentionSpec):
    """Hidden-state cache layers (managed as full attention)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RSWASpec(FullAttentionSpec):
    """Reference sliding-window attention: prompt kept, decode limited to a window (RSWA-1).

    Attributes:
        rswa_window: Decode tokens kept.
    """

    rswa_window: int


@dataclass(frozen=True, slots=True, kw_only=True)
class SinkFullAttentionSpec(FullAttentionSpec):
    """Full attention with ``sink_len`` tokens of blocks reserved at start-up (SINK-1).

    Attributes:
        sink_len: Sink tokens; a positive multiple of the block size.
    """

    sink_len: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Chunked local attention (not a full-attention spec).

    Attributes:
        attention_chunk_size: Tokens per attention chunk.
    """

    attention_chunk_size: int

    def max_admission_blocks_per_request(
        self, max_num_batched_tokens: int, max_model_len: int
    ) -> int:
        """Per-request block cap used by the admission gate (CLA-1).

        Args:
            max_num_batched_tokens: Tokens per scheduler step.
            max_model_len: Longest sequence.

        Returns:
            ``cdiv(min(chunk + max_num_batched_tokens, max_model_len), block_size)``.
        """
        tokens = min(self.attention_chunk_size + max_num_batched_tokens, max_model_len)
        return _cdiv(tokens, self.block_size)


@dataclass(frozen=True, slots=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """Sliding-window attention.

    Attributes:
        sliding_window: Window in tokens.
        head_size_v: Size of a V head; defaults to ``head_size``.
    """

    sliding_window: int
    head_size_v: int = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self.head_size)

    @property
    def real_page_size_bytes(self) -> int:
        """Unpadded bytes of one block (K and V)."""
        return (
            self.block_size
            * self.num_kv_heads
            * (self.head_size + self.head_size_v)
            * dtype_size(self.dtype)
        )

    def max_admission_blocks_per_request(
        self, max_num_batched_tokens: int, max_model_len: int
    ) -> int:
        """Per-request block cap used by the admission gate (SWA-1).

        Args:
            max_num_batched_tokens: Tokens per scheduler step.
            max_model_len: Longest sequence.

        Returns:
            ``cdiv(min(w - 1 + max_num_batched_tokens, max_model_len), block_size) + 1``.
        """
        tokens = min(self.sliding_window - 1 + max_num_batched_tokens, max_model_len)
        return _cdiv(tokens, self.block_size) + 1


@dataclass(frozen=True, slots=True, kw_only=True)
class SlidingWindowMLASpec(SlidingWindowSpec):
    """Sliding-window attention with the MLA cache layout.

    Attributes:
        cache_dtype_str: Cache dtype name, or None.
        alignment: Page alignment in bytes, or None.
        compress_ratio: Token compression ratio (1 = none).
        model_version: Model-specific layout tag, or None.
    """

    cache_dtype_str: str | None = None
    alignment: int | None = None
    compress_ratio: int = 1
    model_version: str | None = None

    @property
    def real_page_size_bytes(self) -> int:
        """Unpadded bytes of one block (a single latent per token)."""
        storage = self.block_size // self.compress_ratio
        return storage * self.num_kv_heads * self.head_size * dtype_size(self.dtype)


@dataclass(frozen=True, slots=True)
class MambaSpec(KVCacheSpec):
    """Mamba (linear attention) state cache (MAMBA-1..8).

    Attributes:
        shapes: State tensor shapes.
        dtypes: State tensor dtypes.
        page_size_padded: Padded page size in bytes, or None.
        mamba_type: Backend name, carried for equality only.
        mamba_cache_mode: ``"none"``, ``"align"`` or ``"all"``.
        num_speculative_blocks: Extra blocks kept for speculative decoding.
    """

    shapes: tuple[tuple[int, ...], ...] = ()
    dtypes: tuple[Any, ...] = ()
    page_size_padded: int | None = None
    mamba_type: str = "mamba2"
    mamba_cache_mode: str = "none"
    num_speculative_blocks: int = 0

    def __post_init__(self) -> None:
        if self.mamba_cache_mode not in ("none", "align", "all"):
            raise ValueError(
                f"mamba_cache_mode must be 'none', 'align' or 'all', not {self.mamba_cache_mode!r}"
            )

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block (the sum of the state tensors), padding included."""
        size = 0
        for shape, dtype in zip(self.shapes, self.dtypes, strict=False):
            n = 1
            for d in shape:
                n *= d
            size += n * dtype_size(dtype)
        if self.page_size_padded is not None:
            return self.page_size_padded
        return size


@dataclass(frozen=True, slots=True, kw_only=True)
class EncoderOnlyAttentionSpec(AttentionSpec):
    """Encoder-only attention layers (no KV cache, no manager)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CrossAttentionSpec(AttentionSpec):
    """Cross-attention layers of encoder-decoder models (XATTN-1)."""


@dataclass(frozen=True, slots=True)
class UniformTypeKVCacheSpecs(KVCacheSpec):
    """Several layers of one attention type with different specs (no manager of its own).

    Attributes:
        kv_cache_specs: Layer name to spec.
    """

    kv_cache_specs: dict[str, KVCacheSpec] = field(default_factory=dict)

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block summed over the member layers."""
        return sum(s.page_size_bytes for s in self.kv_cache_specs.values())


def get_kv_cache_spec_kind(spec: KVCacheSpec) -> KVCacheSpecKind:
    """Returns the event kind of a spec (SPEC-3).

    Args:
        spec: A spec.

    Returns:
        The most specific kind; a UniformType spec reports its members' single kind, or
        ``UNKNOWN`` when they differ.
    """
    if isinstance(spec, UniformTypeKVCacheSpecs):
        kinds = {get_kv_cache_spec_kind(s) for s in spec.kv_cache_specs.values()}
        return next(iter(kinds)) if len(kinds) == 1 else KVCacheSpecKind.UNKNOWN
    if isinstance(spec, SlidingWindowMLASpec):
        return KVCacheSpecKind.SLIDING_WINDOW_MLA
    if isinstance(spec, MLAAttentionSpec):
        return KVCacheSpecKind.MLA_ATTENTION
    if isinstance(spec, SinkFullAttentionSpec):
        return KVCacheSpecKind.SINK_FULL_ATTENTION
    if isinstance(spec, FullAttentionSpec):
        return KVCacheSpecKind.FULL_ATTENTION
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return KVCacheSpecKind.CHUNKED_LOCAL_ATTENTION
    if isinstance(spec, SlidingWindowSpec):
        return KVCacheSpecKind.SLIDING_WINDOW
    if isinstance(spec, MambaSpec):
        return KVCacheSpecKind.MAMBA
    if isinstance(spec, EncoderOnlyAttentionSpec):
        return KVCacheSpecKind.ENCODER_ONLY_ATTENTION
    if isinstance(spec, CrossAttentionSpec):
        return KVCacheSpecKind.CROSS_ATTENTION
    return KVCacheSpecKind.UNKNOWN


def get_kv_cache_spec_sliding_window(spec: KVCacheSpec) -> int | None:
    """Returns the sliding window reported in events (SPEC-4).

    Args:
        spec: A spec.

    Returns:
        ``sliding_window`` for sliding-window specs, the unique member value for a UniformType
        spec, else None (even for a full-attention spec that carries a window).
    """
    if isinstance(spec, UniformTypeKVCacheSpecs):
        windows = {get_kv_cache_spec_sliding_window(s) for s in spec.kv_cache_specs.values()}
        return next(iter(windows)) if len(windows) == 1 else None
    if isinstance(spec, SlidingWindowSpec):
        return spec.sliding_window
    return None
