"""Compiles every kernel variant the launchers plan, for sm_90 (H100/H200), without a GPU.

Run as a script (the test runs it in a subprocess, because the test session uses the
interpreter): `python kernels/tests/kvk_compile_sm90.py [cache] [attention] [split]`. Triton's NVIDIA backend lowers the
kernels to PTX with its own LLVM and assembles the PTX to a cubin with the `ptxas` bundled in the
wheel (`triton/backends/nvidia/bin/ptxas`); neither step needs a CUDA driver or device. Prints
one line per variant and exits non-zero if any fails.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import triton
from kvcore_kernels import _common, attention, cache
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)
_TYPES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.uint8: "u8",
    torch.float8_e4m3fn: "fp8e4nv",
    torch.float8_e5m2: "fp8e5",
}


def _signature(kernel: Any, args: dict[str, Any]) -> tuple[dict[str, str], dict[str, Any]]:
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    for param in kernel.params:
        name = param.name
        value = args[name]
        if param.is_constexpr:
            signature[name] = "constexpr"
            constexprs[name] = value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{name}: cannot type {value!r}")
    return signature, constexprs


def compile_one(kernel: Any, args: dict[str, Any], num_warps: int, num_stages: int = 2) -> int:
    """Compiles one variant to a cubin; returns its size in bytes."""
    signature, constexprs = _signature(kernel, args)
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    compiled = triton.compile(
        src, target=TARGET, options={"num_warps": num_warps, "num_stages": num_stages}
    )
    return len(compiled.asm["cubin"])


def _cache_variants() -> list[tuple[str, Any]]:
    out = []
    for dtype, kv, storage, heads, d in (
        (torch.float16, "auto", torch.float16, 8, 128),
        (torch.bfloat16, "fp8_e4m3", torch.uint8, 4, 80),
        (torch.float32, "fp8_e5m2", torch.uint8, 32, 256),
    ):
        key = torch.zeros(4, heads, d, dtype=dtype)
        kc = torch.zeros(2, 48, heads, d, dtype=storage)
        plan = cache._plan(
            key,
            key,
            kc,
            kc.clone(),
            torch.zeros(4, dtype=torch.int64),
            kv,
            0.5,
            0.5,
            check_slots=False,
        )
        out.append((f"reshape_and_cache {dtype} kv={kv} d={d}", plan))
    return out


def _attention_variants() -> list[tuple[str, Any]]:
    out = []
    specs: list[tuple[torch.dtype, int, int, int, int, str, dict[str, Any], int, int]] = [
        # dtype, head, block, q heads, kv heads, kv dtype, options, max q len, splits
        (torch.float16, 128, 16, 32, 8, "auto", {}, 64, 1),
        (torch.bfloat16, 128, 16, 32, 8, "auto", {}, 1, 1),
        (torch.float32, 64, 32, 8, 8, "auto", {"causal": False}, 16, 1),
        (torch.float16, 80, 48, 12, 4, "auto", {"sliding_window": 128}, 32, 1),
        (torch.bfloat16, 96, 64, 8, 1, "fp8_e4m3", {"softcap": 30.0}, 16, 1),
        (torch.float16, 256, 16, 8, 4, "fp8_e5m2", {"alibi": True}, 16, 1),
        (torch.bfloat16, 64, 16, 64, 8, "auto", {"sinks": True}, 1, 1),
        (torch.float16, 128, 16, 32, 8, "auto", {}, 1, 8),
        (torch.bfloat16, 64, 32, 16, 2, "fp8_e4m3", {"sinks": True, "sliding_window": 64}, 1, 4),
    ]
    for dtype, d, bs, hq, hkv, kv, opts, max_q, splits in specs:
        opts = dict(opts)
        q = torch.zeros(max_q, hq, d, dtype=dtype)
        storage = dtype if kv == "auto" else torch.uint8
        kc = torch.zeros(4, bs, hkv, d, dtype=storage)
        if opts.pop("alibi", False):
            opts["alibi_slopes"] = torch.ones(hq)
        if opts.pop("sinks", False):
            opts["sinks"] = torch.ones(hq)
        plan = attention._plan(
            q,
            kc,
            kc.clone(),
            torch.zeros(1, 4, dtype=torch.int32),
            torch.full((1,), max_q, dtype=torch.int32),
            torch.tensor([0, max_q], dtype=torch.int32),
            scale=d**-0.5,
            causal=opts.pop("causal", True),
            sliding_window=opts.pop("sliding_window", None),
            softcap=opts.pop("softcap", None),
            alibi_slopes=opts.pop("alibi_slopes", None),
            sinks=opts.pop("sinks", None),
            k_scale=0.5,
            v_scale=0.5,
            out=None,
            kv_cache_dtype=kv,
            num_kv_splits=splits,
            config=None,
            max_query_len=max_q,
            max_seq_len=4 * bs,
            validate=False,
        )
        name = (
            f"paged_attention {dtype} d={d} block={bs} {hq}/{hkv} kv={kv} q={max_q} splits={splits}"
        )
        out.append((name, plan))
    return out


GROUPS = ("cache", "attention", "split")


def main(argv: list[str]) -> int:
    """Compiles the variants of the groups named in `argv` (default: all of them)."""
    groups = argv or list(GROUPS)
    unknown = set(groups) - set(GROUPS)
    if unknown:
        print(f"unknown group(s) {sorted(unknown)}; expected some of {GROUPS}")
        return 2
    _common.check_launch_device = lambda device: None  # plans on CPU tensors, compiles for GPU
    failures = 0
    if "cache" in groups:
        for name, plan in _cache_variants():
            failures += _report(name, plan.kernel, plan.args, plan.num_warps, 1)
    for name, plan in _attention_variants():
        split = plan.merge_args is not None
        if ("split" if split else "attention") not in groups:
            continue
        failures += _report(name, plan.kernel, plan.args, plan.num_warps, plan.num_stages)
        if plan.merge_args is not None:
            failures += _report(name + " (merge)", plan.merge_kernel, plan.merge_args, 4, 1)
    return 1 if failures else 0


def _report(name: str, kernel: Any, args: dict[str, Any], num_warps: int, stages: int) -> int:
    start = time.perf_counter()
    try:
        size = compile_one(kernel, args, num_warps, stages)
    except Exception as exc:  # report every variant, then fail
        print(f"FAIL {name}: {type(exc).__name__}: {exc}", flush=True)
        return 1
    print(f"ok   {name}: cubin {size} B in {time.perf_counter() - start:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
