"""The ``kvcore`` command line: ``kvcore simulate`` and ``kvcore bench``.

``kvcore simulate`` replays a serving workload (the built-in synthetic chat mix, or a JSONL
trace) through kvcore's ``KVCacheManager`` with a continuous-batching scheduler and prints a
summary; ``--compare reference`` replays the same workload through the reference and checks
that every decision matches. ``kvcore bench`` times pool operations, hashing and one replay
against the reference.

A default run imports neither torch nor the reference.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from collections.abc import Sequence
from typing import Any

from kvcore.simulate.backends import (
    BACKENDS,
    MODEL_PRESETS,
    Backend,
    BackendUnavailable,
    ManagerSettings,
    ModelPreset,
    make_backend,
    model_preset,
)
from kvcore.simulate.progress import Progress
from kvcore.simulate.report import combine, format_table, summarize
from kvcore.simulate.scheduler import (
    ConfigError,
    SchedulerSettings,
    SimulationStalled,
    Simulator,
    check_config,
)
from kvcore.simulate.trace import TraceError, load_trace
from kvcore.simulate.workload import ChatWorkloadParams, RequestSpec, synthetic_chat

HASH_FUNCTIONS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``kvcore`` (exposed for documentation and tests)."""
    parser = argparse.ArgumentParser(
        prog="kvcore", description="kvcore: a fast KV-cache block manager for LLM serving."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sim = sub.add_parser(
        "simulate",
        help="replay a serving workload through the KV-cache manager",
        description="Replay a serving workload through kvcore's KVCacheManager with a "
        "continuous-batching scheduler (chunked prefill, prefix caching, preemption) and "
        "report hit rate, preemptions, usage and the manager's cost per step.",
    )
    wl = sim.add_argument_group("workload")
    wl.add_argument(
        "--trace",
        metavar="FILE.jsonl",
        help="replay this JSONL trace (see docs/trace-format.md) instead of the synthetic "
        "chat workload",
    )
    wl.add_argument(
        "--requests",
        type=_non_negative,
        default=300,
        metavar="N",
        help="synthetic workload: number of requests (default: %(default)s)",
    )
    wl.add_argument(
        "--arrival-rate",
        type=float,
        default=0.5,
        metavar="RATE",
        help="synthetic workload: new conversations per step (default: %(default)s)",
    )
    wl.add_argument(
        "--seed",
        type=int,
        default=0,
        metavar="SEED",
        help="seed of the workload's tokens and of NONE_HASH (default: %(default)s)",
    )
    kv = sim.add_argument_group("KV cache")
    kv.add_argument(
        "--num-blocks",
        type=_positive,
        default=2000,
        metavar="N",
        help="blocks in the pool, null block included (default: %(default)s)",
    )
    kv.add_argument(
        "--block-size",
        type=_positive,
        default=16,
        metavar="TOKENS",
        help="tokens per block (default: %(default)s)",
    )
    kv.add_argument(
        "--hash",
        choices=HASH_FUNCTIONS,
        default="sha256",
        help="block hash function (default: %(default)s)",
    )
    kv.add_argument(
        "--model",
        choices=MODEL_PRESETS,
        default="full",
        help="model preset: full attention, full + sliding window, full + Mamba "
        "(default: %(default)s)",
    )
    kv.add_argument(
        "--sliding-window",
        type=_positive,
        default=1024,
        metavar="TOKENS",
        help="window of the hybrid-swa preset, in tokens (default: %(default)s)",
    )
    kv.add_argument(
        "--events",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="KV-cache events on or off; evictions are counted from them (default: on)",
    )
    kv.add_argument(
        "--prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="prefix caching on or off (default: on)",
    )
    sc = sim.add_argument_group("scheduler")
    sc.add_argument(
        "--max-model-len",
        type=_positive,
        default=8192,
        metavar="TOKENS",
        help="longest sequence (default: %(default)s)",
    )
    sc.add_argument(
        "--max-num-batched-tokens",
        type=_positive,
        default=2048,
        metavar="TOKENS",
        help="token budget per step (default: %(default)s)",
    )
    sc.add_argument(
        "--max-num-seqs",
        type=_positive,
        default=128,
        metavar="N",
        help="most running requests (default: %(default)s)",
    )
    sc.add_argument(
        "--watermark",
        type=float,
        default=0.0,
        metavar="FRACTION",
        help="fraction of blocks kept free when admitting (default: %(default)s)",
    )
    sc.add_argument(
        "--no-admission-gate",
        dest="admission_gate",
        action="store_false",
        help="do not require the whole sequence to fit at admission",
    )
    out = sim.add_argument_group("output")
    out.add_argument(
        "--backend",
        choices=BACKENDS,
        default="kvcore",
        help="implementation to drive (default: %(default)s)",
    )
    out.add_argument(
        "--compare",
        choices=["reference"],
        help="also replay through the reference and compare speed and decisions",
    )
    out.add_argument("--json", action="store_true", help="print one JSON object instead")
    out.add_argument("--plot", metavar="FILE.png", help="draw usage, hit rate and requests")
    out.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")

    bench = sub.add_parser(
        "bench",
        help="micro-benchmarks against the reference",
        description="Time pool operations, block hashing and one replay with kvcore and, "
        "when it is installed, the reference, and print the ratios.",
    )
    bench.add_argument("--quick", action="store_true", help="fewer repetitions")
    bench.add_argument("--json", action="store_true", help="print one JSON object instead")
    return parser


def _workload(args: argparse.Namespace) -> list[RequestSpec]:
    if args.trace is not None:
        return load_trace(args.trace, seed=args.seed)
    return synthetic_chat(
        ChatWorkloadParams(
            num_requests=args.requests,
            seed=args.seed,
            arrival_rate=args.arrival_rate,
            max_model_len=args.max_model_len,
        )
    )


def _header(args: argparse.Namespace, model: ModelPreset, n: int) -> str:
    source = args.trace if args.trace is not None else f"synthetic chat, seed {args.seed}"
    return (
        f"kvcore simulate: {n} requests ({source}); {model.name} model, "
        f"{args.num_blocks} blocks x {args.block_size} tokens, {args.hash}, "
        f"events {'on' if args.events else 'off'}"
    )


def _run_one(
    backend: Backend,
    args: argparse.Namespace,
    model: ModelPreset,
    settings: ManagerSettings,
    sched: SchedulerSettings,
    workload: list[RequestSpec],
) -> tuple[Simulator, bool]:
    """Runs one backend; returns the simulator and whether it was interrupted.

    Like a serving engine after start-up, the run starts with a collected and frozen heap
    (``gc.freeze``), so that neither backend pays for scanning what its imports allocated.
    """
    sim = Simulator(backend, model, settings, sched, workload)
    progress = Progress(len(workload), f"{backend.name:>9}", enabled=not args.no_progress)

    def on_step(s: Simulator) -> None:
        st = s.stats
        progress.update(st.finished, st.steps, st.sample_usage[-1] if st.sample_usage else 0.0)

    gc.collect()
    gc.freeze()
    try:
        sim.run(on_step)
    except KeyboardInterrupt:
        return sim, True
    finally:
        gc.unfreeze()
        progress.close()
    return sim, False


def cmd_simulate(args: argparse.Namespace) -> int:
    """Runs ``kvcore simulate``; returns the exit status."""
    prog = "kvcore simulate"
    try:
        model = model_preset(args.model, args.block_size, args.sliding_window)
        if args.plot is not None:
            from kvcore.simulate.plot import require_matplotlib

            require_matplotlib()
        workload = _workload(args)
        settings = ManagerSettings(
            num_blocks=args.num_blocks,
            max_model_len=args.max_model_len,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_caching=args.prefix_caching,
            enable_events=args.events,
            watermark=args.watermark,
            hash_name=args.hash,
            hash_seed=str(args.seed),
        )
        sched = SchedulerSettings(
            max_num_seqs=args.max_num_seqs, admission_gate=args.admission_gate
        )
        check_config(model, settings, sched, workload)
    except (TraceError, ConfigError, ValueError, ImportError, OSError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE

    header = _header(args, model, len(workload))
    runs: list[tuple[Simulator, bool]] = []
    try:
        # Every backend is imported before anything runs, so both runs see the same process.
        names = [args.backend] + ([args.compare] if args.compare is not None else [])
        backends = [make_backend(name) for name in names]
    except BackendUnavailable as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        for backend in backends:
            runs.append(_run_one(backend, args, model, settings, sched, workload))
            if runs[-1][1]:
                break
    except SimulationStalled as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_FAILED

    interrupted = any(r[1] for r in runs)
    summaries = [summarize(sim, interrupted=intr) for sim, intr in runs]
    summary = combine(summaries[0], summaries[1] if len(summaries) > 1 else None)
    summary["config"] = {
        "model": model.name,
        "num_blocks": args.num_blocks,
        "block_size": args.block_size,
        "hash": args.hash,
        "events": args.events,
        "prefix_caching": args.prefix_caching,
        "seed": args.seed,
        "max_model_len": args.max_model_len,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs": args.max_num_seqs,
        "watermark": args.watermark,
        "admission_gate": args.admission_gate,
        "workload": args.trace if args.trace is not None else "synthetic-chat",
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(format_table(summary, header))
    if args.plot is not None and runs:
        from kvcore.simulate.plot import plot

        plot(runs[0][0], args.plot, title=header.replace("kvcore simulate: ", ""))
        if not args.json:
            print(f"plot written to {args.plot}")
    if interrupted:
        return EXIT_INTERRUPTED
    if summary.get("decisions_match") is False:
        print(f"{prog}: error: decisions differ from the reference", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def cmd_bench(args: argparse.Namespace) -> int:
    """Runs ``kvcore bench``; returns the exit status."""
    from kvcore.simulate.bench import format_bench, run_bench

    try:
        results = run_bench(quick=args.quick)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(format_bench(results))
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvcore`` console script and of ``python -m kvcore``.

    Args:
        argv: Arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit status: 0, 1 (stalled run or decisions differ), 2 (bad input) or 130
        (interrupted; the partial summary is printed).
    """
    args = build_parser().parse_args(argv)
    command: Any = {"simulate": cmd_simulate, "bench": cmd_bench}[args.command]
    try:
        return int(command(args))
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
