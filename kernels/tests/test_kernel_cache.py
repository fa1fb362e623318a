"""reshape_and_cache against the plain-torch reference (bit-exact), under Triton's interpreter."""

from __future__ import annotations

import kvcore_kernels as kk
import pytest
import torch
from kvcore_kernels import reference as ref
from kvk_cases import FP8, poison

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# (dtype, kv_cache_dtype, cache storage, block_size, num_kv_heads, head_size, scales)
CASES = {
    "f16-auto-b16-d128": (F16, "auto", F16, 16, 2, 128, None),
    "bf16-auto-b48-d80": (BF16, "auto", BF16, 48, 3, 80, None),
    "f32-auto-b32-d96": (F32, "auto", F32, 32, 1, 96, None),
    "f16-fp8e4m3-uint8-b64-d256": (F16, "fp8_e4m3", torch.uint8, 64, 2, 256, (0.5, 0.125)),
    "bf16-fp8e5m2-uint8-b16-d64": (BF16, "fp8_e5m2", torch.uint8, 16, 4, 64, (2.0, 0.25)),
    "f32-fp8-native-e4m3-b48-d64": (F32, "auto", torch.float8_e4m3fn, 48, 2, 64, (0.01, 1.0)),
    "f16-fp8-named-e4m3-b16-d80": (F16, "fp8", torch.float8_e4m3fn, 16, 1, 80, (1.0, 3.0)),
    "bf16-fp8-native-e5m2-b32-d128": (BF16, "auto", torch.float8_e5m2, 32, 2, 128, (0.5, 4.0)),
    "f16-auto-many-heads": (F16, "auto", F16, 16, 16, 256, None),
}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns, so that NaN-poisoned slots compare equal."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference_bitwise(name: str) -> None:
    dtype, kv_dtype, storage, block_size, heads, head_size, scales = CASES[name]
    num_blocks = 7
    num_tokens = block_size + 5
    key = (torch.randn(num_tokens, heads, head_size) * 4).to(dtype)
    value = (torch.randn(num_tokens, heads, head_size) * 4).to(dtype)
    if scales is not None:
        key[0, 0, :4] = torch.tensor([1e6, -1e6, 1e-9, 0.0])  # saturation and tiny values
    # Shuffled slots spread over several blocks, some padding (-1) entries in between.
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[3] = -1
    slots[-1] = -1
    kc = torch.empty(num_blocks, block_size, heads, head_size, dtype=storage)
    poison(kc)
    vc = kc.clone()
    kc_ref, vc_ref = kc.clone(), vc.clone()
    k_scale, v_scale = scales if scales is not None else (None, None)
    kk.reshape_and_cache(key, value, kc, vc, slots, kv_dtype, k_scale, v_scale)
    ref.reshape_and_cache(key, value, kc_ref, vc_ref, slots, kv_dtype, k_scale, v_scale)
    assert torch.equal(_bits(kc), _bits(kc_ref))
    assert torch.equal(_bits(vc), _bits(vc_ref))
    # Untouched slots keep their content (including the padded tokens' would-be slots).
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    flat = _bits(kc).reshape(num_blocks * block_size, -1)
    poisoned = _bits(kc_ref).reshape(num_blocks * block_size, -1)[~written]
    assert torch.equal(flat[~written], poisoned)
    if scales is not None:
        fp8 = FP8.get(kv_dtype, storage)
        top = float(torch.finfo(fp8).max)
        stored = kc.view(fp8)[slots[0] // block_size, slots[0] % block_size, 0, :2].float()
        assert stored.tolist() == [top, -top]


def test_reference_decoding_roundtrip() -> None:
    # Reading back with the scales restores the values up to fp8 precision.
    key = torch.randn(5, 2, 64)
    kc = torch.zeros(2, 16, 2, 64, dtype=torch.float8_e4m3fn)
    vc = kc.clone()
    slots = torch.tensor([0, 1, 2, 17, 31])
    kk.reshape_and_cache(key, key, kc, vc, slots, k_scale=0.5, v_scale=0.5)
    back = kc.float().reshape(32, 2, 64)[slots] * 0.5
    torch.testing.assert_close(back, key, atol=0.05, rtol=0.07)


def test_strided_key_and_value_and_int32_slots() -> None:
    # key/value as slices of a fused kv projection; slot_mapping in int32.
    kv = torch.randn(9, 2, 3, 64).to(F16)
    key, value = kv[:, 0], kv[:, 1]
    kc = torch.zeros(3, 16, 3, 64, dtype=F16)
    vc = torch.zeros_like(kc)
    slots = torch.tensor([5, 6, 7, 8, 9, 40, 41, -1, 0], dtype=torch.int32)
    kk.reshape_and_cache(key, value, kc, vc, slots)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(kc[s // 16, s % 16], key[t])
            assert torch.equal(vc[s // 16, s % 16], value[t])


def test_no_tokens_is_a_no_op() -> None:
    kc = torch.zeros(2, 16, 1, 64, dtype=F16)
    vc = torch.zeros_like(kc)
    empty = torch.empty(0, 1, 64, dtype=F16)
    kk.reshape_and_cache(empty, empty, kc, vc, torch.empty(0, dtype=torch.int64))
    assert not kc.any() and not vc.any()


def test_then_attention_reads_what_was_written() -> None:
    # End to end: kvcore-style block ids -> metadata -> cache write -> attention.
    block_size, heads, head_size = 16, 2, 64
    block_ids = [[4, 1], [2], [3, 5, 6]]
    computed, scheduled = [0, 3, 20], [20, 1, 13]
    meta = kk.build_metadata(block_ids, computed, scheduled, block_size)
    kc = torch.randn(7, block_size, heads, head_size).to(F16)
    vc = torch.randn(7, block_size, heads, head_size).to(F16)
    num_tokens = sum(scheduled)
    key = torch.randn(num_tokens, heads, head_size).to(F16)
    value = torch.randn(num_tokens, heads, head_size).to(F16)
    q = torch.randn(num_tokens, 4, head_size).to(F16)
    kk.reshape_and_cache(key, value, kc, vc, meta.slot_mapping)
    args = (q, kc, vc, meta.block_table, meta.seq_lens, meta.query_start_loc)
    got = kk.paged_attention(*args, scale=0.125)
    expected = ref.paged_attention(*args, scale=0.125)
    torch.testing.assert_close(got.float(), expected.float(), atol=3e-3, rtol=3e-3)
    # The first request is a fresh prefill: plain causal attention over its own new tokens.
    q0, k0, v0 = (t[:20].transpose(0, 1).float() for t in (q, key, value))
    k0, v0 = k0.repeat_interleave(2, 0), v0.repeat_interleave(2, 0)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q0, k0, v0, is_causal=True, scale=0.125)
    torch.testing.assert_close(got[:20].float(), sdpa.transpose(0, 1), atol=3e-3, rtol=3e-3)
