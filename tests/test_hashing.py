"""Block hashing (SPEC §5) and its test vectors (SPEC §19 TV-H, TV-R, TV-B).

The golden vectors in ``tests/vectors/hashing.json`` were produced by running the reference
with ``PYTHONHASHSEED=0``; the Rust unit tests read the same file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import pickle
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cbor2
import pytest
import xxhash as xxhash_pkg
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore import _native
from kvcore import hashing as H

VECTORS = json.loads((Path(__file__).parent / "vectors" / "hashing.json").read_text())
NAMES = ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]
B1 = list(range(1, 17))
B2 = list(range(17, 33))


def decode(v: Any) -> Any:
    """The vectors' JSON encoding: arrays are tuples, ``{"bytes": hex}`` is bytes."""
    if isinstance(v, list):
        return tuple(decode(x) for x in v)
    if isinstance(v, dict):
        return bytes.fromhex(v["bytes"])
    return v


# --- a duck-typed request (SPEC §17) --------------------------------------------------------


@dataclass
class Pos:
    offset: int
    length: int


@dataclass
class Feature:
    identifier: str | None
    mm_position: Pos


@dataclass
class Lora:
    lora_name: str
    adapter_id: int = 1

    @property
    def name(self) -> str:
        return self.lora_name


@dataclass
class Req:
    all_token_ids: list[int]
    lora_request: Lora | None = None
    cache_salt: str | None = None
    mm_features: list[Feature] = field(default_factory=list)
    prompt_embeds: Any = None
    block_hashes: list[bytes] = field(default_factory=list)
    _prompt_embeds_per_block_hashes: dict[tuple[int, int], bytes] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def run(self, hasher: Callable[[Any], list[H.BlockHash]]) -> list[bytes]:
        """RH-2: extend block_hashes with the hasher's result; returns the new hashes."""
        new = hasher(self)
        self.block_hashes.extend(new)
        return list(new)


def mm(identifier: str | None, offset: int, length: int) -> Feature:
    return Feature(identifier, Pos(offset, length))


# --- fixtures ---------------------------------------------------------------------------------


@pytest.fixture
def restore_none_hash() -> Iterator[None]:
    """Leaves kvcore.hashing.NONE_HASH as it was found."""
    missing = object()
    saved = H.__dict__.get("NONE_HASH", missing)
    yield
    if saved is missing:
        H.__dict__.pop("NONE_HASH", None)
    else:
        H.NONE_HASH = saved


@pytest.fixture
def seed0(monkeypatch: pytest.MonkeyPatch, restore_none_hash: None) -> Callable[[str], Any]:
    """PYTHONHASHSEED=0 semantics: returns ``use(name)`` which inits NONE_HASH for ``name``."""
    monkeypatch.setenv("PYTHONHASHSEED", "0")

    def use(name: str) -> Any:
        fn = H.get_hash_fn_by_name(name)
        H.init_none_hash(fn)
        return fn

    return use


# --- §5.1 functions ---------------------------------------------------------------------------


def test_get_hash_fn_by_name() -> None:
    """SPEC §5.1: the four names, ValueError for any other."""
    assert H.get_hash_fn_by_name("sha256") is H.sha256
    assert H.get_hash_fn_by_name("sha256_cbor") is H.sha256_cbor
    assert H.get_hash_fn_by_name("xxhash") is H.xxhash
    assert H.get_hash_fn_by_name("xxhash_cbor") is H.xxhash_cbor
    for bad in ["md5", "SHA256", "", "sha256 "]:
        with pytest.raises(ValueError, match="Unsupported hash function"):
            H.get_hash_fn_by_name(bad)


def test_hash_1_xxhash_digest_big_endian() -> None:
    """HASH-1: XXH3-128 of b"abc", big-endian."""
    assert _native.digest("xxhash", b"abc").hex() == "06b05ab6733a618578af5f94892f3950"
    assert _native.digest("xxhash_cbor", b"abc") == xxhash_pkg.xxh3_128_digest(b"abc")
    assert _native.digest("sha256", b"abc") == hashlib.sha256(b"abc").digest()
    with pytest.raises(ValueError):
        _native.digest("md5", b"abc")


def _oracle(name: str, obj: Any) -> bytes:
    data = cbor2.dumps(obj, canonical=True) if "cbor" in name else pickle.dumps(obj, protocol=5)
    if name.startswith("sha256"):
        return hashlib.sha256(data).digest()
    return xxhash_pkg.xxh3_128_digest(data)


values = st.recursive(
    st.none()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.text(max_size=300)
    | st.binary(max_size=300)
    | st.booleans(),
    lambda inner: st.tuples(inner, inner) | st.lists(inner, max_size=4).map(tuple),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None)
@given(obj=values)
def test_functions_match_pickle_and_cbor2(obj: Any) -> None:
    """HASH-3/HASH-4: every function equals digest(pickle.dumps(obj, 5)) or digest(cbor2)."""
    for name in NAMES:
        assert H.get_hash_fn_by_name(name)(obj) == _oracle(name, obj), name


@pytest.mark.parametrize("name", NAMES)
def test_shapes_that_take_the_python_path(name: str) -> None:
    """HASH-4 caveats: memo back-references, frames above 64 KiB, lists, floats, big ints."""
    fn = H.get_hash_fn_by_name(name)
    s = "shared-" * 3
    t = (1, 2)
    cases: list[Any] = [
        (s, s),  # the same object twice: CPython writes a BINGET
        (t, t),
        ("", ""),
        (b"x" * 70_000,),  # a frame above 64 KiB
        tuple(range(20_000)),
        [1, 2, [3]],
        1.5,
        2**64 + 3,
        -(2**64),
        (True, False),
        "\ud800",  # a lone surrogate (pickle writes it with surrogatepass)
    ]
    for obj in cases:
        try:
            want = _oracle(name, obj)
        except Exception as exc:  # cbor2 refuses the surrogate
            with pytest.raises(type(exc)):
                fn(obj)
            continue
        assert fn(obj) == want, (name, repr(obj)[:60])


def test_hash_4_seed_serialisation() -> None:
    """HASH-10 bytes: the seed "0" pickles to a framed SHORT_BINUNICODE, CBORs to 61 30."""
    assert pickle.dumps("0", protocol=5) == bytes.fromhex("80059505000000000000008c0130942e")
    assert (
        H.sha256("0") == hashlib.sha256(bytes.fromhex("80059505000000000000008c0130942e")).digest()
    )
    assert H.sha256_cbor("0") == hashlib.sha256(b"\x61\x30").digest()


def test_cbor_without_cbor2(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CBOR input the native serialiser does not handle needs cbor2; TypeError without it."""
    monkeypatch.setattr(H, "_cbor2", None)
    assert H.sha256_cbor((1, "a", b"b", None)) == _oracle("sha256_cbor", (1, "a", b"b", None))
    with pytest.raises(TypeError, match="cbor2"):
        H.sha256_cbor(1.5)
    with pytest.raises(TypeError, match="cbor2"):
        H.xxhash_cbor({"a": 1})


def test_bad_inputs() -> None:
    """Unserialisable objects raise what pickle / cbor2 raise."""
    with pytest.raises(cbor2.CBOREncodeError):
        H.sha256_cbor(object())
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        H.sha256(lambda: 0)
    with pytest.raises(ValueError):
        _native.hash_object("nope", 1)
    with pytest.raises(TypeError):
        _native.hash_request_blocks("sha256", b"", None, [1, 2], 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block size"):
        _native.hash_request_blocks("sha256", b"", None, (1, 2), 0)
    with pytest.raises(ValueError, match="extra keys given"):
        _native.hash_request_blocks("sha256", b"", None, (1, 2), 1, [None])


# --- §5.2 NONE_HASH ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_tv_h_none_hash(name: str, seed0: Callable[[str], Any]) -> None:
    """HASH-10 / TV-H: with PYTHONHASHSEED=0, NONE_HASH is fn("0")."""
    fn = seed0(name)
    assert H.NONE_HASH.hex() == VECTORS["none_hash"][name]
    assert fn("0") == H.NONE_HASH


@pytest.mark.parametrize("name", NAMES)
def test_hash_10_unset_seed_is_random(
    name: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    restore_none_hash: None,
) -> None:
    """HASH-10: unset seed -> 32 random bytes for every function; a warning for CBOR ones."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    fn = H.get_hash_fn_by_name(name)
    with caplog.at_level(logging.WARNING, logger="kvcore.hashing"):
        H.init_none_hash(fn)
        first = H.NONE_HASH
        H.init_none_hash(fn)
    assert len(first) == 32
    assert first != H.NONE_HASH
    warned = [r for r in caplog.records if "PYTHONHASHSEED" in r.getMessage()]
    assert len(warned) == (2 if "cbor" in name else 0)


@pytest.mark.parametrize("name", NAMES)
def test_hash_10_empty_seed_counts_as_set(
    name: str, monkeypatch: pytest.MonkeyPatch, restore_none_hash: None
) -> None:
    """HASH-10: PYTHONHASHSEED="" is set: NONE_HASH = fn("")."""
    monkeypatch.setenv("PYTHONHASHSEED", "")
    fn = H.get_hash_fn_by_name(name)
    H.init_none_hash(fn)
    assert fn("") == H.NONE_HASH
    assert len(H.NONE_HASH) == (32 if name.startswith("sha") else 16)


def test_none_hash_uninitialised(restore_none_hash: None) -> None:
    """Hashing a first block before init_none_hash raises NameError, as the reference does."""
    H.__dict__.pop("NONE_HASH", None)
    with pytest.raises(NameError, match="init_none_hash"):
        H.hash_block_tokens(H.sha256, None, [1, 2])
    # A parent needs no NONE_HASH.
    assert len(H.hash_block_tokens(H.sha256, b"p" * 32, [1, 2])) == 32


# --- TV-H / TV-B ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_tv_h_blocks(name: str, seed0: Callable[[str], Any]) -> None:
    """TV-H and HASH-2/HASH-11: every block vector of the function."""
    fn = seed0(name)
    b1 = H.hash_block_tokens(fn, None, B1)
    count = 0
    for v in VECTORS["blocks"]:
        if v["fn"] != name:
            continue
        parent = None if v["parent"] == "NONE" else b1
        got = H.hash_block_tokens(fn, parent, v["tokens"], decode(v["extra"]))
        assert got.hex() == v["hash"], v["case"]
        # Tuples of tokens and b"" parents take the same path (HASH-11).
        got2 = H.hash_block_tokens(fn, parent or b"", tuple(v["tokens"]), decode(v["extra"]))
        assert got2 == got
        count += 1
    assert count >= 20


def test_tv_h_spec_table(seed0: Callable[[str], Any]) -> None:
    """TV-H, quoted from the SPEC table (sha256_cbor column)."""
    fn = seed0("sha256_cbor")
    b1 = H.hash_block_tokens(fn, None, B1)
    assert b1.hex() == "202da172482d928bbc42ab25b0151e2b895f13f41002e27b2ceabcfae6d332ea"
    b2 = H.hash_block_tokens(fn, b1, B2)
    assert b2.hex() == "4a0a393805c6d2f0ed831000d41bb65980336c4c04895d5e26470bbec927f5bf"
    extra = ("lora-a", ("img-abc", 3), "salt-1")
    assert H.hash_block_tokens(fn, None, B1, extra).hex().startswith("b67c16eb37ffea17")


@pytest.mark.parametrize("vec", VECTORS["serialized"], ids=lambda v: v["fn"])
def test_tv_b_bytes(vec: dict[str, Any], seed0: Callable[[str], Any]) -> None:
    """TV-B: the serialised triple, and its digest is the block hash."""
    fn = seed0(vec["fn"])
    obj = (H.NONE_HASH, tuple(vec["tokens"]), decode(vec["extra"]))
    want = bytes.fromhex(vec["bytes"])
    if "cbor" in vec["fn"]:
        assert cbor2.dumps(obj, canonical=True) == want
    else:
        assert pickle.dumps(obj, protocol=5) == want
    assert fn(obj) == _native.digest(vec["fn"], want)
    assert H.hash_block_tokens(fn, None, vec["tokens"], decode(vec["extra"])) == fn(obj)


def test_tv_b_spec_prefixes(seed0: Callable[[str], Any]) -> None:
    """TV-B: the byte layouts quoted in the SPEC."""
    seed0("sha256")
    data = pickle.dumps((H.NONE_HASH, tuple(B1), None), protocol=5)
    assert data[:13] == bytes.fromhex("8005954a000000000000004320")
    assert data.endswith(bytes.fromhex("74944e87942e"))
    cb = cbor2.dumps((H.NONE_HASH, tuple(B1), None), canonical=True)
    assert cb.hex().endswith("900102030405060708090a0b0c0d0e0f10f6")


# --- §5.3 extra keys --------------------------------------------------------------------------


def test_xk_1_lora_salt_order() -> None:
    """XK-1: lora ++ mm ++ salt ++ embeds; salt only at start 0; None, never ()."""
    r = Req(list(range(64)), lora_request=Lora("L"), cache_salt="S", mm_features=[mm("m", 2, 4)])
    assert H.generate_block_hash_extra_keys(r, 0, 16, 0) == (("L", ("m", 2), "S"), 1)
    assert H.generate_block_hash_extra_keys(r, 16, 32, 1) == (("L",), 1)
    plain = Req(list(range(64)))
    assert H.generate_block_hash_extra_keys(plain, 0, 16, 0) == (None, 0)
    empty_salt = Req(list(range(64)), cache_salt="")
    assert H.generate_block_hash_extra_keys(empty_salt, 0, 16, 0) == (None, 0)


def test_xk_2_multimodal() -> None:
    """XK-2: skipping, negative offsets, negative index, stop inside an item."""
    feats = [mm("a", 0, 4), mm("b", 10, 20), mm("c", 40, 2)]
    r = Req(list(range(64)), mm_features=feats)
    assert H.generate_block_hash_extra_keys(r, 0, 16, 0) == ((("a", 0), ("b", 10)), 1)
    assert H.generate_block_hash_extra_keys(r, 16, 32, 1) == ((("b", -6),), 2)
    assert H.generate_block_hash_extra_keys(r, 32, 48, 2) == ((("c", 8),), 3)
    # Scanning from 0 skips the items that ended before the window.
    assert H.generate_block_hash_extra_keys(r, 32, 48, 0) == ((("c", 8),), 3)
    # Negative index counts from the end.
    assert H.generate_block_hash_extra_keys(r, 32, 48, -1) == ((("c", 8),), 3)
    # Past the last item: unchanged index.
    assert H.generate_block_hash_extra_keys(r, 48, 64, -1) == (None, -1)
    with pytest.raises(AssertionError):
        H.generate_block_hash_extra_keys(r, 32, 48, -4)
    bad = Req(list(range(64)), mm_features=[mm(None, 0, 4)])
    with pytest.raises(AssertionError):
        H.generate_block_hash_extra_keys(bad, 0, 16, 0)


def test_xk_1_prompt_embeds_cached() -> None:
    """XK-1: the embeddings key is sha256 of the slice's bytes, cached per (start, end)."""
    torch = pytest.importorskip("torch")
    emb = torch.arange(64, dtype=torch.float32).reshape(16, 4)
    r = Req([0] * 16, prompt_embeds=emb)
    keys, _ = H.generate_block_hash_extra_keys(r, 0, 16, 0)
    assert keys is not None
    assert keys[0].hex() == "21b9ca0f94efa26b229b2d90151c5d0296c3944dc3053a8a28e871d289d50519"
    assert r._prompt_embeds_per_block_hashes == {(0, 16): keys[0]}
    r._prompt_embeds_per_block_hashes[(0, 16)] = b"cached"
    assert H.generate_block_hash_extra_keys(r, 0, 16, 0)[0] == (b"cached",)
    past, _ = H.generate_block_hash_extra_keys(r, 16, 32, 0)
    assert past == (hashlib.sha256(b"").digest(),)


def test_xk_3_need_extra_keys() -> None:
    """XK-3: mm features, a LoRA request or any cache salt (even empty)."""
    assert not H.need_extra_keys(Req([1]))
    assert H.need_extra_keys(Req([1], cache_salt=""))
    assert H.need_extra_keys(Req([1], lora_request=Lora("x")))
    assert H.need_extra_keys(Req([1], mm_features=[mm("a", 0, 1)]))


# --- §5.4 request hasher (TV-R) ---------------------------------------------------------------


def _tv_r_request(case: str) -> Req:
    tokens = list(range(1, 41))
    if case == "plain":
        return Req(tokens)
    if case == "salt":
        return Req(tokens, cache_salt="salt-1")
    if case == "lora":
        return Req(tokens, lora_request=Lora("lora-a"))
    if case == "lora+salt+mm":
        return Req(
            tokens,
            lora_request=Lora("lora-a"),
            cache_salt="salt-1",
            mm_features=[mm("img-abc", 3, 20)],
        )
    torch = pytest.importorskip("torch")
    return Req([0] * 16, prompt_embeds=torch.arange(64, dtype=torch.float32).reshape(16, 4))


@pytest.mark.parametrize("vec", VECTORS["requests"], ids=lambda v: f"{v['fn']}-{v['case']}")
def test_tv_r(vec: dict[str, Any], seed0: Callable[[str], Any]) -> None:
    """TV-R / RH-1: the request hasher reproduces the vectors; the tail is not hashed."""
    fn = seed0(vec["fn"])
    r = _tv_r_request(vec["case"])
    got = r.run(H.get_request_block_hasher(vec["hbs"], fn))
    assert [h.hex() for h in got] == vec["hashes"]
    assert len(r.block_hashes) == r.num_tokens // vec["hbs"]
    # Nothing new until another full window exists.
    assert r.run(H.get_request_block_hasher(vec["hbs"], fn)) == []


def test_tv_r_incremental(seed0: Callable[[str], Any]) -> None:
    """TV-R incremental / RH-2: 19 tokens give B1; appending 20..32 adds B2."""
    fn = seed0("sha256_cbor")
    hasher = H.get_request_block_hasher(16, fn)
    r = Req(list(range(1, 20)))
    assert len(r.run(hasher)) == 1
    for t in range(20, 33):
        r.all_token_ids.append(t)
        r.run(hasher)
    assert r.block_hashes == [
        H.hash_block_tokens(fn, None, B1),
        H.hash_block_tokens(fn, r.block_hashes[0], B2),
    ]
    assert r.block_hashes[1].hex().startswith("4a0a393805c6d2f0")


@pytest.mark.parametrize("name", NAMES)
def test_rh_1_mm_index_after_first_call(name: str, seed0: Callable[[str], Any]) -> None:
    """RH-1: continuing from existing hashes, only the last multimodal item is considered."""
    fn = seed0(name)
    feats = [mm("a", 2, 3), mm("b", 20, 30)]
    r = Req(list(range(24)), mm_features=feats, lora_request=Lora("L"))
    hasher = H.get_request_block_hasher(16, fn)
    first = r.run(hasher)
    r.all_token_ids.extend(range(100, 140))
    more = r.run(hasher)
    assert len(first) == 1
    assert len(more) == 3
    parent = first[0]
    for i, s in enumerate(range(16, 64, 16)):
        extra, _ = H.generate_block_hash_extra_keys(r, s, s + 16, -1)
        parent = H.hash_block_tokens(fn, parent, r.all_token_ids[s : s + 16], extra)
        assert more[i] == parent


class NotAList:
    """A token container that is a sequence but not a list (like the reference's ConstantList)."""

    def __init__(self, items: list[int]) -> None:
        self._items = items

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, idx: Any) -> Any:
        return self._items[idx]


@pytest.mark.parametrize("name", NAMES)
def test_request_hasher_fallbacks(name: str, seed0: Callable[[str], Any]) -> None:
    """Tokens the native path refuses (numpy ints, bigs) and non-list containers still hash."""
    fn = seed0(name)
    np = pytest.importorskip("numpy")
    tokens = [5, 2**40, 7, 9] * 8
    want: list[bytes] = []
    parent: bytes | None = None
    for s in range(0, 32, 4):
        parent = H.hash_block_tokens(fn, parent, tokens[s : s + 4])
        want.append(parent)
    r = Req(tokens)
    r.all_token_ids = NotAList(tokens)  # type: ignore[assignment]
    assert r.run(H.get_request_block_hasher(4, fn)) == want
    big = [2**80, *tokens[1:]]
    got = Req(big).run(H.get_request_block_hasher(4, fn))
    assert got[0] == H.hash_block_tokens(fn, None, big[:4])
    assert got[0] == fn((H.NONE_HASH, tuple(big[:4]), None))
    npt = [np.int64(t) for t in tokens]
    if "cbor" in name:  # cbor2 cannot encode numpy ints, in the reference either
        with pytest.raises(cbor2.CBOREncodeError):
            Req(npt).run(H.get_request_block_hasher(4, fn))
    else:
        assert Req(npt).run(H.get_request_block_hasher(4, fn))[0] == fn(
            (H.NONE_HASH, tuple(npt[:4]), None)
        )


def test_request_hasher_custom_function(seed0: Callable[[str], Any]) -> None:
    """Any callable works as the hash function (pure Python path)."""
    seed0("sha256")
    seen: list[Any] = []

    def fn(obj: Any) -> bytes:
        seen.append(obj)
        return hashlib.md5(repr(obj).encode()).digest()

    r = Req(list(range(8)), cache_salt="s")
    hashes = r.run(H.get_request_block_hasher(4, fn))
    assert len(hashes) == 2
    assert seen[0] == (H.NONE_HASH, (0, 1, 2, 3), ("s",))
    assert seen[1] == (hashes[0], (4, 5, 6, 7), None)


# --- RH-3 view --------------------------------------------------------------------------------


def test_rh_3_block_hash_view() -> None:
    """RH-3: view[i] = fine[(i+1)*k-1], clamped slices, TypeError for other indices."""
    fine = [bytes([i]) for i in range(7)]
    v = H.BlockHashView(fine, 16, 48)  # type: ignore[arg-type]
    assert len(v) == 2
    assert v[0] == b"\x02"
    assert v[1] == b"\x05"
    assert list(v) == [b"\x02", b"\x05"]
    assert v[0:10] == [b"\x02", b"\x05"]
    assert v[-1] == b"\x06"  # not normalised: the last fine hash
    fine.append(b"\x07")
    fine.append(b"\x08")
    assert len(v) == 3
    with pytest.raises(TypeError):
        v["0"]  # type: ignore[call-overload]
    with pytest.raises(AssertionError):
        H.BlockHashView(fine, 16, 40)  # type: ignore[arg-type]


# --- differential tests against the reference -------------------------------------------------


@pytest.fixture
def ref(monkeypatch: pytest.MonkeyPatch, restore_none_hash: None) -> Any:
    """The reference modules, with PYTHONHASHSEED=0."""
    pytest.importorskip("vllm")
    import vllm.utils.hashing as ref_hashing
    import vllm.v1.core.kv_cache_utils as ref_utils

    monkeypatch.setenv("PYTHONHASHSEED", "0")
    saved = ref_utils.__dict__.get("NONE_HASH")
    yield type("Ref", (), {"hashing": ref_hashing, "utils": ref_utils})
    if saved is not None:
        ref_utils.NONE_HASH = saved


def _both(ref: Any, name: str) -> tuple[Any, Any]:
    ours = H.get_hash_fn_by_name(name)
    theirs = ref.hashing.get_hash_fn_by_name(name)
    H.init_none_hash(ours)
    ref.utils.init_none_hash(theirs)
    assert H.NONE_HASH == ref.utils.NONE_HASH
    return ours, theirs


def _random_text(rng: random.Random) -> str:
    n = rng.choice([0, 1, 5, 255, 256, 300, 1000])
    alphabet = "abcXYZ-_/é✓😀"
    return "".join(rng.choice(alphabet) for _ in range(n))


def _random_request(rng: random.Random, torch: Any) -> Req:
    n = rng.randrange(0, 200)
    tokens = [rng.randrange(2**31 - 1) for _ in range(n)]
    r = Req(tokens)
    if rng.random() < 0.4:
        r.lora_request = Lora(_random_text(rng) or "l")
    if rng.random() < 0.4:
        r.cache_salt = _random_text(rng)
    if rng.random() < 0.4 and n:
        offsets = sorted(rng.sample(range(n), min(n, rng.randrange(1, 5))))
        r.mm_features = [
            mm(f"img-{i}-{rng.randrange(10)}", off, rng.randrange(1, 40))
            for i, off in enumerate(offsets)
        ]
    if rng.random() < 0.2 and n:
        dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16])
        r.prompt_embeds = torch.randn(n, 4, generator=torch.Generator().manual_seed(n)).to(dtype)
    return r


@pytest.mark.reference
@pytest.mark.parametrize("name", NAMES)
def test_reference_functions_and_blocks(name: str, ref: Any) -> None:
    """Differential: the four functions and hash_block_tokens, byte for byte."""
    ours, theirs = _both(ref, name)
    rng = random.Random(name)
    for _ in range(200):
        toks = [rng.randrange(2**31 - 1) for _ in range(rng.randrange(0, 40))]
        extra: tuple[Any, ...] | None = None
        if rng.random() < 0.7:
            items: list[Any] = [_random_text(rng)]
            if rng.random() < 0.5:
                items.append((f"mm-{rng.randrange(99)}", rng.randrange(-64, 64)))
            if rng.random() < 0.3:
                items.append(rng.randbytes(rng.choice([0, 32, 256, 300])))
            extra = tuple(items)
        parent = rng.choice([None, b"", rng.randbytes(32), rng.randbytes(16)])
        assert H.hash_block_tokens(ours, parent, toks, extra) == ref.utils.hash_block_tokens(
            theirs, parent, toks, extra
        )
        obj = (parent, tuple(toks), extra)
        assert ours(obj) == theirs(obj)


@pytest.mark.reference
@pytest.mark.parametrize("name", NAMES)
def test_reference_request_hasher(name: str, ref: Any) -> None:
    """Differential: random requests (LoRA, mm, salts incl. >= 256 bytes, prompt embeds),
    hashed in several steps, and the extra keys of every window."""
    torch = pytest.importorskip("torch")
    ours, theirs = _both(ref, name)
    rng = random.Random(f"req-{name}")
    for _ in range(40):
        hbs = rng.choice([1, 4, 16])
        a = _random_request(rng, torch)
        b = Req(
            list(a.all_token_ids),
            lora_request=a.lora_request,
            cache_salt=a.cache_salt,
            mm_features=a.mm_features,
            prompt_embeds=a.prompt_embeds,
        )
        h_ours = H.get_request_block_hasher(hbs, ours)
        h_ref = ref.utils.get_request_block_hasher(hbs, theirs)
        assert a.run(h_ours) == b.run(h_ref)
        for _ in range(3):
            more = [rng.randrange(2**31 - 1) for _ in range(rng.randrange(0, 40))]
            a.all_token_ids.extend(more)
            b.all_token_ids.extend(more)
            assert a.run(h_ours) == b.run(h_ref)
        assert a.block_hashes == b.block_hashes
        for s in range(0, a.num_tokens, hbs):
            idx = rng.choice([0, -1]) if a.mm_features else 0
            assert H.generate_block_hash_extra_keys(
                a, s, s + hbs, idx
            ) == ref.utils.generate_block_hash_extra_keys(b, s, s + hbs, idx)
        assert H.need_extra_keys(a) == ref.utils.need_extra_keys(b)


@pytest.mark.reference
def test_reference_block_hash_view(ref: Any) -> None:
    """Differential: RH-3 view against the reference's BlockHashListWithBlockSize."""
    fine = [bytes([i]) * 4 for i in range(13)]
    for k in (1, 2, 3, 4):
        ours = H.BlockHashView(fine, 16, 16 * k)  # type: ignore[arg-type]
        theirs = ref.utils.BlockHashListWithBlockSize(fine, 16, 16 * k)
        assert len(ours) == len(theirs)
        assert list(ours) == list(theirs)
        assert ours[1:] == theirs[1:]
        assert ours[-1] == theirs[-1]
