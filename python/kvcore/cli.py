"""The ``kvcore`` command line: ``kvcore simulate`` and ``kvcore bench``.

``kvcore simulate`` replays a serving workload (the built-in synthetic chat mix, or a JSONL
trace) through kvcore's ``KVCacheManager`` with a continuous-batching scheduler and prints a
summary; ``--compare reference`` replays the same workload through the reference and checks
that every decision matches. ``kvcore bench`` times pool operations, hashing and one replay
against the reference.

Every mistake in the arguments is reported before anything runs, as one line on stderr that
names the flag (``kvcore simulate: error: --num-blocks: expected an integer >= 2, got 'abc'``),
with exit status 2. The workload is generated (or the trace read) while the simulation runs,
so that progress shows at once and memory does not grow with the whole workload.

Ctrl-C stops a simulation after the current step and prints the partial summary (exit status
130). While the summary is being written, one more Ctrl-C is ignored, with a note on stderr,
so that a double press does not lose it; the next one quits without it.

A default run imports neither torch nor the reference.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

from kvcore import __version__
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
from kvcore.simulate.progress import make_progress
from kvcore.simulate.report import combine, combine_lru, format_table, summarize
from kvcore.simulate.retention import (
    DEFAULT_PRIORITY_MIX,
    MAX_TTL_S,
    MAX_TTL_TEXT,
    STEP_SECONDS,
    PriorityTier,
    RetentionSettings,
    describe_mix,
    parse_priority_mix,
)
from kvcore.simulate.scheduler import (
    ConfigError,
    SchedulerSettings,
    SimulationStalled,
    Simulator,
    check_config,
)
from kvcore.simulate.trace import TraceError, TraceWorkload
from kvcore.simulate.workload import (
    MAX_ARRIVAL_RATE,
    MAX_SYSTEM_PROMPT_SKEW,
    MIN_SYNTHETIC_MODEL_LEN,
    ChatWorkloadParams,
    SyntheticChat,
    Workload,
)

HASH_FUNCTIONS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
PLOT_SUFFIXES = (".png", ".pdf", ".svg")
"""File types ``--plot`` writes (matplotlib's own backends, no extra package)."""

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

MAX_COUNT = 2**31 - 1
"""Largest value of the token and request counts (``2**31 - 1``)."""
MAX_BLOCKS = 2**31
"""Largest ``--num-blocks`` (the block pool's limit)."""
MAX_SEED = 2**32 - 1
"""Largest ``--seed`` (it is also the ``PYTHONHASHSEED`` that ``NONE_HASH`` comes from)."""

DEFAULT_REQUESTS = 300
DEFAULT_ARRIVAL_RATE = 0.5
DEFAULT_SLIDING_WINDOW = 1024
MAX_SYSTEM_PROMPTS = 1000
"""Largest ``--system-prompts`` (they are generated before the run)."""

_SUMMARIZING_NOTE = (
    b"kvcore simulate: still summarizing; press Ctrl-C again to quit without the summary\n"
)


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line: ``PROG: error: --flag: message``."""

    def error(self, message: str) -> NoReturn:
        text = message.removeprefix("argument ").replace("\n", " ")
        self.exit(EXIT_USAGE, f"{self.prog}: error: {text}\n")


def _integer(lo: int, hi: int, hi_text: str) -> Callable[[str], int]:
    """A flag type: an integer in ``[lo, hi]`` (``hi_text`` is how messages write ``hi``)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {text!r}")
        if value > hi:
            raise argparse.ArgumentTypeError(f"expected an integer <= {hi_text}, got {text!r}")
        return value

    return parse


def _number(lo: float, hi: float, *, lo_open: bool, hi_open: bool) -> Callable[[str], float]:
    """A flag type: a finite number in an interval (open or closed at each end)."""
    interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        inside = (
            math.isfinite(value)
            and (lo < value if lo_open else lo <= value)
            and (value < hi if hi_open else value <= hi)
        )
        if not inside:
            raise argparse.ArgumentTypeError(f"expected a number in {interval}, got {text!r}")
        return value

    return parse


def _pin_ttl(text: str) -> float:
    """A flag type: a TTL in simulated seconds, in (0, MAX_TTL_S]."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 < value <= MAX_TTL_S:  # NaN fails too
        raise argparse.ArgumentTypeError(
            f"expected a TTL in seconds, a number in (0, {MAX_TTL_TEXT}], got {text!r}"
        )
    return value


def _priority_mix(text: str) -> tuple[PriorityTier, ...]:
    """A flag type: a priority mix (see :func:`parse_priority_mix`)."""
    try:
        return parse_priority_mix(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _trace_file(text: str) -> str:
    """A flag type: a readable file."""
    if not text:
        raise argparse.ArgumentTypeError("expected a file name, got ''")
    try:
        with open(text, "rb"):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {text!r}: {exc.strerror or exc}") from None
    return text


def _plot_file(text: str) -> str:
    """A flag type: a file ``--plot`` can write, with matplotlib installed."""
    kinds = ", ".join(PLOT_SUFFIXES[:-1]) + f" or {PLOT_SUFFIXES[-1]}"
    path = Path(text)
    if not text.strip() or path.suffix.lower() not in PLOT_SUFFIXES:
        raise argparse.ArgumentTypeError(f"expected a file name ending in {kinds}, got {text!r}")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory")
    folder = path.parent
    if not folder.is_dir():
        what = "is not a directory" if folder.exists() else "does not exist"
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: directory {str(folder)!r} {what}")
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: permission denied")
    if importlib.util.find_spec("matplotlib") is None:
        raise argparse.ArgumentTypeError(
            "needs matplotlib: pip install 'kvcore[plot]' (or pip install matplotlib)"
        )
    return text


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``kvcore`` (exposed for documentation and tests)."""
    parser = _Parser(
        prog="kvcore", description="kvcore: a fast KV-cache block manager for LLM serving."
    )
    parser.add_argument("--version", action="version", version=f"kvcore {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sim = sub.add_parser(
        "simulate",
        help="replay a serving workload through the KV-cache manager",
        description="Replay a serving workload through kvcore's KVCacheManager with a "
        "continuous-batching scheduler (chunked prefill, prefix caching, preemption) and "
        "report hit rate, preemptions, usage and the manager's cost per step.",
        epilog="Ctrl-C stops the run after the current step and prints the partial summary. "
        "While the summary is being written, one more Ctrl-C is ignored (with a note); the "
        "next one quits without it. Exit status: 0 done, 1 the run stalled, the decisions "
        "differ from the reference or the plot could not be written, 2 bad arguments, "
        "trace or configuration (reported before anything runs), 130 interrupted.",
    )
    wl = sim.add_argument_group("workload")
    wl.add_argument(
        "--trace",
        metavar="FILE.jsonl",
        type=_trace_file,
        help="replay this JSONL trace (see docs/trace-format.md; a readable file) instead of "
        "the synthetic chat workload",
    )
    wl.add_argument(
        "--requests",
        type=_integer(1, MAX_COUNT, "2**31 - 1"),
        metavar="N",
        help="synthetic workload only: number of requests, an integer in [1, 2**31 - 1] "
        f"(default: {DEFAULT_REQUESTS})",
    )
    wl.add_argument(
        "--arrival-rate",
        type=_number(0.0, MAX_ARRIVAL_RATE, lo_open=True, hi_open=False),
        metavar="RATE",
        help="synthetic workload only: new conversations per step, a number in "
        f"(0, {MAX_ARRIVAL_RATE:g}] (default: {DEFAULT_ARRIVAL_RATE})",
    )
    wl.add_argument(
        "--system-prompts",
        type=_integer(0, MAX_SYSTEM_PROMPTS, f"{MAX_SYSTEM_PROMPTS}"),
        metavar="N",
        help="synthetic workload only: number of system prompts (600 to 1600 tokens) the "
        f"conversations share, an integer in [0, {MAX_SYSTEM_PROMPTS}] "
        f"(default: {ChatWorkloadParams().num_system_prompts})",
    )
    wl.add_argument(
        "--system-prompt-skew",
        type=_number(0.0, MAX_SYSTEM_PROMPT_SKEW, lo_open=False, hi_open=False),
        metavar="S",
        help="synthetic workload only: popularity of the system prompts, a conversation "
        "picking prompt k (from 0) with weight 1/(k+1)**S (Zipf), a number in "
        f"[0, {MAX_SYSTEM_PROMPT_SKEW:g}] (default: 0, uniform)",
    )
    wl.add_argument(
        "--seed",
        type=_integer(0, MAX_SEED, "2**32 - 1"),
        default=0,
        metavar="SEED",
        help="seed of the workload's tokens and of NONE_HASH (as PYTHONHASHSEED), an integer "
        "in [0, 2**32 - 1] (default: %(default)s)",
    )
    kv = sim.add_argument_group("KV cache")
    kv.add_argument(
        "--num-blocks",
        type=_integer(2, MAX_BLOCKS, "2**31"),
        default=2000,
        metavar="N",
        help="blocks in the pool, null block included, an integer in [2, 2**31] "
        "(default: %(default)s)",
    )
    kv.add_argument(
        "--block-size",
        type=_integer(1, MAX_COUNT, "2**31 - 1"),
        default=16,
        metavar="TOKENS",
        help="tokens per block, an integer in [1, 2**31 - 1] (default: %(default)s)",
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
        type=_integer(1, MAX_COUNT, "2**31 - 1"),
        metavar="TOKENS",
        help="window of --model hybrid-swa (only with it), in tokens, an integer in "
        f"[1, 2**31 - 1] (default: {DEFAULT_SLIDING_WINDOW})",
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
        type=_integer(2, MAX_COUNT, "2**31 - 1"),
        default=8192,
        metavar="TOKENS",
        help="longest sequence, an integer in [2, 2**31 - 1], at least "
        f"{MIN_SYNTHETIC_MODEL_LEN} for the synthetic workload (default: %(default)s)",
    )
    sc.add_argument(
        "--max-num-batched-tokens",
        type=_integer(1, MAX_COUNT, "2**31 - 1"),
        default=2048,
        metavar="TOKENS",
        help="token budget per step, an integer in [1, 2**31 - 1] (default: %(default)s)",
    )
    sc.add_argument(
        "--max-num-seqs",
        type=_integer(1, MAX_COUNT, "2**31 - 1"),
        default=128,
        metavar="N",
        help="most running requests, an integer in [1, 2**31 - 1] (default: %(default)s)",
    )
    sc.add_argument(
        "--watermark",
        type=_number(0.0, 1.0, lo_open=False, hi_open=True),
        default=0.0,
        metavar="FRACTION",
        help="fraction of blocks kept free when admitting, a number in [0, 1) "
        "(default: %(default)s)",
    )
    sc.add_argument(
        "--no-admission-gate",
        dest="admission_gate",
        action="store_false",
        help="do not require the whole sequence to fit at admission",
    )
    rt = sim.add_argument_group(
        "cache control (kvcore extensions)",
        "Pins and retention priorities change which cached blocks are evicted; compare with "
        "plain LRU eviction on the same workload (--compare lru). The manager's clock is "
        f"simulated: {STEP_SECONDS:g} s per scheduler step, idle stretches included.",
    )
    rt.add_argument(
        "--pin-system-prompts",
        nargs="?",
        const=math.inf,
        type=_pin_ttl,
        metavar="TTL",
        help="synthetic workload only: pin each system prompt's full blocks "
        "(KVCacheManager.pin_prefix) once a request has them cached. Without TTL a prompt "
        "stays pinned for the run; with TTL (simulated seconds, a number in "
        f"(0, {MAX_TTL_TEXT}]) each request using the prompt renews its pin, which lapses "
        "after TTL seconds without one. The manager pins at most half of the blocks",
    )
    rt.add_argument(
        "--priority-mix",
        nargs="?",
        const=parse_priority_mix(DEFAULT_PRIORITY_MIX),
        type=_priority_mix,
        metavar="MIX",
        help="give every conversation (its turns alike) a retention priority drawn from MIX "
        "(seeded by --seed): comma-separated PRIORITY:SHARE[:TTL] tiers, PRIORITY an integer "
        "in [0, 100] (higher = cached blocks kept longer, 50 = default), SHARE the tier's "
        "fraction in (0, 1] (the shares sum to 1), TTL the seconds a freed block keeps its "
        f"priority, a number in [0, {MAX_TTL_TEXT}] (default: none). Without MIX: "
        f"{DEFAULT_PRIORITY_MIX} (20%% high, 60%% default, 20%% low)",
    )
    out = sim.add_argument_group("output")
    out.add_argument(
        "--backend",
        choices=BACKENDS,
        default="kvcore",
        help="implementation to drive; the reference must be installed (default: %(default)s)",
    )
    out.add_argument(
        "--compare",
        choices=["reference", "lru"],
        help="reference: also replay through the reference (vLLM 0.25.1, which must be "
        "installed) and compare speed and decisions; lru: also replay the same workload with "
        "plain LRU eviction (no pins, no priorities) and compare hit rate, preemptions and "
        "evictions (the plot shows both); only with --backend kvcore",
    )
    out.add_argument(
        "--json", action="store_true", help="print one JSON object instead (no progress bar)"
    )
    out.add_argument(
        "--plot",
        metavar="FILE",
        type=_plot_file,
        help="draw usage, hit rate and requests into FILE (.png, .pdf or .svg) in an existing "
        "writable directory (needs matplotlib)",
    )
    out.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar on stderr (there is none either with --json or when stderr is "
        "not a terminal)",
    )

    bench = sub.add_parser(
        "bench",
        help="micro-benchmarks against the reference",
        description="Time pool operations, block hashing and one replay with kvcore and, "
        "when it is installed, the reference, and print the ratios.",
        epilog="Ctrl-C stops the benchmarks (exit status 130).",
    )
    bench.add_argument("--quick", action="store_true", help="fewer repetitions")
    bench.add_argument("--json", action="store_true", help="print one JSON object instead")
    return parser


def _misuse(args: argparse.Namespace) -> str | None:
    """Flags that parse one by one but not together: the message, or None."""
    if args.trace is not None:
        for flag, value in (
            ("--requests", args.requests),
            ("--arrival-rate", args.arrival_rate),
            ("--system-prompts", args.system_prompts),
            ("--system-prompt-skew", args.system_prompt_skew),
        ):
            if value is not None:
                return f"{flag}: only for the synthetic workload, not with --trace"
    elif args.max_model_len < MIN_SYNTHETIC_MODEL_LEN:
        return (
            f"--max-model-len: expected an integer >= {MIN_SYNTHETIC_MODEL_LEN} with the "
            f"synthetic workload, got {args.max_model_len}"
        )
    if args.sliding_window is not None and args.model != "hybrid-swa":
        return "--sliding-window: only used by --model hybrid-swa"
    if args.compare is not None and args.backend == args.compare:
        return f"--compare {args.compare}: --backend is {args.backend} already (use kvcore)"
    if args.compare == "lru" and args.backend != "kvcore":
        return f"--compare lru: only with --backend kvcore, not {args.backend}"
    for flag, value in (
        ("--pin-system-prompts", args.pin_system_prompts),
        ("--priority-mix", args.priority_mix),
    ):
        if value is None:
            continue
        if args.backend != "kvcore":
            return f"{flag}: a kvcore extension, not with --backend {args.backend}"
        if args.compare == "reference":
            return f"{flag}: a kvcore extension, not with --compare reference (use --compare lru)"
        if not args.prefix_caching:
            return f"{flag}: needs prefix caching, not with --no-prefix-caching"
    if args.pin_system_prompts is not None and args.trace is not None:
        return "--pin-system-prompts: only for the synthetic workload, not with --trace"
    return None


def _lru_retention(retention: RetentionSettings | None) -> RetentionSettings | None:
    """What the plain-LRU run of ``--compare lru`` gets: with a priority mix, the same tier
    draws, counted but not enforced (hit rates per tier on both sides); else nothing."""
    if retention is None or not retention.priority_mix:
        return None
    return RetentionSettings(
        priority_mix=retention.priority_mix, seed=retention.seed, enforce=False
    )


def _retention(args: argparse.Namespace) -> RetentionSettings | None:
    """The cache control the flags ask for (None: plain LRU, as the reference)."""
    if args.pin_system_prompts is None and args.priority_mix is None:
        return None
    ttl = args.pin_system_prompts
    return RetentionSettings(
        pin_system_prompts=ttl is not None,
        pin_ttl_s=None if ttl is None or math.isinf(ttl) else ttl,
        priority_mix=args.priority_mix or (),
        seed=args.seed,
    )


def _workload(args: argparse.Namespace) -> Workload:
    if args.trace is not None:
        return TraceWorkload(args.trace, seed=args.seed)
    defaults = ChatWorkloadParams()
    return SyntheticChat(
        ChatWorkloadParams(
            num_requests=DEFAULT_REQUESTS if args.requests is None else args.requests,
            seed=args.seed,
            arrival_rate=DEFAULT_ARRIVAL_RATE if args.arrival_rate is None else args.arrival_rate,
            num_system_prompts=(
                defaults.num_system_prompts if args.system_prompts is None else args.system_prompts
            ),
            system_prompt_skew=(
                defaults.system_prompt_skew
                if args.system_prompt_skew is None
                else args.system_prompt_skew
            ),
            max_model_len=args.max_model_len,
        )
    )


def _header(
    args: argparse.Namespace,
    model: ModelPreset,
    workload: Workload,
    retention: RetentionSettings | None = None,
) -> str:
    text = (
        f"kvcore simulate: {len(workload)} requests ({workload.source}); {model.name} model, "
        f"{args.num_blocks} blocks x {args.block_size} tokens, {args.hash}, "
        f"events {'on' if args.events else 'off'}"
    )
    return text if retention is None else f"{text}; {retention.describe()}"


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}" if n == 1 else f"{n:,} {word}s"


class _Interrupts:
    """What Ctrl-C does in ``kvcore simulate`` (a SIGINT handler).

    The first press stops the running simulation after its step. Later presses, and any
    press once the summary is being written, are "extra": the first extra one is only noted
    on stderr, the next raises ``KeyboardInterrupt`` (quit without the summary).
    """

    def __init__(self) -> None:
        self.sim: Simulator | None = None
        self.interrupted = False
        self.summarizing = False
        self._extra = 0

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if not self.interrupted and not self.summarizing:
            self.interrupted = True
            if self.sim is not None:
                self.sim.stop()
            return
        self._extra += 1
        if self._extra > 1:
            raise KeyboardInterrupt
        os.write(2, _SUMMARIZING_NOTE)  # raw write: safe whatever the main code is printing


@contextmanager
def _sigint(handler: _Interrupts) -> Iterator[None]:
    """Installs ``handler`` for SIGINT (main thread only) and restores the previous one."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _run_one(
    backend: Backend,
    args: argparse.Namespace,
    model: ModelPreset,
    settings: ManagerSettings,
    sched: SchedulerSettings,
    workload: Workload,
    interrupts: _Interrupts,
    retention: RetentionSettings | None = None,
    label: str | None = None,
) -> tuple[Simulator, bool]:
    """Runs one backend; returns the simulator and whether it was interrupted.

    Like a serving engine after start-up, the run starts with a collected and frozen heap
    (``gc.freeze``), so that neither backend pays for scanning what its imports allocated.
    """
    sim = Simulator(backend, model, settings, sched, workload, retention)
    interrupts.sim = sim
    progress = make_progress(
        len(workload), label or backend.name, enabled=not (args.no_progress or args.json)
    )

    def on_step(s: Simulator) -> None:
        st = s.stats
        progress.update(st.finished, st.steps, st.sample_usage[-1] if st.sample_usage else 0.0)

    gc.collect()
    gc.freeze()
    try:
        if not interrupts.interrupted:
            sim.run(on_step)
    except KeyboardInterrupt:
        interrupts.interrupted = True
    finally:
        gc.unfreeze()
        progress.close()
        interrupts.sim = None
    return sim, interrupts.interrupted


def cmd_simulate(args: argparse.Namespace) -> int:
    """Runs ``kvcore simulate``; returns the exit status."""
    prog = "kvcore simulate"

    def fail(message: str, status: int = EXIT_USAGE) -> int:
        print(f"{prog}: error: {message}", file=sys.stderr)
        return status

    problem = _misuse(args)
    if problem is not None:
        return fail(problem)
    try:
        window = DEFAULT_SLIDING_WINDOW if args.sliding_window is None else args.sliding_window
        model = model_preset(args.model, args.block_size, window)
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
    except OSError as exc:  # the trace went away after the argument check
        return fail(f"--trace: cannot read {args.trace!r}: {exc.strerror or exc}")
    except (TraceError, ConfigError, ValueError) as exc:
        return fail(str(exc))

    retention = _retention(args)
    header = _header(args, model, workload, retention)
    names = [args.backend]
    if args.compare is not None:
        names.append("kvcore" if args.compare == "lru" else args.compare)
    backends = []
    for flag, name in zip(("--backend", "--compare"), names, strict=False):
        try:
            # Every backend is imported before anything runs, so both runs see the same process.
            backends.append(make_backend(name))
        except BackendUnavailable as exc:
            return fail(f"{flag} {name}: {exc}")

    interrupts = _Interrupts()
    runs: list[tuple[Simulator, bool]] = []
    with _sigint(interrupts):
        try:
            for k, backend in enumerate(backends):
                lru = k > 0 and args.compare == "lru"
                runs.append(
                    _run_one(
                        backend,
                        args,
                        model,
                        settings,
                        sched,
                        workload,
                        interrupts,
                        retention=_lru_retention(retention) if lru else retention,
                        label="lru" if lru else None,
                    )
                )
                if runs[-1][1]:
                    break
        except SimulationStalled as exc:
            return fail(str(exc), EXIT_FAILED)
        except OSError as exc:  # the trace went away while it was being replayed
            return fail(f"--trace: cannot read {args.trace!r}: {exc.strerror or exc}", EXIT_FAILED)
        except TraceError as exc:
            return fail(str(exc), EXIT_FAILED)
        interrupts.summarizing = True
        interrupted = interrupts.interrupted
        if interrupted:
            done = runs[-1][0].stats.finished
            print(
                f"{prog}: interrupted: summarizing {_plural(done, 'finished request')}...",
                file=sys.stderr,
                flush=True,
            )
        return _report(args, prog, header, model, runs, interrupted, retention)


def _report(
    args: argparse.Namespace,
    prog: str,
    header: str,
    model: ModelPreset,
    runs: list[tuple[Simulator, bool]],
    interrupted: bool,
    retention: RetentionSettings | None = None,
) -> int:
    """Prints the summary (and writes the plot); returns the exit status."""
    summaries = [summarize(sim, interrupted=intr) for sim, intr in runs]
    second = summaries[1] if len(summaries) > 1 else None
    if args.compare == "lru":
        summary = combine_lru(summaries[0], second)
    else:
        summary = combine(summaries[0], second)
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
    for key, value in (
        ("system_prompts", args.system_prompts),
        ("system_prompt_skew", args.system_prompt_skew),
    ):
        if value is not None:  # absent unless given: the output of earlier runs stays as it was
            summary["config"][key] = value
    if retention is not None or args.compare == "lru":
        summary["config"]["compare"] = args.compare
    if retention is not None:
        summary["config"]["retention"] = {
            "pin_system_prompts": retention.pin_system_prompts,
            "pin_ttl_s": retention.pin_ttl_s,
            "priority_mix": describe_mix(retention.priority_mix) or None,
            "step_seconds": STEP_SECONDS,
        }
    if args.json:
        print(json.dumps(summary, indent=2), flush=True)
    else:
        print(format_table(summary, header), flush=True)
    status = EXIT_OK
    if args.plot is not None:
        from kvcore.simulate.plot import plot

        lru = runs[1][0] if args.compare == "lru" and len(runs) > 1 else None
        title = header.replace("kvcore simulate: ", "")
        if retention is not None:  # the cache control on a line of its own
            title = title.replace(f"; {retention.describe()}", f"\n{retention.describe()}")
        try:
            plot(runs[0][0], args.plot, title=title, lru=lru)
        except (OSError, ValueError, RuntimeError) as exc:
            print(f"{prog}: error: --plot: cannot write {args.plot!r}: {exc}", file=sys.stderr)
            status = EXIT_FAILED
        else:
            if not args.json:
                print(f"plot written to {args.plot}")
    if interrupted:
        return EXIT_INTERRUPTED
    if summary.get("decisions_match") is False:
        print(f"{prog}: error: decisions differ from the reference", file=sys.stderr)
        return EXIT_FAILED
    return status


def cmd_bench(args: argparse.Namespace) -> int:
    """Runs ``kvcore bench``; returns the exit status."""
    from kvcore.simulate.bench import format_bench, run_bench

    results = run_bench(quick=args.quick)
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
        The exit status: 0, 1 (stalled run, decisions differ, plot not written), 2 (bad
        input, reported before anything runs) or 130 (interrupted; ``simulate`` prints the
        partial summary).
    """
    args, extra = build_parser().parse_known_args(argv)
    prog = f"kvcore {args.command}"
    if extra:  # reported by the subcommand, whose flags they were meant to be
        print(f"{prog}: error: unrecognized arguments: {' '.join(extra)}", file=sys.stderr)
        return EXIT_USAGE
    command: Any = {"simulate": cmd_simulate, "bench": cmd_bench}[args.command]
    try:
        return int(command(args))
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # stdout closed early (piped into head): stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_FAILED
