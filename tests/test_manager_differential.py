"""Differential tests: kvcore's ``KVCacheManager`` against the reference's (SPEC §7–§16).

Every test drives both managers with the same seeded, scheduler-like trace (``difftrace``) and
compares, after every call, the return value, the KV events, the free-queue order and
``usage``; after every step, every block's ref count and prefix-cache key, the block tables,
``take_new_block_ids`` and ``get_num_common_prefix_blocks``.

Configurations cover the three coordinators (no prefix cache, unitary, hybrid), every manager
type compared (full, sliding window, chunked local, Mamba none/align/all, cross-attention with
caching off, RSWA) and hybrid mixes, including groups of different block sizes with
``hash_block_size < block_size``.  Sink full attention (SINK-1) is broken in the reference and is
never compared.

Environment: ``KVCORE_DIFFTEST_SEEDS`` (default 12) seeds and ``KVCORE_DIFFTEST_CALLS``
(default 300) manager calls per configuration and seed.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

pytest.importorskip("vllm.v1.core.kv_cache_manager")

from difftrace import (
    CONFIGS,
    KvcoreSide,
    Mismatch,
    ReferenceSide,
    ReqSpec,
    TraceConfig,
    run_trace,
)

pytestmark = pytest.mark.reference

SEEDS = range(int(os.environ.get("KVCORE_DIFFTEST_SEEDS", "12")))
CALLS = int(os.environ.get("KVCORE_DIFFTEST_CALLS", "300"))
_BY_NAME = {c.name: c for c in CONFIGS}


@pytest.mark.usefixtures("hash_seed")
@pytest.mark.parametrize("seed", SEEDS, ids=lambda s: f"s{s}")
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
def test_trace_matches_reference(cfg: TraceConfig, seed: int) -> None:
    """A seeded trace gives identical results, events and pool state on both managers."""
    run_trace(cfg, seed, CALLS)


@pytest.mark.usefixtures("hash_seed")
def test_kvcore_requests_hash_like_reference() -> None:
    """kvcore's request hasher (or the stand-in) reproduces the reference's hashes (RH-1)."""
    cfg = _BY_NAME["hybrid-full32-swa16"]
    ref, kv = ReferenceSide(cfg), KvcoreSide(cfg)
    prompt = list(range(1, 75))
    for salt in (None, "salt-1"):
        spec = ReqSpec("a", prompt, 4, salt=salt)
        r, k = ref.make_request(spec), kv.make_request(spec)
        assert list(k.block_hashes) == list(r.block_hashes)
        r.append_output_token_ids([7] * 20)
        k.append_output_token_ids([7] * 20)
        assert list(k.block_hashes) == list(r.block_hashes)
        assert len(r.block_hashes) == (74 + 20) // cfg.hash_block_size


# --- The harness itself -------------------------------------------------------------------


@pytest.mark.usefixtures("hash_seed")
@pytest.mark.parametrize("name", ["full", "hybrid-full-swa", "hybrid-full-mamba-align"])
def test_harness_reference_against_itself(name: str) -> None:
    """Two reference managers never diverge: the harness itself is deterministic."""
    d = run_trace(_BY_NAME[name], 0, CALLS, kv_side=ReferenceSide)
    assert d.counts["allocate_slots"] > 50
    assert d.counts.get("BlockStored", 0) > 0


class _ReversedFreeQueue(ReferenceSide):
    def free_ids(self) -> list[int]:
        return super().free_ids()[::-1]


class _DropsEvents(ReferenceSide):
    def events(self) -> list[tuple[Any, ...]]:
        return super().events()[1:]


class _ForgetsHits(ReferenceSide):
    def __init__(self, cfg: TraceConfig) -> None:
        super().__init__(cfg)
        real = self.manager.get_computed_blocks

        def lookup(request: Any) -> Any:
            blocks, n = real(request)
            return (self.manager.empty_kv_cache_blocks, 0) if n else (blocks, n)

        self.manager.get_computed_blocks = lookup


@pytest.mark.usefixtures("hash_seed")
@pytest.mark.parametrize("side", [_ReversedFreeQueue, _DropsEvents, _ForgetsHits])
def test_harness_detects_divergence(side: type[ReferenceSide]) -> None:
    """A manager that differs in free order, events or prefix hits fails the comparison."""
    with pytest.raises(Mismatch):
        for seed in range(3):
            run_trace(_BY_NAME["full-xxhash"], seed, CALLS, kv_side=side)
