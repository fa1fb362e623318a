"""A continuous-batching scheduler loop over a ``KVCacheManager``.

The loop follows the order of operations of the reference scheduler (``Scheduler.schedule`` and
``update_from_output`` of vLLM 0.25.1, FCFS policy, chunked prefill, no speculative decoding,
no connector):

1. Requests whose arrival step has come are queued. The workload is pulled lazily (see
   :meth:`~kvcore.simulate.workload.Workload.releases`): only requests that arrived, or that
   wait for one in flight, are held, as compact token arrays; a request's manager-side object
   is built (its full blocks hashed) when it first reaches the head of the waiting queue.
2. ``new_step_starts()``.
3. Running requests, oldest first, while the token budget lasts: ``allocate_slots`` for the
   tokens they still need (capped by the budget and the model length). When it fails, the
   newest running request is preempted (freed, reset, put at the front of the waiting queue)
   and the allocation is retried; a request that has to preempt itself stops the pass.
4. Only if nothing was preempted: waiting requests, first come first served, while the budget
   and ``max_num_seqs`` allow: prefix-cache lookup (``get_computed_blocks``), then
   ``allocate_slots`` with the hit and the whole-sequence admission gate
   (``full_sequence_must_fit``) and the watermark; the first failure stops admission.
5. ``get_num_common_prefix_blocks`` and ``take_new_block_ids`` as the scheduler output needs.
6. Computed-token counts advance; a request that caught up with its tokens "samples" its next
   output token (``append_output_token_ids``, which hashes new full blocks); one that reached
   its output length or the model length finishes and is freed.
7. ``take_events()`` (with events on) and ``usage``.

With the kvcore backend, step 3 allocates all running requests with one
``allocate_slots_batch`` call (retrying from the one that did not fit) and step 6 appends with
one ``append_output_token_ids_batch`` call: the same decisions in one boundary crossing each.

Only the manager-side calls are timed (request construction and hashing included). Every
decision (hits, allocation results with block ids, preemptions, finishes) feeds a checksum so
that two backends can be compared decision for decision.
"""

from __future__ import annotations

import hashlib
import heapq
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from kvcore.simulate.backends import Backend, ManagerSettings, ModelPreset
from kvcore.simulate.retention import (
    STEP_SECONDS,
    PriorityTiers,
    RetentionSettings,
    SystemPromptPins,
)
from kvcore.simulate.workload import HitBound, RequestSpec, Workload, as_workload

# Tags of the decision stream (negative, so they never collide with ids or counts).
_T_STEP = -1
_T_LOOKUP = -2
_T_ALLOC = -3
_T_ALLOC_FAIL = -4
_T_PREEMPT = -5
_T_FINISH = -6
_T_TABLE = -7
_T_GROUP = -8
_T_PIN = -9


class ConfigError(ValueError):
    """The configuration cannot run the workload (reported before anything runs)."""


class SimulationStalled(RuntimeError):
    """The simulation cannot make progress (a request never fits)."""


@dataclass(slots=True, frozen=True)
class SchedulerSettings:
    """Limits of the simulated scheduler.

    Attributes:
        max_num_seqs: Most requests running at once.
        admission_gate: Pass ``full_sequence_must_fit`` at admission (the reference's default).
    """

    max_num_seqs: int = 128
    admission_gate: bool = True


@dataclass(slots=True)
class _Live:
    """A request in flight: its workload entry and the backend's request object.

    ``req`` is None until the request first reaches the head of the waiting queue.
    """

    idx: int
    spec: RequestSpec
    req: Any = None
    tier: int = -1
    """Its tier of the priority mix (an index), once built; -1 without a mix."""


@dataclass(slots=True)
class SimStats:
    """Figures gathered while the simulation runs (consistent between steps).

    Attributes:
        requests_total: Requests in the workload.
        finished: Requests that finished.
        steps: Steps executed (idle stretches between arrivals are skipped, not counted).
        preemptions: Number of preemptions.
        hit_tokens: Prefix-cache hit tokens at first admissions.
        query_tokens: Prompt tokens at first admissions.
        blocks_evicted: Cached blocks evicted (from ``BlockRemoved`` events); None with events
            off.
        kv_ns: Nanoseconds spent in manager calls, one entry per step.
        sample_step: Step number of each sample (one per executed step).
        sample_usage: Pool usage after each step.
        sample_running: Running requests after each step.
        sample_waiting: Waiting requests after each step.
        sample_hit_rate: Cumulative prefix hit rate after each step.
        sample_preemptions: Cumulative preemptions after each step.
        sample_pinned: Pinned blocks after each step (only with pinned system prompts).
        wall_s: Wall-clock seconds of the run (generating or reading the workload, which is
            pulled as the run goes, included).
    """

    requests_total: int
    finished: int = 0
    steps: int = 0
    preemptions: int = 0
    hit_tokens: int = 0
    query_tokens: int = 0
    blocks_evicted: int | None = None
    kv_ns: array[int] = field(default_factory=lambda: array("q"))
    sample_step: array[int] = field(default_factory=lambda: array("q"))
    sample_usage: array[float] = field(default_factory=lambda: array("d"))
    sample_running: array[int] = field(default_factory=lambda: array("q"))
    sample_waiting: array[int] = field(default_factory=lambda: array("q"))
    sample_hit_rate: array[float] = field(default_factory=lambda: array("d"))
    sample_preemptions: array[int] = field(default_factory=lambda: array("q"))
    sample_pinned: array[int] = field(default_factory=lambda: array("q"))
    wall_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        """Hit tokens over prompt tokens at first admissions (0 before any admission)."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


def blocks_needed(model: ModelPreset, num_tokens: int, max_num_batched_tokens: int) -> int:
    """Blocks a request of ``num_tokens`` tokens holds at most, summed over the groups.

    Args:
        model: The groups.
        num_tokens: Sequence length.
        max_num_batched_tokens: Token budget of a step (bounds a sliding window's span).

    Returns:
        The block count.
    """
    total = 0
    for g in model.groups:
        full = -(-num_tokens // g.block_size)
        if g.kind == "full":
            total += full
        elif g.kind == "swa":
            assert g.sliding_window is not None
            span = g.sliding_window - 1 + max_num_batched_tokens
            total += min(full, -(-span // g.block_size) + 1)
        else:
            total += min(full, -(-max_num_batched_tokens // g.block_size) + 1)
    return total


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def check_config(
    model: ModelPreset,
    settings: ManagerSettings,
    sched: SchedulerSettings,
    workload: Workload | Iterable[RequestSpec],
) -> None:
    """Rejects, before anything runs, a configuration that cannot serve the workload.

    When the workload bounds its request sizes (:meth:`Workload.size_bound`) and the bounds
    fit, nothing is generated; otherwise every request's sizes are gone through
    (:meth:`Workload.shapes`, streamed). A configuration that fits is remembered by the
    workload, so checking it again costs nothing.

    Args:
        model: The groups.
        settings: Manager settings.
        sched: Scheduler settings.
        workload: The requests.

    Raises:
        ConfigError: With a message saying what to change.
    """
    if settings.num_blocks < 2:
        raise ConfigError("--num-blocks must be at least 2 (block 0 is the null block)")
    if settings.max_num_batched_tokens < 1 or sched.max_num_seqs < 1:
        raise ConfigError("--max-num-batched-tokens and --max-num-seqs must be at least 1")
    if not 0.0 <= settings.watermark < 1.0:
        raise ConfigError("--watermark must be in [0, 1)")
    w = as_workload(workload)
    key = (model, settings.num_blocks, settings.max_model_len, settings.max_num_batched_tokens)
    if key in w.checked:
        return
    usable = settings.num_blocks - 1
    max_len = settings.max_model_len
    bound = w.size_bound()
    if (
        bound is None
        or bound.prompt_len >= max_len
        or blocks_needed(model, min(bound.total_len, max_len), settings.max_num_batched_tokens)
        > usable
    ):
        worst: tuple[int, int, str] | None = None
        for shape in w.shapes():
            if shape.prompt_len >= max_len:
                raise ConfigError(
                    f"{shape.name} has a {shape.prompt_len}-token prompt, which does not "
                    f"fit --max-model-len {max_len} (at least one output token must fit too)"
                )
            length = min(shape.prompt_len + shape.output_len, max_len)
            need = blocks_needed(model, length, settings.max_num_batched_tokens)
            if worst is None or need > worst[0]:
                worst = (need, length, shape.name)
        if worst is not None and worst[0] > usable:
            need, length, name = worst
            raise ConfigError(
                f"the KV cache cannot hold even one request: {name} grows to "
                f"{length} tokens, which needs {_plural(need, 'block')} of "
                f"{model.block_size} tokens ({model.name} model), but --num-blocks "
                f"{settings.num_blocks} leaves only {_plural(usable, 'usable block')} "
                f"(block 0 is the null block); use --num-blocks {need + 1} or more"
            )
    w.checked.add(key)


class Simulator:
    """Replays a workload through one backend's ``KVCacheManager``.

    The workload is pulled as the simulation goes (see :meth:`Workload.releases`), so a run
    holds only the requests that arrived and have not finished, plus the later turns of
    conversations in flight; a list of requests is accepted as well.

    Args:
        backend: The implementation to drive.
        model: KV-cache groups.
        settings: Manager settings.
        sched: Scheduler limits.
        workload: The requests.
        retention: kvcore's cache control (pinned system prompts, a priority mix); None
            drives the manager as the reference is driven (plain LRU). With it, the manager's
            clock is simulated (:meth:`seconds`). With ``retention.enforce`` False the
            manager is driven as without it, and only the tiers are drawn, to count hit rates
            per tier.

    Raises:
        ConfigError: If the configuration cannot serve the workload.
    """

    def __init__(
        self,
        backend: Backend,
        model: ModelPreset,
        settings: ManagerSettings,
        sched: SchedulerSettings,
        workload: Workload | Iterable[RequestSpec],
        retention: RetentionSettings | None = None,
    ) -> None:
        self.workload = as_workload(workload)
        check_config(model, settings, sched, self.workload)
        self.backend = backend
        self.model = model
        self.settings = settings
        self.sched = sched
        self.retention = retention
        self.clock = 0
        """The current step (idle stretches skipped over count)."""
        self.pins: SystemPromptPins | None = None
        self.tiers: PriorityTiers | None = None
        self._enforce = retention is not None and retention.enforce
        if not self._enforce:
            self.manager: Any = backend.build_manager(model, settings)
        else:
            self.manager = backend.build_manager(model, settings, clock=self.seconds)
        if retention is not None:
            if retention.pin_system_prompts and retention.enforce:
                self.pins = SystemPromptPins(retention.pin_ttl_s, model.block_size)
            if retention.priority_mix:
                self.tiers = PriorityTiers(retention.priority_mix, retention.seed)
        self.stats = SimStats(requests_total=len(self.workload))
        if settings.enable_events:
            self.stats.blocks_evicted = 0
        self._checksum = hashlib.blake2b(digest_size=16)
        self._waiting: deque[_Live] = deque()
        self._running: list[_Live] = []
        # Pulled from the workload, not yet waiting: (arrival, index) heap and index -> spec.
        self._pending: list[tuple[int, int]] = []
        self._held: dict[int, RequestSpec] = {}
        self._dependents: dict[str, list[int]] = {}
        self._bound = HitBound(model.block_size, settings.max_model_len)
        self._releases = self.workload.releases()
        self._ahead: tuple[int, RequestSpec] | None = None
        self._stop = False
        self.released = 0
        """Requests taken from the workload so far."""
        self._pull_next()

    @property
    def done(self) -> bool:
        """True when every request has finished."""
        return self.stats.finished >= self.stats.requests_total

    @property
    def decisions_checksum(self) -> str:
        """Hex digest over every decision so far (hits, block ids, preemptions, finishes)."""
        return self._checksum.hexdigest()

    def seconds(self) -> float:
        """The manager's clock: simulated seconds, :data:`STEP_SECONDS` per step."""
        return self.clock * STEP_SECONDS

    def hit_rate_bound(self) -> float:
        """The unlimited-cache prefix hit rate of the requests pulled so far, in workload
        order (of the whole workload once every request was pulled; see :class:`HitBound`)."""
        return self._bound.rate

    def stop(self) -> None:
        """Makes :meth:`run` return after the current step (safe to call from a signal
        handler); the figures stay those of whole steps."""
        self._stop = True

    def _pull_next(self) -> None:
        self._ahead = next(self._releases, None)
        if self._ahead is None:
            self._bound.release_memory()  # every request was taken: only the rate is left

    def _pull(self) -> None:
        """Takes every request that arrived by now, and those that wait for one."""
        while self._ahead is not None:
            i, spec = self._ahead
            if spec.after is None:
                if spec.arrival > self.clock:
                    return
                heapq.heappush(self._pending, (spec.arrival, i))
            else:
                self._dependents.setdefault(spec.after, []).append(i)
            self._held[i] = spec
            self._bound.add(i, spec)
            if self.tiers is not None:
                self.tiers.pulled(spec.request_id, spec.after)
            self.released += 1
            self._pull_next()

    def run(self, on_step: Callable[[Simulator], None] | None = None) -> SimStats:
        """Runs until every request has finished.

        Args:
            on_step: Called after every step (for a progress display).

        Returns:
            The statistics (also available as ``self.stats`` while running, so that an
            interrupted run can still be summarised).

        Raises:
            SimulationStalled: If a request can never be scheduled.
        """
        start = time.perf_counter()
        try:
            while not self.done and not self._stop:
                self.step()
                if on_step is not None:
                    on_step(self)
        finally:
            self.stats.wall_s += time.perf_counter() - start
        return self.stats

    def step(self) -> None:
        """Runs one scheduler step (skipping idle time until the next arrival)."""
        perf = time.perf_counter_ns
        mgr = self.manager
        be = self.backend
        stats = self.stats
        running = self._running
        waiting = self._waiting
        max_len = self.settings.max_model_len
        ns = 0
        pending = self._pending
        held = self._held
        self._pull()
        if not running and not waiting:
            # Idle: skip to the next arrival, pulled or not.
            nxt = pending[0][0] if pending else None
            if self._ahead is not None:
                a = self._ahead[1].arrival
                nxt = a if nxt is None else min(nxt, a)
            if nxt is not None and nxt > self.clock:
                self.clock = nxt
                self._pull()
        while pending and pending[0][0] <= self.clock:
            _, i = heapq.heappop(pending)
            waiting.append(_Live(i, held.pop(i)))
        if not running and not waiting:
            if not self.done:
                left = self.stats.requests_total - self.stats.finished
                raise SimulationStalled(
                    f"{_plural(left, 'request')} wait for requests that never run (a request's "
                    "'after' must name an earlier request)"
                )
            return

        log: list[int] = [_T_STEP, self.clock]
        t0 = perf()
        mgr.new_step_starts()
        ns += perf() - t0
        budget = self.settings.max_num_batched_tokens
        scheduled: list[tuple[_Live, int]] = []
        preempted = False

        # 1. Running requests: allocate in order (all at once with the batch call); when one
        # does not fit, preempt the last running request and try it again.
        i = 0
        batch = be.batch_calls
        while i < len(running) and budget > 0:
            plan: list[int] = []  # indices into running
            counts: list[int] = []
            left = budget
            j = i
            while j < len(running) and left > 0 and (batch or not plan):
                req = running[j].req
                n = min(req.num_tokens - req.num_computed_tokens, left)
                n = min(n, max_len - req.num_computed_tokens - 1)
                if n > 0:
                    plan.append(j)
                    counts.append(n)
                    left -= n
                j += 1
            if not plan:
                break
            t0 = perf()
            if batch:
                got = mgr.allocate_slots_batch(
                    [running[k].req for k in plan], counts, allow_none=True
                )
            else:
                new_blocks = mgr.allocate_slots(running[plan[0]].req, counts[0])
                got = [] if new_blocks is None else [new_blocks.get_block_ids(allow_none=True)]
            ns += perf() - t0
            # None: no new block in any group (what an engine forwards for most decode steps).
            for k, n, ids in zip(plan, counts, got, strict=False):
                live = running[k]
                log += (_T_ALLOC, live.idx, n)
                for group in ids or ():
                    log.append(_T_GROUP)
                    log += group
                scheduled.append((live, n))
                budget -= n
            if len(got) == len(plan):
                i = j
                continue
            i = plan[len(got)]
            live = running[i]
            victim = running.pop()
            if victim is live and not running:
                raise SimulationStalled(
                    f"{live.spec.describe()} cannot grow to {live.req.num_tokens} tokens even "
                    "when it is the only running request; use a larger --num-blocks"
                    + self._pinned_note()
                )
            ns += self._preempt(victim, log)
            preempted = True
            if victim is live:
                log += (_T_ALLOC_FAIL, live.idx, counts[len(got)])
                break

        # 2. Waiting requests (only when nothing was preempted).
        num_continued = len(scheduled)
        if not preempted:
            gate = self.sched.admission_gate
            while waiting and budget > 0 and len(running) < self.sched.max_num_seqs:
                live = waiting[0]
                req = live.req
                if req is None:
                    spec = live.spec
                    if self.tiers is not None:
                        live.tier = self.tiers.take(spec.request_id)
                    if live.tier < 0 or not self._enforce:
                        build = be.request_factory(
                            spec.request_id, list(spec.prompt), len(spec.output)
                        )
                    else:
                        assert self.tiers is not None
                        tier = self.tiers.mix[live.tier]
                        build = be.request_factory(
                            spec.request_id,
                            list(spec.prompt),
                            len(spec.output),
                            retention_priority=tier.priority,
                            retention_ttl_s=tier.ttl_s,
                        )
                    t0 = perf()
                    req = live.req = build()
                    ns += perf() - t0
                t0 = perf()
                hit_blocks, hit = mgr.get_computed_blocks(req)
                ns += perf() - t0
                n = min(req.num_tokens - hit, budget)
                t0 = perf()
                new_blocks = mgr.allocate_slots(
                    req,
                    n,
                    num_new_computed_tokens=hit,
                    new_computed_blocks=hit_blocks,
                    num_lookahead_tokens=0,
                    num_external_computed_tokens=0,
                    delay_cache_blocks=False,
                    num_encoder_tokens=0,
                    full_sequence_must_fit=gate,
                    reserved_blocks=0,
                    has_scheduled_reqs=bool(running),
                )
                ns += perf() - t0
                log += (_T_LOOKUP, live.idx, hit)
                for group in hit_blocks.get_block_ids():
                    log.append(_T_GROUP)
                    log += group
                if new_blocks is None:
                    log += (_T_ALLOC_FAIL, live.idx, n)
                    break
                waiting.popleft()
                running.append(live)
                t0 = perf()
                table = mgr.get_blocks(req.request_id).get_block_ids()
                ns += perf() - t0
                log += (_T_TABLE, live.idx, n)
                for group in table:
                    log.append(_T_GROUP)
                    log += group
                if req.num_preemptions == 0:
                    stats.hit_tokens += hit
                    stats.query_tokens += req.num_tokens
                    if self.tiers is not None:
                        self.tiers.admitted(live.tier, hit, req.num_tokens)
                req.status = be.RUNNING
                req.num_computed_tokens = hit
                scheduled.append((live, n))
                budget -= n

        # 3. What the scheduler output needs from the manager.
        t0 = perf()
        if running:
            mgr.get_num_common_prefix_blocks(running[0].req.request_id)
        mgr.take_new_block_ids()
        ns += perf() - t0

        # 4. Advance, sample, finish.
        for live, n in scheduled:
            live.req.num_computed_tokens += n
        if self.pins is not None:
            ns += self._pin_system_prompts(scheduled, num_continued, log)
        sampled: list[Any] = []
        tokens: list[int] = []
        for live, _ in scheduled:
            req = live.req
            if req.num_computed_tokens >= req.num_tokens:  # not a prefill chunk: it samples
                sampled.append(req)
                tokens.append(live.spec.output[req.num_output_tokens])
        t0 = perf()
        be.append_batch(sampled, tokens)  # hashes a block when one fills
        ns += perf() - t0
        finished: list[_Live] = []
        for live, _ in scheduled:
            req = live.req
            if req.num_output_tokens >= len(live.spec.output) or req.num_tokens >= max_len:
                finished.append(live)
        for live in finished:
            running.remove(live)
            live.req.status = be.FINISHED
            t0 = perf()
            mgr.free(live.req)
            ns += perf() - t0
            log += (_T_FINISH, live.idx)
            stats.finished += 1
            if self.tiers is not None:
                self.tiers.finished(live.spec.request_id)
            for j in self._dependents.pop(live.spec.request_id, ()):
                heapq.heappush(pending, (self.clock + 1 + held[j].arrival, j))

        # 5. Events and usage.
        if self.settings.enable_events:
            t0 = perf()
            events = mgr.take_events()
            ns += perf() - t0
            removed = 0
            for ev in events:
                if type(ev).__name__ == "BlockRemoved":
                    removed += len(ev.block_hashes)
            assert stats.blocks_evicted is not None
            stats.blocks_evicted += removed
        t0 = perf()
        usage = mgr.usage
        pinned = mgr.num_pinned_blocks if self.pins is not None else 0
        ns += perf() - t0

        if not scheduled and not preempted and not running:
            raise SimulationStalled(
                f"{waiting[0].spec.describe()} cannot be admitted even into an empty cache; "
                "use a larger --num-blocks" + self._pinned_note()
            )
        self._checksum.update(array("q", log).tobytes())
        stats.kv_ns.append(ns)
        stats.steps += 1
        stats.sample_step.append(self.clock)
        stats.sample_usage.append(float(usage))
        stats.sample_running.append(len(running))
        stats.sample_waiting.append(len(waiting))
        stats.sample_hit_rate.append(stats.hit_rate)
        stats.sample_preemptions.append(stats.preemptions)
        if self.pins is not None:
            stats.sample_pinned.append(pinned)
            self.pins.peak = max(self.pins.peak, pinned)
        self.clock += 1

    def _pinned_note(self) -> str:
        """For a stall message: the pinned blocks, when there are any."""
        if self.pins is None:
            return ""
        pinned = int(self.manager.num_pinned_blocks)
        if pinned == 0:
            return ""
        return (
            f" (or a --pin-system-prompts TTL: {pinned} of {self.settings.num_blocks} blocks "
            "are pinned)"
        )

    def _pin_system_prompts(
        self, scheduled: list[tuple[_Live, int]], num_continued: int, log: list[int]
    ) -> int:
        """Pins the system prompts of requests whose prompt blocks were just cached.

        A request counts when this step's tokens took it past its system prompt, or when it
        was admitted this step with the system prompt already computed (a prefix hit): its
        system prompt's blocks are then cached (allocation caches every full block of the
        computed tokens), and ``pin_prefix`` pins them.

        Args:
            scheduled: This step's requests and token counts (advanced already).
            num_continued: How many of them were running before the step (the rest were
                admitted in it).
            log: The decision stream.

        Returns:
            Nanoseconds spent in the manager.
        """
        pins = self.pins
        assert pins is not None
        perf = time.perf_counter_ns
        mgr = self.manager
        ns = 0
        for k, (live, n) in enumerate(scheduled):
            spec = live.spec
            length = spec.system_prompt_len
            if spec.system_prompt is None or length < self.model.block_size:
                continue
            done = live.req.num_computed_tokens
            if done < length or (done - n >= length and k < num_continued):
                continue
            t0 = perf()
            got = pins.pin(mgr, spec.system_prompt, spec.prompt, length)
            ns += perf() - t0
            if got is not None:
                log += (_T_PIN, live.idx, got)
        return ns

    def _preempt(self, live: _Live, log: list[int]) -> int:
        """Preempts a running request (already removed from the running list).

        Returns:
            Nanoseconds spent in the manager.
        """
        req = live.req
        t0 = time.perf_counter_ns()
        self.manager.free(req)
        spent = time.perf_counter_ns() - t0
        req.status = self.backend.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self._waiting.appendleft(live)
        self.stats.preemptions += 1
        log += (_T_PREEMPT, live.idx)
        return spent
