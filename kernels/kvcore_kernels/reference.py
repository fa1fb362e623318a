"""Plain-torch references of the kernels: slow, obvious, float32 math. Used by tests and benches.

They take the same arguments as the kernels and define their semantics.
"""

from __future__ import annotations

import torch

from kvcore_kernels import _common

__all__ = ["paged_attention", "reshape_and_cache"]


def _fp8_view(cache: torch.Tensor, kv_cache_dtype: str) -> tuple[torch.Tensor, bool]:
    if kv_cache_dtype == "auto":
        return cache, cache.dtype in _common.FP8_MAX
    fp8 = _common.FP8_CACHE_DTYPES[kv_cache_dtype]
    return (cache.view(fp8) if cache.dtype == torch.uint8 else cache), True


def _scale(scale: float | torch.Tensor | None) -> float:
    if scale is None:
        return 1.0
    return float(scale.item()) if isinstance(scale, torch.Tensor) else float(scale)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str = "auto",
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
) -> None:
    """Reference of `kvcore_kernels.reshape_and_cache` (same arguments, writes in place)."""
    kc, fp8 = _fp8_view(key_cache, kv_cache_dtype)
    vc, _ = _fp8_view(value_cache, kv_cache_dtype)
    block_size = kc.shape[1]
    for cache, src, scale in ((kc, key, k_scale), (vc, value, v_scale)):
        for t, slot in enumerate(slot_mapping.tolist()):
            if slot < 0:
                continue
            x = src[t]
            if fp8:
                limit = _common.FP8_MAX[cache.dtype]
                x = (x.float() / _scale(scale)).clamp(-limit, limit)
            cache[slot // block_size, slot % block_size] = x.to(cache.dtype)


def gather_kv(
    cache: torch.Tensor, block_ids: list[int], seq_len: int, scale: float | None = None
) -> torch.Tensor:
    """Gathers a sequence's `[seq_len, num_kv_heads, head_size]` entries from a paged cache.

    Args:
        cache: `[num_blocks, block_size, num_kv_heads, head_size]`.
        block_ids: The sequence's blocks, in order.
        seq_len: Number of tokens to gather.
        scale: When given, the float32 result is multiplied by it (fp8 dequantisation).
    """
    block_size = cache.shape[1]
    nblocks = _common.cdiv(seq_len, block_size)
    ids = torch.tensor(block_ids[:nblocks], dtype=torch.long, device=cache.device)
    flat = cache[ids].float().reshape(nblocks * block_size, *cache.shape[2:])[:seq_len]
    return flat * scale if scale is not None else flat


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
) -> torch.Tensor:
    """Reference of `kvcore_kernels.paged_attention` (see it for the semantics), float32 math."""
    kc, fp8 = _fp8_view(key_cache, kv_cache_dtype)
    vc, _ = _fp8_view(value_cache, kv_cache_dtype)
    ks = _scale(k_scale) if fp8 else None
    vs = _scale(v_scale) if fp8 else None
    num_q_heads = q.shape[1]
    group = num_q_heads // kc.shape[2]
    result = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    qsl = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = qsl[i], qsl[i + 1]
        if end == start:
            continue
        ids = block_table[i].tolist()
        k = gather_kv(kc, ids, seq_len, ks).repeat_interleave(group, dim=1)  # [S, H, D]
        v = gather_kv(vc, ids, seq_len, vs).repeat_interleave(group, dim=1)
        qi = q[start:end].float()  # [Q, H, D]
        s = torch.einsum("qhd,khd->hqk", qi, k) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        q_pos = torch.arange(seq_len - (end - start), seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        rel = k_pos[None, :] - q_pos[:, None]  # [Q, S]
        if alibi_slopes is not None:
            s = s + alibi_slopes.float()[:, None, None] * rel[None].float()
        visible = torch.ones_like(rel, dtype=torch.bool)
        if causal:
            visible &= rel <= 0
        if sliding_window is not None:
            visible &= rel > -sliding_window
        s = s.masked_fill(~visible[None], float("-inf"))
        # Keys no query can see are never read (their blocks may be freed, e.g. kvcore's null
        # block out of a sliding window), so garbage there must not leak through 0 * NaN.
        v = v.masked_fill(~visible.any(0)[:, None, None], 0.0)
        if sinks is not None:
            sink = sinks.float()[:, None, None].expand(-1, s.shape[1], 1)
            p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
        else:
            p = torch.softmax(s, dim=-1)
        result[start:end] = torch.einsum("hqk,khd->qhd", p, v)
    if out is None:
        return result.to(q.dtype)
    out.copy_(result)
    return out
