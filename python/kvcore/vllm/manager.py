"""``kvcore.vllm.KVCacheManager``: kvcore's manager with the constructor and results vLLM expects.

vLLM 0.25.1's scheduler builds its manager from ``vllm.v1.kv_cache_interface`` objects, reads
``vllm.distributed.kv_events`` objects from ``take_events()`` (its ZMQ publisher encodes only
those) and ``vllm.v1.metrics.stats.PrefixCacheStats`` from ``make_prefix_cache_stats()``. This
class converts at exactly those points and is otherwise kvcore's ``KVCacheManager``.
"""

from __future__ import annotations

from typing import Any

from kvcore.manager import KVCacheManager as _KVCacheManager
from kvcore.vllm._convert import convert_kv_cache_config, vllm_events, vllm_prefix_cache_stats


class _NativeStateCoordinator:
    """The coordinator as seen from vLLM when the Rust manager holds the requests.

    With a single full-attention group, kvcore's per-request state lives in
    ``kvcore._native.UnitaryFullAttention``; the Python coordinator under it holds no request,
    so a per-request question asked of it would get a silently wrong answer. This wrapper
    forwards the questions that do not depend on requests and refuses the others with a clear
    error. (``kvcore.vllm.Scheduler`` builds its manager without the Rust path when a KV
    connector, the one user of these questions, is configured.)
    """

    _PER_REQUEST = frozenset(
        {
            "get_num_blocks_to_allocate",
            "allocate_new_computed_blocks",
            "allocate_new_blocks",
            "cache_blocks",
            "free",
            "pop_blocks_for_free",
            "get_num_common_prefix_blocks",
            "remove_skipped_blocks",
            "get_blocks",
        }
    )

    def __init__(self, coordinator: Any, caching: bool) -> None:
        self._coordinator = coordinator
        # Without caching no request has common prefix blocks: the coordinator's answer (all
        # zeros) holds whoever holds the requests.
        self._refused = self._PER_REQUEST - (set() if caching else {"get_num_common_prefix_blocks"})

    def __getattr__(self, name: str) -> Any:
        if name in self._refused:
            raise NotImplementedError(
                f"coordinator.{name}: kvcore keeps this configuration's requests in its Rust "
                "manager; ask the KVCacheManager instead (kvcore.vllm.Scheduler builds the "
                "manager with a Python coordinator when a KV connector is configured)"
            )
        return getattr(self._coordinator, name)


class KVCacheManager(_KVCacheManager):
    """kvcore's KV cache manager for vLLM 0.25.1's scheduler (same constructor and methods).

    Takes vLLM's ``KVCacheConfig`` (kvcore's own works too) and vLLM's ``Request`` objects,
    returns vLLM's event and stats classes, and is otherwise :class:`kvcore.manager.KVCacheManager`.

    Args:
        kv_cache_config: vLLM's (or kvcore's) KV cache configuration.
        max_model_len: Longest sequence.
        scheduler_block_size: The scheduling granularity.
        hash_block_size: The granularity of ``Request.block_hashes``.
        max_num_batched_tokens: Tokens per step.
        enable_caching: Whether prefix caching is on.
        use_eagle: Whether EAGLE/MTP drafting is on.
        log_stats: Whether to keep prefix-cache stats.
        enable_kv_cache_events: Whether to queue KV events.
        dcp_world_size: Decode context-parallel world size.
        pcp_world_size: Prefill context-parallel world size.
        metrics_collector: vLLM's ``KVCacheMetricsCollector``; kvcore collects no per-block
            residency metrics yet, so a collector is refused (raises) rather than left empty.
        watermark: Fraction of blocks kept free when admitting waiting requests.

    Raises:
        NotImplementedError: A metrics collector was given.
        InvalidConfigError: A spec kvcore does not know, or an inconsistent configuration.
    """

    def __init__(
        self,
        kv_cache_config: Any,
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
    ) -> None:
        if metrics_collector is not None:
            raise NotImplementedError(
                "kvcore does not collect KV cache residency metrics "
                "(--kv-cache-metrics); run without them"
            )
        super().__init__(
            convert_kv_cache_config(kv_cache_config),
            max_model_len,
            scheduler_block_size,
            hash_block_size,
            max_num_batched_tokens,
            enable_caching,
            use_eagle,
            log_stats,
            enable_kv_cache_events,
            dcp_world_size,
            pcp_world_size,
            None,
            watermark,
        )
        if self._native is not None:
            self.coordinator = _NativeStateCoordinator(  # type: ignore[assignment]
                self.coordinator, self.enable_caching
            )

    def take_events(self) -> list[Any]:
        """The pool's events as ``vllm.distributed.kv_events`` objects (same fields)."""
        return vllm_events(super().take_events())

    def make_prefix_cache_stats(self) -> Any:
        """Hands back the current stats as vLLM's ``PrefixCacheStats`` and starts fresh ones."""
        stats = super().make_prefix_cache_stats()
        return None if stats is None else vllm_prefix_cache_stats(stats)
