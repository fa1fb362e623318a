"""Index arithmetic is 64-bit: a cache of more than 2**31 elements is written and read correctly.

Runs in a subprocess: with 32-bit offsets the interpreter would compute a wrapped address and
could crash the whole test session. The cache is `torch.empty` (pages are only committed where
written) and K and V share it, so the test touches a few MiB of a 2 GiB allocation.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

TESTS = Path(__file__).resolve().parent

SCRIPT = textwrap.dedent(
    """
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path[:0] = [sys.argv[1], os.path.dirname(sys.argv[1])]
    import kvk_interpreter_patches
    kvk_interpreter_patches.apply()
    import torch
    import kvcore_kernels as kk
    from kvcore_kernels import reference as ref

    torch.manual_seed(0)
    block_size, heads, head = 16, 1, 128
    per_block = block_size * heads * head
    num_blocks = 2**31 // per_block + 3
    cache = torch.empty(num_blocks, block_size, heads, head, dtype=torch.float8_e4m3fn)
    assert cache.numel() > 2**31
    # The sequence lives in the last blocks (offsets beyond 2**31) and in block 1.
    block_ids = [[num_blocks - 1, 1, num_blocks - 2]]
    assert (num_blocks - 2) * per_block > 2**31
    meta = kk.build_metadata(block_ids, [0], [40], block_size)
    kv = torch.randn(40, heads, head, dtype=torch.float16)
    # K and V share the cache; writing the same tensor as both keeps them consistent.
    kk.reshape_and_cache(kv, kv, cache, cache, meta.slot_mapping, k_scale=0.5, v_scale=0.5)
    stored = cache[num_blocks - 1, 3, 0].float() * 0.5
    expected = (kv[3, 0].float() / 0.5).to(torch.float8_e4m3fn).float() * 0.5
    assert torch.equal(stored, expected), (stored, expected)
    last = cache[num_blocks - 2, 7, 0].float() * 0.5
    assert torch.equal(last, (kv[39, 0].float() / 0.5).to(torch.float8_e4m3fn).float() * 0.5)
    q = torch.randn(40, 2, head, dtype=torch.float16)
    args = (q, cache, cache, meta.block_table, meta.seq_lens, meta.query_start_loc)
    got = kk.paged_attention(*args, scale=head**-0.5, k_scale=0.5, v_scale=0.5)
    want = ref.paged_attention(*args, scale=head**-0.5, k_scale=0.5, v_scale=0.5)
    torch.testing.assert_close(got.float(), want.float(), atol=3e-3, rtol=3e-3)
    got = kk.paged_attention(
        q[-1:], cache, cache, meta.block_table, meta.seq_lens,
        torch.tensor([0, 1], dtype=torch.int32), scale=head**-0.5, num_kv_splits=2,
        k_scale=0.5, v_scale=0.5,
    )
    torch.testing.assert_close(got.float(), want[-1:].float(), atol=3e-3, rtol=3e-3)
    print("ok")
    """
)


def test_cache_beyond_2_pow_31_elements() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run(
        [sys.executable, "-W", "error", "-c", SCRIPT, str(TESTS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith("ok")
