"""Triton kernels for kvcore's paged KV cache: cache writes and paged attention.

The kernels take tensors only (a block table built from `KVCacheBlocks.get_block_ids()`), never
manager objects, so a scheduler process can use kvcore without torch. `kvcore_kernels.reference`
holds plain-torch versions of every kernel.
"""

from importlib.metadata import PackageNotFoundError, version

from kvcore_kernels.attention import AttentionConfig, paged_attention
from kvcore_kernels.cache import reshape_and_cache
from kvcore_kernels.metadata import (
    AttentionMetadata,
    block_ids_of_group,
    block_table_tensor,
    build_metadata,
    query_start_loc_tensor,
    slot_mapping_tensor,
)

__all__ = [
    "AttentionConfig",
    "AttentionMetadata",
    "block_ids_of_group",
    "block_table_tensor",
    "build_metadata",
    "paged_attention",
    "query_start_loc_tensor",
    "reshape_and_cache",
    "slot_mapping_tensor",
]

try:
    __version__ = version("kvcore-kernels")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"
