"""The README's Python example runs as printed and does what its comments say."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

from readme_example import readme_example, run_example

from kvcore.blocks import KVCacheBlocks
from kvcore.manager import KVCacheManager
from kvcore.request import Request

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_example_runs_and_allocates() -> None:
    """The example allocates the prompt's blocks, reports events and frees the request."""
    source = readme_example(README)
    assert "KVCacheManager" in source and "allocate_slots" in source
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ns = run_example(README)
    mgr, req = ns["mgr"], ns["req"]
    printed = out.getvalue()
    # 100 tokens in 16-token blocks: 7 blocks, ids printed as one group's tuple.
    assert "BlockStored" in printed
    assert isinstance(mgr, KVCacheManager) and isinstance(req, Request)
    new = ns["new"]
    assert isinstance(new, KVCacheBlocks)
    (ids,) = new.get_block_ids()
    assert len(ids) == 7
    # The example ends by freeing the request: every block is back in the pool.
    assert mgr.block_pool.get_num_free_blocks() == mgr.block_pool.num_gpu_blocks - 1
