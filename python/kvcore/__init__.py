"""kvcore: a fast KV-cache block manager for LLM serving.

The block pool and block hashing live in a Rust core (``kvcore._native``); the request-facing
manager, coordinators, specs and requests are Python modules of this package.
"""

from kvcore._native import (
    BlockIdError,
    BlockPool,
    BlockStateError,
    DoubleFreeError,
    InvalidArgumentError,
    KVCacheBlockView,
    KvcoreError,
    NoFreeBlocksError,
    __version__,
)

__all__ = [
    "BlockIdError",
    "BlockPool",
    "BlockStateError",
    "DoubleFreeError",
    "InvalidArgumentError",
    "KVCacheBlockView",
    "KvcoreError",
    "NoFreeBlocksError",
    "__version__",
]
