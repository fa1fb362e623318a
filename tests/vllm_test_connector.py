"""A seeded KV connector for the vLLM scheduler tests (scheduler side only; nothing moves).

vLLM loads a connector by ``kv_connector_module_path``; this one decides, per request and from
a hash of its id, whether some of its prompt is "found" externally (loaded asynchronously, so
the scheduler allocates with ``delay_cache_blocks`` and reserves blocks for in-flight loads) and
whether its blocks are "saved" after it finishes (so their free is delayed until the save
completes). The fake model runner reports the loads and saves as finished a few steps later.
"""

from __future__ import annotations

import zlib
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)


def _draw(request_id: str, salt: str) -> int:
    return zlib.crc32(f"{salt}:{request_id}".encode()) % 100


class SeededConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """Scheduler-side connector with deterministic external hits and delayed saves."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.block_size = vllm_config.cache_config.block_size
        self.loading: dict[str, int] = {}  # request id -> steps until its load completes
        self.saving: dict[str, int] = {}  # request id -> steps until its save completes
        self.bound_pool: Any = None

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self.bound_pool = gpu_block_pool

    # Scheduler side.
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        if request.request_id in self.loading or _draw(request.request_id, "hit") >= 40:
            return 0, False
        # External hit: whole blocks of the prompt beyond what is cached locally, never the
        # last token.
        extra = (request.num_tokens - 1 - num_computed_tokens) // self.block_size * self.block_size
        extra = min(extra, 3 * self.block_size)
        if extra <= 0:
            return 0, False
        return extra, True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            self.loading[request.request_id] = 1 + _draw(request.request_id, "load") % 4

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request)

    def _finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        if _draw(request.request_id, "save") < 50:
            self.saving[request.request_id] = 1 + _draw(request.request_id, "wait") % 3
            return True, None
        return False, None

    def advance(self) -> tuple[set[str], set[str]]:
        """One model step: the loads and saves that complete now (recving, sending)."""
        done: list[set[str]] = []
        for table in (self.loading, self.saving):
            finished = set()
            for rid in list(table):
                table[rid] -= 1
                if table[rid] <= 0:
                    finished.add(rid)
                    del table[rid]
            done.append(finished)
        return done[0], done[1]

    # Worker side: never called in these tests.
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    def wait_for_layer_load(self, layer_name: str) -> None:
        raise NotImplementedError

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        raise NotImplementedError

    def wait_for_save(self) -> None:
        raise NotImplementedError
