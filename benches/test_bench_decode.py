"""Decode-time ``allocate_slots``: the per-running-request cost of a scheduler step.

``N`` running requests (300-token prompts, fully computed, one full-attention group, block size
16, sha256_cbor, 131072 blocks) each ask for one more token slot, as every decode step does.
The slot falls inside the request's last block, so nothing is allocated or cached: this is the
"almost never allocates" path that the reference spends most of a step's KV time on.

Pairs (reference time / kvcore time, see ``conftest.py``), per running request:

- ``allocate_slots`` loop: both sides call ``allocate_slots(r, 1)`` and ``get_block_ids()`` of
  the result for every request;
- ``allocate_slots_batch``: kvcore allocates all ``N`` in one call, the reference loops as above.

Results go to ``benches/results/decode.json``. Run on a release build.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from typing import Any

import pytest

IMPLS = ["kvcore", "reference"]
TARGET = 10.0
BLOCK_SIZE = 16
NUM_BLOCKS = 131072
PROMPT = 300


def _build(impl: str, n: int) -> tuple[Any, list[Any]]:
    """A manager and ``n`` running requests of the given side."""
    os.environ["PYTHONHASHSEED"] = "0"
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 32000) for _ in range(PROMPT)] for _ in range(n)]
    if impl == "kvcore":
        from kvcore import config, hashing, specs
        from kvcore.manager import KVCacheManager as KvcoreManager
        from kvcore.request import Request, RequestStatus

        fn = hashing.get_hash_fn_by_name("sha256_cbor")
        hashing.init_none_hash(fn)
        hasher: Any = hashing.get_request_block_hasher(BLOCK_SIZE, fn)
        spec: Any = specs.FullAttentionSpec(
            BLOCK_SIZE, num_kv_heads=8, head_size=128, dtype="float16"
        )
        cfg: Any = config.KVCacheConfig(NUM_BLOCKS, [], [config.KVCacheGroupSpec(["a"], spec)])

        def make(i: int) -> Any:
            return Request(f"r{i}", prompts[i], max_tokens=10**6, block_hasher=hasher)

        status: Any = RequestStatus
        manager_cls: Any = KvcoreManager
    else:
        pytest.importorskip("vllm.v1.core.kv_cache_manager")
        import torch
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1 import kv_cache_interface as kvi
        from vllm.v1.core.kv_cache_manager import KVCacheManager as RefManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request as RefRequest
        from vllm.v1.request import RequestStatus as RefStatus

        rfn = get_hash_fn_by_name("sha256_cbor")
        init_none_hash(rfn)
        hasher = get_request_block_hasher(BLOCK_SIZE, rfn)
        spec = kvi.FullAttentionSpec(BLOCK_SIZE, num_kv_heads=8, head_size=128, dtype=torch.float16)
        cfg = kvi.KVCacheConfig(NUM_BLOCKS, [], [kvi.KVCacheGroupSpec(["a"], spec)])
        params = SamplingParams(max_tokens=256)

        def make(i: int) -> Any:
            return RefRequest(f"r{i}", prompts[i], params, None, block_hasher=hasher)

        status = RefStatus
        manager_cls = RefManager
    mgr = manager_cls(
        cfg,
        max_model_len=16384,
        scheduler_block_size=BLOCK_SIZE,
        hash_block_size=BLOCK_SIZE,
        max_num_batched_tokens=32768,
    )
    reqs = [make(i) for i in range(n)]
    for r in reqs:
        hits, num_hits = mgr.get_computed_blocks(r)
        assert mgr.allocate_slots(r, r.num_tokens - num_hits, num_hits, hits) is not None
        r.num_computed_tokens = r.num_tokens
        r.status = status.RUNNING
    return mgr, reqs


def _loop(mgr: Any, reqs: list[Any]) -> Callable[[], None]:
    alloc = mgr.allocate_slots

    def step() -> None:
        for r in reqs:
            alloc(r, 1).get_block_ids()

    return step


@pytest.mark.parametrize("n", [256, 4096])
@pytest.mark.parametrize("impl", IMPLS)
def test_decode_allocate_slots(impl: str, n: int, paired: Callable[..., Any]) -> None:
    """allocate_slots(r, 1) + get_block_ids() for every running request."""
    mgr, reqs = _build(impl, n)
    paired(
        f"decode: allocate_slots loop, {n} running",
        impl,
        _loop(mgr, reqs),
        per=n,
        unit="request",
        target=TARGET,
    )


@pytest.mark.parametrize("n", [256, 4096])
@pytest.mark.parametrize("impl", IMPLS)
def test_decode_allocate_slots_batch(impl: str, n: int, paired: Callable[..., Any]) -> None:
    """kvcore's allocate_slots_batch against the reference's per-request loop."""
    mgr, reqs = _build(impl, n)
    if impl == "kvcore":
        ones = [1] * n

        def step() -> None:
            assert len(mgr.allocate_slots_batch(reqs, ones)) == n

        fn: Callable[[], None] = step
    else:
        fn = _loop(mgr, reqs)
    paired(
        f"decode: allocate_slots_batch, {n} running",
        impl,
        fn,
        per=n,
        unit="request",
        target=TARGET,
    )
