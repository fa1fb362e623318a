"""KV cache configuration (SPEC CFG-1, CFG-2).

Examples:
    >>> from kvcore.specs import FullAttentionSpec
    >>> spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype="float16")
    >>> cfg = KVCacheConfig(num_blocks=100, kv_cache_tensors=[],
    ...                     kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
    >>> resolve_kv_cache_block_sizes(cfg, cache_block_size=16)
    (16, 16)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvcore.errors import InvalidConfigError
from kvcore.specs import KVCacheSpec, MambaSpec

__all__ = ["KVCacheConfig", "KVCacheGroupSpec", "KVCacheTensor", "resolve_kv_cache_block_sizes"]


@dataclass(slots=True)
class KVCacheTensor:
    """How a worker allocates one KV cache tensor (carried, not used by the manager).

    Attributes:
        size: Bytes.
        shared_by: Layer names sharing the tensor.
        offset: Byte offset within a packed block.
        block_stride: Bytes per block in a packed layout (0 = not packed).
    """

    size: int
    shared_by: list[str]
    offset: int = 0
    block_stride: int = 0


@dataclass(slots=True)
class KVCacheGroupSpec:
    """Layers that share one block table (CFG-1).

    Attributes:
        layer_names: The layers of the group.
        kv_cache_spec: Their common spec.
        is_eagle_group: Whether the group holds EAGLE/MTP draft layers.
    """

    layer_names: list[str]
    kv_cache_spec: KVCacheSpec
    is_eagle_group: bool = False


@dataclass(slots=True)
class KVCacheConfig:
    """The KV cache configuration of a model (CFG-1).

    Attributes:
        num_blocks: Blocks in the pool, the null block included.
        kv_cache_tensors: Tensor layout (unused by the manager).
        kv_cache_groups: Groups in group-id order.
    """

    num_blocks: int
    kv_cache_tensors: list[Any] = field(default_factory=list)
    kv_cache_groups: list[KVCacheGroupSpec] = field(default_factory=list)

    @property
    def has_mamba_layers(self) -> bool:
        """Whether any group is a Mamba group."""
        return any(isinstance(g.kv_cache_spec, MambaSpec) for g in self.kv_cache_groups)


def resolve_kv_cache_block_sizes(
    kv_cache_config: KVCacheConfig,
    cache_block_size: int,
    *,
    enable_prefix_caching: bool = True,
    kv_connector_enabled: bool = False,
    hash_block_size: int | None = None,
    dcp_world_size: int = 1,
    pcp_world_size: int = 1,
) -> tuple[int, int]:
    """Resolves ``(scheduler_block_size, hash_block_size)`` the way the engine does (CFG-2).

    Args:
        kv_cache_config: The configuration whose groups are resolved.
        cache_block_size: The configured cache block size.
        enable_prefix_caching: Whether prefix caching is on.
        kv_connector_enabled: Whether a KV connector is configured.
        hash_block_size: The configured hash block size override, or None.
        dcp_world_size: Decode context-parallel world size.
        pcp_world_size: Prefill context-parallel world size.

    Returns:
        The scheduler block size and the hash block size.

    Raises:
        InvalidConfigError: (a ValueError) several groups with context parallelism, or a group
            size that the hash block size does not divide.
    """
    groups = kv_cache_config.kv_cache_groups
    if len(groups) <= 1:
        bs = cache_block_size * dcp_world_size * pcp_world_size
        return bs, bs
    if dcp_world_size != 1 or pcp_world_size != 1:
        raise InvalidConfigError(
            "several KV cache groups do not support context parallelism "
            f"(dcp_world_size={dcp_world_size}, pcp_world_size={pcp_world_size})"
        )
    sizes = [g.kv_cache_spec.block_size for g in groups]
    sbs = math.lcm(*sizes)
    if not (enable_prefix_caching or kv_connector_enabled):
        return sbs, sbs
    if any(
        isinstance(g.kv_cache_spec, MambaSpec) and g.kv_cache_spec.block_size != cache_block_size
        for g in groups
    ):
        return sbs, sbs
    hbs = hash_block_size if hash_block_size is not None else math.gcd(*sizes)
    if hbs <= 0 or any(s % hbs for s in sizes):
        raise InvalidConfigError(
            f"hash_block_size={hbs} must divide every group block size {sizes}"
        )
    return sbs, hbs
