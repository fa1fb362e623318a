"""vLLM 0.25.1's own scheduler step with vLLM's KV cache manager and with kvcore's.

One process, two ``Scheduler`` objects over the same workload, stepped alternately (one step
each in turn, so the machine's drift hits both alike). Timed per step: the whole
``schedule()`` + ``update_from_output()``, and the time spent inside the KV cache manager's
methods (each public method of the manager instance wrapped by a timer; a method called from
inside another, as vLLM's ``allocate_slots`` calls ``create_kv_cache_blocks``, counts once; the
wrapper's own cost, ~0.1 µs a call, is in both). The ceiling is the step's time outside the manager: what a
manager costing nothing would leave. Every step's ``SchedulerOutput`` is compared, so the two
runs make the same decisions.

Run: ``python -m pytest benches/test_bench_vllm.py -q --benchmark-only`` (``make bench`` runs it
too).
"""

from __future__ import annotations

import gc
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import vllm_harness as h
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

import kvcore.vllm

MEASURED_STEPS = 150
_MANAGER_METHODS = (
    "get_computed_blocks",
    "allocate_slots",
    "free",
    "pop_blocks_for_free",
    "get_blocks",
    "get_block_ids",
    "get_block_ids_for_computed_tokens",
    "get_num_common_prefix_blocks",
    "take_new_block_ids",
    "take_events",
    "new_step_starts",
    "remove_skipped_blocks",
    "cache_blocks",
    "make_prefix_cache_stats",
    "create_kv_cache_blocks",
    "evict_blocks",
)


class Timed:
    """A scheduler whose manager calls are timed."""

    def __init__(self, sched: Any) -> None:
        self.sched = sched
        self.manager_s = 0.0
        self.inside = False
        self.step_times: list[float] = []
        self.manager_times: list[float] = []
        mgr = sched.kv_cache_manager
        for name in _MANAGER_METHODS:
            fn = getattr(mgr, name)
            setattr(mgr, name, self._wrap(fn))

    def _wrap(self, fn: Any) -> Any:
        perf = time.perf_counter

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.inside:  # called by another manager method: timed by that one
                return fn(*args, **kwargs)
            self.inside = True
            t = perf()
            try:
                return fn(*args, **kwargs)
            finally:
                self.manager_s += perf() - t
                self.inside = False

        return timed


def _requests(n: int, seed: int, hasher: Any) -> list[Request]:
    rng = random.Random(seed)
    systems = [[rng.randrange(h.VOCAB) for _ in range(rng.randrange(64, 256))] for _ in range(8)]
    out = []
    for i in range(n):
        prompt = list(rng.choice(systems)) if rng.random() < 0.7 else []
        prompt += [rng.randrange(h.VOCAB) for _ in range(rng.randrange(16, 256))]
        out.append(
            Request(
                f"r{i}",
                prompt,
                SamplingParams(max_tokens=100_000, ignore_eos=True),
                None,
                block_hasher=hasher,
            )
        )
    return out


def _step(t: Timed, record: bool) -> dict[str, Any]:
    sched = t.sched
    m0 = t.manager_s
    start = time.perf_counter()
    out = sched.schedule()
    mid = time.perf_counter()
    req_ids = list(out.num_scheduled_tokens)
    sampled = [
        [] if sched.requests[r].num_computed_tokens < sched.requests[r].num_tokens else [7]
        for r in req_ids
    ]
    mro = ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )
    runner = time.perf_counter() - mid
    sched.update_from_output(out, mro)
    elapsed = time.perf_counter() - start - runner
    if record:
        t.step_times.append(elapsed)
        t.manager_times.append(t.manager_s - m0)
    return h.plain_output(out)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("model", ["full", "swa"])
@pytest.mark.parametrize("running", [64, 256, 1024])
def test_bench_vllm_scheduler_step(
    model: str,
    running: int,
    benchmark: Any,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """KV-manager time inside vLLM's scheduler step, vLLM's manager against kvcore's."""
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    init_none_hash(sha256)
    setup = h.Setup(
        model=model,
        num_blocks=running * 64 + 1024,
        max_num_seqs=running,
        max_num_batched_tokens=8192,
        max_model_len=8192,
        events=True,
    )
    cfg = h.vllm_config(setup)
    hasher = get_request_block_hasher(setup.block_size, sha256)
    timed = []
    for cls in (VllmScheduler, kvcore.vllm.Scheduler):
        sched = cls(
            vllm_config=cfg,
            kv_cache_config=h.kv_cache_config(setup),
            structured_output_manager=StructuredOutputManager(cfg),
            block_size=setup.block_size,
            log_stats=True,
        )
        sched.kv_event_publisher = h.CapturingPublisher()
        for req in _requests(running, 0, hasher):
            sched.add_request(req)
        timed.append(Timed(sched))
    ref, ours = timed
    # Warm up: admit and prefill everything, then a few decode steps.
    warm = 0
    while ref.sched.waiting or warm < 5:
        assert _step(ref, False) == _step(ours, False)
        warm = warm + 1 if not ref.sched.waiting else 0

    def measure() -> None:
        gc.collect()
        gc.disable()
        try:
            for i in range(MEASURED_STEPS):
                pair = (ref, ours) if i % 2 == 0 else (ours, ref)
                a = _step(pair[0], True)
                b = _step(pair[1], True)
                assert a == b
        finally:
            gc.enable()

    benchmark.pedantic(measure, rounds=1, iterations=1)
    assert len(ref.sched.running) == len(ours.sched.running) == running

    def us(xs: list[float]) -> float:
        return statistics.median(xs) * 1e6

    ref_mgr, our_mgr = us(ref.manager_times), us(ours.manager_times)
    ref_step, our_step = us(ref.step_times), us(ours.step_times)
    our_ceiling = (
        statistics.median(s - m for s, m in zip(ours.step_times, ours.manager_times, strict=True))
        * 1e6
    )
    benchmark.extra_info.update(
        manager_us_vllm=ref_mgr,
        manager_us_kvcore=our_mgr,
        step_us_vllm=ref_step,
        step_us_kvcore=our_step,
        ceiling_us=our_ceiling,
    )
    with capsys.disabled():
        print(
            f"\nvLLM scheduler step, {model}, {running} running (median of {MEASURED_STEPS} "
            f"steps each, µs): manager vLLM {ref_mgr:.1f} / kvcore {our_mgr:.1f} = "
            f"{ref_mgr / our_mgr:.2f}x; step vLLM {ref_step:.1f} / kvcore {our_step:.1f} = "
            f"{ref_step / our_step:.2f}x; ceiling {our_ceiling:.1f} "
            f"(kvcore step {100 * (our_step / our_ceiling - 1):.1f}% above it)"
        )


@pytest.mark.slow
@pytest.mark.parametrize("running", [256, 4096])
def test_bench_vllm_request_decode(
    running: int,
    benchmark: Any,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Decode ``allocate_slots(r, 1)``: vLLM's ``Request`` against kvcore's.

    Both go through ``kvcore.vllm.KVCacheManager`` (kvcore's Rust manager); vLLM's requests are
    read attribute by attribute, kvcore's from their native state.
    """
    from vllm.v1.request import RequestStatus as VllmStatus

    import kvcore.hashing
    from kvcore.request import Request as KvcoreRequest
    from kvcore.request import RequestStatus as KvcoreStatus

    monkeypatch.setenv("PYTHONHASHSEED", "0")
    init_none_hash(sha256)
    kvcore.hashing.init_none_hash(kvcore.hashing.sha256)
    setup = h.Setup(num_blocks=running * 16 + 16)
    steps = 40

    def run(make: Any, running_status: Any) -> float:
        mgr = kvcore.vllm.KVCacheManager(
            h.kv_cache_config(setup),
            max_model_len=8192,
            scheduler_block_size=16,
            hash_block_size=16,
            enable_kv_cache_events=True,
        )
        reqs = [make(i) for i in range(running)]
        for r in reqs:
            hits, n = mgr.get_computed_blocks(r)
            assert mgr.allocate_slots(r, r.num_tokens - n, n, hits) is not None
            r.num_computed_tokens = r.num_tokens
            r.status = running_status
        allocate = mgr.allocate_slots
        gc.collect()
        in_allocate = 0.0
        for s in range(steps):
            start = time.perf_counter()
            for r in reqs:
                allocate(r, 1)
            in_allocate += time.perf_counter() - start
            for r in reqs:
                r.num_computed_tokens += 1
                r.append_output_token_ids(s)
            mgr.take_events()
        return in_allocate / (steps * running) * 1e6

    vllm_hasher = kvcore.vllm.get_request_block_hasher(16, sha256)
    kv_hasher: Any = kvcore.hashing.get_request_block_hasher(16, kvcore.hashing.sha256)

    def vllm_request(i: int) -> Request:
        return Request(
            f"v{i}",
            list(range(i % 500, i % 500 + 100)),
            SamplingParams(max_tokens=1000),
            None,
            block_hasher=vllm_hasher,
        )

    def kvcore_request(i: int) -> KvcoreRequest:
        return KvcoreRequest(
            f"k{i}", prompt_token_ids=list(range(i % 500, i % 500 + 100)), block_hasher=kv_hasher
        )

    results: dict[str, list[float]] = {"vllm": [], "kvcore": []}

    def measure() -> None:
        for _ in range(3):  # alternate, so the machine's drift hits both
            results["vllm"].append(run(vllm_request, VllmStatus.RUNNING))
            results["kvcore"].append(run(kvcore_request, KvcoreStatus.RUNNING))

    benchmark.pedantic(measure, rounds=1, iterations=1)
    v, k = min(results["vllm"]), min(results["kvcore"])
    benchmark.extra_info.update(vllm_request_us=v, kvcore_request_us=k)
    with capsys.disabled():
        print(
            f"\ndecode allocate_slots(r, 1), {running} running, µs per request (best "
            f"of 3): vLLM Request {v:.3f} / kvcore Request {k:.3f} = {v / k:.2f}x"
        )
