"""What cache control costs (docs/behaviour.md §21): pool cycles and the scheduler loop with
retention off and on, kvcore against the reference.

The workloads are in ``retention_workload.py`` (the loop's harness in ``scheduler_loop.py``,
shared with ``test_bench_manager.py``); ``compare_instructions.py`` counts their instructions
under callgrind. With retention off kvcore runs the reference's
plain LRU; with it on, frees carry retention priorities and times to live (a fake clock makes
the deadlines run out during the run) and some blocks are pinned. The reference has no
retention: its side of an "on" case is its plain LRU on the same trace.

- Pool cycles over a cached 4096-block pool, per block, each in a pair (reference time /
  kvcore time, see ``conftest.py``; ``benches/results/retention.json``):
  ``get_new_blocks`` + ``free_blocks`` (1 / 16 / 256 blocks), ``touch`` of 256 cached free
  blocks, and the churn of a full prefix cache (``get_new_blocks``, which evicts,
  ``cache_full_blocks`` with new hashes, ``free_blocks``; 16 / 256 blocks), each with retention
  off and on; ``pin_prefix`` + ``unpin_prefix`` of 64 blocks (kvcore only).
  Separate runs drift apart on a noisy machine, so ``test_pool_onoff`` also runs kvcore off,
  kvcore on and the reference in turns of 2 ms (100 rounds, medians): the second table, of
  kvcore's on / off ratio and both ratios to the reference per cycle
  (``benches/results/retention_cost.json``).
- The scheduler loop of ``test_bench_manager.py`` (2000 requests / 8192 blocks), run in
  lockstep by the reference, kvcore with retention off and on, each kvcore with per-request
  calls and with the batch calls. Requests carry ``retention_priority`` / ``retention_ttl_s``,
  the two most used system prompts are pinned every 200 steps (``pin_prefix`` with a time to
  live), the manager's clock is a fake one moved 10 ms per step. kvcore with retention off
  makes the reference's decisions (checksums equal); with it on, its own (the same with the
  batch calls). Results: ``benches/results/retention_loop.json``.

``KVCORE_BENCH_SCALE`` (default 1.0) shrinks the loop. Run on a release build:
``python -m pytest benches/test_bench_retention.py --benchmark-only``.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import retention_workload as w
import scheduler_loop as loop

IMPLS = ["kvcore", "reference"]
MODES = ["off", "on"]
SCALE = float(os.environ.get("KVCORE_BENCH_SCALE", "1.0"))
RESULTS = Path(__file__).parent / "results"
ONOFF_ROUNDS = 100
ONOFF_TURN_S = 0.002

LABELS = {
    "alloc_free_1": "get_new_blocks+free_blocks 1",
    "alloc_free_16": "get_new_blocks+free_blocks 16",
    "alloc_free_256": "get_new_blocks+free_blocks 256",
    "touch_256": "touch 256 (cached, free)",
    "churn_16": "churn 16 (get_new+cache_full+free)",
    "churn_256": "churn 256 (get_new+cache_full+free)",
}


def _group(op: str, mode: str) -> str:
    return f"{LABELS[op]}, retention {mode}"


def _fmt(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1e-6:
        return f"{seconds * 1e9:.1f} ns"
    return f"{seconds * 1e6:.2f} us"


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


@pytest.fixture(scope="module")
def onoff(request: pytest.FixtureRequest) -> Iterator[dict[str, dict[str, float]]]:
    """Seconds per block per (cycle, side) from ``test_pool_onoff``; prints the on / off
    table at the end and writes ``benches/results/retention_cost.json``."""
    medians: dict[str, dict[str, float]] = {}
    yield medians
    if not medians:
        return
    rows: list[dict[str, Any]] = []
    for op, sides in medians.items():
        off, on, ref = sides.get("kvcore-off"), sides.get("kvcore-on"), sides.get("reference")
        rows.append(
            {
                "case": LABELS.get(op, op),
                "kvcore_off": off,
                "kvcore_on": on,
                "reference": ref,
                "on_over_off": _ratio(on, off),
                "reference_over_kvcore_off": _ratio(ref, off),
                "reference_over_kvcore_on": _ratio(ref, on),
            }
        )
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "retention_cost.json"
    meta = {"unit": "s/block (median of interleaved rounds)", "rounds": ONOFF_ROUNDS}
    path.write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None:
        return

    def x(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}x"

    with capture.global_and_fixture_disabled():
        reporter.write_line("")
        reporter.write_line(
            "retention cost per block, interleaved (kvcore on / off; reference = its plain "
            "LRU on the same trace)"
        )
        reporter.write_line(
            f"  {'case':36s} {'kv off':>10s} {'kv on':>10s} {'on/off':>7s} "
            f"{'reference':>10s} {'ref/off':>8s} {'ref/on':>8s}"
        )
        for r in rows:
            reporter.write_line(
                f"  {r['case']:36s} {_fmt(r['kvcore_off']):>10s} {_fmt(r['kvcore_on']):>10s} "
                f"{x(r['on_over_off']):>7s} {_fmt(r['reference']):>10s} "
                f"{x(r['reference_over_kvcore_off']):>8s} {x(r['reference_over_kvcore_on']):>8s}"
            )
        reporter.write_line(f"written {path}")


def _case(impl: str, mode: str, op: str) -> w.PoolCase:
    if impl == "reference":
        pytest.importorskip("vllm.v1.core.block_pool")
    return w.pool_case(impl, mode == "on" and impl == "kvcore", op)


# The mode is the innermost parameter, then the side: each cycle runs off and on back to back.
@pytest.mark.parametrize("op", w.POOL_OPS)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", MODES)
def test_pool_cycle(
    paired: Callable[..., Any],
    mode: str,
    impl: str,
    op: str,
) -> None:
    """One pool cycle on one side, retention off or on (the reference: plain LRU)."""
    case = _case(impl, mode, op)
    paired(
        _group(op, mode),
        impl,
        case.fn,
        per=case.per,
        setup=case.setup,
        rounds=2000 if case.setup is not None else None,
    )


def _time_per_block(case: w.PoolCase, target_s: float) -> float:
    """Seconds per block of ``case`` over about ``target_s`` (its setup untimed)."""
    fn, setup, clock = case.fn, case.setup, time.perf_counter
    n = max(1, round(target_s / case.cost_s))
    if setup is None:
        t0 = clock()
        for _ in range(n):
            fn()
        return (clock() - t0) / (n * case.per)
    spent = 0.0
    for _ in range(n):
        setup()
        t0 = clock()
        fn()
        spent += clock() - t0
    return spent / (n * case.per)


def _interleaved(sides: dict[str, w.PoolCase]) -> dict[str, float]:
    """Median seconds per block of each side, measured in turns of ``ONOFF_TURN_S``."""
    for case in sides.values():
        t0 = time.perf_counter()
        for _ in range(20):
            if case.setup is not None:
                case.setup()
            case.fn()
        case.cost_s = (time.perf_counter() - t0) / 20
    samples: dict[str, list[float]] = {k: [] for k in sides}
    order = list(sides)
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for i in range(ONOFF_ROUNDS):
            for k in order if i % 2 == 0 else order[::-1]:
                samples[k].append(_time_per_block(sides[k], ONOFF_TURN_S))
    finally:
        if gc_was:
            gc.enable()
    return {k: statistics.median(v) for k, v in samples.items()}


@pytest.mark.parametrize("op", w.POOL_OPS)
def test_pool_onoff(benchmark: Any, op: str, onoff: dict[str, dict[str, float]]) -> None:
    """kvcore off, kvcore on and the reference (plain LRU, same trace) in turns of about
    2 ms, ``ONOFF_ROUNDS`` rounds: the machine's drift hits all three alike, so the ratios of
    their medians hold better than those of separate runs."""
    sides = {
        "kvcore-off": w.pool_case("kvcore", False, op),
        "kvcore-on": w.pool_case("kvcore", True, op),
    }
    if importlib.util.find_spec("vllm") is not None:
        sides["reference"] = w.pool_case("reference", False, op)
    holder: list[dict[str, float]] = []
    benchmark.pedantic(lambda: holder.append(_interleaved(sides)), rounds=1, iterations=1)
    onoff[op] = holder[0]
    benchmark.extra_info.update(holder[0])


def test_pool_pin(paired: Callable[..., Any]) -> None:
    """``pin_prefix`` + ``unpin_prefix`` of 64 cached free blocks (kvcore only)."""
    case = w.pool_case("kvcore", True, "pin_64")
    paired("pin_prefix+unpin_prefix 64 (kvcore only)", "kvcore", case.fn, per=case.per)


# --------------------------------------------------------------------------------------------
# Scheduler loop
# --------------------------------------------------------------------------------------------


def _loop_record(size: loop.Size, names: list[str], res: list[loop.RunResult]) -> dict[str, Any]:
    by = dict(zip(names, res, strict=True))
    ref_mean, _ = loop.step_stats(by["reference"].step_us)
    ref_total = sum(by["reference"].step_us) / 1e6
    impls: dict[str, Any] = {}
    for name, r in by.items():
        mean, p99 = loop.step_stats(r.step_us)
        total = sum(r.step_us) / 1e6
        impls[name] = {
            "mean_us": round(mean, 2),
            "p99_us": round(p99, 2),
            "total_s": round(total, 3),
            "steps": r.steps,
            "preemptions": r.preemptions,
            "prefix_hit_tokens": r.hit_tokens,
            "prompt_tokens": r.prompt_tokens,
            "pin_calls": r.pin_calls,
            "max_pinned_blocks": r.max_pinned,
            "checksum": r.checksum,
            "reference_over_mean": round(ref_mean / mean, 3),
            "reference_over_total": round(ref_total / total, 3),
        }
    for suffix in ("", "-batch"):
        off, on = impls[f"kvcore-off{suffix}"], impls[f"kvcore-on{suffix}"]
        on["on_over_off_mean"] = round(on["mean_us"] / off["mean_us"], 3)
        on["on_over_off_total"] = round(on["total_s"] / off["total_s"], 3)
    row = {**loop.size_fields(size, SCALE), "impls": impls}
    loop.merge_results(RESULTS / "retention_loop.json", size, row)
    return row


def _loop_table(name: str, row: dict[str, Any]) -> str:
    lines = [
        f"\nretention loop {name}: {row['requests']} requests, {row['num_blocks']} blocks",
        f"  {'impl':17s} {'mean us/step':>12s} {'p99 us/step':>12s} {'total s':>8s} "
        f"{'steps':>6s} {'preempt':>7s} {'hit tokens':>10s} {'ref/mean':>8s} {'ref/total':>9s} "
        f"{'on/off mean':>11s} {'on/off total':>12s}",
    ]
    for impl, r in row["impls"].items():
        onoff = (
            f" {r['on_over_off_mean']:10.3f}x {r['on_over_off_total']:11.3f}x"
            if "on_over_off_mean" in r
            else ""
        )
        lines.append(
            f"  {impl:17s} {r['mean_us']:12.1f} {r['p99_us']:12.1f} {r['total_s']:8.2f} "
            f"{r['steps']:6d} {r['preemptions']:7d} {r['prefix_hit_tokens']:10d} "
            f"{r['reference_over_mean']:7.2f}x {r['reference_over_total']:8.2f}x{onoff}"
        )
    return "\n".join(lines)


@pytest.mark.slow
@pytest.mark.reference
@pytest.mark.timeout(3600)
def test_bench_retention_loop(
    benchmark: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scheduler loop with retention off and on, against the reference."""
    pytest.importorskip("vllm.v1.core.kv_cache_manager")
    monkeypatch.setenv("PYTHONHASHSEED", "0")  # every NONE_HASH from the same seed
    size = w.LOOP_SIZE.scaled(SCALE)
    convs, systems = loop.make_workload(size)
    impls = [
        loop.reference_impl(size),
        w.kvcore_loop_impl(size, retention=False, batch=False),
        w.kvcore_loop_impl(size, retention=True, batch=False, systems=systems),
        w.kvcore_loop_impl(size, retention=False, batch=True),
        w.kvcore_loop_impl(size, retention=True, batch=True, systems=systems),
    ]
    holder: list[list[loop.RunResult]] = []
    benchmark.pedantic(
        lambda: holder.append(loop.run_lockstep(impls, size, convs)), rounds=1, iterations=1
    )
    names = [i.name for i in impls]
    res = dict(zip(names, holder[0], strict=True))
    row = _loop_record(size, names, holder[0])
    benchmark.extra_info.update(row)
    with capsys.disabled():
        print(_loop_table(size.name, row))
    ref = res["reference"]
    assert res["kvcore-off"].checksum == ref.checksum, "retention off changed a decision"
    assert res["kvcore-off-batch"].checksum == ref.checksum, "retention off changed a decision"
    assert res["kvcore-on-batch"].checksum == res["kvcore-on"].checksum, (
        "allocate_slots_batch changed a decision with retention on"
    )
    assert res["kvcore-on"].pin_calls > 0 and res["kvcore-on"].max_pinned > 0
