"""Metadata helpers: kvcore block ids and token counts -> kernel tensors."""

from __future__ import annotations

import kvcore_kernels as kk
import pytest
import torch


def test_build_metadata_mixed_step() -> None:
    # Request 0: 20 cached + 5 new; request 1: fresh prefill of 3; request 2: decode at 33.
    block_ids = [[7, 2], [5], [1, 3, 4]]
    meta = kk.build_metadata(block_ids, [20, 0, 32], [5, 3, 1], 16)
    assert meta.block_table.dtype == torch.int32
    assert meta.block_table.tolist() == [[7, 2, 0], [5, 0, 0], [1, 3, 4]]
    assert meta.seq_lens.tolist() == [25, 3, 33]
    assert meta.query_start_loc.tolist() == [0, 5, 8, 9]
    assert meta.slot_mapping.dtype == torch.int64
    expected = [2 * 16 + p - 16 for p in range(20, 25)] + [5 * 16 + p for p in range(3)]
    expected += [4 * 16 + 0]
    assert meta.slot_mapping.tolist() == expected
    assert (meta.max_query_len, meta.max_seq_len) == (5, 33)


def test_block_table_width_and_padding() -> None:
    table = kk.block_table_tensor([[3], [], [1, 2]], num_cols=4, pad_id=9)
    assert table.tolist() == [[3, 9, 9, 9], [9, 9, 9, 9], [1, 2, 9, 9]]
    with pytest.raises(ValueError, match="num_cols"):
        kk.block_table_tensor([[1, 2, 3]], num_cols=2)
    with pytest.raises(ValueError, match="negative"):
        kk.block_table_tensor([[1, -2]])


def test_block_ids_of_group_picks_one_group_per_request() -> None:
    # As returned by KVCacheBlocks.get_block_ids(): one list per KV-cache group.
    per_request = [([1, 2], [10]), ([3], [11, 12])]
    assert kk.block_ids_of_group(per_request, 0) == [[1, 2], [3]]
    assert kk.block_ids_of_group(per_request, 1) == [[10], [11, 12]]
    with pytest.raises(ValueError, match="no group 2"):
        kk.block_ids_of_group(per_request, 2)


def test_query_start_loc_and_slots_with_padding() -> None:
    assert kk.query_start_loc_tensor([3, 0, 2]).tolist() == [0, 3, 3, 5]
    assert kk.query_start_loc_tensor([]).tolist() == [0]
    slots = kk.slot_mapping_tensor([[4, 6]], [[15, 16]], 16, pad_to=4)
    assert slots.tolist() == [4 * 16 + 15, 6 * 16, -1, -1]
    # Non-power-of-two block size.
    assert kk.slot_mapping_tensor([[2, 9]], [[47, 48]], 48).tolist() == [2 * 48 + 47, 9 * 48]


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: kk.build_metadata([[1]], [10], [7], 16), "need 2 blocks"),
        (lambda: kk.build_metadata([[1], [2]], [0], [1, 1], 16), "block-id lists"),
        (lambda: kk.build_metadata([[1]], [-1], [1], 16), "non-negative"),
        (lambda: kk.build_metadata([[1]], [0], [1], 0), "block_size"),
        (lambda: kk.slot_mapping_tensor([[1]], [[16]], 16), "outside"),
        (lambda: kk.slot_mapping_tensor([[1]], [[0, 1]], 16, pad_to=1), "pad_to"),
        (lambda: kk.query_start_loc_tensor([1, -1]), "non-negative"),
    ],
)
def test_bad_input(call: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()  # type: ignore[operator]
