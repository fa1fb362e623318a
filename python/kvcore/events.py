"""KV cache events (SPEC §6): what the block pool reports about the prefix cache.

The pool emits ``BlockStored`` when blocks enter the prefix cache, ``BlockRemoved`` when a key
leaves it, and ``AllBlocksCleared`` on a successful reset. Field names, order and defaults follow
the reference so that existing KV-aware routers can consume them.

Also here:
- how hashes appear in events (`to_external_block_hash`, SPEC EVT-2);
- the msgpack wire format (`encode_event_batch`, native and byte-identical to the reference's
  msgspec encoder; `decode_event_batch`, pure Python) (SPEC WIRE-2, WIRE-3);
- `KVEventAggregator`, which merges the events of several workers (SPEC EVT-4);
- publishers: `NullEventPublisher`, `ZmqEventPublisher` (PUB socket, replay ROUTER socket;
  needs the optional dependency pyzmq, imported only when one is created) and
  `make_event_publisher` (SPEC WIRE-4..6).
"""

from __future__ import annotations

import importlib
import logging
import os
import queue
import struct
import threading
import time
from abc import ABC, abstractmethod
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import count
from typing import Any

from kvcore import _native
from kvcore._native import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

logger = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"

ExternalBlockHash = bytes | int
"""A block hash as reported in events: an int (the default) or the raw digest (SPEC EVT-2)."""

# The event classes are native (fast to build, like the reference's msgspec structs); they are
# re-exported here as the public home of the event types.
__all__ = [
    "MEDIUM_GPU",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "ExternalBlockHash",
    "KVCacheEvent",
    "KVEventAggregator",
    "KVEventBatch",
    "decode_event_batch",
    "encode_event_batch",
    "make_event_publisher",
    "to_external_block_hash",
    "use_int_block_hashes",
]


@dataclass(slots=True)
class KVEventBatch:
    """The events of one scheduler step, as published (SPEC WIRE-1, WIRE-2).

    Attributes:
        ts: Wall-clock time of the batch.
        events: The events, in emission order.
        data_parallel_rank: The data-parallel rank, or None.
    """

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared] = field(default_factory=list)
    data_parallel_rank: int | None = None


# --- EVT-2: hashes as reported in events ---------------------------------------------------

INT_BLOCK_HASHES_ENV = "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"
"""Environment variable choosing how events report hashes (SPEC EVT-2)."""

_U64_MASK = (1 << 64) - 1


def use_int_block_hashes() -> bool:
    """Reads ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` (SPEC EVT-2), at every call.

    Unset means ``"1"``. The value is parsed by ``int()``; it is truthy when non-zero.

    Returns:
        True when events report hashes as ints, False for raw digest bytes.

    Raises:
        ValueError: The value is not an integer (``"true"``, ``""``).
    """
    return int(os.environ.get(INT_BLOCK_HASHES_ENV, "1")) != 0


def to_external_block_hash(block_hash: bytes, *, as_int: bool | None = None) -> ExternalBlockHash:
    """Converts a block hash (digest bytes, group id stripped) to its event form (SPEC EVT-2).

    Args:
        block_hash: The digest.
        as_int: Whether to report an int; None reads the environment (`use_int_block_hashes`).

    Returns:
        The last 8 bytes read big-endian as an int, or ``block_hash`` itself.

    Raises:
        ValueError: ``as_int`` is None and the environment variable is not an integer.
    """
    if as_int is None:
        as_int = use_int_block_hashes()
    if not as_int:
        return block_hash
    return int.from_bytes(block_hash, "big") & _U64_MASK


# --- WIRE-2, WIRE-3: msgpack encoding and decoding -----------------------------------------


def encode_event_batch(batch: KVEventBatch) -> bytes:
    """Encodes a batch as the msgpack bytes the reference publishes (SPEC WIRE-2, WIRE-3).

    The batch is the 3-array ``[ts, [events], data_parallel_rank]``; each event is a map whose
    first key is ``"type"``, followed by its fields in EVT-1 order, optional fields omitted when
    None. Events are recognised by class name, so the reference's event structs encode too.

    Args:
        batch: The batch.

    Returns:
        The msgpack payload.

    Raises:
        TypeError: An event of another class, or a field value that is not None, bool, int,
            float, str, bytes, bytearray, list or tuple.
        OverflowError: An int outside ``[-2**63, 2**64 - 1]``.
        RecursionError: Values nested more than 1000 deep.
    """
    return _native.encode_event_batch(batch.ts, batch.events, batch.data_parallel_rank)


class _Reader:
    """A cursor over msgpack bytes (decoding only the forms a batch can hold)."""

    __slots__ = ("data", "pos")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int) -> bytes:
        end = self.pos + n
        if end > len(self.data):
            raise ValueError("truncated msgpack data")
        out = self.data[self.pos : end]
        self.pos = end
        return out

    def uint(self, n: int) -> int:
        return int.from_bytes(self.take(n), "big")

    def array(self, n: int) -> list[Any]:
        return [self.read() for _ in range(n)]

    def map(self, n: int) -> dict[Any, Any]:
        out: dict[Any, Any] = {}
        for _ in range(n):
            key = self.read()
            if isinstance(key, list):
                raise ValueError("msgpack map key is an array")
            out[key] = self.read()
        return out

    def read(self) -> Any:
        b = self.take(1)[0]
        if b <= 0x7F:
            return b
        if b >= 0xE0:
            return b - 0x100
        if 0x80 <= b <= 0x8F:
            return self.map(b & 0x0F)
        if 0x90 <= b <= 0x9F:
            return self.array(b & 0x0F)
        if 0xA0 <= b <= 0xBF:
            return self.take(b & 0x1F).decode("utf-8")
        match b:
            case 0xC0:
                return None
            case 0xC2:
                return False
            case 0xC3:
                return True
            case 0xC4 | 0xC5 | 0xC6:
                return self.take(self.uint(1 << (b - 0xC4)))
            case 0xCA:
                return struct.unpack(">f", self.take(4))[0]
            case 0xCB:
                return struct.unpack(">d", self.take(8))[0]
            case 0xCC | 0xCD | 0xCE | 0xCF:
                return self.uint(1 << (b - 0xCC))
            case 0xD0 | 0xD1 | 0xD2 | 0xD3:
                return int.from_bytes(self.take(1 << (b - 0xD0)), "big", signed=True)
            case 0xD9 | 0xDA | 0xDB:
                return self.take(self.uint(1 << (b - 0xD9))).decode("utf-8")
            case 0xDC | 0xDD:
                return self.array(self.uint(2 if b == 0xDC else 4))
            case 0xDE | 0xDF:
                return self.map(self.uint(2 if b == 0xDE else 4))
        raise ValueError(f"unsupported msgpack type byte 0x{b:02x}")


_EVENT_CLASSES: dict[str, type[KVCacheEvent]] = {
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}

_REQUIRED_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}

_OPTIONAL_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": (
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
    ),
    "BlockRemoved": ("group_idx",),
    "AllBlocksCleared": (),
}


def _event_from_map(m: Any) -> BlockStored | BlockRemoved | AllBlocksCleared:
    if not isinstance(m, dict):
        raise ValueError(f"an event must be a msgpack map, got {type(m).__name__}")
    tag = m.get("type")
    if not isinstance(tag, str) or tag not in _EVENT_CLASSES:
        raise ValueError(f"unknown event type {tag!r}")
    kwargs: dict[str, Any] = {}
    for name in _REQUIRED_FIELDS[tag]:
        if name not in m:
            raise ValueError(f"{tag} event lacks the required field {name!r}")
        kwargs[name] = m[name]
    for name in _OPTIONAL_FIELDS[tag]:
        if name in m:
            kwargs[name] = m[name]
    extra = kwargs.get("extra_keys")
    if isinstance(extra, list):
        kwargs["extra_keys"] = [tuple(k) if isinstance(k, list) else k for k in extra]
    if tag == "BlockStored":
        return BlockStored(**kwargs)
    if tag == "BlockRemoved":
        return BlockRemoved(**kwargs)
    return AllBlocksCleared()


def decode_event_batch(data: bytes | bytearray | memoryview) -> KVEventBatch:
    """Decodes a payload written by `encode_event_batch` (or by the reference).

    Decoding follows msgspec's typed decoding of the reference's batch: each ``extra_keys``
    entry becomes a tuple (arrays nested inside it stay lists), unknown event fields are
    ignored, and a 2-array batch gets rank None.

    Args:
        data: The msgpack payload.

    Returns:
        The batch.

    Raises:
        ValueError: The bytes are not a well-formed event batch.
    """
    reader = _Reader(bytes(data))
    top = reader.read()
    if reader.pos != len(reader.data):
        raise ValueError("trailing bytes after the event batch")
    if not isinstance(top, list) or len(top) not in (2, 3):
        raise ValueError("an event batch must be a msgpack array of 3 items")
    ts, events = top[0], top[1]
    rank = top[2] if len(top) == 3 else None
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        raise ValueError(f"batch ts must be a number, got {type(ts).__name__}")
    if not isinstance(events, list):
        raise ValueError("batch events must be an array")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise ValueError(f"batch data_parallel_rank must be an int or nil, got {rank!r}")
    return KVEventBatch(
        ts=float(ts), events=[_event_from_map(e) for e in events], data_parallel_rank=rank
    )


# --- EVT-4: aggregation across workers -----------------------------------------------------


class KVEventAggregator:
    """Merges the event lists of several workers (SPEC EVT-4).

    Each event is counted by value (every field, ``lora_name`` included); an event is common
    when its count equals the number of workers exactly.

    Args:
        num_workers: How many workers contribute events.

    Raises:
        ValueError: ``num_workers <= 0``.
    """

    __slots__ = ("_counts", "_num_workers")

    def __init__(self, num_workers: int) -> None:
        if num_workers <= 0:
            raise ValueError(f"num_workers must be positive, got {num_workers}")
        self._counts: Counter[KVCacheEvent] = Counter()
        self._num_workers = num_workers

    def add_events(self, events: list[KVCacheEvent]) -> None:
        """Counts one worker's events.

        Args:
            events: The events (a list).

        Raises:
            TypeError: ``events`` is not a list.
        """
        if not isinstance(events, list):
            raise TypeError(f"events must be a list, not {type(events).__name__}")
        self._counts.update(events)

    def get_common_events(self) -> list[KVCacheEvent]:
        """Returns each distinct event seen exactly once per worker, in first-seen order."""
        n = self._num_workers
        return [ev for ev, c in self._counts.items() if c == n]

    def get_all_events(self) -> list[KVCacheEvent]:
        """Returns every distinct event repeated by its count, grouped, in first-seen order."""
        return list(self._counts.elements())

    def clear_events(self) -> None:
        """Drops every count."""
        self._counts.clear()

    def increment_workers(self, count: int = 1) -> None:
        """Adds ``count`` workers.

        Args:
            count: How many workers to add.

        Raises:
            ValueError: ``count <= 0``.
        """
        if count <= 0:
            raise ValueError(f"count must be positive, got {count}")
        self._num_workers += count

    def reset_workers(self) -> None:
        """Sets the number of workers back to 1."""
        self._num_workers = 1

    def get_number_of_workers(self) -> int:
        """Returns the number of workers."""
        return self._num_workers

    def __repr__(self) -> str:
        return f"<KVEventAggregator workers={self._num_workers}, events={len(self._counts)}>"


# --- WIRE-4..6: publishers ------------------------------------------------------------------

DEFAULT_ENDPOINT = "tcp://*:5557"
"""Default PUB endpoint (SPEC WIRE-4): binds every interface on port 5557."""

END_SEQ = b"\xff" * 8
"""Sequence number that ends a replay reply (SPEC WIRE-5)."""


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """Offsets an endpoint for a data-parallel rank (SPEC WIRE-6).

    Rank 0, None or an empty endpoint is returned unchanged. Otherwise an endpoint containing
    ``"inproc"`` gets the suffix ``_dp{rank}``; else one containing ``"tcp"`` gets its port (the
    text after the last ``:``) plus the rank.

    Args:
        endpoint: The endpoint, e.g. ``"tcp://*:5557"`` or ``"inproc://cache"``.
        data_parallel_rank: The rank.

    Returns:
        The endpoint for that rank.

    Raises:
        ValueError: The endpoint is neither inproc nor tcp, or its port is not an int.
    """
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{data_parallel_rank}"
    if "tcp" in endpoint:
        base, colon, port = endpoint.rpartition(":")
        if not colon:
            return endpoint
        return f"{base}:{int(port) + data_parallel_rank}"
    raise ValueError(f"invalid endpoint {endpoint!r}: must contain 'inproc' or 'tcp'")


def endpoint_binds(endpoint: str) -> bool:
    """Whether a PUB socket binds (True) or connects (False) to ``endpoint`` (SPEC WIRE-4).

    It binds if the endpoint contains ``*`` or ``::`` or starts with ``ipc://`` or
    ``inproc://``.
    """
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )


class EventPublisher(ABC):
    """Publishes event batches of one data-parallel rank (SPEC WIRE-1).

    Args:
        data_parallel_rank: The rank written into batches that carry None.
    """

    def __init__(self, data_parallel_rank: int = 0) -> None:
        self._data_parallel_rank = data_parallel_rank

    @abstractmethod
    def publish(self, events: KVEventBatch) -> None:
        """Emits one batch; batches go out in order."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stops publishing and releases resources."""

    def __enter__(self) -> EventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class NullEventPublisher(EventPublisher):
    """A publisher that drops every batch (events disabled or publisher ``"null"``)."""

    def publish(self, events: KVEventBatch) -> None:
        """Drops the batch."""

    def shutdown(self) -> None:
        """Does nothing."""


def _import_zmq() -> Any:
    try:
        return importlib.import_module("zmq")
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the zmq event publisher needs pyzmq, an optional dependency: pip install pyzmq"
        ) from exc


class ZmqEventPublisher(EventPublisher):
    """Publishes batches on a ZMQ PUB socket, with an optional replay ROUTER socket.

    A background thread takes batches from a bounded queue, encodes them
    (`encode_event_batch`) and sends ``[topic, seq (u64 big-endian), payload]``, seq counting
    from 0 (SPEC WIRE-4). The last ``buffer_steps`` ``(seq, payload)`` pairs are kept for
    replay: a request ``[identity, b"", start_seq]`` on the ROUTER socket is answered with every
    kept batch whose seq is at least ``start_seq``, then an end marker (SPEC WIRE-5). Both
    endpoints are offset by the data-parallel rank (SPEC WIRE-6). Needs pyzmq.

    Args:
        data_parallel_rank: The rank (offsets the endpoints, fills batches that carry None).
        endpoint: PUB endpoint; it binds or connects as `endpoint_binds` says.
        replay_endpoint: ROUTER endpoint for replay requests (always bound), or None.
        buffer_steps: How many batches to keep for replay.
        hwm: The PUB socket's send high-water mark.
        max_queue_size: How many batches may wait; `publish` blocks while the queue is full.
        topic: Topic frame of every message.

    Raises:
        ImportError: pyzmq is not installed.
        ValueError: An endpoint cannot be offset for the rank (`offset_endpoint_port`).
    """

    SHUTDOWN_TIMEOUT: float = 1.0
    END_SEQ: bytes = END_SEQ

    def __init__(
        self,
        data_parallel_rank: int = 0,
        endpoint: str = DEFAULT_ENDPOINT,
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        topic: str = "",
    ) -> None:
        super().__init__(data_parallel_rank)
        zmq = _import_zmq()
        self._zmq = zmq
        self._endpoint = offset_endpoint_port(endpoint, data_parallel_rank)
        self._replay_endpoint = offset_endpoint_port(replay_endpoint, data_parallel_rank)
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._topic = topic.encode("utf-8")
        self._seq: Iterator[int] = count()
        ctx = zmq.Context.instance()
        self._pub: Any = ctx.socket(zmq.PUB)
        self._replay: Any = None
        try:
            self._pub.set_hwm(hwm)
            if self._endpoint:
                if endpoint_binds(self._endpoint):
                    self._pub.bind(self._endpoint)
                else:
                    self._pub.connect(self._endpoint)
            if self._replay_endpoint is not None:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.bind(self._replay_endpoint)
        except BaseException:
            self._close_sockets()
            raise
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kvcore-zmq-publisher", daemon=True)
        self._thread.start()

    offset_endpoint_port = staticmethod(offset_endpoint_port)

    @property
    def endpoint(self) -> str | None:
        """The PUB endpoint after the rank offset."""
        return self._endpoint

    @property
    def replay_endpoint(self) -> str | None:
        """The ROUTER endpoint after the rank offset, or None."""
        return self._replay_endpoint

    def publish(self, events: KVEventBatch) -> None:
        """Queues a batch, setting its rank to this publisher's when it is None.

        Blocks while ``max_queue_size`` batches are waiting.

        Raises:
            RuntimeError: The publisher was shut down.
        """
        if not self._running:
            raise RuntimeError("the event publisher is shut down")
        if events.data_parallel_rank is None:
            events.data_parallel_rank = self._data_parallel_rank
        self._queue.put(events)

    def shutdown(self) -> None:
        """Sends what is queued (waiting up to ``SHUTDOWN_TIMEOUT``), then closes the sockets."""
        if not self._running and not self._thread.is_alive():
            self._close_sockets()
            return
        self._running = False
        try:
            self._queue.put(None, timeout=self.SHUTDOWN_TIMEOUT)
        except queue.Full:
            logger.warning("event queue full at shutdown; %d batches dropped", self._queue.qsize())
        deadline = time.monotonic() + self.SHUTDOWN_TIMEOUT
        while not self._queue.empty() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self._queue.empty():
            logger.warning(
                "event queue still holds %d items after %.1f s",
                self._queue.qsize(),
                self.SHUTDOWN_TIMEOUT,
            )
        self._thread.join(timeout=self.SHUTDOWN_TIMEOUT)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None and not sock.closed:
                sock.close(linger=0)

    def _run(self) -> None:
        """The publisher thread: serve replay requests, send queued batches."""
        while self._running or not self._queue.empty():
            if self._replay is not None:
                try:
                    if self._replay.poll(0):
                        self._serve_replay()
                except Exception:
                    logger.exception("error serving a KV event replay request")
            try:
                batch = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if batch is None:
                self._queue.task_done()
                break
            try:
                seq = next(self._seq)
                payload = encode_event_batch(batch)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
            except Exception:
                logger.exception("error publishing a KV event batch")
                time.sleep(0.1)
            finally:
                self._queue.task_done()

    def _serve_replay(self) -> None:
        """Answers one replay request (SPEC WIRE-5)."""
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("ignoring a replay request of %d frames: %r", len(frames), frames)
            return
        identity, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((identity, b"", END_SEQ, b""))


_PUBLISHERS: dict[str, Callable[..., EventPublisher]] = {
    "null": NullEventPublisher,
    "zmq": ZmqEventPublisher,
}


def register_event_publisher(name: str, ctor: Callable[..., EventPublisher]) -> None:
    """Makes a publisher class available to `make_event_publisher` under ``name``.

    Raises:
        KeyError: ``name`` is already registered.
    """
    if name in _PUBLISHERS:
        raise KeyError(f"event publisher {name!r} is already registered")
    _PUBLISHERS[name] = ctor


def make_event_publisher(
    name: str | None = None,
    *,
    enable_kv_cache_events: bool = True,
    data_parallel_rank: int = 0,
    endpoint: str = DEFAULT_ENDPOINT,
    replay_endpoint: str | None = None,
    buffer_steps: int = 10_000,
    hwm: int = 100_000,
    max_queue_size: int = 100_000,
    topic: str = "",
) -> EventPublisher:
    """Creates the publisher that events go to (SPEC WIRE-4).

    A no-op publisher is returned when events are disabled or the name is ``"null"``; the name
    defaults to ``"zmq"`` when events are enabled.

    Args:
        name: Publisher name (``"zmq"``, ``"null"`` or a registered one), or None.
        enable_kv_cache_events: Whether events are enabled.
        data_parallel_rank: The rank of this engine.
        endpoint: PUB endpoint.
        replay_endpoint: Replay ROUTER endpoint, or None.
        buffer_steps: Batches kept for replay.
        hwm: PUB high-water mark.
        max_queue_size: Batches that may wait to be sent.
        topic: Topic frame.

    Returns:
        The publisher.

    Raises:
        ValueError: Events are enabled and the name is unknown.
        ImportError: The zmq publisher is chosen and pyzmq is not installed.
    """
    if name is None:
        name = "zmq" if enable_kv_cache_events else "null"
    if not enable_kv_cache_events or name == "null":
        return NullEventPublisher(data_parallel_rank)
    try:
        ctor = _PUBLISHERS[name]
    except KeyError:
        raise ValueError(f"unknown event publisher {name!r}") from None
    return ctor(
        data_parallel_rank=data_parallel_rank,
        endpoint=endpoint,
        replay_endpoint=replay_endpoint,
        buffer_steps=buffer_steps,
        hwm=hwm,
        max_queue_size=max_queue_size,
        topic=topic,
    )
