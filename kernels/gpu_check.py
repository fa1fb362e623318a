"""GPU check of kvcore-kernels (written for one NVIDIA H100/H200, a few minutes in all).

1. Correctness: the compiled kernels against the plain-torch reference over the feature matrix
   (dtypes, head sizes, block sizes, GQA, fp8 caches, options, split-KV), at sizes the CPU
   interpreter cannot afford; `reshape_and_cache` bit-exact.
2. Timings: `paged_attention` against `torch.nn.functional.scaled_dot_product_attention` (and
   FlashAttention when it is installed) on contiguous copies of the same K/V, for decode and
   prefill shapes. SDPA/FlashAttention read contiguous K/V and do no block-table gathers, so they
   are a "no paging" baseline rather than a like-for-like competitor.

Usage (from the repository root, with kvcore-kernels importable):

    python kernels/gpu_check.py            # correctness + timings
    python kernels/gpu_check.py --quick    # fewer cases and shapes

Prints a table per part; exits 1 if any correctness case fails, 2 when no GPU is present.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import kvcore_kernels as kk
import torch
import triton.testing
from kvcore_kernels import reference as ref

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
TOL = {F32: 1e-4, F16: 4e-3, BF16: 3e-2}


@dataclass
class Case:
    """One correctness case (see `make_inputs`)."""

    name: str
    dtype: torch.dtype
    head_size: int
    block_size: int
    heads: tuple[int, int]
    ctx_lens: list[int]
    q_lens: list[int]
    kv: str = "auto"
    opts: dict[str, Any] = field(default_factory=dict)
    splits: int | None = None


def make_inputs(
    case: Case, device: torch.device
) -> tuple[tuple[torch.Tensor, ...], dict[str, Any]]:
    """Caches with shuffled blocks (others NaN), metadata and kwargs for one case."""
    bs = case.block_size
    need = [math.ceil((c + q) / bs) for c, q in zip(case.ctx_lens, case.q_lens, strict=True)]
    num_blocks = 1 + sum(need) + 4
    perm = (torch.randperm(num_blocks - 1) + 1).tolist()
    block_ids = []
    for n in need:
        block_ids.append(perm[:n])
        perm = perm[n:]
    meta = kk.build_metadata(block_ids, case.ctx_lens, case.q_lens, bs, device=device)
    hq, hkv = case.heads
    shape = (num_blocks, bs, hkv, case.head_size)
    caches = []
    for _ in range(2):
        vals = torch.randn(shape, device=device)
        if case.kv == "auto":
            c = vals.to(case.dtype)
            c[0] = float("nan")
        else:
            c = (vals * 2).to(FP8[case.kv]).view(torch.uint8)
            c[0] = 0x7F
        caches.append(c)
    q = torch.randn(sum(case.q_lens), hq, case.head_size, device=device).to(case.dtype)
    kwargs: dict[str, Any] = {"scale": case.head_size**-0.5}
    if case.kv != "auto":
        kwargs.update(kv_cache_dtype=case.kv, k_scale=0.5, v_scale=0.5)
    opts = dict(case.opts)
    if opts.pop("alibi", False):
        kwargs["alibi_slopes"] = torch.exp2(-torch.arange(1, hq + 1, device=device) * 8 / hq)
    if opts.pop("sinks", False):
        kwargs["sinks"] = torch.randn(hq, device=device)
    kwargs.update(opts)
    args = (q, caches[0], caches[1], meta.block_table, meta.seq_lens, meta.query_start_loc)
    return args, kwargs


def correctness_cases(quick: bool) -> list[Case]:
    """The feature matrix, pairwise."""
    cases = [
        Case("f16 d128 b16 gqa4 prefill", F16, 128, 16, (32, 8), [0, 300, 17], [511, 64, 1]),
        Case("bf16 d128 b16 gqa4 decode", BF16, 128, 16, (32, 8), [1000, 77, 5], [1, 1, 1]),
        Case("f32 d64 b32 mha chunked", F32, 64, 32, (8, 8), [200, 0], [100, 33]),
        Case("f16 d80 b48 gqa3", F16, 80, 48, (12, 4), [95, 400], [40, 1]),
        Case("bf16 d96 b64 fp8e4m3", BF16, 96, 64, (8, 1), [250], [70], kv="fp8_e4m3"),
        Case("f16 d256 b16 fp8e5m2", F16, 256, 16, (8, 4), [130, 3], [20, 9], kv="fp8_e5m2"),
        Case(
            "bf16 d128 window+softcap",
            BF16,
            128,
            32,
            (16, 8),
            [600],
            [80],
            opts={"sliding_window": 128, "softcap": 30.0},
        ),
        Case("f16 d64 alibi", F16, 64, 16, (16, 16), [50, 90], [30, 2], opts={"alibi": True}),
        Case("bf16 d64 sinks gqa8", BF16, 64, 16, (64, 8), [300], [40], opts={"sinks": True}),
        Case(
            "f16 d128 non-causal", F16, 128, 16, (8, 8), [0, 0], [300, 129], opts={"causal": False}
        ),
        Case("f16 d128 split decode", F16, 128, 16, (32, 8), [8000, 3000], [1, 1], splits=16),
        Case(
            "bf16 d64 split fp8 sinks window",
            BF16,
            64,
            32,
            (16, 2),
            [5000],
            [1],
            kv="fp8_e4m3",
            opts={"sinks": True, "sliding_window": 1024},
            splits=8,
        ),
        Case("bf16 d128 auto split", BF16, 128, 16, (32, 8), [16000], [1]),
    ]
    return cases[::3] if quick else cases


def check_correctness(device: torch.device, cases: list[Case], cache_tokens: int = 4096) -> int:
    """Runs `cases` and three bit-exact cache writes of `cache_tokens` tokens; returns the number
    of failures."""
    failures = 0
    print(f"{'case':44s} {'max abs err':>12s} {'tol':>8s}  result")
    for case in cases:
        args, kwargs = make_inputs(case, device)
        start = time.perf_counter()
        got = kk.paged_attention(*args, **kwargs, num_kv_splits=case.splits)
        if device.type == "cuda":
            torch.cuda.synchronize()
        first_call = time.perf_counter() - start
        want = ref.paged_attention(*args, **kwargs)
        err = (got.float() - want.float()).abs().max().item()
        tol = TOL[case.dtype] * max(1.0, want.float().abs().max().item())
        ok = math.isfinite(err) and err <= tol
        failures += not ok
        verdict = "ok" if ok else "MISMATCH"
        print(f"{case.name:44s} {err:12.2e} {tol:8.1e}  {verdict} (first call {first_call:.1f}s)")
    # reshape_and_cache, bit-exact, fp16 and fp8 caches.
    for kv, storage in (("auto", F16), ("fp8_e4m3", torch.uint8), ("fp8_e5m2", torch.uint8)):
        key = torch.randn(cache_tokens, 8, 128, device=device).to(F16)
        num_blocks = 2 * cache_tokens // 16
        slots = torch.randperm(num_blocks * 16, device=device)[:cache_tokens]
        slots[::7] = -1
        kc = torch.zeros(num_blocks, 16, 8, 128, dtype=storage, device=device)
        kc_ref = kc.clone()
        vc, vc_ref = kc.clone(), kc.clone()
        kk.reshape_and_cache(key, key, kc, vc, slots, kv, 0.5, 0.5)
        ref.reshape_and_cache(key, key, kc_ref, vc_ref, slots, kv, 0.5, 0.5)
        ok = torch.equal(kc.view(torch.uint8), kc_ref.view(torch.uint8))
        failures += not ok
        print(
            f"{'reshape_and_cache ' + kv:44s} {'':>12s} {'exact':>8s}  {'ok' if ok else 'MISMATCH'}"
        )
    return failures


def _bench(fn: Callable[[], Any]) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=100))


def _flash_attn() -> Any:
    try:
        import flash_attn  # type: ignore[import-not-found]
    except ImportError:
        return None
    return flash_attn


Shape = tuple[str, int, int, int, int, int, int, int, torch.dtype, str]


def timing_shapes(quick: bool) -> list[Shape]:
    """(label, batch, context, query length, q heads, kv heads, head size, block, dtype, kv)."""
    shapes: list[Shape] = [
        # (label, batch, ctx, q_len, hq, hkv, d, block, dtype, kv)
        ("decode b=64 ctx=4096 32/8 d128 bf16", 64, 4096, 1, 32, 8, 128, 16, BF16, "auto"),
        ("decode b=8 ctx=32768 32/8 d128 bf16", 8, 32768, 1, 32, 8, 128, 16, BF16, "auto"),
        ("decode b=64 ctx=4096 32/8 d128 fp8e4m3", 64, 4096, 1, 32, 8, 128, 16, BF16, "fp8_e4m3"),
        ("decode b=256 ctx=1024 64/8 d128 bf16 b=32", 256, 1024, 1, 64, 8, 128, 32, BF16, "auto"),
        ("prefill b=4 len=2048 32/8 d128 bf16", 4, 0, 2048, 32, 8, 128, 16, BF16, "auto"),
        ("chunked b=4 ctx=4096 q=512 32/8 d128 bf16", 4, 4096, 512, 32, 8, 128, 16, BF16, "auto"),
        ("prefill b=2 len=4096 16/16 d64 f16", 2, 0, 4096, 16, 16, 64, 16, F16, "auto"),
    ]
    return shapes[::2] if quick else shapes


def timings(device: torch.device, shapes: list[Shape]) -> None:
    """Times decode and prefill shapes; prints ms and effective bandwidth/throughput."""
    fa = _flash_attn()
    print(f"\nFlashAttention: {'v' + fa.__version__ if fa else 'not installed'}")
    header = f"{'shape':52s} {'kvcore ms':>10s} {'sdpa ms':>9s} {'fa ms':>8s} {'kv/sdpa':>8s}  note"
    print(header)
    for label, b, ctx, ql, hq, hkv, d, bs, dtype, kv in shapes:
        case = Case(label, dtype, d, bs, (hq, hkv), [ctx] * b, [ql] * b, kv=kv)
        args, kwargs = make_inputs(case, device)
        q = args[0]
        kwargs.update(validate=False, max_query_len=ql, max_seq_len=ctx + ql)
        t_kv = _bench(lambda: kk.paged_attention(*args, **kwargs))  # noqa: B023
        # Contiguous baseline: [b, h, s, d] K/V for SDPA, same values.
        seq = ctx + ql
        k_dense = torch.randn(b, hkv, seq, d, device=device, dtype=dtype)
        v_dense = torch.randn_like(k_dense)
        q_dense = q.view(b, ql, hq, d).transpose(1, 2)
        causal = ql > 1 and ctx == 0

        def sdpa() -> Any:
            return torch.nn.functional.scaled_dot_product_attention(
                q_dense,  # noqa: B023
                k_dense,  # noqa: B023
                v_dense,  # noqa: B023
                is_causal=causal,  # noqa: B023
                enable_gqa=True,
            )

        t_sdpa = _bench(sdpa)
        t_fa = float("nan")
        if fa is not None and dtype in (F16, BF16):
            qf = q.view(b, ql, hq, d)
            kf = k_dense.transpose(1, 2).contiguous()
            vf = v_dense.transpose(1, 2).contiguous()
            t_fa = _bench(lambda: fa.flash_attn_func(qf, kf, vf, causal=ql > 1))  # noqa: B023
        kv_bytes = 2 * b * seq * hkv * d * (1 if kv != "auto" else dtype.itemsize)
        note = f"{kv_bytes / t_kv / 1e6:.0f} GB/s KV read"
        if ql > 1:
            flops = 4 * b * hq * d * ql * (ctx + (ql + 1) / 2)
            note += f", {flops / t_kv / 1e9:.0f} TFLOP/s"
        print(f"{label:52s} {t_kv:10.3f} {t_sdpa:9.3f} {t_fa:8.3f} {t_kv / t_sdpa:8.2f}  {note}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer cases and shapes")
    parser.add_argument("--no-timings", action="store_true", help="correctness only")
    ns = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: this script needs a GPU (the CPU suite is kernels/tests)")
        return 2
    device = torch.device("cuda")
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(device)
    print(f"device: {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}")
    start = time.perf_counter()
    failures = check_correctness(device, correctness_cases(ns.quick))
    print(f"correctness: {failures} failure(s) in {time.perf_counter() - start:.0f}s")
    if not ns.no_timings:
        timings(device, timing_shapes(ns.quick))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
