"""Drives vLLM 0.25.1's real scheduler on the CPU with a fake model runner (tests and benches).

A tiny model ``config.json`` is written to a temporary directory (no hub download); the KV cache
configuration is built here and handed to the scheduler directly, so the model's own layers do
not matter. A seeded workload (shared prefixes, varied lengths, staggered arrivals) runs through
``schedule()`` / ``update_from_output()``; the fake runner samples a deterministic token per
request and step. Every step's ``SchedulerOutput`` is reduced to plain data so that two
schedulers (vLLM's manager, kvcore's) can be compared step by step.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import random
import tempfile
import unittest.mock
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    ObservabilityConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import DraftTokenIds, KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

VOCAB = 1000
_MODEL_DIR: Path | None = None


def model_dir() -> Path:
    """A directory holding a tiny Llama ``config.json`` (written once per process)."""
    global _MODEL_DIR
    if _MODEL_DIR is None:
        d = Path(tempfile.mkdtemp(prefix="kvcore-vllm-model-"))
        (d / "config.json").write_text(
            json.dumps(
                {
                    "architectures": ["LlamaForCausalLM"],
                    "model_type": "llama",
                    "hidden_size": 64,
                    "intermediate_size": 128,
                    "num_attention_heads": 4,
                    "num_key_value_heads": 2,
                    "num_hidden_layers": 2,
                    "vocab_size": VOCAB,
                    "max_position_embeddings": 8192,
                    "torch_dtype": "float32",
                    "rms_norm_eps": 1e-5,
                }
            )
        )
        _MODEL_DIR = d
    return _MODEL_DIR


@dataclass
class Setup:
    """One scheduler configuration of the comparison."""

    model: str = "full"  # full | swa | mamba
    block_size: int = 16
    num_blocks: int = 400
    caching: bool = True
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 256
    max_model_len: int = 2048
    events: bool = True
    num_spec_tokens: int = 0
    async_scheduling: bool = False
    log_stats: bool = True
    mamba_mode: str = "none"
    connector: bool = False
    metrics_sample: float = 0.0  # > 0: vLLM's KV cache residency metrics at this sample rate


def kv_cache_config(s: Setup) -> KVCacheConfig:
    """The KV cache groups of the setup's model kind."""
    full = FullAttentionSpec(
        block_size=s.block_size, num_kv_heads=2, head_size=16, dtype=torch.float32
    )
    groups = [KVCacheGroupSpec(["model.layers.0.self_attn"], full)]
    if s.model == "swa":
        swa = SlidingWindowSpec(
            block_size=s.block_size,
            num_kv_heads=2,
            head_size=16,
            dtype=torch.float32,
            sliding_window=4 * s.block_size,
        )
        groups.append(KVCacheGroupSpec(["model.layers.1.self_attn"], swa))
    elif s.model == "mamba":
        mamba = MambaSpec(
            block_size=s.block_size,
            shapes=((4, 8),),
            dtypes=(torch.float32,),
            mamba_cache_mode=s.mamba_mode,
        )
        groups.append(KVCacheGroupSpec(["model.layers.1.mixer"], mamba))
    return KVCacheConfig(num_blocks=s.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def manager_pair(s: Setup, **kwargs: Any) -> tuple[Any, Any]:
    """vLLM's ``KVCacheManager`` and ``kvcore.vllm.KVCacheManager`` over the setup's groups,
    built from the same arguments."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    import kvcore.vllm

    ref = KVCacheManager(kv_cache_config(s), **kwargs)
    return ref, kvcore.vllm.KVCacheManager(kv_cache_config(s), **kwargs)


def vllm_config(s: Setup) -> VllmConfig:
    """A CPU ``VllmConfig`` over the tiny local model."""
    model = ModelConfig(
        model=str(model_dir()),
        tokenizer=None,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=s.max_model_len,
    )
    sched = SchedulerConfig(
        max_num_seqs=s.max_num_seqs,
        max_num_batched_tokens=s.max_num_batched_tokens,
        max_model_len=s.max_model_len,
        is_encoder_decoder=False,
        async_scheduling=s.async_scheduling,
    )
    cache = CacheConfig(
        block_size=s.block_size, enable_prefix_caching=s.caching, mamba_cache_mode=s.mamba_mode
    )
    cache.num_gpu_blocks = s.num_blocks
    spec = (
        SpeculativeConfig(
            method="ngram",
            num_speculative_tokens=s.num_spec_tokens,
            prompt_lookup_max=4,
            prompt_lookup_min=2,
        )
        if s.num_spec_tokens
        else None
    )
    transfer = (
        KVTransferConfig(
            kv_connector="SeededConnector",
            kv_connector_module_path="vllm_test_connector",
            kv_role="kv_both",
        )
        if s.connector
        else None
    )
    events = KVEventsConfig(enable_kv_cache_events=True, publisher="null") if s.events else None
    return VllmConfig(
        model_config=model,
        scheduler_config=sched,
        cache_config=cache,
        device_config=DeviceConfig(device="cpu"),
        speculative_config=spec,
        kv_events_config=events,
        kv_transfer_config=transfer,
        observability_config=ObservabilityConfig(
            kv_cache_metrics=s.metrics_sample > 0,
            kv_cache_metrics_sample=s.metrics_sample or 0.01,
        ),
    )


@dataclass
class Workload:
    """A seeded stream of requests: (arrival step, id, prompt, max_tokens)."""

    seed: int = 0
    num_requests: int = 60
    arrivals: list[tuple[int, str, list[int], int]] = field(default_factory=list)
    aborts: list[tuple[int, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randrange(16, 160))] for _ in range(4)]
        step = 0
        for i in range(self.num_requests):
            step += rng.choice((0, 0, 1, 2, 5))
            if i == self.num_requests // 2:
                step += 300  # a lull: everything drains, so reset_prefix_cache() can succeed
            prompt = list(rng.choice(prefixes)) if rng.random() < 0.7 else []
            prompt += [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 200))]
            self.arrivals.append((step, f"req-{i}", prompt, rng.randrange(1, 80)))
            if rng.random() < 0.1:  # the client goes away mid-flight
                self.aborts.append((step + rng.randrange(1, 30), f"req-{i}"))
        self.aborts.sort()


class CapturingPublisher:
    """Stands in for vLLM's event publisher: encodes each batch's events as its ZMQ thread would.

    vLLM's ``ZmqEventPublisher`` encodes a ``KVEventBatch`` with ``msgspec.msgpack``; the batch's
    ``ts`` differs between runs, so the events list is encoded alone.
    """

    def __init__(self) -> None:
        self.encoder = msgspec.msgpack.Encoder()
        self.payloads: list[bytes] = []

    def publish(self, batch: Any) -> None:
        self.payloads.append(self.encoder.encode(batch.events))

    def shutdown(self) -> None:
        pass


def plain_output(out: Any) -> dict[str, Any]:
    """A ``SchedulerOutput`` as plain, comparable data."""
    cached = out.scheduled_cached_reqs
    return {
        "new": [
            (r.req_id, r.prompt_token_ids, r.block_ids, r.num_computed_tokens)
            for r in out.scheduled_new_reqs
        ],
        "cached": (
            list(cached.req_ids),
            sorted(cached.resumed_req_ids),
            [list(t) for t in cached.new_token_ids],
            {k: list(v) for k, v in cached.all_token_ids.items()},
            [None if b is None else tuple(list(g) for g in b) for b in cached.new_block_ids],
            list(cached.num_computed_tokens),
            list(cached.num_output_tokens),
        ),
        "num_scheduled_tokens": dict(out.num_scheduled_tokens),
        "total": out.total_num_scheduled_tokens,
        "spec": {k: list(v) for k, v in out.scheduled_spec_decode_tokens.items()},
        "common_prefix": list(out.num_common_prefix_blocks),
        "finished": sorted(out.finished_req_ids),
        "preempted": sorted(out.preempted_req_ids or ()),
        "zero": out.new_block_ids_to_zero,
    }


@dataclass
class Trace:
    """What one run produced."""

    outputs: list[dict[str, Any]] = field(default_factory=list)
    events: list[bytes] = field(default_factory=list)
    stats: list[Any] = field(default_factory=list)
    metrics: list[Any] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    steps: int = 0


def _token(seed: int, req_id: str, n: int) -> int:
    return random.Random(f"{seed}:{req_id}:{n}").randrange(VOCAB)


def run(
    scheduler_cls: type,
    s: Setup,
    w: Workload,
    max_steps: int = 3000,
    on_step: Callable[[Any, int], None] | None = None,
    request_cls: type | None = None,
) -> Trace:
    """Runs the workload through a scheduler of ``scheduler_cls`` to completion, its requests
    of ``request_cls``: by default what the engine builds with that scheduler (kvcore's
    scheduler: ``kvcore.vllm.Request``, as its engine plugin arranges; vLLM's: vLLM's
    ``Request``)."""
    cfg = vllm_config(s)
    random.seed(w.seed)  # vLLM's metrics collector samples blocks with the global generator
    # A fixed seed makes NONE_HASH, and so every block hash, the same in both runs.
    with unittest.mock.patch.dict(os.environ, {"PYTHONHASHSEED": "0"}):
        init_none_hash(sha256)
    # kvcore's scheduler runs with kvcore's native hasher for vLLM requests, as its engine
    # plugin arranges; vLLM's with vLLM's.
    if scheduler_cls.__module__.startswith("kvcore."):
        from kvcore.vllm import Request as KvcoreVllmRequest
        from kvcore.vllm import get_request_block_hasher as kvcore_hasher

        hasher = kvcore_hasher(s.block_size, sha256)
        request_cls = request_cls or KvcoreVllmRequest
    else:
        hasher = get_request_block_hasher(s.block_size, sha256)
    make_request = request_cls or Request
    sched = scheduler_cls(
        vllm_config=cfg,
        kv_cache_config=kv_cache_config(s),
        structured_output_manager=StructuredOutputManager(cfg),
        block_size=s.block_size,
        log_stats=s.log_stats,
    )
    publisher = CapturingPublisher()
    sched.kv_event_publisher = publisher
    trace = Trace()
    pending = list(w.arrivals)
    aborts = list(w.aborts)
    in_flight: collections.deque[tuple[Any, ModelRunnerOutput]] = collections.deque()

    def process(out: Any, mro: ModelRunnerOutput) -> None:
        """Hands one step's model output back to the scheduler."""
        if sched.connector is not None:
            recving, sending = sched.connector.advance()
            mro.kv_connector_output = KVConnectorOutput(
                finished_sending=sending or None, finished_recving=recving or None
            )
        engine_outputs = sched.update_from_output(out, mro)
        if s.num_spec_tokens:
            ids = [r for r in mro.req_ids if r in sched.requests]
            drafts = [
                [
                    _token(w.seed + 1, r, sched.requests[r].num_tokens + k)
                    for k in range(s.num_spec_tokens)
                ]
                for r in ids
            ]
            sched.update_draft_token_ids(DraftTokenIds(ids, drafts))
        # The scheduler hands its manager's prefix-cache stats to the engine once per step.
        for eco in engine_outputs.values():
            stats = eco.scheduler_stats and eco.scheduler_stats.prefix_cache_stats
            if stats is not None:
                trace.stats.append((type(stats).__module__, dataclasses.asdict(stats)))
            evictions = eco.scheduler_stats and eco.scheduler_stats.kv_cache_eviction_events
            if sched.kv_metrics_collector is not None:
                trace.metrics.append(
                    (len(evictions or ()), sorted(sched.kv_metrics_collector.block_metrics))
                )

    step = 0
    while step < max_steps:
        while pending and pending[0][0] <= step:
            _, rid, prompt, max_tokens = pending.pop(0)
            sched.add_request(
                make_request(
                    rid,
                    prompt,
                    SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                    None,
                    block_hasher=hasher,
                )
            )
        while aborts and aborts[0][0] <= step:
            rid = aborts.pop(0)[1]
            if rid in sched.requests:
                sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
        if not pending and not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        trace.outputs.append(plain_output(out))
        req_ids = list(out.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for rid in req_ids:
            req = sched.requests[rid]
            spec = out.scheduled_spec_decode_tokens.get(rid, [])
            # schedule() has advanced num_computed_tokens: a request still short of its
            # tokens is mid-prefill and samples nothing.
            if req.num_computed_tokens < req.num_tokens:
                sampled.append([])
                continue
            n = req.num_output_tokens
            # Accept a seeded prefix of the drafts, then one sampled token.
            accepted = [t for t in spec[: _token(w.seed, rid, -n) % (len(spec) + 1)] if t >= 0]
            sampled.append([*accepted, _token(w.seed, rid, n)])
        mro = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )
        # With async scheduling the engine schedules step N+1 before step N's output is
        # back (two batches in flight); the synchronous scheduler waits for each output.
        in_flight.append((out, mro))
        while len(in_flight) >= (2 if s.async_scheduling else 1):
            process(*in_flight.popleft())
        if on_step is not None:
            on_step(sched, step)
        step += 1
    while in_flight:
        process(*in_flight.popleft())
    trace.steps = step
    trace.events = publisher.payloads
    return trace
