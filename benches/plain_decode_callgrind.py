"""One decode ``allocate_slots`` call of a vLLM-shaped request, counted by callgrind with its
cache simulation: instructions, L1 instruction-cache misses and L1 data-cache misses per call.

Inside vLLM's scheduler a manager call runs between stretches of the scheduler's own Python
code, which push the call's code and data out of the L1 caches; the call's wall-clock time
there is mostly those misses, and on a shared 2-core machine it drifts by tens of percent from
run to run. Counted by callgrind, the same call is repeatable: the workload below runs a little
unrelated Python code (dict and list reads, a ``json.dumps``) before each call, as the
scheduler does, and the decode calls ``allocate_slots(request, 1, num_lookahead_tokens=0)``
of 256 running requests of a class laid out as vLLM's ``Request`` (plain attributes, the token
count a property over ``_all_token_ids``: ``tests/test_plain_requests.py``'s ``PlainRequest``,
registered as kvcore's plain class), events on, one
block filled every 16 steps. Two runs (16 and 48 decode steps) are subtracted, so start-up,
imports and admissions cancel out.

Usage::

    python benches/plain_decode_callgrind.py            # full attention and full + SWA
    python benches/plain_decode_callgrind.py --run full 256 48   # the workload alone

Needs valgrind; vLLM is not imported (the request class mimics its layout).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_plain_requests import PlainManager, PlainRequest

from kvcore.config import KVCacheConfig, KVCacheGroupSpec
from kvcore.hashing import get_request_block_hasher, init_none_hash, sha256
from kvcore.specs import FullAttentionSpec, SlidingWindowSpec

BLOCK = 16
RUNNING = 5  # RequestStatus.RUNNING
# The native entry's symbol: callgrind counts what runs inside it.
ENTRY = "*fast_entry*allocate_slots*"


def workload(model: str, running: int, steps: int) -> None:
    """Admits ``running`` requests, then decodes ``steps`` steps with scheduler-like Python
    work before every call."""
    attn: dict[str, Any] = {"block_size": BLOCK, "num_kv_heads": 1, "head_size": 64}
    groups = [KVCacheGroupSpec(["full"], FullAttentionSpec(dtype="float16", **attn))]
    if model == "swa":
        spec = SlidingWindowSpec(dtype="float16", sliding_window=128, **attn)
        groups.append(KVCacheGroupSpec(["swa"], spec))
    num_blocks = running * (steps // BLOCK + 10) * len(groups) + 16
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    mgr = PlainManager(
        KVCacheConfig(num_blocks, [], groups),
        max_model_len=8192,
        scheduler_block_size=BLOCK,
        hash_block_size=BLOCK,
        enable_kv_cache_events=True,
    )
    reqs: list[Any] = [
        PlainRequest(f"req-{i}", list(range(i % 500, i % 500 + 100)), hasher)
        for i in range(running)
    ]
    for r in reqs:
        hits, n = mgr.get_computed_blocks(r)
        assert mgr.allocate_slots(r, r.num_tokens - n, n, hits) is not None
        r.num_computed_tokens = r.num_tokens
        r.status = RUNNING
        r.append(7)  # the sampled token: decode computes it next
    other = [{"a": i, "b": str(i), "c": [i]} for i in range(4000)]

    def scheduler_work(k: int) -> int:
        total = 0
        for d in other[k * 15 % 4000 : k * 15 % 4000 + 15]:
            total += d["a"] + len(d["b"]) + len(d["c"])  # type: ignore[operator,arg-type]
        json.dumps({"k": k})
        return total

    allocate = mgr.allocate_slots
    for s in range(steps):
        for k, r in enumerate(reqs):
            scheduler_work(k)
            assert allocate(r, 1, num_lookahead_tokens=0) is not None
        for r in reqs:
            r.num_computed_tokens += 1
            r.append(s)
        mgr.take_events()


def count(model: str, running: int, steps: int, out: Path, entry: str) -> list[int]:
    """Instructions, L1i misses and L1d read misses inside the entry, in one callgrind run."""
    cmd = [
        "valgrind",
        "--tool=callgrind",
        "--cache-sim=yes",
        f"--callgrind-out-file={out}",
        f"--toggle-collect={entry}",
        sys.executable,
        __file__,
        "--run",
        model,
        str(running),
        str(steps),
    ]
    err = subprocess.run(cmd, check=True, capture_output=True, text=True).stderr
    for line in err.splitlines():
        if "Collected :" in line:
            fields = [int(x) for x in line.split(":", 1)[1].split()]
            # Ir Dr Dw I1mr D1mr D1mw ...
            return [fields[0], fields[3], fields[4]]
    raise RuntimeError(f"no callgrind totals in:\n{err}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", nargs=3, metavar=("MODEL", "RUNNING", "STEPS"))
    parser.add_argument(
        "--entry",
        default=ENTRY,
        help="the native function counted (builds before the fastcall entry: "
        "'*__pymethod_allocate_slots__*')",
    )
    args = parser.parse_args()
    if args.run:
        model, running, steps = args.run
        workload(model, int(running), int(steps))
        return
    running, small, large = 256, 16, 48
    with tempfile.TemporaryDirectory() as tmp:
        for model in ("full", "swa"):
            a = count(model, running, small, Path(tmp) / "a.out", args.entry)
            b = count(model, running, large, Path(tmp) / "b.out", args.entry)
            calls = running * (large - small)
            ir, i1, d1 = ((y - x) / calls for x, y in zip(a, b, strict=True))
            print(
                f"{model}: {ir:.0f} instructions, {i1:.1f} L1i misses, {d1:.1f} L1d read "
                "misses per decode allocate_slots"
            )


if __name__ == "__main__":
    main()
