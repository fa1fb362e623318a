"""Writing new tokens' keys and values into a paged KV cache.

The cache layout is `[num_blocks, block_size, num_kv_heads, head_size]`, one tensor for K and one
for V. A token's slot is `block_id * block_size + offset`; slot -1 marks a padding token, which
is skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from kvcore_kernels import _common

__all__ = ["reshape_and_cache"]


# Triton types kernel parameters by specialising on the arguments, not by annotations.
@triton.jit  # type: ignore[untyped-decorator]
def _reshape_and_cache_kernel(  # type: ignore[no-untyped-def]
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kco,
    stride_kch,
    stride_vcb,
    stride_vco,
    stride_vch,
    NUM_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    # One program writes HEADS_PER_PROGRAM heads of one token.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    heads = tl.program_id(1) * HEADS_PER_PROGRAM + tl.arange(0, HEADS_PER_PROGRAM)
    dims = tl.arange(0, HEAD_PAD)
    mask = (heads < NUM_HEADS)[:, None] & (dims < HEAD_SIZE)[None, :]

    src_k = key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :]
    src_v = value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :]
    dst_k = (
        key_cache_ptr
        + block * stride_kcb
        + offset * stride_kco
        + heads[:, None] * stride_kch
        + dims[None, :]
    )
    dst_v = (
        value_cache_ptr
        + block * stride_vcb
        + offset * stride_vco
        + heads[:, None] * stride_vch
        + dims[None, :]
    )
    k = tl.load(src_k, mask=mask, other=0.0)
    v = tl.load(src_v, mask=mask, other=0.0)
    if FP8:
        k = k.to(tl.float32) / tl.load(k_scale_ptr)
        v = v.to(tl.float32) / tl.load(v_scale_ptr)
        k = tl.minimum(tl.maximum(k, -FP8_MAX), FP8_MAX)
        v = tl.minimum(tl.maximum(v, -FP8_MAX), FP8_MAX)
    tl.store(dst_k, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst_v, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


@dataclass(slots=True)
class _Launch:
    """A planned kernel launch: the kernel, its grid and its arguments (used by the compile test)."""

    kernel: Any
    grid: tuple[int, ...]
    args: dict[str, Any]
    num_warps: int


def _plan(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    k_scale: float | torch.Tensor | None,
    v_scale: float | torch.Tensor | None,
    *,
    check_slots: bool,
) -> _Launch:
    """Validates the arguments of `reshape_and_cache` and plans its launch."""
    for name, t in (("key", key), ("value", value)):
        if t.dim() != 3:
            raise ValueError(
                f"{name} must be [num_tokens, num_kv_heads, head_size], got {tuple(t.shape)}"
            )
    if key.shape != value.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} differ in shape")
    if key.dtype != value.dtype or key.dtype not in _common.COMPUTE_DTYPES:
        raise ValueError(
            f"key and value must share a dtype among float32/float16/bfloat16, got "
            f"{key.dtype} and {value.dtype}"
        )
    _common.check_cache_pair(key_cache, value_cache)
    num_blocks, block_size, num_heads, head_size = key_cache.shape
    if (key.shape[1], key.shape[2]) != (num_heads, head_size):
        raise ValueError(
            f"key has {key.shape[1]} heads of size {key.shape[2]}, the cache "
            f"{num_heads} heads of size {head_size}"
        )
    _common.check_int_tensor("slot_mapping", slot_mapping, 1)
    num_tokens = key.shape[0]
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens"
        )
    device = key.device
    for name, t in (
        ("value", value),
        ("key_cache", key_cache),
        ("value_cache", value_cache),
        ("slot_mapping", slot_mapping),
    ):
        _common.check_device(name, t, device)
    _common.check_launch_device(device)
    for name, t in (
        ("key", key),
        ("value", value),
        ("key_cache", key_cache),
        ("value_cache", value_cache),
    ):
        _common.check_last_dim_contiguous(name, t)
    key_cache, fp8 = _common.resolve_cache_dtype("key_cache", key_cache, kv_cache_dtype)
    value_cache, _ = _common.resolve_cache_dtype("value_cache", value_cache, kv_cache_dtype)
    if not fp8 and key_cache.dtype != key.dtype:
        raise ValueError(
            f"key_cache dtype {key_cache.dtype} differs from key dtype {key.dtype} (only fp8 "
            "caches may differ)"
        )
    if check_slots and num_tokens > 0:
        bad = (slot_mapping < -1) | (slot_mapping >= num_blocks * block_size)
        if bool(bad.any()):
            raise ValueError(
                f"slot_mapping holds slots outside [-1, {num_blocks * block_size}) "
                f"(num_blocks={num_blocks}, block_size={block_size})"
            )
    k_scale_t = _common.scale_tensor("k_scale", k_scale, device)
    v_scale_t = _common.scale_tensor("v_scale", v_scale, device)

    head_pad = _common.next_power_of_2(head_size)
    heads_per_program = min(_common.next_power_of_2(num_heads), max(1, 4096 // head_pad))
    grid = (num_tokens, _common.cdiv(num_heads, heads_per_program))
    args: dict[str, Any] = {
        "key_ptr": key,
        "value_ptr": value,
        "key_cache_ptr": key_cache,
        "value_cache_ptr": value_cache,
        "slot_mapping_ptr": slot_mapping,
        "k_scale_ptr": k_scale_t,
        "v_scale_ptr": v_scale_t,
        "stride_kt": key.stride(0),
        "stride_kh": key.stride(1),
        "stride_vt": value.stride(0),
        "stride_vh": value.stride(1),
        "stride_kcb": key_cache.stride(0),
        "stride_kco": key_cache.stride(1),
        "stride_kch": key_cache.stride(2),
        "stride_vcb": value_cache.stride(0),
        "stride_vco": value_cache.stride(1),
        "stride_vch": value_cache.stride(2),
        "NUM_HEADS": num_heads,
        "HEAD_SIZE": head_size,
        "BLOCK_SIZE": block_size,
        "HEADS_PER_PROGRAM": heads_per_program,
        "HEAD_PAD": head_pad,
        "FP8": fp8,
        "FP8_MAX": _common.FP8_MAX.get(key_cache.dtype, 0.0),
    }
    num_warps = 4 if heads_per_program * head_pad <= 2048 else 8
    return _Launch(_reshape_and_cache_kernel, grid, args, num_warps)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str = "auto",
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    *,
    check_slots: bool = True,
) -> None:
    """Writes each new token's key and value into its cache slot.

    Args:
        key: `[num_tokens, num_kv_heads, head_size]` new keys (float32, float16 or bfloat16).
        value: Same shape and dtype as `key`.
        key_cache: `[num_blocks, block_size, num_kv_heads, head_size]`, written in place.
        value_cache: Same shape and dtype as `key_cache`, written in place.
        slot_mapping: `[num_tokens]` int32/int64 slots, `block_id * block_size + offset`;
            -1 skips the token (padding).
        kv_cache_dtype: `"auto"` (cache dtype equals `key`'s, or is a float8 dtype) or
            `"fp8"`/`"fp8_e4m3"`/`"fp8_e5m2"` (the caches may then be `uint8`).
        k_scale: fp8 only: keys are stored as `key / k_scale`, clamped to the fp8 range
            (float or one-element tensor, default 1.0).
        v_scale: fp8 only: as `k_scale`, for values.
        check_slots: Check that every slot is -1 or inside the cache (one device-to-host
            synchronisation). Pass False on a hot path once the caller is trusted.

    Raises:
        ValueError: On mismatched shapes, dtypes or devices, or out-of-range slots, before
            anything is launched.
    """
    launch = _plan(
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        kv_cache_dtype,
        k_scale,
        v_scale,
        check_slots=check_slots,
    )
    if launch.grid[0] == 0:
        return
    launch.kernel[launch.grid](**launch.args, num_warps=launch.num_warps)
