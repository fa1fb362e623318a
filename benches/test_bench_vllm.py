"""vLLM 0.25.1's own scheduler step with vLLM's KV cache manager and with kvcore's.

One process, four ``Scheduler`` objects over the same workload, stepped in turn (the order
rotates every step, so the machine's drift hits all alike): for each manager, a *plain* scheduler
whose whole ``schedule()`` + ``update_from_output()`` is timed, and a *timed* twin whose
manager methods are each wrapped by a timer (a method called from inside another, as vLLM's
``allocate_slots`` calls ``create_kv_cache_blocks``, counts once). Every step's
``SchedulerOutput`` of all four is compared, so they make the same decisions.

The timer is not free, and it must not change the call it times. A wrapper that forwards
``fn(*args, **kwargs)`` would: the scheduler calls ``allocate_slots(request, n,
num_lookahead_tokens=k)`` with its keyword passed by name (vectorcall), and forwarding a dict
makes CPython unpack it into a fresh argument array and names tuple first, inside the timed
span, ~250 ns more for kvcore's C method and ~170 ns more for vLLM's Python one than for a C
function taking a dict (measured in a tight loop). So the wrapper forwards the calls of a
steady step as the scheduler made them: positional arguments as they are, and the decode
shape ``(request, n, num_lookahead_tokens=k)`` by name; only rarer shapes (admissions with
several keywords) go through the dict. What the timer still adds is its two clock reads: that
*bias* is measured in the same run, after every step, by the same clock reads with nothing
between them, and subtracted per call (a lower bound: the forwarding call itself counts as the
manager's, as the scheduler makes it too). The raw times (bias included, in both columns) are
reported too. In a tight loop the timed span less the bias matches the call's unwrapped time
within ~10 ns for either manager. Inside a step the clock's first read after the scheduler's own
code is slower than the bias (its code and data are out of the caches), so the wrapper reads the
clock once more, discarded, a few bytecodes before the read that opens the span: both reads of
the span are then warm, as the bias measures them. Without that read, each call of either
manager counted ~70-90 ns of the timer's own cache misses (measured with 256 running: four
schedulers in one process, the two timers side by side). The *ceiling* is the plain kvcore
step's time less kvcore's manager time: what a manager costing nothing would leave.

Run: ``python -m pytest benches/test_bench_vllm.py -q --benchmark-only`` (``make bench`` runs it
too).
"""

from __future__ import annotations

import gc
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import vllm_harness as h
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

import kvcore.vllm

MEASURED_STEPS = 150
_MANAGER_METHODS = (
    "get_computed_blocks",
    "allocate_slots",
    "free",
    "pop_blocks_for_free",
    "get_blocks",
    "get_block_ids",
    "get_block_ids_for_computed_tokens",
    "get_num_common_prefix_blocks",
    "take_new_block_ids",
    "take_events",
    "new_step_starts",
    "remove_skipped_blocks",
    "cache_blocks",
    "make_prefix_cache_stats",
    "create_kv_cache_blocks",
    "evict_blocks",
)


class Timer:
    """Wraps methods of an object by one timer: total seconds inside, and the number of calls."""

    def __init__(self, obj: Any, names: tuple[str, ...]) -> None:
        self.seconds = 0.0
        self.calls = 0
        self.inside = False
        for name in names:
            setattr(obj, name, self._wrap(getattr(obj, name)))

    def _wrap(self, fn: Any) -> Any:
        perf = time.perf_counter

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.inside:  # called by another wrapped method: timed by that one
                return fn(*args, **kwargs)
            self.inside = True
            perf()  # warms the clock (see the module docs)
            # Forwarded as the scheduler called it (see the module docs): no keyword, or the
            # decode shape's one keyword by name; anything else through the dict.
            if not kwargs:
                t = perf()
                try:
                    return fn(*args)
                finally:
                    self._done(perf() - t)
            if len(args) == 2 and len(kwargs) == 1 and "num_lookahead_tokens" in kwargs:
                request, n = args
                k = kwargs["num_lookahead_tokens"]
                t = perf()
                try:
                    return fn(request, n, num_lookahead_tokens=k)
                finally:
                    self._done(perf() - t)
            t = perf()
            try:
                return fn(*args, **kwargs)
            finally:
                self._done(perf() - t)

        return timed

    def _done(self, seconds: float) -> None:
        self.seconds += seconds
        self.calls += 1
        self.inside = False

    @staticmethod
    def bias(calls: int) -> float:
        """Seconds the timer adds to one call: its two clock reads with nothing between them,
        as many times as the step had calls (at least 64)."""
        perf = time.perf_counter
        total = 0.0
        n = max(calls, 64)
        for _ in range(n):
            t = perf()
            total += perf() - t
        return total / n


class Side:
    """One manager's pair of schedulers: a plain one (step times) and a timed twin (manager
    times, with the timer's bias measured after each step)."""

    def __init__(self, plain: Any, timed: Any) -> None:
        self.plain = plain
        self.timed = timed
        self.timer = Timer(timed.kv_cache_manager, _MANAGER_METHODS)
        self.step_times: list[float] = []
        self.manager_times: list[float] = []
        self.raw_manager_times: list[float] = []
        self.biases: list[float] = []


def _requests(n: int, seed: int, hasher: Any, cls: type = Request) -> list[Request]:
    rng = random.Random(seed)
    systems = [[rng.randrange(h.VOCAB) for _ in range(rng.randrange(64, 256))] for _ in range(8)]
    out = []
    for i in range(n):
        prompt = list(rng.choice(systems)) if rng.random() < 0.7 else []
        prompt += [rng.randrange(h.VOCAB) for _ in range(rng.randrange(16, 256))]
        out.append(
            cls(
                f"r{i}",
                prompt,
                SamplingParams(max_tokens=100_000, ignore_eos=True),
                None,
                block_hasher=hasher,
            )
        )
    return out


def _step(sched: Any) -> tuple[float, dict[str, Any]]:
    """One ``schedule()`` + fake model run + ``update_from_output()``: the seconds spent in the
    scheduler (the fake runner's time excluded) and the plain output."""
    start = time.perf_counter()
    out = sched.schedule()
    mid = time.perf_counter()
    req_ids = list(out.num_scheduled_tokens)
    sampled = [
        [] if sched.requests[r].num_computed_tokens < sched.requests[r].num_tokens else [7]
        for r in req_ids
    ]
    mro = ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )
    runner = time.perf_counter() - mid
    sched.update_from_output(out, mro)
    return time.perf_counter() - start - runner, h.plain_output(out)


def _step_side(side: Side, which: str, record: bool) -> dict[str, Any]:
    """Steps the side's plain or timed scheduler, recording its times when ``record``."""
    if which == "plain":
        elapsed, out = _step(side.plain)
        if record:
            side.step_times.append(elapsed)
        return out
    timer = side.timer
    s0, c0 = timer.seconds, timer.calls
    _, out = _step(side.timed)
    if record:
        raw, calls = timer.seconds - s0, timer.calls - c0
        bias = Timer.bias(calls)
        side.raw_manager_times.append(raw)
        side.manager_times.append(raw - calls * bias)
        side.biases.append(bias)
    return out


def _scheduler(cls: Any, setup: h.Setup, cfg: Any, hasher: Any) -> Any:
    sched = cls(
        vllm_config=cfg,
        kv_cache_config=h.kv_cache_config(setup),
        structured_output_manager=StructuredOutputManager(cfg),
        block_size=setup.block_size,
        log_stats=True,
    )
    sched.kv_event_publisher = h.CapturingPublisher()
    # The requests the engine builds with each scheduler: kvcore's has it build
    # kvcore.vllm.Request (its engine plugin).
    kvcore_scheduler = cls.__module__.startswith("kvcore.")
    request_cls = kvcore.vllm.Request if kvcore_scheduler else Request
    for req in _requests(setup.max_num_seqs, 0, hasher, request_cls):
        sched.add_request(req)
    return sched


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("model", ["full", "swa", "full-nocache"])
@pytest.mark.parametrize("running", [64, 256, 1024])
def test_bench_vllm_scheduler_step(
    model: str,
    running: int,
    benchmark: Any,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """KV-manager time inside vLLM's scheduler step, vLLM's manager against kvcore's
    (``full-nocache``: full attention with prefix caching off)."""
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    init_none_hash(sha256)
    setup = h.Setup(
        model=model.removesuffix("-nocache"),
        caching=not model.endswith("-nocache"),
        num_blocks=running * 64 + 1024,
        max_num_seqs=running,
        max_num_batched_tokens=8192,
        max_model_len=8192,
        events=True,
    )
    cfg = h.vllm_config(setup)
    hasher = get_request_block_hasher(setup.block_size, sha256)
    ref, ours = (
        Side(_scheduler(cls, setup, cfg, hasher), _scheduler(cls, setup, cfg, hasher))
        for cls in (VllmScheduler, kvcore.vllm.Scheduler)
    )
    runs = [(ref, "plain"), (ref, "timed"), (ours, "plain"), (ours, "timed")]

    def step_all(i: int, record: bool) -> None:
        k = i % len(runs)
        outs = [_step_side(side, which, record) for side, which in runs[k:] + runs[:k]]
        assert all(o == outs[0] for o in outs)

    # Warm up: admit and prefill everything, then a few decode steps.
    warm = 0
    while ref.plain.waiting or warm < 5:
        step_all(warm, False)
        warm = warm + 1 if not ref.plain.waiting else 0

    def measure() -> None:
        gc.collect()
        gc.disable()
        try:
            for i in range(MEASURED_STEPS):
                step_all(i, True)
        finally:
            gc.enable()

    benchmark.pedantic(measure, rounds=1, iterations=1)
    for side in (ref, ours):
        assert len(side.plain.running) == len(side.timed.running) == running

    def us(xs: list[float]) -> float:
        return statistics.median(xs) * 1e6

    ref_mgr, our_mgr = us(ref.manager_times), us(ours.manager_times)
    ref_raw, our_raw = us(ref.raw_manager_times), us(ours.raw_manager_times)
    ref_step, our_step = us(ref.step_times), us(ours.step_times)
    bias_ns = us(ref.biases + ours.biases) * 1e3
    our_ceiling = our_step - our_mgr
    benchmark.extra_info.update(
        manager_us_vllm=ref_mgr,
        manager_us_kvcore=our_mgr,
        raw_manager_us_vllm=ref_raw,
        raw_manager_us_kvcore=our_raw,
        timer_bias_ns=bias_ns,
        step_us_vllm=ref_step,
        step_us_kvcore=our_step,
        ceiling_us=our_ceiling,
    )
    with capsys.disabled():
        print(
            f"\nvLLM scheduler step, {model}, {running} running (median of {MEASURED_STEPS} "
            f"steps each, µs): manager vLLM {ref_mgr:.1f} / kvcore {our_mgr:.1f} = "
            f"{ref_mgr / our_mgr:.2f}x (raw {ref_raw:.1f} / {our_raw:.1f} = "
            f"{ref_raw / our_raw:.2f}x, timer bias {bias_ns:.0f} ns a call); "
            f"step vLLM {ref_step:.1f} / kvcore {our_step:.1f} = {ref_step / our_step:.2f}x; "
            f"ceiling {our_ceiling:.1f} (kvcore step {100 * our_mgr / our_ceiling:.1f}% above it)"
        )


@pytest.mark.slow
@pytest.mark.parametrize("work", ["alone", "shared", "none"])
@pytest.mark.parametrize("order", ["in-order", "shuffled"])
@pytest.mark.parametrize("running", [256, 4096])
def test_bench_vllm_request_decode(
    running: int,
    order: str,
    work: str,
    benchmark: Any,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Decode ``allocate_slots(r, 1)``: vLLM's ``Request`` and ``kvcore.vllm.Request`` (what
    vLLM's engine builds with kvcore's scheduler) against kvcore's own ``Request``.

    All go through ``kvcore.vllm.KVCacheManager`` (kvcore's Rust manager); vLLM's requests are
    read from their instance dicts, ``kvcore.vllm.Request`` from its slots, kvcore's from their
    native state.

    ``in-order`` calls the requests in the order they were made, which is also their order in
    memory: the CPU's own prefetcher then follows kvcore's requests (one object each, made one
    after another) but not vLLM's (each made with its dict, lists and parameters). In a server,
    requests arrive over time among the engine's other allocations, and the running list is
    reordered by finishes and preemptions: ``shuffled`` calls them in a fixed random order.

    Between steps every request gets its token (``append_output_token_ids``), a new int object
    each, as the sampler's ``tolist()`` makes them. ``alone`` runs each kind of request by
    itself, so that each step's calls follow that kind's own appends, made in the calls' order
    as vLLM's ``update_from_output`` follows the order ``schedule()`` scheduled in: vLLM's (Python, over the request's lists and hash list) touch more memory than kvcore's
    native one, and with thousands of requests push more of the manager's tables out of the
    caches. ``shared`` makes the three kinds together (interleaved, as a server's allocations
    are) and appends to all of them every step in that interleaved order, calling the manager
    for one kind only: the same work around every call, so that the calls differ only in the
    request they read (appending kind by kind would leave the last kind's requests the most
    recently touched, and favour it). ``none`` appends nothing: each step repeats the same
    calls, whose code and data the previous step left in the caches, so that the figure is the
    call's own work.
    """
    from vllm.v1.request import RequestStatus as VllmStatus

    import kvcore.hashing
    from kvcore.request import Request as KvcoreRequest
    from kvcore.request import RequestStatus as KvcoreStatus

    monkeypatch.setenv("PYTHONHASHSEED", "0")
    init_none_hash(sha256)
    kvcore.hashing.init_none_hash(kvcore.hashing.sha256)
    setup = h.Setup(num_blocks=running * 16 + 16)
    steps = 40
    vllm_hasher = kvcore.vllm.get_request_block_hasher(16, sha256)
    kv_hasher: Any = kvcore.hashing.get_request_block_hasher(16, kvcore.hashing.sha256)

    def vllm_made(cls: type[Request], prefix: str) -> Any:
        """Requests of vLLM's class `cls` (vLLM's own or ``kvcore.vllm.Request``)."""

        def make(i: int) -> Request:
            prompt = list(range(i % 500, i % 500 + 100))
            params = SamplingParams(max_tokens=1000)
            return cls(f"{prefix}{i}", prompt, params, None, block_hasher=vllm_hasher)

        return make

    def kvcore_request(i: int) -> KvcoreRequest:
        return KvcoreRequest(
            f"k{i}", prompt_token_ids=list(range(i % 500, i % 500 + 100)), block_hasher=kv_hasher
        )

    kinds = {
        "vllm": (vllm_made(Request, "v"), VllmStatus.RUNNING),
        "engine": (vllm_made(kvcore.vllm.Request, "e"), VllmStatus.RUNNING),
        "kvcore": (kvcore_request, KvcoreStatus.RUNNING),
    }

    def run(kind: str) -> tuple[float, float]:
        mgr = kvcore.vllm.KVCacheManager(
            h.kv_cache_config(setup),
            max_model_len=8192,
            scheduler_block_size=16,
            hash_block_size=16,
            enable_kv_cache_events=True,
        )
        made = kinds if work == "shared" else {kind: kinds[kind]}
        sets: dict[str, list[Any]] = {k: [] for k in made}
        for i in range(running):
            for k, (make, _) in made.items():
                sets[k].append(make(i))
        # Interleaved: the i-th request of each kind, then the next.
        everyone = [r for made_at_i in zip(*sets.values(), strict=True) for r in made_at_i]
        reqs = sets[kind]
        if order == "shuffled":
            random.Random(0).shuffle(reqs)
        # Alone, the appends follow the calls, as a scheduler's update follows its schedule.
        appended = reqs if work == "alone" else everyone
        for r in reqs:
            hits, n = mgr.get_computed_blocks(r)
            assert mgr.allocate_slots(r, r.num_tokens - n, n, hits) is not None
            r.status = kinds[kind][1]
        for r in everyone:
            r.num_computed_tokens = r.num_tokens
        allocate = mgr.allocate_slots
        gc.collect()
        in_allocate = in_append = 0.0
        for s in range(steps):
            # The step's sampled tokens, new int objects as the sampler's `tolist()` makes them
            # (ids from 256 up are not CPython's shared small ints).
            sampled = [1000 + (i * 7919 + s * 104729) % 60000 for i in range(len(everyone))]
            start = time.perf_counter()
            for r in reqs:
                allocate(r, 1)
            in_allocate += time.perf_counter() - start
            if work != "none":
                start = time.perf_counter()
                for r, token in zip(appended, sampled, strict=True):
                    r.num_computed_tokens += 1
                    r.append_output_token_ids(token)
                in_append += time.perf_counter() - start
            del sampled
            mgr.take_events()
        per_request = 1e6 / (steps * len(everyone))
        return in_allocate / (steps * running) * 1e6, in_append * per_request

    results: dict[str, list[float]] = {k: [] for k in kinds}
    appends: dict[str, list[float]] = {k: [] for k in kinds}
    rounds = 7

    def measure() -> None:
        for _ in range(rounds):  # alternate, so the machine's drift hits all three
            for k in kinds:
                allocate_us, append_us = run(k)
                results[k].append(allocate_us)
                appends[k].append(append_us)

    benchmark.pedantic(measure, rounds=1, iterations=1)
    v, e, k = (min(results[n]) for n in ("vllm", "engine", "kvcore"))

    def ratio(kind: str) -> float:
        """The median over rounds of the kind's time over kvcore's in the same round."""
        return statistics.median(
            a / b for a, b in zip(results[kind], results["kvcore"], strict=True)
        )

    rv, re_ = ratio("vllm"), ratio("engine")
    for kind, us, r in (("vllm", v, rv), ("engine", e, re_), ("kvcore", k, 1.0)):
        benchmark.extra_info[f"{kind}_request_us"] = us
        benchmark.extra_info[f"{kind}_ratio"] = r
    with capsys.disabled():
        print(
            f"\ndecode allocate_slots(r, 1), {running} running {order}, {work}, µs per request "
            f"(best of {rounds}; median ratio of {rounds} rounds): vLLM Request {v:.3f} "
            f"({rv:.2f}x) / kvcore.vllm.Request {e:.3f} ({re_:.2f}x) / kvcore Request {k:.3f}"
        )
    if work == "alone":
        # Each kind's own appends (under `shared` every round appends to all three kinds), and
        # each kind's append and call together: what a step spends on a decoding request.
        a = {n: statistics.median(appends[n]) for n in kinds}

        def round_ratios(kind: str, of: Callable[[str, int], float]) -> float:
            return statistics.median(of(kind, i) / of("kvcore", i) for i in range(rounds))

        def appended(n: str, i: int) -> float:
            return appends[n][i]

        def both(n: str, i: int) -> float:
            return appends[n][i] + results[n][i]

        ra = {n: round_ratios(n, appended) for n in ("vllm", "engine")}
        rb = {n: round_ratios(n, both) for n in ("vllm", "engine")}
        for n in kinds:
            benchmark.extra_info[f"{n}_append_us"] = a[n]
        for n in ("vllm", "engine"):
            benchmark.extra_info[f"{n}_append_ratio"] = ra[n]
            benchmark.extra_info[f"{n}_step_ratio"] = rb[n]
        with capsys.disabled():
            print(
                f"num_computed_tokens += 1 and append_output_token_ids, µs per request (median "
                f"of {rounds}; median ratio of {rounds} rounds): vLLM Request {a['vllm']:.3f} "
                f"({ra['vllm']:.2f}x) / kvcore.vllm.Request {a['engine']:.3f} "
                f"({ra['engine']:.2f}x) / kvcore Request {a['kvcore']:.3f}; append and call "
                f"together (median ratio of {rounds} rounds): vLLM Request {rb['vllm']:.2f}x / "
                f"kvcore.vllm.Request {rb['engine']:.2f}x"
            )
