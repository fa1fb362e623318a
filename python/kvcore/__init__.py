"""kvcore: a fast KV-cache block manager for LLM serving.

The block pool and block hashing live in a Rust core (``kvcore._native``); the request-facing
manager, coordinators, specs and requests are Python modules of this package (a model whose
only KV-cache group is full attention is managed in Rust too). The behaviour, rule by rule, is
specified in the repository's ``docs/behaviour.md``, which docstrings cite as "SPEC".
"""

from importlib import metadata as _metadata

from kvcore._native import (
    BlockIdError,
    BlockPool,
    BlockStateError,
    DoubleFreeError,
    InvalidArgumentError,
    KVCacheBlockView,
    KvcoreError,
    NoFreeBlocksError,
)
from kvcore.blocks import KVCacheBlocks
from kvcore.config import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from kvcore.errors import InvalidConfigError, InvariantViolationError
from kvcore.manager import KVCacheManager, PrefixCacheStats
from kvcore.request import Request, RequestStatus
from kvcore.specs import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
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
    UniformTypeKVCacheSpecs,
)

try:
    __version__ = _metadata.version("kvcore")
except _metadata.PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "BlockIdError",
    "BlockPool",
    "BlockStateError",
    "ChunkedLocalAttentionSpec",
    "CrossAttentionSpec",
    "DoubleFreeError",
    "EncoderOnlyAttentionSpec",
    "FullAttentionSpec",
    "HiddenStateCacheSpec",
    "InvalidArgumentError",
    "InvalidConfigError",
    "InvariantViolationError",
    "KVCacheBlockView",
    "KVCacheBlocks",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVCacheManager",
    "KVCacheSpec",
    "KVCacheTensor",
    "KvcoreError",
    "MLAAttentionSpec",
    "MambaSpec",
    "NoFreeBlocksError",
    "PrefixCacheStats",
    "RSWASpec",
    "Request",
    "RequestStatus",
    "SinkFullAttentionSpec",
    "SlidingWindowMLASpec",
    "SlidingWindowSpec",
    "TQFullAttentionSpec",
    "UniformTypeKVCacheSpecs",
    "__version__",
]
