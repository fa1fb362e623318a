"""Argument checks and dtype rules shared by the kernels' launchers.

Every launcher validates its inputs here before any Triton launch, so that misuse surfaces as a
`ValueError` that names the offending argument instead of a crash or a silent wrong answer.
"""

from __future__ import annotations

import os

import torch

#: Query / activation dtypes the attention kernel computes in.
COMPUTE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

#: `kv_cache_dtype` strings accepted by the launchers and the fp8 dtype each one selects.
FP8_CACHE_DTYPES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}

#: Largest finite magnitude of each fp8 format; values are clamped to it before the cast.
FP8_MAX: dict[torch.dtype, float] = {
    torch.float8_e4m3fn: float(torch.finfo(torch.float8_e4m3fn).max),
    torch.float8_e5m2: float(torch.finfo(torch.float8_e5m2).max),
}


def check_cache_pair(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """Checks that the paged caches are ``[num_blocks, block_size, num_kv_heads, head_size]``
    tensors of one shape and dtype.

    Raises:
        ValueError: Naming the cache and what is wrong.
    """
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be [num_blocks, block_size, num_kv_heads, head_size], "
                f"got {tuple(t.shape)}"
            )
    if key_cache.shape != value_cache.shape:
        raise ValueError(
            f"key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} "
            "differ in shape"
        )
    if key_cache.dtype != value_cache.dtype:
        raise ValueError(
            f"key_cache ({key_cache.dtype}) and value_cache ({value_cache.dtype}) differ in dtype"
        )


def next_power_of_2(n: int) -> int:
    """Returns the smallest power of two that is at least `n` (and at least 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers."""
    return -(-a // b)


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def check_device(name: str, tensor: torch.Tensor, device: torch.device) -> None:
    """Checks that `tensor` lives on `device` and that Triton can run there.

    Raises:
        ValueError: When the device differs, or the tensors are on the CPU while Triton's
            interpreter is off (a compiled Triton kernel needs a GPU).
    """
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, expected {device} like the other inputs")


def check_launch_device(device: torch.device) -> None:
    """Checks that a kernel can be launched for tensors on `device`.

    Raises:
        ValueError: When `device` is neither a GPU nor the CPU under `TRITON_INTERPRET=1`.
    """
    if device.type == "cpu":
        if not interpreting():
            raise ValueError(
                "CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 before importing "
                "triton, or move the tensors to a GPU"
            )
    elif device.type not in ("cuda", "xpu"):
        raise ValueError(f"unsupported device {device} for Triton kernels")


def check_int_tensor(name: str, tensor: torch.Tensor, ndim: int) -> None:
    """Checks that `tensor` is an int32/int64 tensor with `ndim` dimensions.

    Raises:
        ValueError: Otherwise.
    """
    if tensor.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {tensor.dtype}")
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {tuple(tensor.shape)}")


def check_last_dim_contiguous(name: str, tensor: torch.Tensor) -> None:
    """Checks that the last dimension of `tensor` has stride 1 (the kernels rely on it).

    Raises:
        ValueError: Otherwise.
    """
    if tensor.dim() > 0 and tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension")


def resolve_cache_dtype(
    name: str, cache: torch.Tensor, kv_cache_dtype: str
) -> tuple[torch.Tensor, bool]:
    """Resolves the storage format of a KV cache.

    Args:
        name: Argument name for error messages.
        cache: The cache tensor.
        kv_cache_dtype: `"auto"` (the cache's own dtype; float8 dtypes mean an fp8 cache) or one
            of `"fp8"`, `"fp8_e4m3"`, `"fp8_e5m2"` (the cache may then also be `uint8`).

    Returns:
        The cache viewed with its element dtype (uint8 caches are reinterpreted as the fp8 type)
        and whether it is an fp8 cache.

    Raises:
        ValueError: On an unknown `kv_cache_dtype` or a cache dtype that contradicts it.
    """
    if kv_cache_dtype == "auto":
        if cache.dtype in FP8_MAX:
            return cache, True
        if cache.dtype not in COMPUTE_DTYPES:
            raise ValueError(
                f"{name} has dtype {cache.dtype}; with kv_cache_dtype='auto' it must be one of "
                "float32, float16, bfloat16, float8_e4m3fn, float8_e5m2 (pass kv_cache_dtype for "
                "a uint8 fp8 cache)"
            )
        return cache, False
    if kv_cache_dtype not in FP8_CACHE_DTYPES:
        raise ValueError(
            f"unknown kv_cache_dtype {kv_cache_dtype!r}; expected 'auto' or one of "
            f"{sorted(FP8_CACHE_DTYPES)}"
        )
    fp8 = FP8_CACHE_DTYPES[kv_cache_dtype]
    if cache.dtype == torch.uint8:
        return cache.view(fp8), True
    if cache.dtype != fp8:
        raise ValueError(f"{name} has dtype {cache.dtype}, but kv_cache_dtype={kv_cache_dtype!r}")
    return cache, True


def scale_tensor(
    name: str, scale: float | torch.Tensor | None, device: torch.device
) -> torch.Tensor:
    """Turns an fp8 scale (None means 1.0) into a one-element float32 tensor on `device`.

    Raises:
        ValueError: When the scale is not a positive finite scalar (or one-element tensor).
    """
    if scale is None:
        return torch.ones(1, dtype=torch.float32, device=device)
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(f"{name} must hold one element, got shape {tuple(scale.shape)}")
        check_device(name, scale, device)
        return scale.reshape(1).to(torch.float32)
    value = float(scale)
    if not value > 0.0 or value == float("inf"):
        raise ValueError(f"{name} must be a positive finite number, got {scale!r}")
    return torch.full((1,), value, dtype=torch.float32, device=device)
