"""KV cache events (SPEC §6): what the block pool reports about the prefix cache.

The pool emits ``BlockStored`` when blocks enter the prefix cache, ``BlockRemoved`` when a key
leaves it, and ``AllBlocksCleared`` on a successful reset. Field names, order and defaults follow
the reference so that existing KV-aware routers can consume them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MEDIUM_GPU = "GPU"

ExternalBlockHash = bytes | int
"""A block hash as reported in events: an int (the default) or the raw digest (SPEC EVT-2)."""


@dataclass(slots=True)
class KVCacheEvent:
    """Base class of every KV cache event."""


@dataclass(slots=True)
class BlockStored(KVCacheEvent):
    """Blocks entered the prefix cache.

    Attributes:
        block_hashes: Hashes of the stored blocks, in order.
        parent_block_hash: Hash of the block before the first stored one, or None.
        token_ids: Token ids of the stored range (skipped blocks included).
        block_size: Tokens per stored block.
        lora_id: The LoRA adapter id, or None.
        medium: Where the blocks live (``"GPU"``).
        lora_name: The LoRA name, or None.
        extra_keys: Extra hash keys per stored block, or None.
        group_idx: KV cache group id.
        kv_cache_spec_kind: The group's attention kind (set by the manager).
        kv_cache_spec_sliding_window: The group's sliding window, if any.
    """

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None

    def __hash__(self) -> int:
        return hash(
            (
                tuple(self.block_hashes),
                self.parent_block_hash,
                tuple(self.token_ids),
                self.block_size,
                self.lora_id,
                self.medium,
                self.lora_name,
                tuple(self.extra_keys) if self.extra_keys else None,
                self.group_idx,
                self.kv_cache_spec_kind,
                self.kv_cache_spec_sliding_window,
            )
        )


@dataclass(slots=True)
class BlockRemoved(KVCacheEvent):
    """A key left the prefix cache.

    Attributes:
        block_hashes: The removed hash (the pool puts one in each event).
        medium: Where the block lived (``"GPU"``).
        group_idx: KV cache group id.
    """

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None

    def __hash__(self) -> int:
        return hash((tuple(self.block_hashes), self.medium, self.group_idx))


@dataclass(slots=True)
class AllBlocksCleared(KVCacheEvent):
    """The whole prefix cache was cleared."""

    def __hash__(self) -> int:
        return hash("AllBlocksCleared")


@dataclass(slots=True)
class KVEventBatch:
    """The events of one scheduler step, as published (SPEC WIRE-1, WIRE-2).

    Attributes:
        ts: Wall-clock time of the batch.
        events: The events, in emission order.
        data_parallel_rank: The data-parallel rank, or None.
    """

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared] = field(default_factory=list)
    data_parallel_rank: int | None = None
