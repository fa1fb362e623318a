"""Specs, configuration and requests as pure data (SPEC §16, §17, §7)."""

from __future__ import annotations

import dataclasses
import hashlib
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

from kvcore.blocks import KVCacheBlocks
from kvcore.config import KVCacheConfig, KVCacheGroupSpec, resolve_kv_cache_block_sizes
from kvcore.errors import InvalidArgumentError, InvalidConfigError, InvariantViolationError
from kvcore.request import Request, RequestStatus
from kvcore.single_type import (
    ChunkedLocalAttentionManager,
    CrossAttentionManager,
    FullAttentionManager,
    MambaManager,
    RSWAManager,
    SinkFullAttentionManager,
    SlidingWindowManager,
    get_manager_class,
)
from kvcore.specs import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    HiddenStateCacheSpec,
    KVCacheSpec,
    KVCacheSpecKind,
    MambaSpec,
    MLAAttentionSpec,
    RSWASpec,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    TQFullAttentionSpec,
    UniformTypeKVCacheSpecs,
    dtype_size,
    get_kv_cache_spec_kind,
    get_kv_cache_spec_sliding_window,
)

ATTN: dict[str, Any] = {"block_size": 16, "num_kv_heads": 2, "head_size": 64, "dtype": "float16"}


def full(**kw: Any) -> FullAttentionSpec:
    return FullAttentionSpec(**{**ATTN, **kw})


ALL_SPECS: list[KVCacheSpec] = [
    full(),
    TQFullAttentionSpec(**ATTN, tq_slot_size=8),
    MLAAttentionSpec(**ATTN),
    HiddenStateCacheSpec(**ATTN),
    RSWASpec(**ATTN, rswa_window=64),
    SinkFullAttentionSpec(**ATTN, sink_len=32),
    SlidingWindowSpec(**ATTN, sliding_window=32),
    SlidingWindowMLASpec(**ATTN, sliding_window=32),
    ChunkedLocalAttentionSpec(**ATTN, attention_chunk_size=64),
    MambaSpec(16, ((2, 3),), ("float32",), mamba_cache_mode="align"),
    CrossAttentionSpec(**ATTN),
    EncoderOnlyAttentionSpec(**ATTN),
]


def test_spec_1_manager_class_along_hierarchy() -> None:
    """SPEC-1: each spec class maps to its manager; subclasses resolve along the MRO."""
    expected = [
        FullAttentionManager,
        FullAttentionManager,
        FullAttentionManager,
        FullAttentionManager,
        RSWAManager,
        SinkFullAttentionManager,
        SlidingWindowManager,
        SlidingWindowManager,
        ChunkedLocalAttentionManager,
        MambaManager,
        CrossAttentionManager,
    ]
    for spec, cls in zip(ALL_SPECS, expected, strict=False):
        assert get_manager_class(spec) is cls, type(spec).__name__

    @dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
    class CustomFull(FullAttentionSpec):
        extra: int = 0

    assert get_manager_class(CustomFull(**ATTN)) is FullAttentionManager


@pytest.mark.parametrize(
    "spec",
    [
        EncoderOnlyAttentionSpec(**ATTN),
        UniformTypeKVCacheSpecs(16, {"a": full()}),
        KVCacheSpec(16),
    ],
)
def test_spec_1_no_manager_raises_assertion(spec: KVCacheSpec) -> None:
    """SPEC-1: EncoderOnly, UniformType and unknown specs have no manager (AssertionError)."""
    with pytest.raises(AssertionError):
        get_manager_class(spec)
    with pytest.raises(InvalidConfigError):
        get_manager_class(spec)


def test_spec_2_equality_is_class_and_every_field() -> None:
    """SPEC-2: equal iff same class and equal fields; TQ never equals Full."""
    assert full() == full()
    assert hash(full()) == hash(full())
    assert full() != full(head_size=128)
    assert full() != full(dtype="bfloat16")
    assert full() != TQFullAttentionSpec(**ATTN)
    assert TQFullAttentionSpec(**ATTN) == TQFullAttentionSpec(**ATTN)
    assert SlidingWindowSpec(**ATTN, sliding_window=32) != SlidingWindowSpec(
        **ATTN,
        sliding_window=64,
    )
    assert full().head_size_v == 64
    assert full(head_size_v=32).head_size_v == 32


def test_spec_2_frozen_and_slotted() -> None:
    """SPEC-2: specs are immutable values."""
    spec = full()
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.block_size = 32  # type: ignore[misc]
    assert not hasattr(spec, "__dict__")


def test_spec_2_class_hierarchy() -> None:
    """SPEC-2: RSWA and sink are full-attention specs; chunked-local is not."""
    assert isinstance(ALL_SPECS[4], FullAttentionSpec)
    assert isinstance(ALL_SPECS[5], FullAttentionSpec)
    assert not isinstance(ALL_SPECS[8], FullAttentionSpec)
    assert isinstance(ALL_SPECS[7], SlidingWindowSpec)


def test_spec_2_kvcore_never_imports_torch() -> None:
    """SPEC-2: importing kvcore (manager layer included) does not import torch."""
    code = "import sys, kvcore, kvcore.manager; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_spec_2_dtype_is_torch_or_str() -> None:
    """SPEC-2: dtype may be a torch dtype (kvcore never imports torch itself)."""
    torch = pytest.importorskip("torch")
    spec = full(dtype=torch.float16)
    assert spec.page_size_bytes == full().page_size_bytes == 16 * 2 * 128 * 2
    assert dtype_size("torch.bfloat16") == 2
    with pytest.raises(ValueError):
        dtype_size("complex1024")


@pytest.mark.parametrize(
    ("spec", "kind", "window"),
    [
        (full(sliding_window=8), "full_attention", None),
        (TQFullAttentionSpec(**ATTN), "full_attention", None),
        (RSWASpec(**ATTN, rswa_window=8), "full_attention", None),
        (MLAAttentionSpec(**ATTN), "mla_attention", None),
        (HiddenStateCacheSpec(**ATTN), "mla_attention", None),
        (SinkFullAttentionSpec(**ATTN, sink_len=16), "sink_full_attention", None),
        (SlidingWindowMLASpec(**ATTN, sliding_window=8), "sliding_window_mla", 8),
        (SlidingWindowSpec(**ATTN, sliding_window=32), "sliding_window", 32),
        (
            ChunkedLocalAttentionSpec(**ATTN, attention_chunk_size=64),
            "chunked_local_attention",
            None,
        ),
        (MambaSpec(16), "mamba", None),
        (EncoderOnlyAttentionSpec(**ATTN), "encoder_only_attention", None),
        (CrossAttentionSpec(**ATTN), "cross_attention", None),
        (KVCacheSpec(16), "unknown", None),
        (
            UniformTypeKVCacheSpecs(
                16,
                {
                    "a": SlidingWindowSpec(**ATTN, sliding_window=32),
                    "b": SlidingWindowSpec(**{**ATTN, "head_size": 32}, sliding_window=32),
                },
            ),
            "sliding_window",
            32,
        ),
        (UniformTypeKVCacheSpecs(16, {"a": full(), "b": MambaSpec(16)}), "unknown", None),
    ],
)
def test_spec_3_kind_and_spec_4_window(spec: KVCacheSpec, kind: str, window: int | None) -> None:
    """SPEC-3 kind strings (most specific first) and SPEC-4 reported windows."""
    assert get_kv_cache_spec_kind(spec) == KVCacheSpecKind(kind)
    assert get_kv_cache_spec_kind(spec).value == kind
    assert get_kv_cache_spec_sliding_window(spec) == window


def test_swa_1_and_cla_1_admission_caps() -> None:
    """SWA-1 and CLA-1 caps."""
    swa = SlidingWindowSpec(**ATTN, sliding_window=32)
    assert swa.max_admission_blocks_per_request(64, 1024) == 7  # cdiv(95, 16) + 1 (TV-S4)
    assert swa.max_admission_blocks_per_request(64, 40) == 4
    cla = ChunkedLocalAttentionSpec(**ATTN, attention_chunk_size=32)
    assert cla.max_admission_blocks_per_request(64, 1024) == 6
    assert cla.max_admission_blocks_per_request(64, 50) == 4


def test_mamba_spec_rejects_unknown_mode() -> None:
    """MambaSpec modes are none/align/all; anything else is a ValueError."""
    with pytest.raises(ValueError):
        MambaSpec(16, mamba_cache_mode="sometimes")
    assert MambaSpec(16, ((4,),), ("float32",)).page_size_bytes == 16


def test_cfg_1_config_fields() -> None:
    """CFG-1: num_blocks, tensors, groups; eagle flag defaults to False."""
    g = KVCacheGroupSpec(["l0"], full())
    cfg = KVCacheConfig(8, [], [g])
    assert cfg.num_blocks == 8 and cfg.kv_cache_groups[0].is_eagle_group is False
    assert not cfg.has_mamba_layers


def test_cfg_2_block_size_resolution() -> None:
    """CFG-2: one group uses bs*dcp*pcp; several use lcm and gcd, with the error cases."""
    one = KVCacheConfig(8, [], [KVCacheGroupSpec(["a"], full())])
    assert resolve_kv_cache_block_sizes(one, 16, dcp_world_size=2) == (32, 32)
    two = KVCacheConfig(
        8,
        [],
        [
            KVCacheGroupSpec(["a"], full(block_size=32)),
            KVCacheGroupSpec(
                ["b"], SlidingWindowSpec(**{**ATTN, "block_size": 48}, sliding_window=8)
            ),
        ],
    )
    assert resolve_kv_cache_block_sizes(two, 16) == (96, 16)
    assert resolve_kv_cache_block_sizes(two, 16, enable_prefix_caching=False) == (96, 96)
    assert resolve_kv_cache_block_sizes(two, 16, hash_block_size=8) == (96, 8)
    with pytest.raises(ValueError):
        resolve_kv_cache_block_sizes(two, 16, hash_block_size=32)
    with pytest.raises(ValueError):
        resolve_kv_cache_block_sizes(two, 16, pcp_world_size=2)
    mamba = KVCacheConfig(
        8,
        [],
        [KVCacheGroupSpec(["a"], full(block_size=32)), KVCacheGroupSpec(["b"], MambaSpec(64))],
    )
    assert resolve_kv_cache_block_sizes(mamba, 32) == (64, 64)


def test_req_3_status_values() -> None:
    """REQ-3: the IntEnum values; above PREEMPTED means finished."""
    assert RequestStatus(1) is RequestStatus.WAITING
    assert RequestStatus(5) is RequestStatus.RUNNING
    assert RequestStatus(6) is RequestStatus.PREEMPTED
    assert RequestStatus(12) is RequestStatus.FINISHED_REPETITION
    assert [s.value for s in RequestStatus] == list(range(1, 13))
    assert not RequestStatus.is_finished(RequestStatus.PREEMPTED)
    assert RequestStatus.is_finished(RequestStatus.FINISHED_STOPPED)
    assert str(RequestStatus.RUNNING) == "RUNNING"


def _counting_hasher(hbs: int) -> tuple[list[int], Callable[[Request], list[bytes]]]:
    calls: list[int] = []

    def hasher(req: Request) -> list[bytes]:
        calls.append(req.num_tokens)
        start = len(req.block_hashes) * hbs
        out = []
        while start + hbs <= req.num_tokens:
            chunk = bytes(str(req.all_token_ids[start : start + hbs]), "ascii")
            out.append(hashlib.sha256(chunk).digest())
            start += hbs
        return out

    return calls, hasher


def test_req_1_req_2_rh_2_request_attributes_and_hasher() -> None:
    """REQ-1/REQ-2 attributes; RH-2 runs the hasher at build and after each append."""
    calls, hasher = _counting_hasher(4)
    r = Request("r", [1, 2, 3, 4, 5], block_hasher=hasher, cache_salt="s")
    assert (r.request_id, r.num_tokens, r.num_prompt_tokens, r.num_computed_tokens) == (
        "r",
        5,
        5,
        0,
    )
    assert r.status is RequestStatus.WAITING and r.num_preemptions == 0
    assert r.skip_reading_prefix_cache is False and r.lora_request is None
    assert r.cache_salt == "s" and r.mm_features == [] and r.prompt_embeds is None
    assert len(r.block_hashes) == 1 and calls == [5]
    r.append_output_token_ids(6)
    r.append_output_token_ids([7, 8, 9])
    assert calls == [5, 6, 9]
    assert r.all_token_ids == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert r.output_token_ids == [6, 7, 8, 9] and r.num_output_tokens == 4
    assert len(r.block_hashes) == 9 // 4


def test_req_2_embeddings_only_prompt() -> None:
    """REQ-2: a request built only from embeddings has all_token_ids = [0]*n."""
    r = Request("e", None, prompt_embeds=[[0.0]] * 3)
    assert r.all_token_ids == [0, 0, 0] and r.num_prompt_tokens == 3
    with pytest.raises(ValueError):
        Request("bad", None)
    with pytest.raises(InvalidArgumentError):
        Request("bad", [1, 2], prompt_embeds=[[0.0]])


def test_mgr_6_skip_reading_prefix_cache_from_params() -> None:
    """MGR-6 input: skip_reading_prefix_cache comes from the sampling/pooling parameters."""

    class Params:
        skip_reading_prefix_cache = True
        max_tokens = 7

    r = Request("p", [1], sampling_params=Params())
    assert r.skip_reading_prefix_cache is True and r.max_tokens == 7
    assert Request("q", [1], skip_reading_prefix_cache=True).skip_reading_prefix_cache


class _HashState:
    null_block = 0

    def __init__(self, hashed: set[int]) -> None:
        self.hashed = hashed

    def get_block_hashes(self, block_ids: list[int]) -> list[bytes | None]:
        return [b"h" if b in self.hashed else None for b in block_ids]


def test_kvb_1_add_and_kvb_2_block_ids() -> None:
    """KVB-1: a + b concatenates per group into lists; KVB-2: tuple of new lists."""
    a = KVCacheBlocks(([1, 2], ()))
    b = KVCacheBlocks(([3], [4]))
    s = a + b
    assert s.blocks == ([1, 2, 3], [4])
    ids = s.get_block_ids()
    assert ids == ([1, 2, 3], [4])
    ids[0].append(99)
    assert s.blocks[0] == [1, 2, 3]
    assert KVCacheBlocks(((), ())).get_block_ids(allow_none=True) is None
    assert KVCacheBlocks(((), ())).get_block_ids() == ([], [])
    assert a.get_block_ids(allow_none=True) == ([1, 2], [])


def test_kvb_3_unhashed_ids() -> None:
    """KVB-3: one-group form keeps the null block; all-groups form drops it."""
    pool = _HashState({2})
    one = KVCacheBlocks(([0, 1, 2, 3],), pool)
    assert one.get_unhashed_block_ids() == [0, 1, 3]
    two = KVCacheBlocks(([0, 1, 2], [2, 5]), pool)
    assert two.get_unhashed_block_ids_all_groups() == [[1], [5]]
    with pytest.raises(AssertionError):
        two.get_unhashed_block_ids()
    with pytest.raises(InvariantViolationError):
        two.get_unhashed_block_ids()
    with pytest.raises(ValueError):
        KVCacheBlocks(([1],)).get_unhashed_block_ids()


def test_kvb_4_new_empty() -> None:
    """KVB-4: one empty tuple per group."""
    assert KVCacheBlocks(([1], [2], [3])).new_empty().blocks == ((), (), ())
