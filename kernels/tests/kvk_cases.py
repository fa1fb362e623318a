"""Builders of random paged-attention batches for the kernel tests (shared by several files)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from kvcore_kernels import build_metadata
from kvcore_kernels.metadata import AttentionMetadata

FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
#: Byte that is NaN in both fp8 formats (e4m3fn: S.1111.111; e5m2: S.11111.11).
FP8_NAN_BYTE = 0x7F


@dataclass
class Batch:
    """One step: caches holding every request's context and new tokens, plus the metadata."""

    q: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    meta: AttentionMetadata
    block_ids: list[list[int]]
    kwargs: dict[str, Any] = field(default_factory=dict)

    def args(self) -> tuple[torch.Tensor, ...]:
        m = self.meta
        return (
            self.q,
            self.key_cache,
            self.value_cache,
            m.block_table,
            m.seq_lens,
            m.query_start_loc,
        )


def poison(cache: torch.Tensor) -> None:
    """Fills `cache` with NaN (bitwise for fp8/uint8 caches)."""
    if cache.dtype in (torch.uint8, *FP8.values()):
        cache.view(torch.uint8).fill_(FP8_NAN_BYTE)
    else:
        cache.fill_(float("nan"))


def make_batch(
    *,
    ctx_lens: list[int],
    q_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    num_q_heads: int,
    head_size: int,
    dtype: torch.dtype,
    kv_cache_dtype: str = "auto",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
    extra_cols: int = 1,
) -> Batch:
    """A batch whose requests own shuffled blocks; every other block (the null block 0, unused
    blocks, and, with a sliding window, blocks no query can see) is NaN so that any stray read
    shows up in the output."""
    need = [-(-(c + q) // block_size) for c, q in zip(ctx_lens, q_lens, strict=True)]
    num_blocks = 1 + sum(need) + 2
    perm = (torch.randperm(num_blocks - 1) + 1).tolist()
    block_ids: list[list[int]] = []
    for n in need:
        block_ids.append(perm[:n])
        perm = perm[n:]
    if sliding_window is not None:
        # Like kvcore's sliding-window manager: blocks out of every new query's window are
        # replaced by the null block.
        for i, (c, ids) in enumerate(zip(ctx_lens, block_ids, strict=True)):
            first_visible = max(0, c - sliding_window + 1)
            block_ids[i] = [
                0 if (b + 1) * block_size <= first_visible else x for b, x in enumerate(ids)
            ]
    meta = build_metadata(
        block_ids,
        ctx_lens,
        q_lens,
        block_size,
        num_cols=max(need) + extra_cols,
    )
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    used = sorted({x for ids in block_ids for x in ids} - {0})
    if kv_cache_dtype == "auto":
        key_cache = torch.empty(shape, dtype=dtype)
        value_cache = torch.empty(shape, dtype=dtype)
    else:
        key_cache = torch.empty(shape, dtype=torch.uint8)
        value_cache = torch.empty(shape, dtype=torch.uint8)
    poison(key_cache)
    poison(value_cache)
    for cache, sc in ((key_cache, k_scale), (value_cache, v_scale)):
        vals = torch.randn(len(used), block_size, num_kv_heads, head_size)
        if kv_cache_dtype == "auto":
            cache[used] = vals.to(dtype)
        else:
            cache.view(FP8[kv_cache_dtype])[used] = (vals / sc).to(FP8[kv_cache_dtype])
    num_tokens = sum(q_lens)
    q = torch.randn(num_tokens, num_q_heads, head_size).to(dtype)
    kwargs: dict[str, Any] = {"scale": head_size**-0.5}
    if kv_cache_dtype != "auto":
        kwargs.update(kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale)
    if sliding_window is not None:
        kwargs["sliding_window"] = sliding_window
    return Batch(q, key_cache, value_cache, meta, block_ids, kwargs)


#: Absolute/relative tolerances against the float32 reference, by query dtype.
TOLERANCE = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (3e-3, 3e-3),
    torch.bfloat16: (2.5e-2, 2.5e-2),
}
