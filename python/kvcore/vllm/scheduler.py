"""vLLM 0.25.1's ``Scheduler`` and ``AsyncScheduler`` with kvcore's KV cache manager.

Select them with ``vllm serve MODEL --scheduler-cls kvcore.vllm.Scheduler`` (or
``kvcore.vllm.AsyncScheduler`` with async scheduling), i.e. ``SchedulerConfig.scheduler_cls``.
Everything but the KV cache manager is vLLM's own code.

vLLM's ``Scheduler.__init__`` builds its manager by name, with no hook to pass a class; these
subclasses let it, then replace it with :class:`kvcore.vllm.KVCacheManager` built from the same
arguments (the scheduler's own attributes) and rebind the KV connector to the new pool. The
dropped manager costs one construction at start-up.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler as _VllmAsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler as _VllmScheduler

from kvcore.vllm.manager import KVCacheManager
from kvcore.vllm.plugin import note_scheduler_built


def _install_kvcore_manager(scheduler: Any, hash_block_size: int | None) -> None:
    """Replaces the scheduler's vLLM manager with kvcore's, built from the same arguments."""
    old = scheduler.kv_cache_manager
    scheduler.kv_cache_manager = KVCacheManager(
        kv_cache_config=scheduler.kv_cache_config,
        max_model_len=scheduler.max_model_len,
        max_num_batched_tokens=scheduler.scheduler_config.max_num_batched_tokens,
        enable_caching=scheduler.cache_config.enable_prefix_caching,
        use_eagle=scheduler.use_eagle,
        log_stats=scheduler.log_stats,
        enable_kv_cache_events=scheduler.enable_kv_cache_events,
        dcp_world_size=scheduler.dcp_world_size,
        pcp_world_size=scheduler.pcp_world_size,
        scheduler_block_size=scheduler.block_size,
        hash_block_size=hash_block_size if hash_block_size is not None else scheduler.block_size,
        metrics_collector=scheduler.kv_metrics_collector,
        watermark=scheduler.scheduler_config.watermark,
    )
    del old
    if scheduler.connector is not None:
        scheduler.connector.bind_gpu_block_pool(scheduler.kv_cache_manager.block_pool)
    note_scheduler_built()


class Scheduler(_VllmScheduler):  # type: ignore[misc]
    """vLLM's ``Scheduler`` (same constructor) with :class:`kvcore.vllm.KVCacheManager`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _install_kvcore_manager(self, _hash_block_size(args, kwargs))


class AsyncScheduler(_VllmAsyncScheduler):  # type: ignore[misc]
    """vLLM's ``AsyncScheduler`` (same constructor) with :class:`kvcore.vllm.KVCacheManager`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _install_kvcore_manager(self, _hash_block_size(args, kwargs))


def _hash_block_size(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """The ``hash_block_size`` argument of vLLM's ``Scheduler.__init__`` (5th positional)."""
    if "hash_block_size" in kwargs:
        return kwargs["hash_block_size"]  # type: ignore[no-any-return]
    return args[4] if len(args) > 4 else None
