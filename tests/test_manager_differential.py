"""Differential tests: kvcore's ``KVCacheManager`` against the reference's (SPEC §7–§16).

Every test drives both managers with the same seeded, scheduler-like trace (``difftrace``) and
compares, after every call, the return value, the KV events, the free-queue order and
``usage``; after every step, every block's ref count and prefix-cache key, the block tables,
``take_new_block_ids`` and ``get_num_common_prefix_blocks``.

Configurations cover the three coordinators (no prefix cache, unitary, hybrid), every manager
type compared (full, sliding window, chunked local, Mamba none/align/all, cross-attention with
caching off, RSWA) and hybrid mixes, including groups of different block sizes with
``hash_block_size < block_size``; every single-group configuration also runs with
``dcp_world_size`` 2 and 4 and ``pcp_world_size`` 2 (``CP_CONFIGS``).  Sink full attention (SINK-1) is broken in the reference and is
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
    CP_CONFIGS,
    BothRaised,
    GroupDesc,
    KvcoreSide,
    Mismatch,
    ReferenceSide,
    ReqSpec,
    TraceConfig,
    TraceDriver,
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
@pytest.mark.parametrize("seed", SEEDS[:4], ids=lambda s: f"s{s}")
@pytest.mark.parametrize("cfg", CP_CONFIGS, ids=lambda c: c.name)
def test_context_parallel_trace_matches_reference(cfg: TraceConfig, seed: int) -> None:
    """With decode or prefill context parallelism every call agrees too (DCP-1, MGR-26)."""
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


# --- Rejections: both sides raise the same class -------------------------------------------


def _build_error(cfg: TraceConfig, **overrides: Any) -> tuple[type | None, BaseException | None]:
    """Build both managers for ``cfg``; return the reference's exception class and kvcore's."""
    import dataclasses

    cfg = dataclasses.replace(cfg, **overrides)
    got: list[BaseException | None] = []
    for side in (ReferenceSide, KvcoreSide):
        try:
            side(cfg)
        except Exception as e:
            got.append(e)
        else:
            got.append(None)
    ref, kv = got
    return (None if ref is None else type(ref)), kv


_F = GroupDesc("full")
_BAD_CONFIGS: dict[str, dict[str, Any]] = {
    # COORD-7: unitary with caching needs block_size == hash_block_size.
    "unitary-bs-ne-hbs": dict(groups=(GroupDesc("full", 32),), scheduler_block_size=32),
    # COORD-2: scheduler block size must be a multiple of every group's block size.
    "sbs-not-multiple": dict(groups=(_F, GroupDesc("swa", 32, window=64)), num_blocks=64),
    # COORD-9: equal specs merge, leaving a single attention group.
    "hybrid-one-attention-group": dict(groups=(_F, _F)),
    # COORD-9: every group's block size must be a multiple of the hash block size.
    "hybrid-hbs-not-divisor": dict(
        groups=(GroupDesc("full", 32), GroupDesc("swa", 16, window=32)),
        scheduler_block_size=32,
        hash_block_size=32,
    ),
    # MGR-1: negative watermark.
    "negative-watermark": dict(watermark=-0.1),
}


@pytest.mark.usefixtures("hash_seed")
@pytest.mark.parametrize("case", sorted(_BAD_CONFIGS))
def test_bad_configuration_rejected_like_reference(case: str) -> None:
    """Configurations the reference rejects are rejected by kvcore with a compatible class."""
    ref_cls, kv_exc = _build_error(_BY_NAME["full"], **_BAD_CONFIGS[case])
    assert ref_cls is not None, f"the reference accepted {case}"
    assert isinstance(kv_exc, ref_cls), f"{case}: reference {ref_cls}, kvcore {kv_exc!r}"


def _driver(name: str, **overrides: Any) -> TraceDriver:
    import dataclasses

    return TraceDriver(dataclasses.replace(_BY_NAME[name], **overrides), 0)


def _pair(d: TraceDriver, rid: str, prompt: list[int]) -> Any:
    from difftrace import _Req

    spec = ReqSpec(rid, prompt, 4)
    return _Req(rid, d.ref.make_request(spec), d.kv.make_request(spec), 4)


@pytest.mark.usefixtures("hash_seed")
def test_zero_new_tokens_rejected_like_reference() -> None:
    """ALLOC-1: no new and no external tokens raises ValueError on both, nothing allocated."""
    d = _driver("full")
    r = _pair(d, "r", list(range(1, 40)))
    with pytest.raises(BothRaised) as info:
        d.allocate(r, 0)
    assert isinstance(info.value.__cause__, ValueError)
    d.check_state()
    d.check("free queue", d.ref.free_ids(), d.kv.free_ids())


@pytest.mark.usefixtures("hash_seed")
def test_hits_for_running_request_rejected_like_reference() -> None:
    """COORD-5: handing prefix hits to a request that already holds blocks is rejected."""
    d = _driver("full")
    a = _pair(d, "a", list(range(1, 50)))
    assert d.allocate(a, 49)
    b = _pair(d, "b", list(range(1, 50)))
    ref_b, hits, kv_b = d.get_computed_blocks(b)
    assert hits == 48
    assert d.allocate(b, 1, hits, (ref_b, kv_b))
    for r in (b.ref, b.kv):
        r.num_computed_tokens = 49
        r.append_output_token_ids([5])
    with pytest.raises(BothRaised) as info:
        d.allocate(b, 1, 0, (ref_b, kv_b))
    assert isinstance(info.value.__cause__, AssertionError)


@pytest.mark.usefixtures("hash_seed")
def test_cross_attention_with_caching_rejected_like_reference() -> None:
    """XATTN-1: cross-attention groups cannot cache blocks (ValueError on both)."""
    d = _driver("nocache-cross", enable_caching=True)
    r = _pair(d, "r", list(range(1, 40)))
    with pytest.raises(BothRaised) as info:
        d.allocate(r, 39, num_encoder_tokens=40)
    assert isinstance(info.value.__cause__, (ValueError, NotImplementedError))
