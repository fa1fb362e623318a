"""Feeds NVIDIA Dynamo's standalone KV indexer with kvcore's ZMQ events (tests/test_router_dynamo.py).

A KV-aware router keeps its own picture of each engine's prefix cache from the engine's KV
events and routes a prompt to the engine with the longest cached prefix. Here the router is
Dynamo's standalone indexer (``python -m dynamo.indexer`` from the PyPI package
``ai-dynamo-runtime``, installed in a virtual environment of its own by
``scripts/install-dynamo.sh``, run as a subprocess) and the engine is a kvcore
``KVCacheManager`` whose ``take_events()`` go out through ``kvcore.events.ZmqEventPublisher``,
the bytes vLLM's publisher sends. A seeded scenario drives the manager and, at checkpoints,
compares the router's overlap score for a prompt with the engine's own hit length.

How the indexer is used:

- Started with ``--port P --threads 1`` (HTTP only, one indexer thread: events are applied in
  the order they arrive); ready when ``GET /workers`` answers.
- ``POST /register {instance_id, endpoint, model_name, block_size}``: the indexer connects a
  ZMQ SUB socket (topic ``""``) to the engine's PUB endpoint and applies each message
  ``[topic, seq (u64 big-endian), msgpack KVEventBatch]``. Each ``model_name`` has its own
  radix tree, so every scenario registers a fresh one. The PUB socket must bind, so the
  publisher's endpoint is ``tcp://*:port`` (SPEC WIRE-4: a host without ``*`` connects).
- The indexer does not use the engine's block hashes to answer queries: ``BlockStored`` gives
  it each block's tokens (``token_ids``, ``block_size`` per block), which it hashes with its own
  function into a radix tree; the engine's hashes only name the nodes, for later
  ``parent_block_hash`` lookups and ``BlockRemoved``. ``AllBlocksCleared`` drops the engine's
  whole tree.
- ``POST /query {token_ids, model_name}`` hashes the tokens' full blocks the same way and
  answers ``{"scores": {instance_id: {dp_rank: tokens}}, ...}``: the matched prefix in tokens
  (matched blocks times the block size); an engine with no match is absent.

Comparison: the engine never counts a prompt's last token as a hit (it must be recomputed), so
the engine's answer for prompt ``p`` is ``get_computed_blocks(fresh request)`` hit tokens //
block size, and the router is asked about ``p[:-1]``: both are then counts of full blocks.

Delivery: ZMQ PUB/SUB gives no acknowledgement, so before each comparison `RouterFeed.sync`
publishes a sentinel block (tokens and hash no scenario uses, in a batch after every event of
the checkpoint) and polls ``/query`` until the indexer reports it; a single indexer thread
applies one engine's batches in order, so everything before it has been applied. Messages sent
before the SUB socket connected are lost (ZMQ's slow joiner): the first sync re-sends its
sentinel until one arrives, and the indexer, registered with the publisher's replay endpoint,
asks for the batches whose sequence numbers it did not see (kvcore's replay reply, vLLM's
bytes, is what the indexer expects).
"""

from __future__ import annotations

import itertools
import json
import os
import random
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from kvcore.config import KVCacheConfig, KVCacheGroupSpec
from kvcore.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
    ZmqEventPublisher,
)
from kvcore.hashing import get_hash_fn_by_name, get_request_block_hasher, init_none_hash
from kvcore.manager import KVCacheManager
from kvcore.request import Request
from kvcore.specs import FullAttentionSpec

ROOT = Path(__file__).resolve().parent.parent
INSTALL_SCRIPT = ROOT / "scripts" / "install-dynamo.sh"
VENV_ENV = "KVCORE_DYNAMO_VENV"
"""Environment variable naming the indexer's venv (default ``.venv-dynamo`` at the root)."""

SENTINEL_TOKEN_BASE = 3_000_000_000
"""Sentinel blocks use token ids from here up (scenario tokens are small; the indexer reads u32)."""
SENTINEL_HASH_BASE = 0xFFFF_FFFF_0000_0000
"""Sentinel blocks' hashes count up from here (engine hashes are SHA-256 prefixes: no clash)."""


WireEvent = BlockStored | BlockRemoved | AllBlocksCleared
"""The events a `KVEventBatch` carries."""


class RouterSetupError(RuntimeError):
    """The Dynamo indexer is not installed or did not start."""


def dynamo_python() -> Path:
    """The venv python that runs the indexer (installed by ``make install-router``).

    Raises:
        RouterSetupError: It is missing.
    """
    venv = Path(os.environ.get(VENV_ENV) or ROOT / ".venv-dynamo")
    python = venv / "bin" / "python"
    if not python.exists():
        raise RouterSetupError(
            f"the Dynamo KV indexer is not installed ({python} is missing): run "
            f"`make install-router` (or `bash {INSTALL_SCRIPT.relative_to(ROOT)}`), which puts "
            "ai-dynamo-runtime in its own virtual environment"
        )
    return python


def free_port() -> int:
    """A TCP port free on this machine now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class DynamoIndexer:
    """A running ``python -m dynamo.indexer`` and its HTTP API.

    Args:
        python: The venv python (`dynamo_python`).
        log_path: Where the indexer's output goes (shown when something fails).
        startup_timeout: Seconds to wait for the HTTP server.
    """

    def __init__(self, python: Path, log_path: Path, startup_timeout: float = 60.0) -> None:
        self.port = free_port()
        self.log_path = log_path
        self._log = log_path.open("wb")
        env = dict(os.environ)
        env.pop("DYN_ROUTER_MIN_INITIAL_WORKERS", None)  # would hold the HTTP listener back
        self.proc = subprocess.Popen(
            [str(python), "-m", "dynamo.indexer", "--port", str(self.port), "--threads", "1"],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        self._instance_ids = itertools.count(1)
        try:
            self._wait_ready(startup_timeout)
        except BaseException:
            self.close()
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RouterSetupError(
                    f"the Dynamo indexer exited with status {self.proc.returncode}:\n"
                    + self.log_tail()
                )
            try:
                status, _ = self.request("GET", "/workers")
                if status == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RouterSetupError(
                    f"the Dynamo indexer did not answer on port {self.port} within {timeout} s:\n"
                    + self.log_tail()
                )
            time.sleep(0.05)

    def log_tail(self, chars: int = 4000) -> str:
        """The end of the indexer's output."""
        self._log.flush()
        text = self.log_path.read_text(errors="replace")
        return text[-chars:]

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """One HTTP call; returns the status and the decoded JSON body (None when empty)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            data=data,
            method=method,
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                raw = resp.read()
                return resp.status, json.loads(raw) if raw else None
        except urllib.error.HTTPError as err:
            raw = err.read()
            try:
                return err.code, json.loads(raw)
            except ValueError:
                return err.code, raw.decode(errors="replace")

    def register(
        self, model_name: str, endpoint: str, block_size: int, replay_endpoint: str | None = None
    ) -> int:
        """Registers an engine's PUB endpoint under a fresh instance id, which it returns.

        With a replay endpoint (the publisher's ROUTER socket), the indexer asks for the
        batches it missed when a sequence number skips (SPEC WIRE-5).
        """
        instance_id = next(self._instance_ids)
        body: dict[str, Any] = {
            "instance_id": instance_id,
            "endpoint": endpoint,
            "model_name": model_name,
            "block_size": block_size,
        }
        if replay_endpoint is not None:
            body["replay_endpoint"] = replay_endpoint
        status, answer = self.request("POST", "/register", body)
        if status not in (200, 201):
            raise RouterSetupError(f"/register answered {status}: {answer}\n{self.log_tail()}")
        return instance_id

    def overlap_tokens(self, model_name: str, instance_id: int, token_ids: Sequence[int]) -> int:
        """The router's overlap score of ``instance_id`` for a prompt, in tokens."""
        status, body = self.request(
            "POST", "/query", {"token_ids": list(token_ids), "model_name": model_name}
        )
        if status != 200:
            raise RuntimeError(f"/query answered {status}: {body}\n{self.log_tail()}")
        per_rank: dict[str, int] = body["scores"].get(str(instance_id), {})
        return int(per_rank.get("0", 0))

    def close(self) -> None:
        """Stops the indexer (SIGTERM, then SIGKILL after 5 s)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self._log.close()


class RouterFeed:
    """One engine's events going to the indexer: a ZMQ publisher and a registration.

    Args:
        indexer: The running indexer.
        model_name: A model name no other feed uses (its own radix tree).
        block_size: The engine's block size.
    """

    def __init__(self, indexer: DynamoIndexer, model_name: str, block_size: int) -> None:
        self.indexer = indexer
        self.model_name = model_name
        self.block_size = block_size
        port, replay_port = free_port(), free_port()
        self.publisher = ZmqEventPublisher(
            endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay_port}"
        )
        self._sentinels = itertools.count()
        self._last_sentinel: int | None = None
        self.batches = 0
        try:
            self.instance_id = indexer.register(
                model_name,
                f"tcp://127.0.0.1:{port}",
                block_size,
                replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
            )
            self.sync(first=True)
        except BaseException:
            self.publisher.shutdown()
            raise

    def publish(self, events: Sequence[KVCacheEvent]) -> None:
        """Publishes one step's events as a batch (none: nothing is sent, SPEC WIRE-1)."""
        if events:
            batch = cast("list[WireEvent]", list(events))
            self.publisher.publish(KVEventBatch(ts=time.time(), events=batch))
            self.batches += 1
            if any(isinstance(ev, AllBlocksCleared) for ev in batch):
                self._last_sentinel = None  # cleared with the rest

    def _sentinel_tokens(self, n: int) -> list[int]:
        start = SENTINEL_TOKEN_BASE + n * self.block_size
        return list(range(start, start + self.block_size))

    def sync(self, timeout: float = 20.0, first: bool = False) -> None:
        """Returns once the indexer has applied every batch published so far.

        Publishes a fresh sentinel block (and the removal of the previous one) and polls until
        the router scores it. The first sync re-sends sentinels until one gets through.

        Raises:
            RuntimeError: The sentinel was not seen within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while True:
            n = next(self._sentinels)
            tokens = self._sentinel_tokens(n)
            events: list[WireEvent] = []
            if self._last_sentinel is not None:
                events.append(BlockRemoved([SENTINEL_HASH_BASE + self._last_sentinel], "GPU"))
            events.append(
                BlockStored(
                    [SENTINEL_HASH_BASE + n], None, tokens, self.block_size, None, "GPU", None
                )
            )
            self.publisher.publish(KVEventBatch(ts=time.time(), events=events))
            resend_at = time.monotonic() + 0.5
            delay = 0.001
            while True:
                seen = self.indexer.overlap_tokens(self.model_name, self.instance_id, tokens)
                if seen == self.block_size:
                    self._last_sentinel = n
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the Dynamo indexer did not apply sentinel {n} within {timeout} s "
                        f"(router score {seen}):\n{self.indexer.log_tail()}"
                    )
                if first and time.monotonic() > resend_at:
                    break  # slow joiner: that one may have been sent before the SUB connected
                time.sleep(delay)
                delay = min(delay * 2, 0.05)

    def close(self) -> None:
        """Shuts the publisher down."""
        self.publisher.shutdown()


@contextmanager
def running_indexer(python: Path, log_path: Path) -> Iterator[DynamoIndexer]:
    """Starts the indexer with the venv's ``python``, stops it on exit."""
    indexer = DynamoIndexer(python, log_path)
    try:
        yield indexer
    finally:
        indexer.close()


# --- the engine and the comparison ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Check:
    """One comparison of the router with the engine for one prompt."""

    step: int
    what: str
    label: str
    engine_blocks: int
    router_blocks: int

    @property
    def ok(self) -> bool:
        """Whether the router's overlap equals the engine's hit."""
        return self.engine_blocks == self.router_blocks


@dataclass
class CopyLedger:
    """Counts the cached copies of each hash that the events report.

    The reference's events report every copy (a duplicate is stored again, and each copy's
    eviction is a ``BlockRemoved``); exact router events report a hash stored only while no copy
    was reported and removed only when it was reported once, which `violations` checks.
    """

    copies: Counter[int | bytes] = field(default_factory=Counter)
    first_duplicate_step: int | None = None
    violations: list[str] = field(default_factory=list)

    def record(self, step: int, events: Sequence[KVCacheEvent]) -> None:
        """Accounts one step's events."""
        for ev in events:
            if isinstance(ev, BlockStored):
                for h in ev.block_hashes:
                    self.copies[h] += 1
                    if self.copies[h] == 2:
                        self.violations.append(f"step {step}: {h!r} stored while reported cached")
                        if self.first_duplicate_step is None:
                            self.first_duplicate_step = step
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    if self.copies[h] != 1:
                        self.violations.append(
                            f"step {step}: {h!r} removed while reported {self.copies[h]} times"
                        )
                    self.copies[h] -= 1
                    if self.copies[h] <= 0:
                        del self.copies[h]
            elif isinstance(ev, AllBlocksCleared):
                self.copies.clear()


@dataclass
class Engine:
    """A kvcore manager (one full-attention group, caching and events on) feeding a router.

    Args:
        feed: Where its events go.
        num_blocks: Pool size (the null block included).
        exact_router_events: Passed to the manager when true (issue 15); the default events
            otherwise.
    """

    feed: RouterFeed
    num_blocks: int
    exact_router_events: bool = False
    max_model_len: int = 1024
    checks: list[Check] = field(default_factory=list)
    ledger: CopyLedger = field(default_factory=CopyLedger)
    step: int = 0
    what: str = "start"

    def __post_init__(self) -> None:
        bs = self.feed.block_size
        fn = get_hash_fn_by_name("sha256_cbor")
        init_none_hash(fn)
        self.hasher = get_request_block_hasher(bs, fn)
        spec = FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=8, dtype="float16")
        config = KVCacheConfig(
            num_blocks=self.num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
        )
        extra: dict[str, Any] = {"exact_router_events": True} if self.exact_router_events else {}
        self.mgr = KVCacheManager(
            config,
            max_model_len=self.max_model_len,
            scheduler_block_size=bs,
            hash_block_size=bs,
            enable_caching=True,
            enable_kv_cache_events=True,
            **extra,
        )
        self._ids = itertools.count()
        self.running: dict[str, Request] = {}

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self.feed.block_size

    def new_request(self, tokens: Sequence[int]) -> Request:
        """A request for ``tokens``, not known to the manager."""
        return Request(f"r{next(self._ids)}", list(tokens), block_hasher=self.hasher)

    def engine_hit_blocks(self, tokens: Sequence[int]) -> int:
        """The engine's own hit for a prompt, in blocks (a fresh request, never added)."""
        probe = Request(f"probe{next(self._ids)}", list(tokens), block_hasher=self.hasher)
        _, num_hit = self.mgr.get_computed_blocks(probe)
        return num_hit // self.block_size

    def router_blocks(self, tokens: Sequence[int]) -> int:
        """The router's overlap for a prompt, in blocks (asked without the last token)."""
        feed = self.feed
        score = feed.indexer.overlap_tokens(feed.model_name, feed.instance_id, tokens[:-1])
        return score // self.block_size

    # Scheduler-like operations. Each publishes the events it caused as one batch.

    def flush(self, what: str) -> None:
        """Ends a step: publishes the manager's events."""
        self.step += 1
        self.what = what
        events = self.mgr.take_events()
        self.ledger.record(self.step, events)
        self.feed.publish(events)

    def admit(self, requests: Sequence[Request]) -> list[Request]:
        """Looks every request up first, then allocates each (the prompt, less its hit).

        Two requests for one prompt admitted together both miss, so both cache a copy of its
        blocks under the same hashes. Returns the requests that got their blocks (now running).
        """
        hits = [self.mgr.get_computed_blocks(r) for r in requests]
        admitted: list[Request] = []
        for req, (blocks, num_hit) in zip(requests, hits, strict=True):
            got = self.mgr.allocate_slots(req, req.num_tokens - num_hit, num_hit, blocks)
            if got is None:
                continue
            req.num_computed_tokens = req.num_tokens
            self.running[req.request_id] = req
            admitted.append(req)
        return admitted

    def decode(self, req: Request, tokens: Sequence[int]) -> int:
        """Appends output tokens one step at a time; returns how many fitted."""
        done = 0
        for tok in tokens:
            if self.mgr.allocate_slots(req, 1) is None:
                break
            req.num_computed_tokens += 1
            req.append_output_token_ids(tok)
            done += 1
        return done

    def finish(self, req: Request) -> None:
        """Frees a running request's blocks."""
        self.mgr.free(req)
        del self.running[req.request_id]

    def reset(self) -> bool:
        """Frees every running request, then resets the prefix cache."""
        for req in list(self.running.values()):
            self.finish(req)
        return self.mgr.reset_prefix_cache()

    def check(self, prompts: Sequence[tuple[str, Sequence[int]]]) -> list[Check]:
        """Waits for the router to catch up, then compares it with the engine for each prompt."""
        self.feed.sync()
        out = [
            Check(self.step, self.what, label, self.engine_hit_blocks(p), self.router_blocks(p))
            for label, p in prompts
        ]
        self.checks.extend(out)
        return out

    def summary(self) -> str:
        """How many checks matched, and the first mismatches."""
        bad = [c for c in self.checks if not c.ok]
        lines = [f"{len(self.checks) - len(bad)} of {len(self.checks)} checks matched"]
        lines += [
            f"  step {c.step} ({c.what}) {c.label}: engine {c.engine_blocks} blocks, "
            f"router {c.router_blocks}"
            for c in bad[:10]
        ]
        return "\n".join(lines)


# --- scenarios ----------------------------------------------------------------------------------


def duplicate_copies_scenario(engine: Engine) -> None:
    """Two copies of a prompt's blocks; pool pressure evicts one, then the other.

    Pool of ``engine.num_blocks`` = 16 blocks of 4 tokens (15 usable). A and B look up prompt P
    (13 tokens: 3 full blocks and a partial one) before either allocates, so both cache P's 3
    blocks under the same hashes. Both finish: their partial blocks go to the front of the free
    queue, their full ones after the 7 never-used blocks, A's (tail first) before B's. C (44
    tokens, 11 blocks) takes the partial blocks, the never-used ones and A's copies of P's 3rd
    and 2nd blocks: the engine still serves all of P from B's copies. D (11 blocks) then takes
    the rest, B's copies included.
    """
    bs = engine.block_size
    assert bs == 4 and engine.num_blocks == 16, "the block arithmetic below assumes this pool"
    p = list(range(1, 3 * bs + 2))
    q = list(range(1000, 1044))  # 11 full blocks, unrelated to P
    r = list(range(2000, 2044))
    prompts = [("P", p), ("P[:2 blocks]", p[: 2 * bs + 1]), ("C", q)]
    a, b = engine.new_request(p), engine.new_request(p)
    assert len(engine.admit([a, b])) == 2
    engine.flush("A and B cache P twice")
    engine.check(prompts)
    engine.finish(a)
    engine.finish(b)
    engine.flush("A and B finish")
    engine.check(prompts)
    (c,) = engine.admit([engine.new_request(q)])
    engine.flush("C evicts A's copy of P")
    engine.check(prompts)
    engine.finish(c)
    engine.flush("C finishes")
    engine.check(prompts)
    (d,) = engine.admit([engine.new_request(r)])
    engine.flush("D evicts B's copy of P")
    engine.check([*prompts, ("D", r)])
    engine.finish(d)
    engine.flush("D finishes")
    assert engine.reset()
    engine.flush("reset_prefix_cache")
    engine.check([*prompts, ("D", r)])


def random_scenario(engine: Engine, seed: int, steps: int) -> None:
    """A seeded serving mix: shared prefixes, duplicate copies, decodes, evictions, resets.

    Prompts come from a few prefix families (whole blocks of a family's prefix, then a random
    tail), so requests share prefixes; a pair admitted together (both looking up before either
    allocates) caches duplicate copies; the small pool makes every admission evict; now and then
    everything finishes and the prefix cache is reset. After every step the router is compared
    with the engine on each family's prefix and on a few earlier prompts.
    """
    rng = random.Random(seed)
    bs = engine.block_size
    families = [[rng.randrange(1, 50_000) for _ in range(rng.randint(3, 6) * bs)] for _ in range(5)]
    history: list[list[int]] = []

    def prompt() -> list[int]:
        fam = rng.choice(families)
        head = fam[: rng.randint(1, len(fam) // bs) * bs]
        tail = [rng.randrange(1, 50_000) for _ in range(rng.randint(1, 2 * bs))]
        return head + tail

    for _ in range(steps):
        op = rng.choices(
            ["admit", "pair", "decode", "finish", "reset"], weights=[30, 25, 15, 25, 5]
        )[0]
        if op in ("admit", "pair") and len(engine.running) >= 4:
            op = "finish"
        if op in ("decode", "finish") and not engine.running:
            op = "admit"
        if op == "admit":
            p = prompt()
            history.append(p)
            engine.admit([engine.new_request(p)])
        elif op == "pair":
            p = rng.choice(history) if history and rng.random() < 0.3 else prompt()
            history.append(p)
            engine.admit([engine.new_request(p), engine.new_request(p)])
        elif op == "decode":
            req = engine.running[rng.choice(sorted(engine.running))]
            engine.decode(req, [rng.randrange(1, 50_000) for _ in range(rng.randint(1, 2 * bs))])
            history.append([*req.all_token_ids, 1])
        elif op == "finish":
            engine.finish(engine.running[rng.choice(sorted(engine.running))])
        else:
            engine.reset()
        engine.flush(op)
        queries = [(f"family {i}", [*fam, 7]) for i, fam in enumerate(families)]
        picks = rng.sample(range(len(history)), min(3, len(history)))
        queries += [(f"prompt {j}", history[j]) for j in picks]
        engine.check(queries)
