"""Differential trace harness: kvcore's ``KVCacheManager`` against the reference's.

A trace is a seeded, scheduler-like sequence of manager calls (admissions with prefix sharing,
chunked prefill, decode with draft tokens, preemption under memory pressure, finishes, async
external loads, prefix-cache resets and evictions).  :class:`TraceDriver` applies every call to
both managers with equal arguments and, after each call, compares:

- the return value (block ids per group, hit token counts, ``None``, booleans, whether the
  shared empty ``KVCacheBlocks`` came back) or the class of the exception raised;
- the queued KV events (reference msgspec structs and kvcore dataclasses as tuples);
- the free-list order (front to back) and ``usage``.

After every scheduler step it also compares every block's ref count and prefix-cache key, the
per-request block tables, ``take_new_block_ids`` and ``get_num_common_prefix_blocks``.

The trace evolves from the reference's answers; the first divergence raises
:class:`Mismatch`, whose message names the configuration, the seed, the call and both values.

Both sides are described by one :class:`TraceConfig`, built into each implementation by
:class:`ReferenceSide` and :class:`KvcoreSide`.  Requests of both sides hash with the same
function and the same ``NONE_HASH`` (``PYTHONHASHSEED`` must be set by the caller, see
``tests/conftest.py``); when ``kvcore.hashing`` is not importable, kvcore's requests are given
the reference's hasher so that the comparison isolates the manager.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CONFIGS",
    "GroupDesc",
    "KvcoreSide",
    "Mismatch",
    "ReferenceSide",
    "TraceConfig",
    "TraceDriver",
    "run_trace",
]


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupDesc:
    """One KV cache group, independent of the implementation.

    Attributes:
        kind: ``full``, ``swa``, ``chunked``, ``mamba``, ``cross`` or ``rswa``.
        block_size: Tokens per block.
        window: Sliding window (swa), chunk size (chunked) or R-SWA window (rswa).
        mamba_mode: ``none``, ``align`` or ``all`` (mamba only).
        num_spec_blocks: Mamba ``num_speculative_blocks``.
        eagle: Whether the group is flagged as an EAGLE group.
    """

    kind: str
    block_size: int = 16
    window: int = 0
    mamba_mode: str = "none"
    num_spec_blocks: int = 0
    eagle: bool = False


@dataclass(frozen=True)
class TraceConfig:
    """A manager configuration plus the features the trace generator may use.

    Attributes:
        name: Test id.
        groups: KV cache groups in group-id order.
        num_blocks: Pool size, null block included.
        max_model_len: Longest sequence.
        scheduler_block_size: Scheduler block size (lcm of the group sizes).
        hash_block_size: Hash granularity.
        max_num_batched_tokens: Token budget per step.
        enable_caching: Prefix caching on/off (off selects the no-prefix-cache coordinator).
        events: KV events on/off.
        watermark: Manager watermark fraction.
        hash_fn: ``sha256_cbor``, ``xxhash`` (or any name both hashing modules know).
        use_eagle: Manager ``use_eagle``.
        lookahead: ``num_lookahead_tokens`` passed on every call; > 0 also schedules drafts.
        external: Use external computed tokens (sync and, with ``delay``, async loads).
        delay: Use ``delay_cache_blocks`` async loads.
        admission_gates: Use ``full_sequence_must_fit`` and ``reserved_blocks``.
        encoder_tokens: ``num_encoder_tokens`` for admissions (cross-attention).
        salt: Give some requests hash extras: a ``cache_salt``, a LoRA adapter, multimodal
            features, or prompt embeddings instead of token ids.
        mamba_align_split: Apply the scheduler's block-aligned split (mamba align mode).
        log_stats: Manager ``log_stats``; prefix-cache stats are compared every step.
        skip_reading: Give some requests ``skip_reading_prefix_cache`` (MGR-6).
        dcp: Decode context-parallel world size.
        pcp: Prefill context-parallel world size.
    """

    name: str
    groups: tuple[GroupDesc, ...]
    num_blocks: int = 48
    max_model_len: int = 512
    scheduler_block_size: int = 16
    hash_block_size: int = 16
    max_num_batched_tokens: int = 128
    enable_caching: bool = True
    events: bool = True
    watermark: float = 0.0
    hash_fn: str = "sha256_cbor"
    use_eagle: bool = False
    lookahead: int = 0
    external: bool = False
    delay: bool = False
    admission_gates: bool = True
    encoder_tokens: int = 0
    salt: bool = True
    mamba_align_split: bool = False
    log_stats: bool = False
    skip_reading: bool = True
    dcp: int = 1
    pcp: int = 1


def _g(kind: str, bs: int = 16, **kw: Any) -> GroupDesc:
    return GroupDesc(kind, bs, **kw)


_F16 = _g("full")
CONFIGS: tuple[TraceConfig, ...] = (
    # Unitary coordinator (one group, caching on).
    TraceConfig("full", (_F16,), external=True, delay=True, lookahead=2, log_stats=True),
    TraceConfig("full-xxhash", (_F16,), hash_fn="xxhash", watermark=0.05),
    TraceConfig("full-noevents", (_F16,), events=False, external=True, lookahead=1),
    TraceConfig("full-eagle", (_F16,), use_eagle=True, lookahead=3),
    TraceConfig(
        "full-bs32-nosalt",
        (_g("full", 32),),
        scheduler_block_size=32,
        hash_block_size=32,
        salt=False,
        num_blocks=40,
    ),
    TraceConfig("swa", (_g("swa", window=48),), external=True, delay=True),
    TraceConfig("chunked", (_g("chunked", window=64),), external=True),
    TraceConfig("rswa", (_g("rswa", window=64),), watermark=0.05, external=True),
    TraceConfig("mamba-none", (_g("mamba"),)),
    TraceConfig("mamba-all", (_g("mamba", mamba_mode="all", num_spec_blocks=1),), lookahead=2),
    TraceConfig("mamba-align", (_g("mamba", mamba_mode="align"),), mamba_align_split=True),
    # No-prefix-cache coordinator (caching off).
    TraceConfig("nocache-full", (_F16,), enable_caching=False, external=True, delay=True),
    TraceConfig("nocache-swa", (_g("swa", window=32),), enable_caching=False),
    TraceConfig("nocache-cross", (_F16, _g("cross")), enable_caching=False, encoder_tokens=40),
    TraceConfig("nocache-full-mamba", (_F16, _g("mamba")), enable_caching=False),
    # Hybrid coordinator.
    TraceConfig(
        "hybrid-full-swa", (_F16, _g("swa", window=32)), external=True, delay=True, num_blocks=96
    ),
    TraceConfig(
        "hybrid-full-swa-eagle",
        (_F16, _g("swa", window=64)),
        use_eagle=True,
        lookahead=2,
        num_blocks=96,
    ),
    TraceConfig("hybrid-full-chunked", (_F16, _g("chunked", window=64)), num_blocks=96),
    TraceConfig(
        "hybrid-full-mamba-all",
        (_F16, _g("mamba", mamba_mode="all")),
        num_blocks=96,
        external=True,
        log_stats=True,
    ),
    TraceConfig(
        "hybrid-full-mamba-align",
        (_F16, _g("mamba", mamba_mode="align")),
        num_blocks=96,
        mamba_align_split=True,
    ),
    TraceConfig(
        "hybrid-full32-swa16",
        (_g("full", 32), _g("swa", 16, window=48)),
        scheduler_block_size=32,
        hash_block_size=16,
        num_blocks=96,
        hash_fn="xxhash",
    ),
    TraceConfig(
        "hybrid-full-full-swa",
        (_F16, _F16, _g("swa", window=32)),
        num_blocks=128,
        log_stats=True,
    ),
    TraceConfig(
        "hybrid-swa32-full16",
        (_g("swa", 32, window=64), _F16),
        scheduler_block_size=32,
        hash_block_size=16,
        num_blocks=96,
        external=True,
    ),
    TraceConfig(
        "hybrid-full-swa-eaglegroup",
        (_F16, _g("swa", window=48, eagle=True)),
        num_blocks=96,
        lookahead=1,
    ),
    TraceConfig(
        "hybrid-full-mamba-all-eagle",
        (_F16, _g("mamba", mamba_mode="all", num_spec_blocks=2)),
        use_eagle=True,
        lookahead=2,
        num_blocks=96,
    ),
    TraceConfig(
        "mamba-align-spec",
        (_g("mamba", mamba_mode="align", num_spec_blocks=1),),
        lookahead=1,
        mamba_align_split=True,
    ),
    TraceConfig(
        "hybrid-full-full-swa-mamba-eagle",
        (_F16, _F16, _g("swa", window=48), _g("mamba", mamba_mode="all", num_spec_blocks=1)),
        use_eagle=True,
        lookahead=2,
        num_blocks=160,
    ),
    TraceConfig(
        "hybrid-full-full-swa32-mamba32-eagle",
        (_F16, _F16, _g("swa", 32, window=64), _g("mamba", 32)),
        use_eagle=True,
        scheduler_block_size=32,
        hash_block_size=16,
        lookahead=2,
        num_blocks=160,
    ),
    TraceConfig(
        "hybrid-full16-full32-swa-mamba-eagle",
        (_F16, _g("full", 32), _g("swa", window=48), _g("mamba", 32, mamba_mode="none")),
        use_eagle=True,
        scheduler_block_size=32,
        hash_block_size=16,
        lookahead=1,
        num_blocks=160,
    ),
    TraceConfig(
        "hybrid-full-swa-swa",
        (_F16, _g("swa", window=32), _g("swa", window=96)),
        num_blocks=128,
        watermark=0.05,
    ),
)


def _context_parallel(cfg: TraceConfig, dcp: int, pcp: int) -> TraceConfig:
    """``cfg`` under context parallelism: the scheduler's and hash block size grow by
    ``dcp * pcp`` (the reference's single-group rule, ``resolve_kv_cache_block_sizes``)."""
    k = dcp * pcp
    suffix = f"dcp{dcp}" if pcp == 1 else f"pcp{pcp}"
    return dataclasses.replace(
        cfg,
        name=f"{cfg.name}-{suffix}",
        dcp=dcp,
        pcp=pcp,
        scheduler_block_size=cfg.scheduler_block_size * k,
        hash_block_size=cfg.hash_block_size * k,
    )


#: Every single-group configuration (context parallelism is single-group only in the reference)
#: with ``dcp_world_size`` 2 and 4 and ``pcp_world_size`` 2.
CP_CONFIGS: tuple[TraceConfig, ...] = tuple(
    _context_parallel(c, dcp, pcp)
    for c in CONFIGS
    if len(c.groups) == 1
    for dcp, pcp in ((2, 1), (4, 1), (1, 2))
)


# --------------------------------------------------------------------------------------------
# Implementation sides
# --------------------------------------------------------------------------------------------


_EVENT_FIELDS = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}
"""Event fields in declaration order (SPEC EVT-1)."""


def _event_tuple(ev: Any) -> tuple[Any, ...]:
    """A comparable tuple of an event: class name, then its EVT-1 fields in order."""
    name = type(ev).__name__
    return (name, *(getattr(ev, f) for f in _EVENT_FIELDS[name]))


@dataclass
class ReqSpec:
    """Everything a request is built from; both sides get the very same objects.

    Attributes:
        rid: Request id.
        prompt: Prompt token ids (all zeros when ``embeds`` is set).
        max_tokens: Output tokens before the trace finishes it.
        salt: ``cache_salt``.
        skip: ``skip_reading_prefix_cache``.
        lora: A reference ``LoRARequest`` (duck-typed by kvcore), or None.
        mm: Reference ``MultiModalFeatureSpec`` objects, or None.
        embeds: A float32 tensor of one row per prompt token, or None.
    """

    rid: str
    prompt: list[int]
    max_tokens: int
    salt: str | None = None
    skip: bool = False
    lora: Any = None
    mm: list[Any] | None = None
    embeds: Any = None


class _Side:
    """What the driver needs from one implementation."""

    name = "?"
    manager: Any
    status: Any

    def make_request(self, spec: ReqSpec) -> Any:
        raise NotImplementedError

    def free_ids(self) -> list[int]:
        raise NotImplementedError

    def ref_cnts(self) -> list[int]:
        raise NotImplementedError

    def block_keys(self) -> list[bytes | None]:
        raise NotImplementedError

    def free_popped(self, popped: Any) -> None:
        raise NotImplementedError

    @staticmethod
    def ids(blocks: Any) -> list[int]:
        raise NotImplementedError

    def events(self) -> list[tuple[Any, ...]]:
        return [_event_tuple(e) for e in self.manager.take_events()]


def _build_config(cfg: TraceConfig, specs_mod: Any, config_mod: Any, dtype: Any) -> Any:
    groups = []
    for i, g in enumerate(cfg.groups):
        common = {"num_kv_heads": 1, "head_size": 8, "dtype": dtype}
        bs = g.block_size
        spec: Any
        if g.kind == "full":
            spec = specs_mod.FullAttentionSpec(bs, **common)
        elif g.kind == "swa":
            spec = specs_mod.SlidingWindowSpec(bs, sliding_window=g.window, **common)
        elif g.kind == "chunked":
            spec = specs_mod.ChunkedLocalAttentionSpec(bs, attention_chunk_size=g.window, **common)
        elif g.kind == "rswa":
            spec = specs_mod.RSWASpec(bs, rswa_window=g.window, **common)
        elif g.kind == "cross":
            spec = specs_mod.CrossAttentionSpec(bs, **common)
        elif g.kind == "mamba":
            spec = specs_mod.MambaSpec(
                bs,
                shapes=((4,),),
                dtypes=(dtype,),
                mamba_cache_mode=g.mamba_mode,
                num_speculative_blocks=g.num_spec_blocks,
            )
        else:
            raise ValueError(g.kind)
        groups.append(config_mod.KVCacheGroupSpec([f"layer{i}"], spec, is_eagle_group=g.eagle))
    return config_mod.KVCacheConfig(cfg.num_blocks, [], groups)


def _manager_kwargs(cfg: TraceConfig) -> dict[str, Any]:
    return {
        "max_model_len": cfg.max_model_len,
        "scheduler_block_size": cfg.scheduler_block_size,
        "hash_block_size": cfg.hash_block_size,
        "max_num_batched_tokens": cfg.max_num_batched_tokens,
        "enable_caching": cfg.enable_caching,
        "use_eagle": cfg.use_eagle,
        "enable_kv_cache_events": cfg.events,
        "watermark": cfg.watermark,
        "log_stats": cfg.log_stats,
        "dcp_world_size": cfg.dcp,
        "pcp_world_size": cfg.pcp,
    }


def reference_hasher(cfg: TraceConfig) -> Any:
    """The reference's request block hasher for ``cfg``, with its ``NONE_HASH`` initialised."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    fn = get_hash_fn_by_name(cfg.hash_fn)
    init_none_hash(fn)
    hasher: Any = get_request_block_hasher(cfg.hash_block_size, fn)
    return hasher


class ReferenceSide(_Side):
    """The reference (vLLM 0.25.1) manager and requests."""

    name = "reference"

    def __init__(self, cfg: TraceConfig) -> None:
        import torch
        from vllm.sampling_params import SamplingParams
        from vllm.v1 import kv_cache_interface as kvi
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.request import Request, RequestStatus

        self._request_cls = Request
        self._sampling_params = SamplingParams
        self.status = RequestStatus
        self.hasher = reference_hasher(cfg)
        self.manager = KVCacheManager(
            _build_config(cfg, kvi, kvi, torch.float16), **_manager_kwargs(cfg)
        )
        self._n = cfg.num_blocks

    def make_request(self, spec: ReqSpec) -> Any:
        sp = self._sampling_params(
            max_tokens=spec.max_tokens, skip_reading_prefix_cache=spec.skip or None
        )
        return self._request_cls(
            spec.rid,
            None if spec.embeds is not None else list(spec.prompt),
            sp,
            None,
            prompt_embeds=spec.embeds,
            mm_features=spec.mm,
            lora_request=spec.lora,
            cache_salt=spec.salt,
            block_hasher=self.hasher,
        )

    def free_ids(self) -> list[int]:
        q = self.manager.block_pool.free_block_queue
        return [b.block_id for b in q.get_all_free_blocks()]

    def ref_cnts(self) -> list[int]:
        return [b.ref_cnt for b in self.manager.block_pool.blocks]

    def block_keys(self) -> list[bytes | None]:
        return [b.block_hash for b in self.manager.block_pool.blocks]

    def free_popped(self, popped: Any) -> None:
        self.manager.block_pool.free_blocks(reversed(popped))

    @staticmethod
    def ids(blocks: Any) -> list[int]:
        return [b.block_id for b in blocks]


def kvcore_hasher(cfg: TraceConfig) -> tuple[Any, str]:
    """kvcore's request block hasher for ``cfg`` and where it came from.

    Falls back to the reference's hasher while ``kvcore.hashing`` is not available.
    """
    try:
        from kvcore import hashing
    except ImportError:
        return reference_hasher(cfg), "reference"
    fn = hashing.get_hash_fn_by_name(cfg.hash_fn)
    hashing.init_none_hash(fn)
    hasher: Any = hashing.get_request_block_hasher(cfg.hash_block_size, fn)
    return hasher, "kvcore"


class KvcoreSide(_Side):
    """kvcore's manager and requests (a block is its int id)."""

    name = "kvcore"

    def __init__(self, cfg: TraceConfig) -> None:
        from kvcore import config as kconfig
        from kvcore import specs as kspecs
        from kvcore.manager import KVCacheManager
        from kvcore.request import Request, RequestStatus

        self._request_cls = Request
        self.status = RequestStatus
        self.hasher, self.hasher_origin = kvcore_hasher(cfg)
        self.manager = KVCacheManager(
            _build_config(cfg, kspecs, kconfig, "float16"), **_manager_kwargs(cfg)
        )
        self._all = list(range(cfg.num_blocks))

    def make_request(self, spec: ReqSpec) -> Any:
        return self._request_cls(
            spec.rid,
            None if spec.embeds is not None else list(spec.prompt),
            prompt_embeds=spec.embeds,
            mm_features=spec.mm,
            lora_request=spec.lora,
            cache_salt=spec.salt,
            max_tokens=spec.max_tokens,
            block_hasher=self.hasher,
            skip_reading_prefix_cache=spec.skip or None,
        )

    def free_ids(self) -> list[int]:
        return list(self.manager.block_pool.get_all_free_block_ids())

    def ref_cnts(self) -> list[int]:
        return list(self.manager.block_pool.get_ref_cnts(self._all))

    def block_keys(self) -> list[bytes | None]:
        return list(self.manager.block_pool.get_block_hashes(self._all))

    def free_popped(self, popped: Any) -> None:
        self.manager.block_pool.free_blocks(list(reversed(popped)))

    @staticmethod
    def ids(blocks: Any) -> list[int]:
        return [int(b) for b in blocks]


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------


class Mismatch(AssertionError):
    """The two implementations disagreed."""


_OBSERVERS = (
    "get_num_common_prefix_blocks",
    "get_block_ids_for_computed_tokens",
    "take_new_block_ids",
    "make_prefix_cache_stats",
    "new_step_starts",
)
"""Calls that do not count towards a trace's length."""


class BothRaised(Exception):
    """Both implementations raised the same exception class; the trace cannot go on."""


_STAT_FIELDS = (
    "reset",
    "requests",
    "queries",
    "hits",
    "preempted_requests",
    "preempted_queries",
    "preempted_hits",
)


def _stats_tuple(side: Any, stats: Any) -> tuple[Any, ...] | None:
    return None if stats is None else tuple(getattr(stats, f) for f in _STAT_FIELDS)


@dataclass
class _Outcome:
    value: Any = None
    exc: BaseException | None = None


@dataclass
class _Req:
    """One request as seen by the trace: a pair of request objects plus scheduler state."""

    rid: str
    ref: Any
    kv: Any
    max_out: int
    enc: int = 0
    out: int = 0
    spec_k: int = 0
    ready_at: int = -1
    reqs: tuple[Any, Any] = field(init=False)

    def __post_init__(self) -> None:
        self.reqs = (self.ref, self.kv)

    @property
    def num_tokens(self) -> int:
        n: int = self.ref.num_tokens
        return n

    @property
    def computed(self) -> int:
        n: int = self.ref.num_computed_tokens
        return n

    @computed.setter
    def computed(self, value: int) -> None:
        for r in self.reqs:
            r.num_computed_tokens = value

    def set_status(self, name: str, sides: tuple[_Side, _Side]) -> None:
        for r, s in zip(self.reqs, sides, strict=True):
            r.status = getattr(s.status, name)

    def status_is(self, name: str, side: _Side) -> bool:
        ok: bool = self.ref.status == getattr(side.status, name)
        return ok

    def append(self, tokens: list[int]) -> None:
        for r in self.reqs:
            r.append_output_token_ids(list(tokens))
        self.out += len(tokens)


class TraceDriver:
    """Applies calls to both managers and compares everything observable after each call.

    Args:
        cfg: The configuration.
        seed: Trace seed.
        kv_side: Optional factory for the second side (tests of the harness itself pass a
            second ``ReferenceSide``).
    """

    def __init__(
        self,
        cfg: TraceConfig,
        seed: int,
        kv_side: Callable[[TraceConfig], _Side] | None = None,
    ) -> None:
        self.cfg = cfg
        self.seed = seed
        self.rng = random.Random(f"{cfg.name}/{seed}")
        self.ref = ReferenceSide(cfg)
        self.kv: _Side = (kv_side or KvcoreSide)(cfg)
        self.sides = (self.ref, self.kv)
        self.ncalls = 0
        self.nops = 0
        self.log: deque[str] = deque(maxlen=12)
        self.counts: dict[str, int] = {}
        self.both_raised: str | None = None

    # -- comparison ---------------------------------------------------------------------------

    def fail(self, what: str, ref: Any, kv: Any) -> None:
        """Raise a :class:`Mismatch` with context."""
        recent = "\n    ".join(self.log)
        raise Mismatch(
            f"[{self.cfg.name} seed={self.seed} call#{self.ncalls}] {what}\n"
            f"  reference: {ref!r}\n  kvcore:    {kv!r}\n  recent calls:\n    {recent}"
        )

    def check(self, what: str, ref: Any, kv: Any) -> None:
        """Fail unless ``ref == kv``."""
        if ref != kv:
            self.fail(what, ref, kv)

    def call(
        self,
        desc: str,
        fn: Callable[[_Side, int], Any],
        convert: Callable[[_Side, Any], Any] = lambda s, v: v,
    ) -> Any:
        """Call ``fn(side, index)`` on both sides and compare results, events and pool state.

        Returns:
            The reference's raw result.

        Raises:
            Mismatch: on any difference.
            BothRaised: when both raise the same exception class (the reference's exception
                is its cause); the trace cannot go on.
        """
        self.ncalls += 1
        if not desc.startswith(_OBSERVERS):
            self.nops += 1
        self.log.append(desc)
        name = desc.split("(", 1)[0]
        self.counts[name] = self.counts.get(name, 0) + 1
        outs = []
        for i, side in enumerate(self.sides):
            o = _Outcome()
            try:
                o.value = fn(side, i)
            except Exception as e:
                o.exc = e
            outs.append(o)
        ro, ko = outs
        if ro.exc is not None or ko.exc is not None:
            if ro.exc is None:
                self.fail(f"{desc}: kvcore raised", convert(self.ref, ro.value), ko.exc)
            if ko.exc is None:
                self.fail(f"{desc}: only the reference raised", ro.exc, convert(self.kv, ko.value))
            assert ro.exc is not None and ko.exc is not None
            if not isinstance(ko.exc, type(ro.exc)):
                self.fail(f"{desc}: exception class", ro.exc, ko.exc)
            raise BothRaised(f"{desc}: {ro.exc!r} / {ko.exc!r}") from ro.exc
        self.check(
            f"{desc}: result",
            convert(self.ref, ro.value),
            convert(self.kv, ko.value),
        )
        events = self.ref.events()
        self.check(f"{desc}: events", events, self.kv.events())
        for ev in events:
            self.bump(ev[0])
        self.check(f"{desc}: free queue", self.ref.free_ids(), self.kv.free_ids())
        self.check(f"{desc}: usage", self.ref.manager.usage, self.kv.manager.usage)
        return ro.value

    def bump(self, key: str) -> None:
        """Count a trace feature (for coverage reporting)."""
        self.counts[key] = self.counts.get(key, 0) + 1

    def blocks_result(self, side: _Side, res: Any) -> Any:
        """Comparable form of a ``KVCacheBlocks | None`` result."""
        if res is None:
            return None
        return (
            res.get_block_ids(),
            res is side.manager.empty_kv_cache_blocks,
            res.get_unhashed_block_ids_all_groups(),
        )

    def check_state(self) -> None:
        """Compare ref counts, keys, and the per-request views of live requests."""
        self.check("ref counts", self.ref.ref_cnts(), self.kv.ref_cnts())
        self.check("block keys", self.ref.block_keys(), self.kv.block_keys())

    # -- manager calls ------------------------------------------------------------------------

    def get_computed_blocks(self, r: _Req) -> tuple[Any, int, Any]:
        res: list[Any] = [None, None]

        def fn(s: _Side, i: int) -> Any:
            res[i] = s.manager.get_computed_blocks(r.reqs[i])
            return res[i]

        def conv(s: _Side, v: Any) -> Any:
            return (v[0].get_block_ids(), v[1], v[0] is s.manager.empty_kv_cache_blocks)

        out = self.call(f"get_computed_blocks({r.rid}, n={r.num_tokens})", fn, conv)
        if out[1]:
            self.bump("prefix hits")
        return res[0][0], int(out[1]), res[1][0]

    def allocate(self, r: _Req, num_new: int, hits: int = 0, blocks: Any = None, **kw: Any) -> bool:
        kw.setdefault("num_lookahead_tokens", self.cfg.lookahead)
        desc = (
            f"allocate_slots({r.rid}, new={num_new}, hit={hits}, comp={r.computed}, "
            f"ntok={r.num_tokens}, st={r.ref.status.name}, "
            + ", ".join(f"{k}={v}" for k, v in kw.items() if v)
            + ")"
        )

        def fn(s: _Side, i: int) -> Any:
            return s.manager.allocate_slots(
                r.reqs[i], num_new, hits, None if blocks is None else blocks[i], **kw
            )

        ok = self.call(desc, fn, self.blocks_result) is not None
        if not ok:
            self.bump("allocate_slots=None")
        return ok

    def free(self, r: _Req) -> None:
        self.call(f"free({r.rid})", lambda s, i: s.manager.free(r.reqs[i]))

    def pop_and_free(self, r: _Req) -> None:
        popped: list[Any] = [None, None]

        def fn(s: _Side, i: int) -> Any:
            popped[i] = s.manager.pop_blocks_for_free(r.reqs[i])
            return popped[i]

        self.call(f"pop_blocks_for_free({r.rid})", fn, lambda s, v: s.ids(v))
        self.call(
            f"block_pool.free_blocks(reversed popped {r.rid})",
            lambda s, i: s.free_popped(popped[i]),
        )


# --------------------------------------------------------------------------------------------
# Trace generation
# --------------------------------------------------------------------------------------------

_VOCAB = 30000


class _Workload:
    """Chat-like prompt source: shared system prompts, multi-turn follow-ups, repeats."""

    def __init__(self, rng: random.Random, cfg: TraceConfig) -> None:
        self.rng = rng
        self.cfg = cfg
        bs = cfg.scheduler_block_size
        self.systems = [
            [rng.randrange(1, _VOCAB) for _ in range(n)]
            for n in (bs * 2, bs * 4 + 3, rng.randrange(8, 120))
        ]
        self.history: list[list[int]] = []

    def prompt(self) -> list[int]:
        rng, limit = self.rng, self.cfg.max_model_len // 2
        kind = rng.random()
        if kind < 0.4:
            p = rng.choice(self.systems) + self.tokens(rng.randrange(1, 60))
        elif kind < 0.65 and self.history:
            p = rng.choice(self.history) + self.tokens(rng.randrange(1, 40))
        elif kind < 0.8 and self.history:
            p = list(rng.choice(self.history))
        else:
            n = rng.randrange(1, limit)
            if rng.random() < 0.3:
                n = max(self.cfg.scheduler_block_size, n // 16 * 16)
            p = self.tokens(n)
        return p[:limit] if len(p) > limit else p

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(1, _VOCAB) for _ in range(n)]


def _add_extras(rng: random.Random, spec: ReqSpec) -> None:
    """Randomly give a request a salt, a LoRA adapter, images or prompt embeddings."""
    n = len(spec.prompt)
    if rng.random() < 0.08:
        spec.salt = rng.choice(("salt-a", "salt-b"))
    if rng.random() < 0.08:
        from vllm.lora.request import LoRARequest

        name, lora_id = rng.choice((("lora-a", 1), ("lora-b", 2)))
        spec.lora = LoRARequest(name, lora_id, lora_path=f"/nonexistent/{name}")
    if rng.random() < 0.08 and n > 4:
        from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

        feats = []
        offset = rng.randrange(0, n // 2)
        for _ in range(rng.randrange(1, 3)):
            if offset >= n:
                break
            length = min(rng.randrange(4, 40), n - offset)
            ident = rng.choice(("img-1", "img-2", "img-3"))
            feats.append(
                MultiModalFeatureSpec(None, "image", ident, PlaceholderRange(offset, length))
            )
            offset += length + rng.randrange(0, 20)
        spec.mm = feats
    elif rng.random() < 0.04:
        import torch

        g = torch.Generator().manual_seed(rng.randrange(1 << 30))
        spec.embeds = torch.randint(0, 3, (n, 4), generator=g).to(torch.float32)
        spec.prompt = [0] * n


def _mamba_align_split(cfg: TraceConfig, r: _Req, num_new: int, computed: int, budget: int) -> int:
    """The scheduler's block-aligned prefill split for Mamba align mode."""
    if computed < max(r.ref.num_prompt_tokens, r.num_tokens - 1):
        bs = cfg.scheduler_block_size
        last = r.num_tokens - r.num_tokens % bs
        if cfg.use_eagle:
            last = max(last - bs, 0)
        after = computed + num_new
        if after < last:
            num_new = num_new // bs * bs
        elif computed < last < after:
            num_new = last - computed
        num_new = min(num_new, budget)
    return num_new


def run_trace(
    cfg: TraceConfig,
    seed: int,
    num_calls: int = 300,
    kv_side: Callable[[TraceConfig], _Side] | None = None,
) -> TraceDriver:
    """Run a seeded trace of about ``num_calls`` state-changing calls, comparing after each.

    Returns:
        The driver (its ``counts`` tell which calls were exercised).

    Raises:
        Mismatch: at the first divergence.
    """
    d = TraceDriver(cfg, seed, kv_side)
    try:
        _run(d, num_calls)
    except BothRaised as e:
        # Both rejected the call with the same exception class: that agrees, but the state
        # after a rejected call is not comparable (the reference asserts midway), so stop.
        d.counts["both raised"] = 1
        d.both_raised = str(e)
    if os.environ.get("KVCORE_DIFFTRACE_VERBOSE"):
        print(cfg.name, seed, d.counts)
    return d


def _cache_blocks(r: _Req, n: int, s: _Side, i: int) -> Any:
    return s.manager.cache_blocks(r.reqs[i], n)


def _common_prefix(rid: str, s: _Side, i: int) -> Any:
    return list(s.manager.get_num_common_prefix_blocks(rid))


def _ids_for_computed(rid: str, n: int, s: _Side, i: int) -> Any:
    return s.manager.get_block_ids_for_computed_tokens(rid, n)


def _evict(ids: set[int], s: _Side, i: int) -> Any:
    return s.manager.evict_blocks(set(ids))


def _run(d: TraceDriver, num_calls: int) -> None:
    cfg = d.cfg
    rng = d.rng
    work = _Workload(rng, cfg)
    waiting: deque[_Req] = deque()
    running: list[_Req] = []
    remote: list[_Req] = []
    reqs_made = 0
    step = 0
    L = cfg.lookahead

    def new_request() -> _Req:
        nonlocal reqs_made
        reqs_made += 1
        rid = f"r{reqs_made}"
        spec = ReqSpec(rid, work.prompt(), rng.choice((1, 3, 8, 24, 64, 128)))
        spec.skip = cfg.skip_reading and rng.random() < 0.05
        if cfg.salt:
            _add_extras(rng, spec)
        pair = [s.make_request(spec) for s in d.sides]
        return _Req(rid, pair[0], pair[1], spec.max_tokens, enc=cfg.encoder_tokens)

    def preempt(v: _Req) -> None:
        d.bump("preemptions")
        d.free(v)
        v.set_status("PREEMPTED", d.sides)
        v.computed = 0
        v.spec_k = 0
        for r in v.reqs:
            r.num_preemptions += 1
        waiting.appendleft(v)

    def finish(r: _Req) -> None:
        if rng.random() < 0.25:
            d.pop_and_free(r)
        else:
            d.free(r)
        r.set_status("FINISHED_STOPPED", d.sides)
        work.history.append(list(r.ref.all_token_ids))
        if len(work.history) > 12:
            work.history.pop(0)

    while d.nops < num_calls:
        step += 1
        d.call("new_step_starts()", lambda s, i: s.manager.new_step_starts())
        for _ in range(rng.choice((0, 0, 1, 1, 2, 3))):
            waiting.append(new_request())

        # Async external loads that finished: cache and move back to waiting.
        for r in [r for r in remote if r.ready_at <= step]:
            remote.remove(r)
            n = r.computed
            d.call(
                f"cache_blocks({r.rid}, {n})",
                functools.partial(_cache_blocks, r, n),
            )
            if r.computed == r.num_tokens:
                r.computed = r.num_tokens - 1
            r.set_status("WAITING", d.sides)
            waiting.appendleft(r)

        budget = cfg.max_num_batched_tokens
        scheduled: list[tuple[_Req, int]] = []
        preempted = False
        idx = 0
        while idx < len(running) and budget > 0:
            r = running[idx]
            num_new = min(r.num_tokens + r.spec_k - r.computed, budget)
            if cfg.mamba_align_split:
                num_new = _mamba_align_split(cfg, r, num_new, r.computed, budget)
            if num_new <= 0:
                idx += 1
                continue
            while True:
                if d.allocate(r, num_new):
                    scheduled.append((r, num_new))
                    budget -= num_new
                    idx += 1
                    break
                victim = running.pop()
                preempted = True
                for j, (q, n) in enumerate(scheduled):
                    if q is victim:
                        budget += n
                        del scheduled[j]
                        break
                preempt(victim)
                if victim is r:
                    break

        while waiting and budget > 0 and not preempted:
            r = waiting[0]
            hits, ncb = 0, None
            if r.computed == 0:
                ref_b, hits, kv_b = d.get_computed_blocks(r)
                ncb = (ref_b, kv_b)
                if hits == 0 and rng.random() < 0.1:
                    ncb = (ref_b.new_empty(), kv_b.new_empty())  # ALLOC-8 identity quirk
            ext, delay = 0, False
            room = r.num_tokens - r.computed - hits - 1
            if cfg.external and r.computed == 0 and room > 0 and rng.random() < 0.35:
                bs = cfg.scheduler_block_size
                ext = rng.randrange(1, room + 1)
                if rng.random() < 0.7 and ext >= bs:
                    ext = ext // bs * bs
                delay = cfg.delay and rng.random() < 0.5
            num_new = 0 if delay else min(r.num_tokens - r.computed - hits - ext, budget)
            if cfg.mamba_align_split and not delay:
                num_new = _mamba_align_split(cfg, r, num_new, r.computed + hits + ext, budget)
            if num_new <= 0 and not delay:
                break
            kw: dict[str, Any] = {
                "num_external_computed_tokens": ext,
                "delay_cache_blocks": delay,
                "num_encoder_tokens": r.enc,
                "has_scheduled_reqs": bool(scheduled),
            }
            if cfg.admission_gates:
                kw["full_sequence_must_fit"] = rng.random() < 0.3
                kw["reserved_blocks"] = rng.choice((0, 0, 0, 1, 3, 8))
            if not d.allocate(r, num_new, hits, ncb, **kw):
                break
            waiting.popleft()
            r.computed = r.computed + hits + ext
            if delay:
                r.set_status("WAITING_FOR_REMOTE_KVS", d.sides)
                r.ready_at = step + rng.randrange(1, 4)
                remote.append(r)
                continue
            r.set_status("RUNNING", d.sides)
            running.append(r)
            scheduled.append((r, num_new))
            budget -= num_new

        for r in running:
            d.call(
                f"get_num_common_prefix_blocks({r.rid})",
                functools.partial(_common_prefix, r.rid),
            )
        d.call("take_new_block_ids()", lambda s, i: list(s.manager.take_new_block_ids()))
        d.call(
            "make_prefix_cache_stats()",
            lambda s, i: s.manager.make_prefix_cache_stats(),
            _stats_tuple,
        )

        # "Run the model": advance, sample, finish.
        for r, n in scheduled:
            r.computed = r.computed + n
            if r.computed < r.num_tokens:
                continue  # a prefill chunk
            accepted = rng.randrange(0, r.computed - r.num_tokens + 1)
            r.computed = r.num_tokens + accepted
            r.append(work.tokens(accepted + 1))
            r.spec_k = rng.randrange(0, L + 1) if L else 0
            if r.out >= r.max_out or r.num_tokens + L + 2 >= cfg.max_model_len:
                running.remove(r)
                finish(r)

        for r in running:
            d.check(
                f"get_block_ids({r.rid})",
                d.ref.manager.get_block_ids(r.rid),
                d.kv.manager.get_block_ids(r.rid),
            )
        if running and rng.random() < 0.2:
            r = rng.choice(running)
            n = r.computed
            d.call(
                f"get_block_ids_for_computed_tokens({r.rid}, {n})",
                functools.partial(_ids_for_computed, r.rid, n),
            )
        if cfg.enable_caching and rng.random() < 0.05:
            ids = {rng.randrange(0, cfg.num_blocks) for _ in range(rng.randrange(1, 6))}
            d.call(
                f"evict_blocks({sorted(ids)})",
                functools.partial(_evict, ids),
            )
        if rng.random() < 0.03:
            d.call("reset_prefix_cache()", lambda s, i: s.manager.reset_prefix_cache())
        d.check_state()

    # Drain: finish everything, then the pool must be back to all-free on both sides.
    for r in running + remote + list(waiting):
        finish(r)
    ok = d.call("final reset_prefix_cache()", lambda s, i: s.manager.reset_prefix_cache())
    assert ok, "harness bug: blocks still held after the drain"
    d.check_state()
