"""Conversions between vLLM 0.25.1's objects and kvcore's, at the edge of the adapter.

kvcore's specs, config classes and events have the reference's names and fields, so each
conversion is a field-by-field copy chosen by class name; a vLLM class kvcore has no counterpart
for raises instead of being approximated.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.v1.core.kv_cache_utils import KVCacheBlock as _VllmKVCacheBlock

from kvcore import specs as kv_specs
from kvcore.config import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from kvcore.errors import InvalidConfigError


def convert_spec(spec: Any) -> kv_specs.KVCacheSpec:
    """kvcore's spec for a ``vllm.v1.kv_cache_interface`` spec (kvcore's own pass through).

    Args:
        spec: A vLLM (or kvcore) KV cache spec.

    Returns:
        The kvcore spec of the same class name, with the same field values.

    Raises:
        InvalidConfigError: kvcore has no spec of that class.
    """
    if isinstance(spec, kv_specs.KVCacheSpec):
        return spec
    name = type(spec).__name__
    cls = getattr(kv_specs, name, None)
    if not (isinstance(cls, type) and issubclass(cls, kv_specs.KVCacheSpec)):
        raise InvalidConfigError(f"kvcore has no KV cache spec for vLLM's {name}")
    if name == "UniformTypeKVCacheSpecs":
        return kv_specs.UniformTypeKVCacheSpecs(
            block_size=spec.block_size,
            kv_cache_specs={k: convert_spec(v) for k, v in spec.kv_cache_specs.items()},
        )
    wanted = {f.name for f in dataclasses.fields(cls) if f.init}
    values = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name in wanted}
    return cls(**values)


def convert_kv_cache_config(config: Any) -> KVCacheConfig:
    """kvcore's ``KVCacheConfig`` for vLLM's (kvcore's own passes through unchanged).

    Args:
        config: A ``vllm.v1.kv_cache_interface.KVCacheConfig``.

    Returns:
        The same configuration in kvcore's classes.
    """
    if isinstance(config, KVCacheConfig):
        return config
    return KVCacheConfig(
        num_blocks=config.num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(
                size=t.size,
                shared_by=list(t.shared_by),
                offset=getattr(t, "offset", 0),
                block_stride=getattr(t, "block_stride", 0),
            )
            for t in config.kv_cache_tensors
        ],
        kv_cache_groups=[
            KVCacheGroupSpec(
                list(g.layer_names),
                convert_spec(g.kv_cache_spec),
                bool(getattr(g, "is_eagle_group", False)),
            )
            for g in config.kv_cache_groups
        ],
    )


def feed_metrics(collector: Any, ops: list[tuple[int, int]]) -> None:
    """Replays the pool's recorded block operations into vLLM's ``KVCacheMetricsCollector``.

    Args:
        collector: The collector.
        ops: ``BlockPool.take_block_ops()``: ``(kind, block_id)`` with kind 0 allocated,
            1 accessed, 2 evicted, 3 reset.
    """
    if not ops:
        return
    calls = (
        collector.on_block_allocated,
        collector.on_block_accessed,
        collector.on_block_evicted,
    )
    for kind, block_id in ops:
        if kind == 3:
            collector.reset()
        else:
            calls[kind](_VllmKVCacheBlock(block_id))
