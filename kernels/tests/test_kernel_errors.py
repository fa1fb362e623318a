"""Bad input raises a clear ValueError before any kernel is launched."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import kvcore_kernels as kk
import pytest
import torch
from kvcore_kernels import attention, cache
from kvk_cases import make_batch

F16 = torch.float16


class _NoLaunch:
    """Stands in for a kernel: any launch fails the test."""

    def __getitem__(self, grid: Any) -> Any:
        raise AssertionError(f"kernel launched with grid {grid}")


@pytest.fixture(autouse=True)
def _forbid_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention, "_paged_attention_kernel", _NoLaunch())
    monkeypatch.setattr(attention, "_merge_splits_kernel", _NoLaunch())
    monkeypatch.setattr(cache, "_reshape_and_cache_kernel", _NoLaunch())


def _batch() -> dict[str, Any]:
    b = make_batch(
        ctx_lens=[20, 3],
        q_lens=[2, 1],
        block_size=16,
        num_kv_heads=2,
        num_q_heads=4,
        head_size=64,
        dtype=F16,
    )
    m = b.meta
    return {
        "q": b.q,
        "key_cache": b.key_cache,
        "value_cache": b.value_cache,
        "block_table": m.block_table,
        "seq_lens": m.seq_lens,
        "query_start_loc": m.query_start_loc,
        "scale": 0.125,
    }


def _with(**changes: Callable[[dict[str, Any]], Any]) -> Callable[[], dict[str, Any]]:
    def make() -> dict[str, Any]:
        kw = _batch()
        for key, fn in changes.items():
            kw[key] = fn(kw)
        return kw

    return make


ATTENTION_ERRORS = {
    "q-2d": (_with(q=lambda k: k["q"][:, 0]), "q must be"),
    "q-int": (_with(q=lambda k: k["q"].to(torch.int32)), "q must be float32"),
    "cache-shape-mismatch": (
        _with(value_cache=lambda k: k["value_cache"][:, :8]),
        "differ in shape",
    ),
    "cache-dtype-mismatch": (
        _with(value_cache=lambda k: k["value_cache"].float()),
        "differ in dtype",
    ),
    "cache-vs-q-dtype": (
        _with(
            key_cache=lambda k: k["key_cache"].float(),
            value_cache=lambda k: k["value_cache"].float(),
        ),
        "differs from q dtype",
    ),
    "head-size": (_with(q=lambda k: k["q"][:, :, :32]), "head_size"),
    "heads-dont-divide": (_with(q=lambda k: k["q"][:, :3]), "multiple of num_kv_heads"),
    "block-table-too-short": (
        _with(block_table=lambda k: k["block_table"][:, :1]),
        "needs 2 blocks",
    ),
    "block-id-out-of-range": (
        _with(block_table=lambda k: k["block_table"].index_fill(1, torch.tensor([0]), 999)),
        "not a block id",
    ),
    "block-table-float": (
        _with(block_table=lambda k: k["block_table"].float()),
        "block_table must be int32 or int64",
    ),
    "seq-lens-count": (_with(seq_lens=lambda k: k["seq_lens"][:1]), "num_seqs \\+ 1"),
    "seq-shorter-than-queries": (
        _with(seq_lens=lambda k: torch.tensor([1, 4], dtype=torch.int32)),
        "shorter than its 2 queries",
    ),
    "query-start-loc-total": (
        _with(query_start_loc=lambda k: torch.tensor([0, 2, 2], dtype=torch.int32)),
        "q holds 3 tokens",
    ),
    "query-start-loc-decreasing": (
        _with(query_start_loc=lambda k: torch.tensor([0, 4, 3], dtype=torch.int32)),
        "non-decreasing",
    ),
    "device-mismatch": (_with(seq_lens=lambda k: k["seq_lens"].to("meta")), "is on meta"),
    "alibi-shape": (_with(alibi_slopes=lambda k: torch.ones(3)), "alibi_slopes must be"),
    "sinks-int": (_with(sinks=lambda k: torch.ones(4, dtype=torch.int32)), "floating-point"),
    "window-non-causal": (
        _with(sliding_window=lambda k: 4, causal=lambda k: False),
        "requires causal",
    ),
    "window-zero": (_with(sliding_window=lambda k: 0), "sliding_window must be"),
    "softcap-negative": (_with(softcap=lambda k: -1.0), "softcap"),
    "scale-nan": (_with(scale=lambda k: float("nan")), "scale"),
    "out-dtype": (_with(out=lambda k: torch.empty(k["q"].shape)), "out has dtype"),
    "out-shape": (_with(out=lambda k: k["q"][:1].clone()), "out has shape"),
    "kv-cache-dtype-unknown": (_with(kv_cache_dtype=lambda k: "int4"), "unknown kv_cache_dtype"),
    "kv-cache-dtype-contradicts": (
        _with(kv_cache_dtype=lambda k: "fp8_e4m3"),
        "but kv_cache_dtype",
    ),
    "uint8-cache-without-dtype": (
        _with(
            key_cache=lambda k: torch.zeros(k["key_cache"].shape, dtype=torch.uint8),
            value_cache=lambda k: torch.zeros(k["value_cache"].shape, dtype=torch.uint8),
        ),
        "kv_cache_dtype",
    ),
    "k-scale-two-elements": (
        _with(
            key_cache=lambda k: k["key_cache"].to(torch.float8_e4m3fn),
            value_cache=lambda k: k["value_cache"].to(torch.float8_e4m3fn),
            k_scale=lambda k: torch.ones(2),
        ),
        "k_scale must hold one element",
    ),
    "splits-zero": (_with(num_kv_splits=lambda k: 0), "num_kv_splits"),
    "config-not-power-of-two": (
        _with(config=lambda k: kk.AttentionConfig(block_m=24, tile_n=16)),
        "power of two",
    ),
    "config-too-few-rows": (
        _with(
            q=lambda k: torch.randn(3, 64, 64).to(F16),
            config=lambda k: kk.AttentionConfig(block_m=16, tile_n=16),
        ),
        "query heads per KV head",
    ),
}


@pytest.mark.parametrize("name", list(ATTENTION_ERRORS))
def test_attention_bad_input(name: str) -> None:
    make, match = ATTENTION_ERRORS[name]
    kw = make()
    args = [kw.pop(k) for k in ("q", "key_cache", "value_cache", "block_table", "seq_lens")]
    args.append(kw.pop("query_start_loc"))
    with pytest.raises(ValueError, match=match):
        kk.paged_attention(*args, **kw)


def _cache_args() -> dict[str, Any]:
    return {
        "key": torch.randn(3, 2, 64).to(F16),
        "value": torch.randn(3, 2, 64).to(F16),
        "key_cache": torch.zeros(4, 16, 2, 64, dtype=F16),
        "value_cache": torch.zeros(4, 16, 2, 64, dtype=F16),
        "slot_mapping": torch.tensor([0, 17, -1]),
    }


CACHE_ERRORS: dict[str, tuple[dict[str, Callable[[dict[str, Any]], Any]], str]] = {
    "key-2d": ({"key": lambda a: a["key"][:, 0]}, "key must be"),
    "key-value-shape": ({"value": lambda a: a["value"][:2]}, "differ in shape"),
    "key-value-dtype": ({"value": lambda a: a["value"].float()}, "share a dtype"),
    "heads-vs-cache": (
        {"key": lambda a: a["key"][:, :1], "value": lambda a: a["value"][:, :1]},
        "heads of size",
    ),
    "cache-dtype-vs-key": (
        {
            "key_cache": lambda a: a["key_cache"].float(),
            "value_cache": lambda a: a["value_cache"].float(),
        },
        "differs from key dtype",
    ),
    "caches-differ": ({"value_cache": lambda a: a["value_cache"][:2]}, "differ in shape"),
    "slots-count": ({"slot_mapping": lambda a: a["slot_mapping"][:2]}, "2 entries for 3"),
    "slots-float": ({"slot_mapping": lambda a: a["slot_mapping"].float()}, "int32 or int64"),
    "slot-out-of-range": ({"slot_mapping": lambda a: torch.tensor([0, 64, -1])}, "outside"),
    "slot-below-minus-one": ({"slot_mapping": lambda a: torch.tensor([0, -2, 1])}, "outside"),
    "device": ({"slot_mapping": lambda a: a["slot_mapping"].to("meta")}, "is on meta"),
    "scale-zero": ({"k_scale": lambda a: 0.0}, "k_scale must be a positive"),
    "non-contiguous-head-dim": (
        {"key": lambda a: a["key"].transpose(1, 2).contiguous().transpose(1, 2)},
        "contiguous in its last dimension",
    ),
}


@pytest.mark.parametrize("name", list(CACHE_ERRORS))
def test_cache_bad_input_leaves_cache_unchanged(name: str) -> None:
    changes, match = CACHE_ERRORS[name]
    kw = _cache_args()
    before = (kw["key_cache"].clone(), kw["value_cache"].clone())
    for key, fn in changes.items():
        kw[key] = fn(kw)
    with pytest.raises(ValueError, match=match):
        kk.reshape_and_cache(**kw)
    assert not before[0].any() and not before[1].any()


def test_cpu_tensors_need_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        kk.reshape_and_cache(**_cache_args())
