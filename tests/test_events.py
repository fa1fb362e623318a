"""KV events and their wire format (SPEC §6: EVT-1..4, WIRE-1..6; vectors TV-B of §19)."""

from __future__ import annotations

import random
import struct
import subprocess
import sys
import threading
import time
import types
from collections import Counter
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore import BlockPool, _native
from kvcore.events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventAggregator,
    KVEventBatch,
    NullEventPublisher,
    ZmqEventPublisher,
    decode_event_batch,
    encode_event_batch,
    endpoint_binds,
    make_event_publisher,
    offset_endpoint_port,
    register_event_publisher,
    to_external_block_hash,
    use_int_block_hashes,
)

U64_MAX = 2**64 - 1

# --- TV-B -----------------------------------------------------------------------------------

TV_B_STORED = (
    "8ca474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391cf26470bbec927f5bfb17061"
    "72656e745f626c6f636b5f68617368cf2ceabcfae6d332eaa9746f6b656e5f6964739111aa626c6f636b5f73"
    "697a6510a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa65787472615f6b65"
    "79739193a66c6f72612d6192a3696d67f3c40100a967726f75705f69647801b26b765f63616368655f737065"
    "635f6b696e64ae736c6964696e675f77696e646f77bc6b765f63616368655f737065635f736c6964696e675f"
    "77696e646f7720"
)
TV_B_CLEARED_BATCH = "93cb3ff80000000000009181a474797065b0416c6c426c6f636b73436c6561726564c0"

# TV-H: B1 and B2 under sha256_cbor.
B1_SHA256_CBOR = bytes.fromhex("202da172482d928bbc42ab25b0151e2b895f13f41002e27b2ceabcfae6d332ea")
B2_SHA256_CBOR = bytes.fromhex("4a0a393805c6d2f0ed831000d41bb65980336c4c04895d5e26470bbec927f5bf")


def tv_b_stored() -> BlockStored:
    return BlockStored(
        block_hashes=[2758186210834249151],
        parent_block_hash=3236607068019569386,
        token_ids=[17],
        block_size=16,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=[("lora-a", ("img", -13), b"\x00")],
        group_idx=1,
        kv_cache_spec_kind="sliding_window",
        kv_cache_spec_sliding_window=32,
    )


def test_tv_b_block_stored_with_every_optional_field() -> None:
    """TV-B, WIRE-3: a full BlockStored is a 12-entry fixmap (8c), "type" first."""
    batch = encode_event_batch(KVEventBatch(ts=1.5, events=[tv_b_stored()]))
    assert batch.hex() == "93" + "cb3ff8000000000000" + "91" + TV_B_STORED + "c0"


def test_tv_b_all_blocks_cleared_batch() -> None:
    """TV-B, WIRE-2: the batch is a 3-array with float64 ts and a trailing nil rank."""
    data = encode_event_batch(KVEventBatch(ts=1.5, events=[AllBlocksCleared()]))
    assert data.hex() == TV_B_CLEARED_BATCH


def test_tv_b_event_ints() -> None:
    """TV-B, EVT-2: the event int of a hash is its last 8 bytes, big-endian."""
    assert to_external_block_hash(B1_SHA256_CBOR, as_int=True) == 3236607068019569386
    assert to_external_block_hash(B2_SHA256_CBOR, as_int=True) == 2758186210834249151
    assert to_external_block_hash(B1_SHA256_CBOR, as_int=False) == B1_SHA256_CBOR


# --- WIRE-3: value forms --------------------------------------------------------------------

INT_FORMS = [
    (0, "00"),
    (1, "01"),
    (127, "7f"),
    (128, "cc80"),
    (255, "ccff"),
    (256, "cd0100"),
    (65535, "cdffff"),
    (65536, "ce00010000"),
    (2**32 - 1, "ceffffffff"),
    (2**32, "cf0000000100000000"),
    (2**63 - 1, "cf7fffffffffffffff"),
    (2**63, "cf8000000000000000"),
    (U64_MAX, "cfffffffffffffffff"),
    (-1, "ff"),
    (-13, "f3"),
    (-32, "e0"),
    (-33, "d0df"),
    (-128, "d080"),
    (-129, "d1ff7f"),
    (-32768, "d18000"),
    (-32769, "d2ffff7fff"),
    (-(2**31), "d280000000"),
    (-(2**31) - 1, "d3ffffffff7fffffff"),
    (-(2**63), "d38000000000000000"),
]


@pytest.mark.parametrize(("value", "want"), INT_FORMS)
def test_int_forms(value: int, want: str) -> None:
    """WIRE-3: non-negative ints use unsigned forms (2**32 up is cf); negatives fixint/d0-d3."""
    assert _native.msgpack_encode(value).hex() == want


@pytest.mark.parametrize("value", [2**64, -(2**63) - 1, 10**30])
def test_int_out_of_range(value: int) -> None:
    """Ints msgpack cannot carry raise OverflowError (as msgspec does)."""
    with pytest.raises(OverflowError):
        _native.msgpack_encode(value)


@pytest.mark.parametrize("value", [0.0, 1.5, -2.25, 1e300, float("inf"), float("-inf"), 0.1])
def test_floats_are_float64(value: float) -> None:
    """WIRE-3: floats are always float64 (cb)."""
    assert _native.msgpack_encode(value) == b"\xcb" + struct.pack(">d", value)


def test_nan_is_float64() -> None:
    data = _native.msgpack_encode(float("nan"))
    assert data[0] == 0xCB and len(data) == 9


def test_scalars() -> None:
    assert _native.msgpack_encode(None) == b"\xc0"
    assert _native.msgpack_encode(False) == b"\xc2"
    assert _native.msgpack_encode(True) == b"\xc3"


@pytest.mark.parametrize(
    ("n", "header"),
    [
        (0, "a0"),
        (31, "bf"),
        (32, "d920"),
        (255, "d9ff"),
        (256, "da0100"),
        (65535, "daffff"),
        (65536, "db00010000"),
    ],
)
def test_str_lengths(n: int, header: str) -> None:
    """WIRE-3: str is fixstr below 32 bytes, then d9, da, db."""
    s = "é" * (n // 2) + "x" * (n % 2)  # lengths count UTF-8 bytes
    assert len(s.encode()) == n
    assert _native.msgpack_encode(s) == bytes.fromhex(header) + s.encode()


@pytest.mark.parametrize(
    ("n", "header"),
    [
        (0, "c400"),
        (31, "c41f"),
        (32, "c420"),
        (255, "c4ff"),
        (256, "c50100"),
        (65535, "c5ffff"),
        (65536, "c600010000"),
    ],
)
def test_bin_lengths(n: int, header: str) -> None:
    """WIRE-3: bytes become bin (c4, c5, c6); bytearray too."""
    b = bytes(range(256)) * (n // 256) + bytes(n % 256)
    assert _native.msgpack_encode(b) == bytes.fromhex(header) + b
    assert _native.msgpack_encode(bytearray(b)) == bytes.fromhex(header) + b


@pytest.mark.parametrize(
    ("n", "header"), [(0, "90"), (15, "9f"), (16, "dc0010"), (65536, "dd00010000")]
)
def test_array_lengths(n: int, header: str) -> None:
    """WIRE-3: lists and tuples become arrays (fixarray, dc, dd)."""
    items = [0] * n
    want = bytes.fromhex(header) + bytes(n)
    assert _native.msgpack_encode(items) == want
    assert _native.msgpack_encode(tuple(items)) == want


class _MyInt(int):
    pass


class _MyStr(str):
    __slots__ = ()


@pytest.mark.parametrize(
    "value", [{"a": 1}, {1, 2}, object(), _MyInt(3), _MyStr("x"), [1, [2, {}]], 1j]
)
def test_unsupported_values_raise_type_error(value: object) -> None:
    """Values of other (or subclassed) types raise TypeError, as in msgspec."""
    with pytest.raises(TypeError):
        _native.msgpack_encode(value)


def test_self_referential_list_raises_recursion_error() -> None:
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(RecursionError):
        _native.msgpack_encode(loop)
    with pytest.raises(RecursionError):
        encode_event_batch(KVEventBatch(0.0, [BlockRemoved(loop, "GPU")]))


values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=U64_MAX)
    | st.floats(allow_nan=False)
    | st.text(max_size=300)
    | st.binary(max_size=300),
    lambda inner: st.lists(inner, max_size=20) | st.tuples(inner, inner),
    max_leaves=40,
)


@settings(max_examples=150, deadline=None)
@given(values)
def test_values_match_msgpack_python(value: Any) -> None:
    """WIRE-3 forms are the smallest ones, which msgpack-python also writes."""
    assert _native.msgpack_encode(value) == msgpack.packb(value, use_bin_type=True)


# --- WIRE-2, WIRE-3: events and batches -----------------------------------------------------


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def test_required_fields_written_as_nil_optional_omitted() -> None:
    """WIRE-3: required None fields are nil; optional None fields are left out."""
    ev = BlockStored(
        block_hashes=[], parent_block_hash=None, token_ids=[], block_size=16, lora_id=None,
        medium=None, lora_name=None,
    )  # fmt: skip
    data = encode_event_batch(KVEventBatch(ts=2.0, events=[ev]))
    top = _unpack(data)
    assert top[0] == 2.0 and top[2] is None
    assert list(top[1][0].items()) == [
        ("type", "BlockStored"),
        ("block_hashes", []),
        ("parent_block_hash", None),
        ("token_ids", []),
        ("block_size", 16),
        ("lora_id", None),
        ("medium", None),
        ("lora_name", None),
    ]
    assert data[1 + 9 + 1] == 0x88  # an 8-entry fixmap


def test_optional_fields_keep_evt1_order() -> None:
    """EVT-1, WIRE-3: set optional fields follow the required ones in EVT-1 order."""
    ev = BlockStored([1, 2], 3, [4], 2, 7, "GPU", "lora", None, 0, None, 4096)
    keys = list(_unpack(encode_event_batch(KVEventBatch(0.5, [ev])))[1][0])
    assert keys == [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "group_idx",
        "kv_cache_spec_sliding_window",
    ]


def test_block_removed_and_rank() -> None:
    """WIRE-2, WIRE-3: BlockRemoved with and without group_idx; an int rank."""
    h = bytes(range(32))
    batch = KVEventBatch(
        ts=3.25,
        events=[BlockRemoved([U64_MAX], "GPU"), BlockRemoved([h], "GPU", group_idx=2)],
        data_parallel_rank=3,
    )
    data = encode_event_batch(batch)
    assert data == msgpack.packb(
        [
            3.25,
            [
                {"type": "BlockRemoved", "block_hashes": [U64_MAX], "medium": "GPU"},
                {"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU", "group_idx": 2},
            ],
            3,
        ],
        use_bin_type=True,
    )
    assert data.endswith(b"\x03")
    assert b"\xcf" + b"\xff" * 8 in data  # a u64 hash is cf, never d3


def test_empty_batch_and_many_events() -> None:
    assert encode_event_batch(KVEventBatch(0.0)).hex() == "93cb000000000000000090c0"
    data = encode_event_batch(KVEventBatch(0.0, [AllBlocksCleared()] * 16))
    assert data[10:13] == b"\xdc\x00\x10"


def test_unknown_event_class_raises_type_error() -> None:
    class Mystery(KVCacheEvent):
        pass

    with pytest.raises(TypeError, match="Mystery"):
        encode_event_batch(KVEventBatch(0.0, [Mystery()]))  # type: ignore[list-item]
    with pytest.raises(TypeError):
        _native.encode_event_batch(0.0, [object()], None)
    with pytest.raises(TypeError):
        _native.encode_event_batch(0.0, {AllBlocksCleared()}, None)  # type: ignore[arg-type]


def test_unsupported_field_value_raises_type_error() -> None:
    ev = BlockRemoved([{"not": "a hash"}], "GPU")  # type: ignore[list-item]
    with pytest.raises(TypeError):
        encode_event_batch(KVEventBatch(0.0, [ev]))


def test_decode_round_trip() -> None:
    batch = KVEventBatch(
        ts=9.5,
        events=[
            tv_b_stored(),
            BlockStored([b"\x01" * 32], None, [1, 2], 2, None, "GPU", None, [None, ("s",)]),
            BlockRemoved([5], "GPU", group_idx=0),
            AllBlocksCleared(),
        ],
        data_parallel_rank=1,
    )
    back = decode_event_batch(encode_event_batch(batch))
    assert back.ts == 9.5 and back.data_parallel_rank == 1
    # Arrays nested inside an extra-keys tuple decode as lists (as msgspec decodes them).
    stored = back.events[0]
    assert isinstance(stored, BlockStored) and stored.extra_keys == [
        ("lora-a", ["img", -13], b"\x00")
    ]
    assert back.events[1:] == batch.events[1:]
    assert decode_event_batch(bytes.fromhex(TV_B_CLEARED_BATCH)) == KVEventBatch(
        1.5, [AllBlocksCleared()]
    )


@pytest.mark.parametrize(
    "data",
    [
        b"",
        bytes.fromhex(TV_B_CLEARED_BATCH)[:-1],
        bytes.fromhex(TV_B_CLEARED_BATCH) + b"\x00",
        msgpack.packb([1.0, [{"type": "Nope"}], None]),
        msgpack.packb([1.0, [{"type": "BlockRemoved", "medium": "GPU"}], None]),
        msgpack.packb([1.0, [], None, 4]),
        msgpack.packb({"ts": 1.0}),
        b"\xc1",
    ],
)
def test_decode_rejects_malformed_batches(data: bytes) -> None:
    with pytest.raises(ValueError):
        decode_event_batch(data)


# --- EVT-2 ----------------------------------------------------------------------------------


def test_evt2_env_default_is_int(monkeypatch: pytest.MonkeyPatch) -> None:
    """EVT-2: unset means "1": hashes are reported as ints of their last 8 bytes."""
    monkeypatch.delenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", raising=False)
    assert use_int_block_hashes() is True
    assert to_external_block_hash(B2_SHA256_CBOR) == 2758186210834249151


@pytest.mark.parametrize(
    ("raw", "as_int"),
    [("0", False), ("00", False), ("1", True), ("7", True), (" 2 ", True), ("-1", True)],
)
def test_evt2_env_values(monkeypatch: pytest.MonkeyPatch, raw: str, as_int: bool) -> None:
    """EVT-2: the value is truthy when it parses as a non-zero integer; read at every call."""
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", raw)
    assert use_int_block_hashes() is as_int
    want = 3236607068019569386 if as_int else B1_SHA256_CBOR
    assert to_external_block_hash(B1_SHA256_CBOR) == want


@pytest.mark.parametrize("raw", ["true", "", "yes", "1.0"])
def test_evt2_env_not_an_int_raises(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    """EVT-2: a value that is not an integer raises ValueError when read."""
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", raw)
    with pytest.raises(ValueError):
        use_int_block_hashes()
    with pytest.raises(ValueError):
        to_external_block_hash(B1_SHA256_CBOR)
    assert to_external_block_hash(B1_SHA256_CBOR, as_int=False) == B1_SHA256_CBOR


def _pool_events(
    monkeypatch: pytest.MonkeyPatch, raw: str | None
) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
    """Caches B1, B2 (sha256_cbor) in a native pool, evicts B1, returns the events."""
    if raw is None:
        monkeypatch.delenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", raising=False)
    else:
        monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", raw)
    pool = BlockPool(8, True, 16, enable_kv_cache_events=True)
    request = types.SimpleNamespace(
        request_id="r",
        block_hashes=[B1_SHA256_CBOR, B2_SHA256_CBOR],
        all_token_ids=list(range(1, 33)),
        lora_request=None,
        mm_features=[],
        cache_salt=None,
        prompt_embeds=None,
    )
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(request, blocks, 0, 2, 16, 0)
    pool.evict_blocks({blocks[0]})
    return pool.take_events()


@pytest.mark.parametrize("raw", [None, "1", "0"])
def test_evt2_native_pool_events(monkeypatch: pytest.MonkeyPatch, raw: str | None) -> None:
    """EVT-2: the pool's events carry ints (TV-B) by default and raw digests for "0"."""
    stored, removed = _pool_events(monkeypatch, raw)
    as_int = raw != "0"
    b1 = 3236607068019569386 if as_int else B1_SHA256_CBOR
    b2 = 2758186210834249151 if as_int else B2_SHA256_CBOR
    # One extra-keys entry per stored block, None when a block has none (POOL-17).
    assert stored == BlockStored(
        [b1, b2], None, list(range(1, 33)), 16, None, "GPU", None, [None, None], 0
    )
    assert removed == BlockRemoved([b1], "GPU", 0)
    data = encode_event_batch(KVEventBatch(1.5, [stored, removed]))
    assert decode_event_batch(data) == KVEventBatch(1.5, [stored, removed])
    if as_int:
        assert b"\xcf" + (3236607068019569386).to_bytes(8, "big") in data


def test_evt2_native_pool_env_not_an_int(monkeypatch: pytest.MonkeyPatch) -> None:
    """EVT-2: "true" is not an integer: reading it raises ValueError."""
    with pytest.raises(ValueError):
        _pool_events(monkeypatch, "true")


def test_evt2_short_and_long_hashes() -> None:
    """EVT-2: only the last 8 bytes count; shorter digests are read whole."""
    assert to_external_block_hash(b"\x01\x02", as_int=True) == 0x0102
    assert to_external_block_hash(b"\xff" * 16, as_int=True) == U64_MAX


# --- EVT-4 ----------------------------------------------------------------------------------


def _stored(h: int, lora_name: str | None = None) -> BlockStored:
    return BlockStored([h], None, [1, 2], 2, None, "GPU", lora_name)


def test_aggregator_common_and_all_events() -> None:
    """EVT-4: common = count equals workers exactly; all = grouped, first-seen order."""
    a, b, c = _stored(1), BlockRemoved([2], "GPU"), AllBlocksCleared()
    agg = KVEventAggregator(2)
    agg.add_events([a, b])
    agg.add_events([c, _stored(1), b, b])
    assert agg.get_common_events() == [a]  # b was seen 3 times, c once
    assert agg.get_all_events() == [a, a, b, b, b, c]
    assert agg.get_number_of_workers() == 2
    assert repr(agg) == "<KVEventAggregator workers=2, events=3>"
    agg.clear_events()
    assert agg.get_all_events() == [] and agg.get_common_events() == []


def test_aggregator_counts_by_every_field() -> None:
    """EVT-4: equality covers every field, lora_name included."""
    agg = KVEventAggregator(2)
    agg.add_events([_stored(1, "x")])
    agg.add_events([_stored(1, "y")])
    assert agg.get_common_events() == []
    agg.add_events([_stored(1, "x")])
    assert agg.get_common_events() == [_stored(1, "x")]


def test_aggregator_workers() -> None:
    """EVT-4: increment_workers adds, reset_workers sets 1; non-positive counts raise."""
    agg = KVEventAggregator(1)
    agg.add_events([_stored(5)])
    assert agg.get_common_events() == [_stored(5)]
    agg.increment_workers()
    agg.increment_workers(3)
    assert agg.get_number_of_workers() == 5
    assert agg.get_common_events() == []
    for bad in (0, -1):
        with pytest.raises(ValueError):
            agg.increment_workers(bad)
    assert agg.get_number_of_workers() == 5
    agg.reset_workers()
    assert agg.get_number_of_workers() == 1
    assert agg.get_common_events() == [_stored(5)]


@pytest.mark.parametrize("n", [0, -3])
def test_aggregator_rejects_non_positive_workers(n: int) -> None:
    with pytest.raises(ValueError):
        KVEventAggregator(n)


def test_aggregator_add_events_needs_a_list() -> None:
    agg = KVEventAggregator(1)
    with pytest.raises(TypeError):
        agg.add_events((AllBlocksCleared(),))  # type: ignore[arg-type]
    assert agg.get_all_events() == []


# --- WIRE-4, WIRE-6 (no zmq needed) ----------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "rank", "want"),
    [
        ("tcp://*:5557", 0, "tcp://*:5557"),
        ("tcp://*:5557", 2, "tcp://*:5559"),
        ("tcp://[::1]:6000", 1, "tcp://[::1]:6001"),
        ("tcp://host:5557", 3, "tcp://host:5560"),
        ("inproc://cache", 1, "inproc://cache_dp1"),
        ("inproc://tcp:1", 2, "inproc://tcp:1_dp2"),  # "inproc" is tested first
        ("ipc://x", 0, "ipc://x"),
        ("", 4, ""),
        (None, 4, None),
        ("tcp", 1, "tcp"),  # "tcp" without a port is left alone
    ],
)
def test_wire6_offsets(endpoint: str | None, rank: int, want: str | None) -> None:
    """WIRE-6: inproc gets _dp{r}, tcp gets port + r, rank 0 or empty is unchanged."""
    assert offset_endpoint_port(endpoint, rank) == want
    assert ZmqEventPublisher.offset_endpoint_port(endpoint, rank) == want


@pytest.mark.parametrize(
    ("endpoint", "rank"), [("ipc:///tmp/x", 1), ("udp://h:1", 2), ("tcp://h:port", 1)]
)
def test_wire6_invalid_endpoints(endpoint: str, rank: int) -> None:
    """WIRE-6: other schemes and non-numeric ports raise ValueError."""
    with pytest.raises(ValueError):
        offset_endpoint_port(endpoint, rank)


@pytest.mark.parametrize(
    ("endpoint", "binds"),
    [
        ("tcp://*:5557", True),
        ("tcp://[::]:5557", True),
        ("ipc:///tmp/kv", True),
        ("inproc://kv", True),
        ("tcp://localhost:5557", False),
        ("tcp://10.0.0.1:5557", False),
    ],
)
def test_wire4_bind_or_connect(endpoint: str, binds: bool) -> None:
    assert endpoint_binds(endpoint) is binds


def test_wire4_publisher_choice() -> None:
    """WIRE-4: disabled or "null" gives the no-op publisher; an unknown name raises."""
    assert isinstance(make_event_publisher(enable_kv_cache_events=False), NullEventPublisher)
    assert isinstance(make_event_publisher("null"), NullEventPublisher)
    assert isinstance(
        make_event_publisher("bogus", enable_kv_cache_events=False), NullEventPublisher
    )
    with pytest.raises(ValueError):
        make_event_publisher("bogus")
    null = NullEventPublisher()
    null.publish(KVEventBatch(0.0))
    null.shutdown()
    with pytest.raises(KeyError):
        register_event_publisher("zmq", NullEventPublisher)


# --- WIRE-4, WIRE-5 over zmq -----------------------------------------------------------------


def _recv(sock: Any, timeout_ms: int = 5000) -> list[bytes]:
    assert sock.poll(timeout_ms), "timed out waiting for a message"
    frames: list[bytes] = sock.recv_multipart()
    return frames


def test_zmq_pub_sub_and_replay() -> None:
    """WIRE-4, WIRE-5, WIRE-6: [topic, seq, payload] frames, replay from a seq, rank offsets."""
    zmq = pytest.importorskip("zmq")
    ctx = zmq.Context.instance()
    tag = f"kvcore-test-{time.monotonic_ns()}"
    pub = make_event_publisher(
        "zmq",
        data_parallel_rank=1,
        endpoint=f"inproc://{tag}",
        replay_endpoint=f"inproc://{tag}-replay",
        buffer_steps=3,
        topic="kv",
    )
    assert isinstance(pub, ZmqEventPublisher)
    assert pub.endpoint == f"inproc://{tag}_dp1"
    assert pub.replay_endpoint == f"inproc://{tag}-replay_dp1"
    sub = ctx.socket(zmq.SUB)
    dealer = ctx.socket(zmq.DEALER)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(pub.endpoint)
        dealer.connect(pub.replay_endpoint)
        # PUB drops messages until the subscription arrives: publish warm-up batches until one
        # gets through, then check that the following ones arrive in order.
        for _ in range(100):
            pub.publish(KVEventBatch(0.0))
            if sub.poll(50):
                break
        else:
            pytest.fail("the subscriber never received a batch")
        topic, seq0_bytes, _ = _recv(sub)
        assert topic == b"kv"
        while sub.poll(200):
            topic, seq0_bytes, _ = _recv(sub)
        seq0 = int.from_bytes(seq0_bytes, "big")
        batches = [
            KVEventBatch(1.0, [tv_b_stored()]),
            KVEventBatch(2.0, [BlockRemoved([7], "GPU")], data_parallel_rank=5),
            KVEventBatch(3.0, [AllBlocksCleared()]),
            KVEventBatch(4.0, []),
        ]
        for b in batches:
            pub.publish(b)
        got = [_recv(sub) for _ in batches]
        assert batches[0].data_parallel_rank == 1  # None became the publisher's rank
        assert batches[1].data_parallel_rank == 5  # a set rank is kept
        for i, (b, frames) in enumerate(zip(batches, got, strict=True)):
            assert frames[0] == b"kv"
            assert frames[1] == (seq0 + 1 + i).to_bytes(8, "big")
            assert frames[2] == encode_event_batch(b)
            assert encode_event_batch(decode_event_batch(frames[2])) == frames[2]

        # An ill-formed request (2 frames at the ROUTER) is ignored; no reply comes.
        dealer.send_multipart([b""])
        assert not dealer.poll(300)
        # Replay from seq0 + 3: batches[2] and batches[3], then the end marker.
        dealer.send_multipart([b"", (seq0 + 3).to_bytes(8, "big")])
        replies = [_recv(dealer) for _ in range(3)]
        assert replies[-1] == [b"", END_SEQ, b""]
        assert replies[:2] == [
            [b"", (seq0 + 3 + i).to_bytes(8, "big"), encode_event_batch(batches[2 + i])]
            for i in range(2)
        ]
        # Replay from 0: only the last 3 batches are kept (buffer_steps=3).
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replies = [_recv(dealer) for _ in range(4)]
        assert [r[1] for r in replies] == [(seq0 + 2 + i).to_bytes(8, "big") for i in range(3)] + [
            END_SEQ
        ]
        # shutdown sends what is still queued before it closes the sockets.
        tail = [KVEventBatch(10.0 + i) for i in range(5)]
        for b in tail:
            pub.publish(b)
        pub.shutdown()
        got = [_recv(sub) for _ in tail]
        assert [int.from_bytes(f[1], "big") for f in got] == list(range(seq0 + 5, seq0 + 10))
        assert [f[2] for f in got] == [encode_event_batch(b) for b in tail]
    finally:
        pub.shutdown()
        sub.close(linger=0)
        dealer.close(linger=0)
    with pytest.raises(RuntimeError):
        pub.publish(KVEventBatch(0.0))
    pub.shutdown()  # a second shutdown is harmless


def test_zmq_is_imported_lazily() -> None:
    """pyzmq is optional: importing kvcore.events does not import it."""
    code = "import sys, kvcore.events; sys.exit('zmq' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_zmq_publisher_without_pyzmq(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without pyzmq the zmq publisher raises ImportError; the null one still works."""
    monkeypatch.setitem(sys.modules, "zmq", None)
    with pytest.raises(ImportError, match="pyzmq"):
        make_event_publisher("zmq", endpoint="inproc://nowhere")
    assert isinstance(make_event_publisher(enable_kv_cache_events=False), NullEventPublisher)


class _BlockingSocket:
    """Stands in for the PUB socket: each send waits until the test lets it through."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.sent: list[bytes] = []
        self.closed = False

    def send_multipart(self, frames: tuple[bytes, bytes, bytes]) -> None:
        assert self.gate.wait(10)
        self.sent.append(frames[1])

    def close(self, linger: int = 0) -> None:
        self.closed = True


def test_zmq_publish_blocks_while_the_queue_is_full() -> None:
    """WIRE-4: at most max_queue_size batches wait; publish blocks until one leaves."""
    pytest.importorskip("zmq")
    pub = ZmqEventPublisher(
        0, endpoint=f"inproc://kvcore-full-{time.monotonic_ns()}", max_queue_size=1
    )
    real, fake = pub._pub, _BlockingSocket()
    pub._pub = fake
    real.close(linger=0)
    try:
        pub.publish(KVEventBatch(0.0))  # taken by the thread, which then waits in send
        deadline = time.monotonic() + 5
        while not pub._queue.empty() and time.monotonic() < deadline:
            time.sleep(0.01)
        pub.publish(KVEventBatch(1.0))  # fills the queue
        third = threading.Thread(target=pub.publish, args=(KVEventBatch(2.0),))
        third.start()
        third.join(0.3)
        assert third.is_alive(), "publish returned although the queue was full"
        fake.gate.set()
        third.join(5)
        assert not third.is_alive()
    finally:
        fake.gate.set()
        pub.shutdown()
    assert fake.sent == [i.to_bytes(8, "big") for i in range(3)]
    assert fake.closed


def test_zmq_tcp_connect_offsets_port() -> None:
    """WIRE-4, WIRE-6: a host endpoint connects (no listener needed); rank 2 adds 2 to the port."""
    pytest.importorskip("zmq")
    pub = ZmqEventPublisher(2, endpoint="tcp://127.0.0.1:1", topic="t")
    try:
        assert pub.endpoint == "tcp://127.0.0.1:3"
        pub.publish(KVEventBatch(0.0))
    finally:
        pub.shutdown()


# --- differential tests against the reference -----------------------------------------------


def _random_hash(rng: random.Random) -> int | bytes:
    r = rng.random()
    if r < 0.4:
        return rng.randrange(U64_MAX + 1)
    if r < 0.55:
        return rng.choice([0, 1, 127, 128, 2**32 - 1, 2**32, 2**63, U64_MAX])
    return rng.randbytes(rng.choice([8, 16, 32]))


def _random_key_item(rng: random.Random, depth: int = 0) -> Any:
    r = rng.random()
    if r < 0.3:
        return "".join(rng.choice("abcé-_0") for _ in range(rng.choice([0, 3, 31, 32, 40])))
    if r < 0.5:
        return rng.randbytes(rng.choice([0, 1, 32, 300]))
    if r < 0.75:
        return rng.choice([-1, -32, -33, -129, -(2**31) - 1, -(2**63), 0, 5, 300, 2**40])
    if r < 0.85 and depth < 2:
        return tuple(_random_key_item(rng, depth + 1) for _ in range(rng.randrange(3)))
    return None


def _random_event_fields(rng: random.Random) -> tuple[str, dict[str, Any]]:
    kind = rng.choice(["BlockStored", "BlockStored", "BlockRemoved", "AllBlocksCleared"])

    def opt(v: Any) -> Any:
        return v if rng.random() < 0.5 else None

    if kind == "BlockStored":
        n = rng.randrange(0, 20)
        extra = None
        if rng.random() < 0.5:
            extra = [
                None if rng.random() < 0.2 else tuple(_random_key_item(rng) for _ in range(3))
                for _ in range(n)
            ]
        return kind, {
            "block_hashes": [_random_hash(rng) for _ in range(n)],
            "parent_block_hash": opt(_random_hash(rng)),
            "token_ids": [rng.randrange(0, 2**31) for _ in range(rng.randrange(0, 40))],
            "block_size": rng.choice([1, 16, 128, 256]),
            "lora_id": opt(rng.randrange(0, 1000)),
            "medium": opt("GPU"),
            "lora_name": opt(rng.choice(["a", "lora-a" * 10])),
            "extra_keys": extra,
            "group_idx": opt(rng.randrange(0, 300)),
            "kv_cache_spec_kind": opt(rng.choice(["full_attention", "sliding_window"])),
            "kv_cache_spec_sliding_window": opt(rng.choice([32, 4096, 70000])),
        }
    if kind == "BlockRemoved":
        return kind, {
            "block_hashes": [_random_hash(rng)],
            "medium": opt("GPU"),
            "group_idx": opt(rng.randrange(0, 3)),
        }
    return kind, {}


_KV_CLASSES: dict[str, Any] = {
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}


@pytest.fixture(scope="module")
def ref() -> Any:
    pytest.importorskip("msgspec")
    return pytest.importorskip("vllm.distributed.kv_events")


@pytest.mark.reference
def test_reference_encoding_is_byte_identical(ref: Any) -> None:
    """WIRE-2, WIRE-3: random batches encode to the reference's msgspec bytes."""
    import msgspec

    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(ref.KVEventBatch)
    rng = random.Random(20261129)
    for _ in range(300):
        specs = [_random_event_fields(rng) for _ in range(rng.randrange(0, 6))]
        ts = rng.choice([0.0, 1.5, time.time(), rng.uniform(-1e9, 1e9)])
        rank = rng.choice([None, 0, 1, 7, 300])
        ours = KVEventBatch(ts, [_KV_CLASSES[k](**f) for k, f in specs], rank)
        theirs = ref.KVEventBatch(
            ts=ts, events=[getattr(ref, k)(**f) for k, f in specs], data_parallel_rank=rank
        )
        want = encoder.encode(theirs)
        assert encode_event_batch(ours) == want
        # The encoder works by class name, so it writes the reference's own structs too.
        assert (
            _native.encode_event_batch(theirs.ts, theirs.events, theirs.data_parallel_rank) == want
        )
        # Both decoders agree.
        back = decode_event_batch(want)
        ref_back = decoder.decode(want)
        assert encode_event_batch(back) == encoder.encode(ref_back) == want


def _as_key(ev: Any) -> bytes:
    """An event's identity across both class families: its wire bytes (every field)."""
    return _native.encode_event_batch(0.0, [ev], None)


@pytest.mark.reference
def test_reference_aggregator(ref: Any) -> None:
    """EVT-4: random operation sequences give the reference's common and all events."""
    rng = random.Random(7)
    for _ in range(50):
        workers = rng.randrange(1, 4)
        ours, theirs = KVEventAggregator(workers), ref.KVEventAggregator(workers)
        # The reference's AllBlocksCleared is unhashable (its Counter raises TypeError); kvcore's
        # is hashable, so it is left out here.
        pool = [f for f in (_random_event_fields(rng) for _ in range(8)) if f[1]][:4]
        pool.append(
            ("BlockStored", {**pool[0][1], "lora_name": "other"})
            if pool[0][0] == "BlockStored"
            else pool[0]
        )
        for _ in range(20):
            op = rng.random()
            if op < 0.6:
                picks = [rng.choice(pool) for _ in range(rng.randrange(0, 5))]
                ours.add_events([_KV_CLASSES[k](**f) for k, f in picks])
                theirs.add_events([getattr(ref, k)(**f) for k, f in picks])
            elif op < 0.75:
                c = rng.choice([1, 2, 0, -1])
                outcomes: list[str] = []
                for agg in (ours, theirs):
                    try:
                        agg.increment_workers(c)
                        outcomes.append("ok")
                    except ValueError:
                        outcomes.append("ValueError")
                assert outcomes[0] == outcomes[1]
            elif op < 0.85:
                ours.reset_workers()
                theirs.reset_workers()
            elif op < 0.9:
                ours.clear_events()
                theirs.clear_events()
            assert ours.get_number_of_workers() == theirs.get_number_of_workers()
            assert [_as_key(e) for e in ours.get_common_events()] == [
                _as_key(e) for e in theirs.get_common_events()
            ]
            assert [_as_key(e) for e in ours.get_all_events()] == [
                _as_key(e) for e in theirs.get_all_events()
            ]


@pytest.mark.reference
def test_reference_endpoint_offsets(ref: Any) -> None:
    """WIRE-6: offsets and errors match the reference."""
    cases = [
        ("tcp://*:5557", 1), ("tcp://h:80", 9), ("inproc://x", 2), ("", 3), (None, 1),
        ("ipc://x", 1), ("tcp://h:p", 1), ("tcp://*:5557", 0), ("tcp", 2), ("udp://tcp:1", 1),
    ]  # fmt: skip
    for endpoint, rank in cases:
        try:
            want: Any = ref.ZmqEventPublisher.offset_endpoint_port(endpoint, rank)
        except ValueError:
            want = ValueError
        try:
            got: Any = offset_endpoint_port(endpoint, rank)
        except ValueError:
            got = ValueError
        assert got == want, (endpoint, rank)


@pytest.mark.reference
@pytest.mark.parametrize("raw", ["1", "0"])
def test_reference_pool_event_bytes(ref: Any, monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    """EVT-1..3, WIRE-3: random pool histories publish the reference's bytes, duplicates kept."""
    import msgspec

    ref_pool_mod = pytest.importorskip("vllm.v1.core.block_pool")
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", raw)
    encoder = msgspec.msgpack.Encoder()
    rng = random.Random(11)
    kinds: Counter[str] = Counter()
    for _ in range(10):
        ours = BlockPool(12, True, 16, enable_kv_cache_events=True)
        theirs = ref_pool_mod.BlockPool(12, True, 16, enable_kv_cache_events=True)
        seen: list[bytes] = []
        for _ in range(15):
            op = rng.random()
            if op < 0.6:
                n = rng.randrange(1, min(4, theirs.get_num_free_blocks()) + 1)
                hashes = [
                    rng.choice(seen) if seen and rng.random() < 0.3 else rng.randbytes(32)
                    for _ in range(n)
                ]
                seen.extend(hashes)
                req = types.SimpleNamespace(
                    request_id="r",
                    block_hashes=hashes,
                    all_token_ids=[rng.randrange(50000) for _ in range(16 * n)],
                    lora_request=None,
                    mm_features=[],
                    cache_salt=None,
                    prompt_embeds=None,
                )
                ref_blocks = theirs.get_new_blocks(n)
                our_blocks = ours.get_new_blocks(n)
                assert our_blocks == [b.block_id for b in ref_blocks]
                cached = rng.randrange(n)
                gid = rng.randrange(2)
                theirs.cache_full_blocks(req, ref_blocks, cached, n, 16, gid)
                ours.cache_full_blocks(req, our_blocks, cached, n, 16, gid)
                theirs.free_blocks(ref_blocks)
                ours.free_blocks(our_blocks)
            elif op < 0.9:
                ids = {rng.randrange(1, 12) for _ in range(3)}
                theirs.evict_blocks(ids)
                ours.evict_blocks(ids)
            else:
                assert ours.reset_prefix_cache() == theirs.reset_prefix_cache()
            ref_events = theirs.take_events()
            kinds.update(type(e).__name__ for e in ref_events)
            want = encoder.encode(ref.KVEventBatch(ts=0.0, events=ref_events))
            assert encode_event_batch(KVEventBatch(0.0, ours.take_events())) == want
    assert kinds["BlockStored"] > 20 and kinds["BlockRemoved"] > 20 and kinds["AllBlocksCleared"]
