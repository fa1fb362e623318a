"""kvcore inside vLLM 0.25.1's own scheduler: ``kvcore.vllm`` against vLLM's manager.

vLLM's real ``Scheduler`` / ``AsyncScheduler`` run a seeded workload on the CPU twice, once with
vLLM's KV cache manager and once as ``kvcore.vllm.Scheduler`` (kvcore's manager); every step's
``SchedulerOutput``, the encoded KV event batches and the prefix-cache stats must be identical.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
from typing import Any

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")

import vllm.v1.core.kv_cache_coordinator as vllm_coordinators
import vllm_harness as h
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
from vllm.v1.core.sched.async_scheduler import AsyncScheduler as VllmAsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
from vllm.v1.request import Request, RequestStatus

import kvcore.vllm
from kvcore.errors import InvalidConfigError


def _reset_when_idle(sched: Any, step: int) -> None:
    """Calls ``reset_prefix_cache()`` whenever nothing runs (it refuses while blocks are held)."""
    if not sched.running:
        sched.reset_prefix_cache()


CASES: dict[str, dict[str, Any]] = {
    "full": {},
    "full-no-caching": {"caching": False},
    "full-preemption": {"num_blocks": 60},
    "full-chunked-small-budget": {"max_num_batched_tokens": 64},
    "full-block-32": {"block_size": 32, "num_blocks": 100},
    "full-spec-decode": {"num_spec_tokens": 3},
    "full-async": {"async_scheduling": True},
    "full-async-preemption": {"async_scheduling": True, "num_blocks": 60},
    "swa": {"model": "swa"},
    "swa-no-caching": {"model": "swa", "caching": False},
    "swa-preemption": {"model": "swa", "num_blocks": 80},
    "swa-spec-decode": {"model": "swa", "num_spec_tokens": 2},
    "mamba": {"model": "mamba"},
    "mamba-align": {"model": "mamba", "mamba_mode": "align"},
    "mamba-all": {"model": "mamba", "mamba_mode": "all"},
    "connector": {"connector": True},
    "connector-preemption": {"connector": True, "num_blocks": 80},
    "connector-async-deferred-frees": {"connector": True, "async_scheduling": True},
    "connector-swa": {"connector": True, "model": "swa", "num_blocks": 120},
    "full-metrics": {"metrics_sample": 0.5, "num_blocks": 80},
    "swa-metrics": {"model": "swa", "metrics_sample": 1.0, "num_blocks": 100},
    # vLLM's Mamba + connector path asks the coordinator itself for per-group hits.
    "connector-mamba": {"connector": True, "model": "mamba"},
    "connector-mamba-align": {"connector": True, "model": "mamba", "mamba_mode": "align"},
}


class Probe:
    """Counts, per run, what the connector cases must exercise."""

    def __init__(self) -> None:
        self.remote_waits = 0
        self.inflight_prefills = 0
        self.deferred_frees = 0
        self.wrapped = False

    def __call__(self, sched: Any, step: int) -> None:
        _reset_when_idle(sched, step)
        if not self.wrapped:
            self.wrapped = True
            free = sched._free_request_blocks

            def counting(request: Any) -> None:
                before = len(sched.deferred_frees)
                free(request)
                self.deferred_frees += len(sched.deferred_frees) > before

            sched._free_request_blocks = counting
        waiting = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.remote_waits += sum(r.status == waiting for r in sched.requests.values())
        self.inflight_prefills += len(sched._inflight_prefills)


@pytest.mark.reference
@pytest.mark.parametrize("case", sorted(CASES))
def test_scheduler_outputs_identical(case: str) -> None:
    """Every step's output, the event bytes and the stats match vLLM's own manager."""
    setup = h.Setup(**CASES[case])
    workload = h.Workload(seed=sum(map(ord, case)))
    if setup.async_scheduling:
        ref_cls, kv_cls = VllmAsyncScheduler, kvcore.vllm.AsyncScheduler
    else:
        ref_cls, kv_cls = VllmScheduler, kvcore.vllm.Scheduler
    ref_probe, our_probe = Probe(), Probe()
    ref = h.run(ref_cls, setup, workload, on_step=ref_probe)
    # kvcore's scheduler with the requests its engine builds (kvcore.vllm.Request, read from
    # its slots), and with vLLM's own (read from their instance dicts).
    ours = h.run(kv_cls, setup, workload, on_step=our_probe)
    plain_probe = Probe()
    plain = h.run(kv_cls, setup, workload, on_step=plain_probe, request_cls=Request)
    for name in ("steps", "outputs", "events", "stats", "metrics"):
        assert getattr(plain, name) == getattr(ours, name), f"{case}: {name} differ"
    assert vars(plain_probe) == vars(our_probe)
    assert ours.steps == ref.steps
    for step, (a, b) in enumerate(zip(ref.outputs, ours.outputs, strict=True)):
        assert b == a, f"{case}: SchedulerOutput differs at step {step}"
    assert ours.events == ref.events
    assert ours.stats == ref.stats
    # The metrics collector saw the same blocks (sampled, evicted) as vLLM's pool feeds it.
    assert ours.metrics == ref.metrics
    if setup.metrics_sample:
        assert sum(n for n, _ in ref.metrics) > 0, "no eviction event"
    # The workload exercised what the case is about.
    assert any(o["new"] for o in ref.outputs)
    if setup.caching:
        assert sum(s[1]["hits"] for s in ref.stats if s) > 0
        assert any(s[1]["reset"] for s in ref.stats if s), "no reset_prefix_cache succeeded"
        assert ref.events
    if setup.num_blocks <= 80:
        assert any(o["preempted"] for o in ref.outputs), "no preemption happened"
    if setup.num_spec_tokens:
        assert any(o["spec"] for o in ref.outputs)
    assert vars(our_probe) == vars(ref_probe)
    if setup.connector:
        # Async loads (allocated with delay_cache_blocks, reserved while in flight) happened.
        assert ref_probe.remote_waits > 0 and ref_probe.inflight_prefills > 0
        if setup.async_scheduling:
            assert ref_probe.deferred_frees > 0, "no deferred free happened"


@pytest.mark.reference
def test_scheduler_uses_kvcore_manager() -> None:
    """The scheduler class really runs kvcore's manager, whose coordinator answers from it."""
    setup = h.Setup()
    seen: list[Any] = []
    h.run(
        kvcore.vllm.Scheduler,
        setup,
        h.Workload(num_requests=3),
        on_step=lambda s, _: seen.append(s.kv_cache_manager),
    )
    mgr = seen[0]
    assert isinstance(mgr, kvcore.vllm.KVCacheManager)
    # The coordinator's per-request questions are answered from the manager's own state (a
    # request it does not hold needs every block).
    need = mgr.coordinator.get_num_blocks_to_allocate(
        request_id="not-there",
        num_tokens=40,
        new_computed_blocks=mgr.empty_kv_cache_blocks.blocks,
        num_encoder_tokens=0,
        total_computed_tokens=0,
        num_tokens_main_model=40,
        apply_admission_cap=True,
    )
    assert need == 3
    assert mgr.coordinator.block_pool is mgr.block_pool
    assert isinstance(mgr.coordinator, vllm_coordinators.UnitaryKVCacheCoordinator)


@pytest.mark.reference
@pytest.mark.parametrize(
    ("model", "cls"),
    [
        ("swa", "HybridKVCacheCoordinator"),
        ("mamba", "HybridKVCacheCoordinator"),
        ("full", "UnitaryKVCacheCoordinator"),
    ],
)
def test_coordinator_is_vllms_class(model: str, cls: str) -> None:
    """``manager.coordinator`` passes vLLM's isinstance checks and answers from kvcore's state."""
    setup = h.Setup(model=model, caching=True)
    mgr = kvcore.vllm.KVCacheManager(
        h.kv_cache_config(setup),
        max_model_len=2048,
        scheduler_block_size=16,
        hash_block_size=16,
    )
    coordinator = mgr.coordinator
    assert isinstance(coordinator, getattr(vllm_coordinators, cls))
    assert coordinator.block_pool is mgr.block_pool
    if cls == "HybridKVCacheCoordinator":
        blocks, hits = coordinator.find_longest_cache_hit_per_group([], 0)
        assert len(blocks) == len(hits) == 2 and not any(hits)


def _params(fn: Any) -> list[tuple[str, Any, Any]]:
    """Name, kind and default of each parameter. ``self`` counts by name only: a method
    written in Rust (most of kvcore's manager) takes it positionally, as every caller passes it,
    and its signature says so (``self, /``); the bound method's signature is exact."""
    params = list(inspect.signature(fn).parameters.values())
    out: list[tuple[str, Any, Any]] = []
    for i, p in enumerate(params):
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD if i == 0 and p.name == "self" else p.kind
        out.append((p.name, kind, p.default))
    return out


def test_drift_public_methods_match_vllm() -> None:
    """Every public method of vLLM's manager exists on kvcore's with the same parameters.

    Names, kinds and defaults must be identical; annotations name each project's own classes.
    """
    public = [
        n
        for n, _ in inspect.getmembers(VllmKVCacheManager)
        if not n.startswith("_") or n == "__init__"
    ]
    assert "allocate_slots" in public and "__init__" in public
    for name in public:
        ref = getattr(VllmKVCacheManager, name)
        ours = getattr(kvcore.vllm.KVCacheManager, name, None)
        assert ours is not None, f"kvcore.vllm.KVCacheManager has no {name}"
        if isinstance(ref, property):
            assert isinstance(ours, property), name
        elif callable(ref):
            assert _params(ours) == _params(ref), name


@pytest.mark.reference
def test_drift_event_fields_match_vllm() -> None:
    """kvcore builds vLLM's event structs positionally, in the fields' order of its own."""
    from vllm.distributed import kv_events

    from kvcore.events import AllBlocksCleared, BlockRemoved, BlockStored

    classes = kvcore.vllm.KVCacheManager._event_classes
    assert classes == (kv_events.BlockStored, kv_events.BlockRemoved, kv_events.AllBlocksCleared)
    ours: tuple[Any, ...] = (BlockStored, BlockRemoved, AllBlocksCleared)
    for mine, theirs in zip(ours, classes, strict=True):
        assert theirs.__struct_fields__ == mine.__match_args__


def test_vllm_request_is_read_as_a_plain_class() -> None:
    """vLLM's ``Request`` passes the plain-class checks (a dict read is what getattr reads)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    assert (Request, "_all_token_ids") in kvcore.vllm.KVCacheManager._plain_request_classes
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=4), None)
    req.append_output_token_ids([4, 5])
    assert req.num_tokens == len(req._all_token_ids) == 5
    assert list(req.all_token_ids) == req._all_token_ids


def test_instance_attributes_match_vllm() -> None:
    """The attributes vLLM's scheduler and connectors read exist on kvcore's manager."""
    setup = h.Setup(model="swa")
    args: dict[str, Any] = {
        "max_model_len": 2048,
        "scheduler_block_size": 16,
        "hash_block_size": 16,
        "enable_caching": True,
        "log_stats": True,
        "enable_kv_cache_events": True,
    }
    ref, ours = h.manager_pair(setup, **args)
    public = {n for n in vars(ref) if not n.startswith("_")}
    missing = sorted(n for n in public if not hasattr(ours, n))
    assert not missing
    assert type(ours.make_prefix_cache_stats()) is type(ref.make_prefix_cache_stats())


def test_unknown_spec_raises() -> None:
    """What kvcore cannot do raises, never a silent approximation."""

    class BespokeSpec:
        block_size = 16

    with pytest.raises(InvalidConfigError, match="BespokeSpec"):
        kvcore.vllm.convert_spec(BespokeSpec())


def test_kvcore_imports_without_vllm() -> None:
    """``import kvcore`` and its manager never import vLLM."""
    code = (
        "import sys; sys.modules['vllm'] = None\n"
        "import kvcore, kvcore.manager, kvcore.cli\n"
        "assert not any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules if sys.modules[m])\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.reference
def test_events_through_vllm_zmq_publisher(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's own ZMQ publisher sends kvcore's events; a subscriber reads vLLM's bytes."""
    import socket
    import time

    import msgspec
    import zmq
    from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    monkeypatch.setenv("PYTHONHASHSEED", "0")
    init_none_hash(sha256)
    setup = h.Setup(model="swa")
    args: dict[str, Any] = {
        "max_model_len": 2048,
        "scheduler_block_size": 16,
        "hash_block_size": 16,
        "enable_kv_cache_events": True,
    }
    hasher = get_request_block_hasher(16, sha256)

    def events_of(cls: Any) -> list[Any]:
        mgr = cls(h.kv_cache_config(setup), **args)
        for i, n in enumerate((70, 40, 90)):
            req = Request(
                f"r{i}", list(range(n)), SamplingParams(max_tokens=4), None, block_hasher=hasher
            )
            hits, num_hits = mgr.get_computed_blocks(req)
            assert mgr.allocate_slots(req, n - num_hits, num_hits, hits) is not None
            if i == 1:
                mgr.free(req)
        return list(mgr.take_events())

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"tcp://127.0.0.1:{port}"
    ctx: Any = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        publisher = ZmqEventPublisher(data_parallel_rank=0, endpoint=endpoint, topic="kv")
        sub.bind(endpoint)  # vLLM's publisher connects to a non-wildcard endpoint
        ours = events_of(kvcore.vllm.KVCacheManager)
        ref = events_of(VllmKVCacheManager)
        # A PUB socket drops what it sends before the subscription arrives: send until one
        # batch gets through (bounded).
        sub.setsockopt(zmq.RCVTIMEO, 200)
        payload = b""
        for _ in range(50):
            publisher.publish(KVEventBatch(ts=1.0, events=ours))
            try:
                _topic, _seq, payload = sub.recv_multipart()
                break
            except zmq.Again:
                time.sleep(0.1)
    finally:
        publisher.shutdown()
        sub.close(linger=0)
    assert payload, "no batch reached the subscriber"
    received = msgspec.msgpack.decode(payload, type=KVEventBatch)
    expected = KVEventBatch(ts=1.0, events=ref, data_parallel_rank=0)
    assert payload == msgspec.msgpack.encode(expected)
    assert len(received.events) == len(ref) > 0
