"""Building the kernels' metadata tensors from kvcore's block ids.

kvcore hands the scheduler `KVCacheBlocks` per request; `get_block_ids()` returns a tuple with
one list of block ids per KV-cache group. For the layers of one group, each request's list is one
row of the block table. The functions here turn those lists plus token counts into the tensors
`reshape_and_cache` and `paged_attention` take. They accept plain Python sequences, so they never
import the manager.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvcore_kernels import _common

__all__ = [
    "AttentionMetadata",
    "block_ids_of_group",
    "block_table_tensor",
    "build_metadata",
    "query_start_loc_tensor",
    "slot_mapping_tensor",
]

Device = torch.device | str


@dataclass(slots=True, frozen=True)
class AttentionMetadata:
    """Everything one attention step needs besides q/k/v and the caches.

    Attributes:
        block_table: `[num_seqs, max_blocks]` int32 block ids, rows padded with `pad_id`.
        seq_lens: `[num_seqs]` int32 tokens per request (computed + scheduled).
        query_start_loc: `[num_seqs + 1]` int32 offsets of each request's new tokens.
        slot_mapping: `[num_tokens]` int64 cache slot of each new token.
        max_query_len: Most new tokens of one request.
        max_seq_len: Longest sequence.
    """

    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int


def block_ids_of_group(
    per_request: Sequence[Sequence[Sequence[int]]], group: int = 0
) -> list[list[int]]:
    """Picks one KV-cache group's block ids out of each request's `get_block_ids()` tuple.

    Args:
        per_request: For each request, the tuple returned by `KVCacheBlocks.get_block_ids()`.
        group: The KV-cache group whose layers the kernels will serve.

    Returns:
        One list of block ids per request.

    Raises:
        ValueError: When a request has no such group.
    """
    rows: list[list[int]] = []
    for i, groups in enumerate(per_request):
        if not 0 <= group < len(groups):
            raise ValueError(f"request {i} has {len(groups)} KV-cache group(s), no group {group}")
        rows.append(list(groups[group]))
    return rows


def block_table_tensor(
    block_ids: Sequence[Sequence[int]],
    *,
    num_cols: int | None = None,
    pad_id: int = 0,
    device: Device = "cpu",
) -> torch.Tensor:
    """Stacks per-request block-id lists into an int32 `[num_seqs, num_cols]` block table.

    Args:
        block_ids: One list of block ids per request, in order.
        num_cols: Columns of the table (default: the longest list); a fixed width lets a caller
            reuse one buffer across steps.
        pad_id: Filler for the columns past a request's blocks (never read by the kernels;
            kvcore's null block 0 is a safe choice).
        device: Where to put the table.

    Raises:
        ValueError: When a list is longer than `num_cols` or holds a negative id.
    """
    longest = max((len(ids) for ids in block_ids), default=0)
    cols = longest if num_cols is None else num_cols
    if longest > cols:
        raise ValueError(f"a request has {longest} blocks, more than num_cols={cols}")
    table = torch.full((len(block_ids), cols), pad_id, dtype=torch.int32)
    for i, ids in enumerate(block_ids):
        if ids:
            row = torch.tensor(list(ids), dtype=torch.int64)
            if int(row.min()) < 0:
                raise ValueError(f"request {i} has a negative block id")
            table[i, : len(ids)] = row.to(torch.int32)
    return table.to(device)


def query_start_loc_tensor(query_lens: Sequence[int], *, device: Device = "cpu") -> torch.Tensor:
    """Cumulative offsets `[0, q0, q0 + q1, ...]` (int32) of packed per-request queries.

    Raises:
        ValueError: On a negative length.
    """
    if any(n < 0 for n in query_lens):
        raise ValueError("query lengths must be non-negative")
    loc = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    if query_lens:
        loc[1:] = torch.cumsum(torch.tensor(list(query_lens), dtype=torch.int64), 0).to(torch.int32)
    return loc.to(device)


def slot_mapping_tensor(
    block_ids: Sequence[Sequence[int]],
    positions: Sequence[Sequence[int]],
    block_size: int,
    *,
    pad_to: int | None = None,
    device: Device = "cpu",
) -> torch.Tensor:
    """Cache slots (`block_id * block_size + offset`, int64) of the given token positions.

    Args:
        block_ids: One list of block ids per request.
        positions: For each request, the positions (0-based within its sequence) of the tokens
            to write, in the order they appear in the packed key/value tensors.
        block_size: Tokens per block.
        pad_to: Pad the result with -1 (skipped slots) up to this many tokens.
        device: Where to put the mapping.

    Raises:
        ValueError: When a position falls outside the request's blocks, or `pad_to` is too small.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if len(block_ids) != len(positions):
        raise ValueError(
            f"{len(block_ids)} block-id lists but {len(positions)} position lists were given"
        )
    slots: list[int] = []
    for i, (ids, pos) in enumerate(zip(block_ids, positions, strict=True)):
        for p in pos:
            if not 0 <= p < len(ids) * block_size:
                raise ValueError(
                    f"request {i}: position {p} is outside its {len(ids)} blocks of {block_size}"
                )
            slots.append(ids[p // block_size] * block_size + p % block_size)
    if pad_to is not None:
        if pad_to < len(slots):
            raise ValueError(f"pad_to={pad_to} is less than the {len(slots)} tokens")
        slots.extend([-1] * (pad_to - len(slots)))
    return torch.tensor(slots, dtype=torch.int64).to(device)


def build_metadata(
    block_ids: Sequence[Sequence[int]],
    num_computed_tokens: Sequence[int],
    num_scheduled_tokens: Sequence[int],
    block_size: int,
    *,
    num_cols: int | None = None,
    device: Device = "cpu",
) -> AttentionMetadata:
    """Builds the metadata of one step in which request `i` appends `num_scheduled_tokens[i]`
    tokens after its `num_computed_tokens[i]` tokens already in the cache.

    Args:
        block_ids: One list of block ids per request (one KV-cache group), e.g.
            `manager.get_block_ids(req_id)[group]`.
        num_computed_tokens: Tokens of each request whose K/V are already cached (prefix-cache
            hits included).
        num_scheduled_tokens: New tokens of each request in this step (1 for decode).
        block_size: Tokens per block of this group.
        num_cols: Width of the block table (default: the longest list).
        device: Where to put the tensors.

    Returns:
        The metadata; `slot_mapping` lists the new tokens in request order, matching the packed
        layout of `q`, `key` and `value`.

    Raises:
        ValueError: On lists of different lengths, negative counts, or a request whose blocks
            cannot hold its tokens.
    """
    n = len(block_ids)
    if len(num_computed_tokens) != n or len(num_scheduled_tokens) != n:
        raise ValueError(
            f"got {n} block-id lists, {len(num_computed_tokens)} computed counts and "
            f"{len(num_scheduled_tokens)} scheduled counts"
        )
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    seq_lens: list[int] = []
    positions: list[range] = []
    for i in range(n):
        done, new = num_computed_tokens[i], num_scheduled_tokens[i]
        if done < 0 or new < 0:
            raise ValueError(f"request {i}: token counts must be non-negative")
        total = done + new
        if _common.cdiv(total, block_size) > len(block_ids[i]):
            raise ValueError(
                f"request {i}: {total} tokens need {_common.cdiv(total, block_size)} blocks of "
                f"{block_size}, it has {len(block_ids[i])}"
            )
        seq_lens.append(total)
        positions.append(range(done, total))
    return AttentionMetadata(
        block_table=block_table_tensor(block_ids, num_cols=num_cols, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device),
        query_start_loc=query_start_loc_tensor(list(num_scheduled_tokens), device=device),
        slot_mapping=slot_mapping_tensor(block_ids, positions, block_size, device=device),
        max_query_len=max(num_scheduled_tokens, default=0),
        max_seq_len=max(seq_lens, default=0),
    )
