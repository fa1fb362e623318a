"""paged_attention against the plain-torch reference, under Triton's interpreter.

The cases are chosen pairwise over the feature matrix rather than as a full product: every
dtype, head size, block size, GQA ratio, KV-cache format, option and path appears, and most pairs
of them appear together, while each case stays around a second in the interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import kvcore_kernels as kk
import pytest
import torch
from kvcore_kernels import AttentionConfig
from kvcore_kernels import reference as ref
from kvcore_kernels.attention import _default_num_splits
from kvk_cases import TOLERANCE, make_batch

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@dataclass
class Case:
    dtype: torch.dtype
    head_size: int
    block_size: int
    heads: tuple[int, int]  # (query heads, kv heads)
    ctx_lens: list[int]
    q_lens: list[int]
    kv: str = "auto"
    scales: tuple[float, float] = (1.0, 1.0)
    opts: dict[str, Any] = field(default_factory=dict)
    splits: int | None = None
    config: AttentionConfig | None = None


CASES = {
    "f16-d128-b16-gqa4-mixed": Case(F16, 128, 16, (8, 2), [0, 20, 37], [19, 5, 1]),
    "bf16-d64-b32-mha-decode": Case(BF16, 64, 32, (4, 4), [40, 70, 3], [1, 1, 1]),
    "f32-d80-b48-gqa3-chunked": Case(F32, 80, 48, (6, 2), [50, 0], [7, 30]),
    "f16-d96-b64-gqa4-fp8e4m3": Case(
        F16, 96, 64, (4, 1), [10, 90], [3, 1], kv="fp8_e4m3", scales=(0.5, 0.25)
    ),
    "bf16-d256-b16-gqa2-fp8e5m2": Case(
        BF16, 256, 16, (2, 1), [33], [4], kv="fp8_e5m2", scales=(2.0, 0.5)
    ),
    "f16-d64-b48-gqa8-window": Case(
        F16, 64, 48, (8, 1), [60, 5], [6, 9], opts={"sliding_window": 13}
    ),
    "bf16-d128-b32-softcap": Case(BF16, 128, 32, (4, 2), [25], [12], opts={"softcap": 20.0}),
    "f32-d64-b16-alibi": Case(F32, 64, 16, (4, 2), [18, 3], [5, 4], opts={"alibi": True}),
    "f16-d80-b16-sinks": Case(F16, 80, 16, (4, 4), [31], [9], opts={"sinks": True}),
    "f16-d64-b16-noncausal": Case(F16, 64, 16, (2, 2), [0, 12], [17, 6], opts={"causal": False}),
    "f32-d128-b32-gqa8-noncausal-alibi": Case(
        F32, 128, 32, (16, 2), [7], [9], opts={"causal": False, "alibi": True}
    ),
    "all-options-bf16-fp8": Case(
        BF16,
        80,
        16,
        (8, 4),
        [40, 2],
        [3, 5],
        kv="fp8_e4m3",
        scales=(0.75, 1.5),
        opts={"sliding_window": 9, "softcap": 30.0, "alibi": True, "sinks": True},
    ),
    "f16-d256-b64-fp8e5m2-decode": Case(
        F16, 256, 64, (4, 2), [130, 1], [1, 1], kv="fp8_e5m2", scales=(0.5, 0.5)
    ),
    "empty-and-fresh-requests": Case(F16, 64, 16, (4, 2), [10, 0, 20], [3, 1, 0]),
    "many-q-blocks-tile-straddles-blocks": Case(
        F16, 64, 48, (4, 2), [10], [40], config=AttentionConfig(block_m=16, tile_n=16)
    ),
    "split-f16-d128-decode": Case(F16, 128, 16, (8, 2), [300, 129, 5], [1, 1, 1], splits=4),
    "split-bf16-fp8-sinks": Case(
        BF16,
        64,
        32,
        (4, 1),
        [200, 64],
        [1, 1],
        kv="fp8_e4m3",
        scales=(0.5, 2.0),
        opts={"sinks": True},
        splits=3,
    ),
    "split-f32-d96-b48-window-alibi-empty-splits": Case(
        F32, 96, 48, (2, 2), [150], [1], opts={"sliding_window": 40, "alibi": True}, splits=5
    ),
    "split-f16-chunked-softcap": Case(
        F16, 64, 16, (4, 2), [100], [5], opts={"softcap": 10.0}, splits=2
    ),
}


def _run(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    opts = dict(case.opts)
    batch = make_batch(
        ctx_lens=case.ctx_lens,
        q_lens=case.q_lens,
        block_size=case.block_size,
        num_kv_heads=case.heads[1],
        num_q_heads=case.heads[0],
        head_size=case.head_size,
        dtype=case.dtype,
        kv_cache_dtype=case.kv,
        k_scale=case.scales[0],
        v_scale=case.scales[1],
        sliding_window=opts.pop("sliding_window", None),
    )
    kwargs = dict(batch.kwargs)
    num_q_heads = case.heads[0]
    if opts.pop("alibi", False):
        kwargs["alibi_slopes"] = torch.exp2(-torch.arange(1, num_q_heads + 1) * 8 / num_q_heads)
    if opts.pop("sinks", False):
        kwargs["sinks"] = torch.randn(num_q_heads) * 2
    kwargs.update(opts)
    expected = ref.paged_attention(*batch.args(), **kwargs)
    got = kk.paged_attention(*batch.args(), **kwargs, num_kv_splits=case.splits, config=case.config)
    return got, expected


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name: str) -> None:
    case = CASES[name]
    got, expected = _run(case)
    assert got.dtype == case.dtype
    assert not got.isnan().any()
    atol, rtol = TOLERANCE[case.dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=rtol)


def test_split_and_unsplit_agree() -> None:
    batch = make_batch(
        ctx_lens=[90, 45],
        q_lens=[1, 1],
        block_size=16,
        num_kv_heads=2,
        num_q_heads=4,
        head_size=64,
        dtype=F32,
    )
    one = kk.paged_attention(*batch.args(), **batch.kwargs, num_kv_splits=1)
    three = kk.paged_attention(*batch.args(), **batch.kwargs, num_kv_splits=3)
    torch.testing.assert_close(one, three, atol=2e-6, rtol=2e-6)


def test_writes_into_out_and_reads_strided_q() -> None:
    batch = make_batch(
        ctx_lens=[12, 0],
        q_lens=[4, 6],
        block_size=16,
        num_kv_heads=2,
        num_q_heads=4,
        head_size=64,
        dtype=F16,
    )
    # q as a slice of a fused qkv projection: token stride larger than heads * head_size.
    qkv = torch.randn(batch.q.shape[0], 8, 64).to(F16)
    qkv[:, :4] = batch.q
    q = qkv[:, :4]
    assert not q.is_contiguous()
    out_buf = torch.full((q.shape[0], 4, 64), float("nan"), dtype=F16)
    args = (q, *batch.args()[1:])
    result = kk.paged_attention(*args, **batch.kwargs, out=out_buf)
    assert result is out_buf
    expected = ref.paged_attention(*batch.args(), **batch.kwargs)
    torch.testing.assert_close(out_buf.float(), expected.float(), atol=3e-3, rtol=3e-3)


def test_without_validation_given_maxima() -> None:
    batch = make_batch(
        ctx_lens=[5, 30],
        q_lens=[2, 1],
        block_size=16,
        num_kv_heads=1,
        num_q_heads=2,
        head_size=64,
        dtype=F16,
    )
    m = batch.meta
    got = kk.paged_attention(
        *batch.args(),
        **batch.kwargs,
        validate=False,
        max_query_len=m.max_query_len,
        max_seq_len=m.max_seq_len,
    )
    expected = ref.paged_attention(*batch.args(), **batch.kwargs)
    torch.testing.assert_close(got.float(), expected.float(), atol=3e-3, rtol=3e-3)


def test_default_split_heuristic() -> None:
    cpu = torch.device("cpu")
    assert _default_num_splits(cpu, 1, 8, 1, 32768) > 1  # one long decode: split
    assert _default_num_splits(cpu, 256, 8, 1, 32768) == 1  # enough programs already
    assert _default_num_splits(cpu, 1, 8, 64, 32768) == 1  # prefill: no split
    assert _default_num_splits(cpu, 1, 8, 1, 512) == 1  # short context: no split


def test_argument_forms_agree() -> None:
    # uint8 cache + kv_cache_dtype == native float8 cache with "auto"; float scales == tensor
    # scales; int32 metadata == int64 metadata.
    batch = make_batch(
        ctx_lens=[21, 4],
        q_lens=[3, 2],
        block_size=16,
        num_kv_heads=2,
        num_q_heads=4,
        head_size=64,
        dtype=F16,
        kv_cache_dtype="fp8_e4m3",
        k_scale=0.5,
        v_scale=2.0,
    )
    q, kc, vc, bt, sl, qsl = batch.args()
    base = kk.paged_attention(*batch.args(), **batch.kwargs)
    native = kk.paged_attention(
        q,
        kc.view(torch.float8_e4m3fn),
        vc.view(torch.float8_e4m3fn),
        bt.long(),
        sl.long(),
        qsl.long(),
        scale=batch.kwargs["scale"],
        k_scale=torch.tensor([0.5]),
        v_scale=torch.tensor(2.0),
    )
    assert torch.equal(base, native)
    expected = ref.paged_attention(*batch.args(), **batch.kwargs)
    torch.testing.assert_close(base.float(), expected.float(), atol=3e-3, rtol=3e-3)
