"""``kvcore.vllm.KVCacheManager``: kvcore's manager with the constructor and results vLLM expects.

vLLM 0.25.1's scheduler builds its manager from ``vllm.v1.kv_cache_interface`` objects, reads
``vllm.distributed.kv_events`` objects from ``take_events()`` (its ZMQ publisher encodes only
those) and ``vllm.v1.metrics.stats.PrefixCacheStats`` from ``make_prefix_cache_stats()``. This
class converts the configuration, has the core build vLLM's event structs and keep vLLM's stats
class, has it read vLLM's ``Request`` from its instance dict, and is otherwise kvcore's
``KVCacheManager``.
"""

from __future__ import annotations

import os
from typing import Any

from vllm.distributed.kv_events import AllBlocksCleared as VllmAllBlocksCleared
from vllm.distributed.kv_events import BlockRemoved as VllmBlockRemoved
from vllm.distributed.kv_events import BlockStored as VllmBlockStored
from vllm.v1.metrics.stats import PrefixCacheStats as VllmPrefixCacheStats
from vllm.v1.request import Request as VllmRequest

from kvcore._native import Retention
from kvcore.errors import InvalidConfigError
from kvcore.manager import KVCacheManager as _KVCacheManager
from kvcore.vllm._convert import (
    convert_kv_cache_config,
    feed_metrics,
)
from kvcore.vllm.request import Request


def vllm_coordinator(coordinator: Any) -> Any:
    """kvcore's coordinator seen as an instance of vLLM's coordinator class of the same name.

    vLLM's scheduler tests ``isinstance(manager.coordinator, HybridKVCacheCoordinator)`` to
    choose its Mamba + KV connector path. The returned object is an instance of a subclass of
    vLLM's class, made once per class, whose ``__init__`` is never run: each method vLLM's
    class defines and kvcore's coordinator has is a method of the subclass that calls
    kvcore's, and every other attribute is read from kvcore's coordinator.

    Args:
        coordinator: A ``kvcore.coordinator`` coordinator.
    """
    import vllm.v1.core.kv_cache_coordinator as vllm_coordinators

    base = getattr(vllm_coordinators, type(coordinator).__name__)
    facade_cls = _FACADES.get(base)
    if facade_cls is None:
        names = {n for klass in base.__mro__ for n in vars(klass) if not n.startswith("__")}
        ours = type(coordinator)
        body: dict[str, Any] = {
            "__init__": lambda self: None,
            "__getattr__": lambda self, name: getattr(self.__dict__["_kvcore"], name),
            "__module__": __name__,
        }
        for name in names:
            if callable(getattr(ours, name, None)):
                body[name] = _forward(name)
        facade_cls = type(f"Kvcore{base.__name__}", (base,), body)
        _FACADES[base] = facade_cls
    facade: Any = object.__new__(facade_cls)
    facade.__dict__["_kvcore"] = coordinator
    return facade


def _forward(name: str) -> Any:
    """A method that calls kvcore's coordinator's method ``name``."""

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.__dict__["_kvcore"], name)(*args, **kwargs)

    method.__name__ = name
    return method


_FACADES: dict[type, type] = {}


RETENTION_FROM_PRIORITY_ENV = "KVCORE_VLLM_RETENTION_FROM_PRIORITY"
"""Set to 1 to map vLLM's request ``priority`` to kvcore's retention priority (CC-4)."""


def retention_from_priority() -> bool:
    """Whether :data:`RETENTION_FROM_PRIORITY_ENV` is on (``1``; ``0`` or unset: off).

    Raises:
        InvalidConfigError: Any other value.
    """
    raw = os.environ.get(RETENTION_FROM_PRIORITY_ENV, "0").strip()
    if raw not in ("0", "1", ""):
        raise InvalidConfigError(f"{RETENTION_FROM_PRIORITY_ENV}={raw!r}: use 1 or 0")
    return raw == "1"


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
        metrics_collector: vLLM's ``KVCacheMetricsCollector``. The pool then records the
            operations the collector follows (allocations, accesses, evictions, resets) and
            ``take_events()``, which vLLM's scheduler calls once per step before it drains the
            collector, hands them to it in pool order: the same calls vLLM's pool makes, made
            at the end of the step instead of during it.
        watermark: Fraction of blocks kept free when admitting waiting requests.

    With ``KVCORE_VLLM_RETENTION_FROM_PRIORITY=1`` in the environment, ``free`` gives a
    request's cached blocks the retention priority ``clamp(50 - request.priority, 0, 100)``
    (vLLM's lower priority values are more important), so that blocks of important requests are
    evicted last (docs/behaviour.md CC-4).

    Raises:
        InvalidConfigError: A spec kvcore does not know, an inconsistent configuration, or a
            bad ``KVCORE_VLLM_RETENTION_FROM_PRIORITY``.
    """

    _stats_class = VllmPrefixCacheStats
    """The stats are vLLM's ``PrefixCacheStats`` (same fields and ``record``)."""

    _event_classes = (VllmBlockStored, VllmBlockRemoved, VllmAllBlocksCleared)
    """Events are built as vLLM's ``vllm.distributed.kv_events`` structs (same fields)."""

    _plain_request_classes = ((VllmRequest, "_all_token_ids"), (Request, "_all_token_ids"))
    """vLLM's ``Request`` keeps its fields as plain attributes and ``num_tokens`` is
    ``len(self._all_token_ids)``: the core reads them from the instance dict, and those of
    :class:`kvcore.vllm.Request` (the engine's requests with kvcore's scheduler) from its
    slots."""

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
        self.metrics_collector = metrics_collector
        if metrics_collector is not None:
            self.block_pool.record_block_ops(True)
            # Only a collector makes `take_events` more than the core's method: without one
            # the scheduler's per-step call goes straight to it (no Python frame).
            self.take_events = self._take_events_feeding  # type: ignore[method-assign]
        self._kvcore_coordinator = self.coordinator
        self.coordinator = vllm_coordinator(self.coordinator)
        self._priority_retention = retention_from_priority()

    def free(self, request: Any) -> None:
        """Frees the request's blocks (MGR-20); with ``KVCORE_VLLM_RETENTION_FROM_PRIORITY=1``
        its scheduling priority becomes the retention priority of its cached blocks (CC-4)."""
        if self._priority_retention:
            self._free_retained(request, Retention(min(100, max(0, 50 - int(request.priority)))))
        else:
            super().free(request)

    def _take_events_feeding(self) -> list[Any]:
        """``take_events`` with a metrics collector: first hands the collector the pool's
        recorded block operations, then returns the pool's events (as the core's method, as
        ``vllm.distributed.kv_events`` objects)."""
        feed_metrics(self.metrics_collector, self.block_pool.take_block_ops())
        return super().take_events()
