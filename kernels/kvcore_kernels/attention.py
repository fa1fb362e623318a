"""Paged attention over block tables: one varlen kernel for chunked prefill and decode.

Queries are packed: request `i` owns query rows `query_start_loc[i]:query_start_loc[i + 1]`, which
are the *last* tokens of its sequence of `seq_lens[i]` tokens (context already in the cache plus
the new tokens, whose K/V were written by `reshape_and_cache` first). Key position `p` of request
`i` lives in block `block_table[i, p // block_size]` at offset `p % block_size`.

Kernel layout: one program handles `BLOCK_Q` consecutive query tokens of one request times the
`num_q_heads // num_kv_heads` query heads that share one KV head (so K/V tiles are loaded once per
GQA group), and walks the keys in tiles of `TILE_N` positions, gathering each key's block id from
the block table (so block sizes need not be powers of two nor match the tile). Online softmax in
float32 (base 2). For long decode contexts the key range is split across programs
(`num_kv_splits`) and a second kernel merges the partial results.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from kvcore_kernels import _common

__all__ = ["AttentionConfig", "paged_attention"]


# Triton types kernel parameters by specialising on the arguments, not by annotations.
@triton.jit  # type: ignore[untyped-decorator]
def _paged_attention_kernel(  # type: ignore[no-untyped-def]
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    alibi_slopes_ptr,
    sinks_ptr,
    k_scale_ptr,
    v_scale_ptr,
    out_ptr,
    part_o_ptr,
    part_m_ptr,
    part_l_ptr,
    scale,
    softcap,
    sliding_window,
    num_q_heads,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ko,
    stride_kh,
    stride_vb,
    stride_vo,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    CAUSAL: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_ALIBI: tl.constexpr,
    USE_SINKS: tl.constexpr,
    KV_FP8: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    q_block = tl.program_id(1)
    kv_head = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS

    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int32)
    q_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int32) - q_start
    q_first = q_block * BLOCK_Q
    if q_first >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    context_len = seq_len - q_len

    # Rows: query token (within this program) major, query head (within the GQA group) minor.
    rows = tl.arange(0, BLOCK_M)
    row_q = q_first + rows // QUERIES_PER_KV
    row_head = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
    row_valid = (rows < BLOCK_Q * QUERIES_PER_KV) & (row_q < q_len)
    row_pos = context_len + row_q
    row_token = (q_start + row_q).to(tl.int64)

    dims = tl.arange(0, HEAD_PAD)
    dim_valid = dims < HEAD_SIZE
    q = tl.load(
        q_ptr + row_token[:, None] * stride_qt + row_head[:, None] * stride_qh + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )

    # Key range needed by any row of this program.
    kv_end = context_len + tl.minimum(q_first + BLOCK_Q, q_len) if CAUSAL else seq_len
    kv_start = 0
    if USE_WINDOW:
        kv_start = tl.maximum(context_len + q_first - sliding_window + 1, 0)
    tile_lo = kv_start // TILE_N
    tile_hi = (kv_end + TILE_N - 1) // TILE_N
    if NUM_SPLITS > 1:
        per_split = (tile_hi - tile_lo + NUM_SPLITS - 1) // NUM_SPLITS
        tile_lo = tile_lo + split * per_split
        tile_hi = tl.minimum(tile_lo + per_split, tile_hi)

    if USE_ALIBI:
        slope = tl.load(alibi_slopes_ptr + row_head).to(tl.float32)
    if KV_FP8:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)

    if USE_SINKS and NUM_SPLITS == 1:
        m_i = tl.load(sinks_ptr + row_head).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    qk_scale = scale * 1.4426950408889634

    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(tile_lo, tile_hi):
        key_pos = tile * TILE_N + tl.arange(0, TILE_N)
        key_valid = (key_pos >= kv_start) & (key_pos < kv_end)
        block = tl.load(bt_row + key_pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        offset = key_pos % BLOCK_SIZE
        k_base = block * stride_kb + offset * stride_ko + kv_head * stride_kh
        v_base = block * stride_vb + offset * stride_vo + kv_head * stride_vh
        k_t = tl.load(
            key_cache_ptr + k_base[None, :] + dims[:, None],
            mask=dim_valid[:, None] & key_valid[None, :],
            other=0.0,
        )
        v = tl.load(
            value_cache_ptr + v_base[:, None] + dims[None, :],
            mask=key_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )
        if KV_FP8:
            k_t = (k_t.to(tl.float32) * k_scale).to(q.dtype)
            v = (v.to(tl.float32) * v_scale).to(q.dtype)

        s = tl.dot(q, k_t, input_precision=DOT_PRECISION)
        if USE_SOFTCAP:
            # softcap * tanh(s * scale / softcap), with exp of a non-positive argument only.
            x = s * (scale / softcap)
            e = tl.exp(-2.0 * tl.abs(x))
            t = (1.0 - e) / (1.0 + e)
            s = tl.where(x < 0, -t, t) * (softcap * 1.4426950408889634)
        else:
            s = s * qk_scale
        if USE_ALIBI:
            s += (slope[:, None] * 1.4426950408889634) * (key_pos[None, :] - row_pos[:, None]).to(
                tl.float32
            )
        visible = key_valid[None, :] & row_valid[:, None]
        if CAUSAL:
            visible = visible & (key_pos[None, :] <= row_pos[:, None])
        if USE_WINDOW:
            visible = visible & (key_pos[None, :] > row_pos[:, None] - sliding_window)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if NUM_SPLITS == 1:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc / l_safe[:, None]
        tl.store(
            out_ptr
            + row_token[:, None] * stride_ot
            + row_head[:, None] * stride_oh
            + dims[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & dim_valid[None, :],
        )
    else:
        part = (row_token * num_q_heads + row_head) * NUM_SPLITS + split
        tl.store(part_m_ptr + part, m_i, mask=row_valid)
        tl.store(part_l_ptr + part, l_i, mask=row_valid)
        tl.store(
            part_o_ptr + part[:, None] * HEAD_SIZE + dims[None, :],
            acc,
            mask=row_valid[:, None] & dim_valid[None, :],
        )


# Triton types kernel parameters by specialising on the arguments, not by annotations.
@triton.jit  # type: ignore[untyped-decorator]
def _merge_splits_kernel(  # type: ignore[no-untyped-def]
    part_o_ptr,
    part_m_ptr,
    part_l_ptr,
    sinks_ptr,
    out_ptr,
    num_q_heads,
    stride_ot,
    stride_oh,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    USE_SINKS: tl.constexpr,
):
    # One program merges the split partials of HEADS_PER_PROGRAM heads of one token.
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HEADS_PER_PROGRAM + tl.arange(0, HEADS_PER_PROGRAM)
    head_valid = heads < num_q_heads
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_PAD)
    dim_valid = dims < HEAD_SIZE
    part = (token * num_q_heads + heads)[:, None] * NUM_SPLITS + splits[None, :]
    part_valid = head_valid[:, None] & (splits < NUM_SPLITS)[None, :]
    m = tl.load(part_m_ptr + part, mask=part_valid, other=float("-inf"))
    l = tl.load(part_l_ptr + part, mask=part_valid, other=0.0)  # noqa: E741
    m_max = tl.max(m, 1)
    if USE_SINKS:
        sink = tl.load(sinks_ptr + heads, mask=head_valid, other=0.0).to(tl.float32)
        sink = sink * 1.4426950408889634
        m_max = tl.maximum(m_max, sink)
    m_use = tl.where(m_max == float("-inf"), 0.0, m_max)
    weight = tl.where(m == float("-inf"), 0.0, tl.math.exp2(m - m_use[:, None]))
    total = tl.sum(l * weight, 1)
    if USE_SINKS:
        total += tl.math.exp2(sink - m_use)
    o = tl.load(
        part_o_ptr + part[:, :, None] * HEAD_SIZE + dims[None, None, :],
        mask=part_valid[:, :, None] & dim_valid[None, None, :],
        other=0.0,
    )
    o = tl.sum(o * weight[:, :, None], 1) / tl.where(total == 0.0, 1.0, total)[:, None]
    tl.store(
        out_ptr + token * stride_ot + heads[:, None] * stride_oh + dims[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=head_valid[:, None] & dim_valid[None, :],
    )


@dataclass(slots=True, frozen=True)
class AttentionConfig:
    """Tile sizes of the attention kernel (a tuning override; the defaults suit an H100/H200).

    Attributes:
        block_m: Rows per program (query tokens x query heads per KV head), a power of two >= 16.
        tile_n: Key positions per inner-loop step, a power of two >= 16.
        num_warps: Warps per program.
        num_stages: Software-pipelining depth of the key loop.
    """

    block_m: int
    tile_n: int
    num_warps: int = 4
    num_stages: int = 2


def _default_config(head_pad: int, queries_per_kv: int, max_query_len: int) -> AttentionConfig:
    """Picks tile sizes from the head size, the GQA ratio and the longest query."""
    rows_needed = _common.next_power_of_2(max(1, max_query_len) * queries_per_kv)
    block_m = max(16, min(64 if head_pad <= 128 else 32, rows_needed))
    block_m = max(block_m, _common.next_power_of_2(queries_per_kv))
    tile_n = 64 if head_pad <= 64 else 32
    num_warps = 4 if block_m * head_pad <= 64 * 128 else 8
    return AttentionConfig(block_m=block_m, tile_n=tile_n, num_warps=num_warps, num_stages=2)


def _default_num_splits(
    device: torch.device, num_seqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int
) -> int:
    """Splits long decode contexts so that the GPU has enough programs to fill its SMs."""
    if max_query_len > 1 or max_seq_len < 2048:
        return 1
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        sms = 132
    programs = num_seqs * num_kv_heads
    if programs >= sms:
        return 1
    return max(1, min(_common.cdiv(2 * sms, programs), max_seq_len // 512, 64))


@dataclass(slots=True)
class _Launch:
    """Planned launches of the attention kernels (used by the launcher and the compile test)."""

    kernel: Any
    grid: tuple[int, ...]
    args: dict[str, Any]
    num_warps: int
    num_stages: int
    merge_kernel: Any
    merge_grid: tuple[int, ...] | None
    merge_args: dict[str, Any] | None
    out: torch.Tensor


def _check_inputs(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    alibi_slopes: torch.Tensor | None,
    sinks: torch.Tensor | None,
    out: torch.Tensor | None,
) -> None:
    """Checks shapes, dtypes and devices (no device-to-host transfer)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [num_tokens, num_q_heads, head_size], got {tuple(q.shape)}")
    if q.dtype not in _common.COMPUTE_DTYPES:
        raise ValueError(f"q must be float32, float16 or bfloat16, got {q.dtype}")
    _common.check_cache_pair(key_cache, value_cache)
    num_tokens, num_q_heads, head_size = q.shape
    _, _, num_kv_heads, cache_head_size = key_cache.shape
    if cache_head_size != head_size:
        raise ValueError(f"q head_size {head_size} differs from the cache's {cache_head_size}")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    if head_size > 512:
        raise ValueError(f"head_size {head_size} exceeds the supported 512")
    _common.check_int_tensor("block_table", block_table, 2)
    _common.check_int_tensor("seq_lens", seq_lens, 1)
    _common.check_int_tensor("query_start_loc", query_start_loc, 1)
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(
            f"query_start_loc must have num_seqs + 1 = {num_seqs + 1} entries, "
            f"got {query_start_loc.shape[0]}"
        )
    if block_table.shape[0] != num_seqs:
        raise ValueError(f"block_table has {block_table.shape[0]} rows for {num_seqs} sequences")
    for name, opt in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if opt is not None and (opt.dim() != 1 or opt.shape[0] != num_q_heads):
            raise ValueError(f"{name} must be [num_q_heads={num_q_heads}], got {tuple(opt.shape)}")
        if opt is not None and not opt.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {opt.dtype}")
    if out is not None:
        if out.shape != q.shape:
            raise ValueError(f"out has shape {tuple(out.shape)}, expected {tuple(q.shape)}")
        if out.dtype != q.dtype:
            raise ValueError(f"out has dtype {out.dtype}, expected {q.dtype}")
    device = q.device
    named: list[tuple[str, torch.Tensor | None]] = [
        ("key_cache", key_cache),
        ("value_cache", value_cache),
        ("block_table", block_table),
        ("seq_lens", seq_lens),
        ("query_start_loc", query_start_loc),
        ("alibi_slopes", alibi_slopes),
        ("sinks", sinks),
        ("out", out),
    ]
    for name, opt in named:
        if opt is not None:
            _common.check_device(name, opt, device)
    _common.check_launch_device(device)
    for name, opt in (
        ("q", q),
        ("key_cache", key_cache),
        ("value_cache", value_cache),
        ("out", out),
    ):
        if opt is not None:
            _common.check_last_dim_contiguous(name, opt)
    if block_table.shape[1] > 0 and block_table.stride(1) != 1:
        raise ValueError("block_table must be contiguous in its last dimension")
    del num_tokens


def _check_values(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> tuple[int, int]:
    """Checks the metadata's values (one device-to-host copy); returns the longest query/sequence."""
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
    qsl = query_start_loc.to("cpu", torch.int64)
    lens = seq_lens.to("cpu", torch.int64)
    num_seqs = lens.shape[0]
    if int(qsl[0]) != 0:
        raise ValueError(f"query_start_loc must start at 0, got {int(qsl[0])}")
    q_lens = qsl[1:] - qsl[:-1]
    if num_seqs and bool((q_lens < 0).any()):
        raise ValueError("query_start_loc must be non-decreasing")
    if int(qsl[-1]) != q.shape[0]:
        raise ValueError(f"query_start_loc ends at {int(qsl[-1])} but q holds {q.shape[0]} tokens")
    if num_seqs and bool((lens < q_lens).any()):
        i = int(torch.nonzero(lens < q_lens)[0, 0])
        raise ValueError(
            f"sequence {i}: seq_len {int(lens[i])} is shorter than its {int(q_lens[i])} queries"
        )
    need = (lens + block_size - 1) // block_size
    max_need = int(need.max()) if num_seqs else 0
    if max_need > block_table.shape[1]:
        i = int(torch.argmax(need))
        raise ValueError(
            f"sequence {i} of {int(lens[i])} tokens needs {int(need[i])} blocks of "
            f"{block_size}, but block_table has {block_table.shape[1]} columns"
        )
    if max_need:
        # Checked where the table lives; only a flag (and, on failure, the culprit) comes back.
        used = block_table[:, :max_need]
        need_dev = need.to(used.device)
        in_use = torch.arange(max_need, device=used.device)[None, :] < need_dev[:, None]
        bad = in_use & ((used < 0) | (used >= num_blocks))
        if bool(bad.any()):
            i, j = (int(x) for x in torch.nonzero(bad)[0])
            raise ValueError(
                f"block_table[{i}, {j}] = {int(used[i, j])} is not a block id in [0, {num_blocks})"
            )
    max_query_len = int(q_lens.max()) if num_seqs else 0
    max_seq_len = int(lens.max()) if num_seqs else 0
    return max_query_len, max_seq_len


def _plan(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float,
    causal: bool,
    sliding_window: int | None,
    softcap: float | None,
    alibi_slopes: torch.Tensor | None,
    sinks: torch.Tensor | None,
    k_scale: float | torch.Tensor | None,
    v_scale: float | torch.Tensor | None,
    out: torch.Tensor | None,
    kv_cache_dtype: str,
    num_kv_splits: int | None,
    config: AttentionConfig | None,
    max_query_len: int | None,
    max_seq_len: int | None,
    validate: bool,
) -> _Launch:
    """Validates the arguments of `paged_attention` and plans its launches."""
    _check_inputs(
        q, key_cache, value_cache, block_table, seq_lens, query_start_loc, alibi_slopes, sinks, out
    )
    if not math.isfinite(scale) or scale == 0.0:
        raise ValueError(f"scale must be a finite non-zero number, got {scale!r}")
    if sliding_window is not None:
        if sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        if not causal:
            raise ValueError("sliding_window requires causal=True")
    if softcap is not None and not (softcap > 0.0 and math.isfinite(softcap)):
        raise ValueError(f"softcap must be a positive finite number, got {softcap!r}")
    key_cache, kv_fp8 = _common.resolve_cache_dtype("key_cache", key_cache, kv_cache_dtype)
    value_cache, _ = _common.resolve_cache_dtype("value_cache", value_cache, kv_cache_dtype)
    if not kv_fp8 and key_cache.dtype != q.dtype:
        raise ValueError(
            f"key_cache dtype {key_cache.dtype} differs from q dtype {q.dtype} (only fp8 caches "
            "may differ)"
        )
    num_tokens, num_q_heads, head_size = q.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    if validate:
        max_query_len, max_seq_len = _check_values(
            q, key_cache, block_table, seq_lens, query_start_loc
        )
    else:
        if max_query_len is None:
            max_query_len = num_tokens
        if max_seq_len is None:
            max_seq_len = block_table.shape[1] * block_size
    if out is None:
        out = torch.empty_like(q)
    device = q.device

    queries_per_kv = num_q_heads // num_kv_heads
    head_pad = max(16, _common.next_power_of_2(head_size))
    if config is None:
        config = _default_config(head_pad, queries_per_kv, max_query_len)
    for name, v in (("block_m", config.block_m), ("tile_n", config.tile_n)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"config.{name} must be a power of two >= 16, got {v}")
    if config.block_m < queries_per_kv:
        raise ValueError(
            f"config.block_m ({config.block_m}) is smaller than the {queries_per_kv} query heads "
            "per KV head"
        )
    block_q = config.block_m // queries_per_kv
    if num_kv_splits is None:
        num_kv_splits = _default_num_splits(
            device, num_seqs, num_kv_heads, max_query_len, max_seq_len
        )
    if num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")

    if num_kv_splits > 1:
        part_o = torch.empty(
            (num_tokens, num_q_heads, num_kv_splits, head_size), dtype=torch.float32, device=device
        )
        part_m = torch.empty(
            (num_tokens, num_q_heads, num_kv_splits), dtype=torch.float32, device=device
        )
        part_l = torch.empty_like(part_m)
    else:
        part_o = part_m = part_l = out  # unused placeholders
    dummy = q  # placeholder for absent optional tensors (never read)
    args: dict[str, Any] = {
        "q_ptr": q,
        "key_cache_ptr": key_cache,
        "value_cache_ptr": value_cache,
        "block_table_ptr": block_table,
        "seq_lens_ptr": seq_lens,
        "query_start_loc_ptr": query_start_loc,
        "alibi_slopes_ptr": alibi_slopes if alibi_slopes is not None else dummy,
        "sinks_ptr": sinks if sinks is not None else dummy,
        "k_scale_ptr": _common.scale_tensor("k_scale", k_scale, device),
        "v_scale_ptr": _common.scale_tensor("v_scale", v_scale, device),
        "out_ptr": out,
        "part_o_ptr": part_o,
        "part_m_ptr": part_m,
        "part_l_ptr": part_l,
        "scale": float(scale),
        "softcap": float(softcap) if softcap is not None else 1.0,
        "sliding_window": int(sliding_window) if sliding_window is not None else 0,
        "num_q_heads": num_q_heads,
        "stride_qt": q.stride(0),
        "stride_qh": q.stride(1),
        "stride_kb": key_cache.stride(0),
        "stride_ko": key_cache.stride(1),
        "stride_kh": key_cache.stride(2),
        "stride_vb": value_cache.stride(0),
        "stride_vo": value_cache.stride(1),
        "stride_vh": value_cache.stride(2),
        "stride_bt": block_table.stride(0),
        "stride_ot": out.stride(0),
        "stride_oh": out.stride(1),
        "QUERIES_PER_KV": queries_per_kv,
        "HEAD_SIZE": head_size,
        "HEAD_PAD": head_pad,
        "BLOCK_SIZE": block_size,
        "BLOCK_Q": block_q,
        "BLOCK_M": config.block_m,
        "TILE_N": config.tile_n,
        "NUM_SPLITS": num_kv_splits,
        "CAUSAL": causal,
        "USE_WINDOW": sliding_window is not None,
        "USE_SOFTCAP": softcap is not None,
        "USE_ALIBI": alibi_slopes is not None,
        "USE_SINKS": sinks is not None,
        "KV_FP8": kv_fp8,
        # float32 queries get exact float32 products rather than TF32.
        "DOT_PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",
    }
    grid = (num_seqs, _common.cdiv(max_query_len, block_q), num_kv_heads * num_kv_splits)
    merge_grid = None
    merge_args = None
    if num_kv_splits > 1:
        splits_pad = _common.next_power_of_2(num_kv_splits)
        heads_per_program = min(
            _common.next_power_of_2(num_q_heads), max(1, 4096 // (splits_pad * head_pad))
        )
        merge_grid = (num_tokens, _common.cdiv(num_q_heads, heads_per_program))
        merge_args = {
            "part_o_ptr": part_o,
            "part_m_ptr": part_m,
            "part_l_ptr": part_l,
            "sinks_ptr": sinks if sinks is not None else dummy,
            "out_ptr": out,
            "num_q_heads": num_q_heads,
            "stride_ot": out.stride(0),
            "stride_oh": out.stride(1),
            "HEAD_SIZE": head_size,
            "HEAD_PAD": head_pad,
            "HEADS_PER_PROGRAM": heads_per_program,
            "NUM_SPLITS": num_kv_splits,
            "SPLITS_PAD": splits_pad,
            "USE_SINKS": sinks is not None,
        }
    return _Launch(
        _paged_attention_kernel,
        grid,
        args,
        config.num_warps,
        config.num_stages,
        _merge_splits_kernel,
        merge_grid,
        merge_args,
        out,
    )


def paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    kv_cache_dtype: str = "auto",
    num_kv_splits: int | None = None,
    config: AttentionConfig | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """Attention of packed variable-length queries over a paged KV cache.

    Serves chunked prefill (queries after context already in the cache) and decode (one query
    per request) in one launch. The new tokens' K/V must already be in the cache.

    Args:
        q: `[num_tokens, num_q_heads, head_size]` queries (float32, float16 or bfloat16).
        key_cache: `[num_blocks, block_size, num_kv_heads, head_size]`, dtype of `q` or fp8.
        value_cache: Same shape and dtype as `key_cache`.
        block_table: `[num_seqs, max_blocks]` int32/int64 block ids; row `i` lists request `i`'s
            blocks in order (entries past `ceil(seq_lens[i] / block_size)` are ignored).
        seq_lens: `[num_seqs]` tokens per request, cached context plus new tokens.
        query_start_loc: `[num_seqs + 1]` offsets of each request's queries in `q`
            (cumulative query lengths starting at 0).
        scale: Multiplier of `q . k` (usually `head_size ** -0.5`).
        causal: Query at position `p` sees keys at positions `<= p` (its position is
            `seq_len - query_len + j` for its `j`-th query). False: every query sees the whole
            sequence.
        sliding_window: Query at `p` sees only keys `> p - sliding_window` (needs `causal`).
        softcap: Scores become `softcap * tanh(score / softcap)` (after `scale`).
        alibi_slopes: `[num_q_heads]`; adds `slope * (key_pos - query_pos)` to the scores.
        sinks: `[num_q_heads]` attention-sink logits: an extra softmax term per head that
            attends to nothing.
        k_scale: fp8 caches: keys are dequantised as `stored * k_scale` (default 1.0).
            Ignored for other caches.
        v_scale: fp8 caches: as `k_scale`, for values.
        out: Optional preallocated output, same shape and dtype as `q`.
        kv_cache_dtype: `"auto"` or an fp8 name (`"fp8"`, `"fp8_e4m3"`, `"fp8_e5m2"`) for a
            `uint8` cache.
        num_kv_splits: Split each request's keys over this many programs and merge (the
            split-KV path); default: chosen from the batch for long decode contexts.
        config: Tile-size override.
        max_query_len: Longest query (used with `validate=False` to size the grid without
            reading the metadata back).
        max_seq_len: Longest sequence (idem, for the split heuristic).
        validate: Check the metadata's values (query offsets, sequence lengths, block table
            length and block ids) on the host before launching; costs one device-to-host copy.

    Returns:
        The attention output, `[num_tokens, num_q_heads, head_size]` (`out` when given).

    Raises:
        ValueError: On mismatched shapes, dtypes or devices, head counts that don't divide, a
            block table too short for a sequence, or invalid options, before any launch.
    """
    launch = _plan(
        q,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        query_start_loc,
        scale=scale,
        causal=causal,
        sliding_window=sliding_window,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        sinks=sinks,
        k_scale=k_scale,
        v_scale=v_scale,
        out=out,
        kv_cache_dtype=kv_cache_dtype,
        num_kv_splits=num_kv_splits,
        config=config,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        validate=validate,
    )
    if min(launch.grid) == 0:
        return launch.out
    launch.kernel[launch.grid](
        **launch.args, num_warps=launch.num_warps, num_stages=launch.num_stages
    )
    if launch.merge_grid is not None and launch.merge_args is not None:
        launch.merge_kernel[launch.merge_grid](**launch.merge_args, num_warps=4)
    return launch.out
