"""Fixes for known defects of Triton's CPU interpreter, applied on import (tests only).

The kernels do not depend on these patches; the GPU compiler has none of these defects.

* `tl.dot` on bfloat16 operands multiplies the raw uint16 bit patterns (the interpreter stores
  bfloat16 as uint16), giving garbage. Patched: operands are widened to float32 first, as the
  GPU's tensor cores do.
* Down-casts to bfloat16 truncate instead of rounding to nearest even, and casts to fp8 round by
  adding the cut-off bit without carrying into the exponent and without saturation handling.
  Patched: float conversions involving bfloat16 or fp8 go through torch's (RTNE) conversions,
  which match the GPU's `cvt.rn` for in-range values (the kernels clamp before fp8 casts).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import triton.language as tl
from triton.runtime import interpreter as _interp

_TORCH_OF = {
    tl.bfloat16: torch.bfloat16,
    tl.float8e4nv: torch.float8_e4m3fn,
    tl.float8e5: torch.float8_e5m2,
    tl.float16: torch.float16,
    tl.float32: torch.float32,
    tl.float64: torch.float64,
}
_BITS_VIEW = {torch.bfloat16: np.int16, torch.float8_e4m3fn: np.int8, torch.float8_e5m2: np.int8}
_BITS_TORCH = {np.int16: torch.int16, np.int8: torch.int8}
_SPECIAL = (tl.bfloat16, tl.float8e4nv, tl.float8e5)


def _np_to_torch(data: np.ndarray, dtype: Any) -> torch.Tensor:
    tdt = _TORCH_OF[dtype]
    arr = np.ascontiguousarray(data)
    if tdt in _BITS_VIEW:
        bits = _BITS_VIEW[tdt]
        return torch.from_numpy(arr.view(bits).copy()).view(tdt)
    return torch.from_numpy(arr.copy())


def _torch_to_np(t: torch.Tensor, dtype: Any) -> np.ndarray:
    tdt = _TORCH_OF[dtype]
    if tdt in _BITS_VIEW:
        bits = _BITS_VIEW[tdt]
        out: np.ndarray = t.view(_BITS_TORCH[bits]).numpy().view(_interp._get_np_dtype(dtype))
        return out
    return t.numpy()


def _torch_convert(src: Any, dst_scalar: Any) -> Any:
    data = _np_to_torch(src.data, src.dtype.scalar).to(_TORCH_OF[dst_scalar])
    return _interp.TensorHandle(_torch_to_np(data, dst_scalar).reshape(src.data.shape), dst_scalar)


def _needs_torch(src_scalar: Any, dst_scalar: Any) -> bool:
    return (
        src_scalar in _TORCH_OF
        and dst_scalar in _TORCH_OF
        and (src_scalar in _SPECIAL or dst_scalar in _SPECIAL)
        and src_scalar != dst_scalar
    )


_Builder = _interp.InterpreterBuilder
_orig_cast_impl = _Builder.cast_impl
_orig_fp_to_fp = _Builder.create_fp_to_fp
_orig_dot = _Builder.create_dot


def _cast_impl(self: Any, src: Any, dst_type: Any) -> Any:
    if _needs_torch(src.dtype.scalar, dst_type.scalar):
        return _torch_convert(src, dst_type.scalar)
    return _orig_cast_impl(self, src, dst_type)


def _fp_to_fp(self: Any, src: Any, dst_type: Any, rounding_mode: Any) -> Any:
    if _needs_torch(src.dtype.scalar, dst_type.scalar):
        return _torch_convert(src, dst_type.scalar)
    return _orig_fp_to_fp(self, src, dst_type, rounding_mode)


def _dot(
    self: Any, a: Any, b: Any, d: Any, input_precision: Any, max_num_imprecise_acc: Any
) -> Any:
    if a.dtype.scalar in _SPECIAL or b.dtype.scalar in _SPECIAL:
        a = _torch_convert(a, tl.float32)
        b = _torch_convert(b, tl.float32)
    return _orig_dot(self, a, b, d, input_precision, max_num_imprecise_acc)


def apply() -> None:
    """Installs the patches (idempotent)."""
    _Builder.cast_impl = _cast_impl
    _Builder.create_fp_to_fp = _fp_to_fp
    _Builder.create_dot = _dot
