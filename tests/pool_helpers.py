"""Shared helpers of the block-pool tests and benchmarks.

- :class:`PoolRequest`: a small duck-typed request (SPEC §17) with exactly what the pool reads:
  ``block_hashes``, ``all_token_ids``, ``lora_request``, ``mm_features``, ``cache_salt`` and
  ``prompt_embeds`` (plus the reference's ``_prompt_embeds_per_block_hashes`` cache). Its block
  hashes are a SHA-256 chain over the token windows: the pool treats hashes as opaque, so any
  deterministic chain will do.
- :func:`key`, :func:`ext`: the key layout (SPEC KEY-1) and the event form of a hash (EVT-2).
- :func:`snapshot` / :func:`assert_same_state`: the whole observable state of a
  ``kvcore.BlockPool`` (free list order, every ref count, every primary key and its token count,
  lookups, queued events), used to assert that a rejected call changed nothing.
- :func:`event_fields`: an event (kvcore dataclass or reference msgspec struct) as
  ``(class name, {field: value})`` so both implementations compare field by field.
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import kvcore

NULL = 0
"""The null block's id (SPEC POOL-1)."""


@dataclass(frozen=True)
class LoRARequest:
    """The LoRA fields the pool and the extra-key generator read."""

    lora_name: str
    lora_int_id: int

    @property
    def adapter_id(self) -> int:
        """The adapter id reported as ``lora_id`` in events (SPEC POOL-17)."""
        return self.lora_int_id

    @property
    def name(self) -> str:
        """The name reported as ``lora_name`` in events (SPEC POOL-17)."""
        return self.lora_name


@dataclass(frozen=True)
class PlaceholderRange:
    """Where a multimodal item sits in the prompt (SPEC XK-2)."""

    offset: int
    length: int


@dataclass(frozen=True)
class MMFeature:
    """A multimodal item: its identifier and position (SPEC XK-2)."""

    identifier: str | None
    mm_position: PlaceholderRange


def chain_hashes(
    token_ids: Sequence[int],
    hash_block_size: int,
    *,
    salt: bytes = b"",
    digest_size: int = 32,
    start: int = 0,
    parent: bytes | None = None,
) -> list[bytes]:
    """Chained digests of every full ``hash_block_size`` window of ``token_ids`` from ``start``.

    Args:
        token_ids: All tokens of the request.
        hash_block_size: Tokens per window.
        salt: Mixed into every window (stands in for extra keys).
        digest_size: 32 (like sha256) or 16 (like xxhash) bytes.
        start: First token of the first window to hash (a multiple of ``hash_block_size``).
        parent: The hash of the window before ``start``.

    Returns:
        One digest per full window.
    """
    out: list[bytes] = []
    prev = parent or b"\x00" * digest_size
    for s in range(start, len(token_ids) - hash_block_size + 1, hash_block_size):
        h = hashlib.sha256(prev + salt)
        for t in token_ids[s : s + hash_block_size]:
            h.update(int(t).to_bytes(8, "little", signed=True))
        prev = h.digest()[:digest_size]
        out.append(prev)
    return out


@dataclass
class PoolRequest:
    """A duck-typed request holding what ``BlockPool`` reads (SPEC §17).

    Args:
        token_ids: The request's tokens.
        hash_block_size: Tokens per block hash; None leaves ``block_hashes`` as given.
        block_hashes: Explicit hashes (otherwise a SHA-256 chain of the tokens).
        lora_request: A LoRA request, or None.
        mm_features: Multimodal items sorted by offset.
        cache_salt: The cache salt, or None.
        prompt_embeds: Prompt embeddings (a tensor), or None.
        salt: Mixed into the hash chain, so requests can share tokens but not hashes.
        digest_size: Hash length in bytes.
    """

    token_ids: list[int]
    hash_block_size: int | None = 16
    block_hashes: list[bytes] = field(default_factory=list)
    lora_request: LoRARequest | None = None
    mm_features: list[MMFeature] = field(default_factory=list)
    cache_salt: str | None = None
    prompt_embeds: Any = None
    salt: bytes = b""
    digest_size: int = 32
    _prompt_embeds_per_block_hashes: dict[tuple[int, int], bytes] = field(
        default_factory=dict, repr=False
    )

    def __post_init__(self) -> None:
        if not self.block_hashes and self.hash_block_size is not None:
            self.block_hashes = chain_hashes(
                self.token_ids,
                self.hash_block_size,
                salt=self.salt,
                digest_size=self.digest_size,
            )

    @property
    def all_token_ids(self) -> list[int]:
        """Every token of the request (prompt and output)."""
        return self.token_ids

    @property
    def num_tokens(self) -> int:
        """Number of tokens."""
        return len(self.token_ids)

    def append(self, tokens: Iterable[int]) -> None:
        """Appends tokens and hashes the windows that became full (SPEC RH-2).

        Args:
            tokens: The tokens to append.
        """
        self.token_ids.extend(tokens)
        hbs = self.hash_block_size
        if hbs is None:
            return
        start = len(self.block_hashes) * hbs
        parent = self.block_hashes[-1] if self.block_hashes else None
        self.block_hashes.extend(
            chain_hashes(
                self.token_ids,
                hbs,
                salt=self.salt,
                digest_size=self.digest_size,
                start=start,
                parent=parent,
            )
        )


def key(block_hash: bytes, group_id: int = 0) -> bytes:
    """The prefix-cache key of a hash in a group: ``hash ‖ u32_be(group_id)`` (SPEC KEY-1)."""
    return block_hash + group_id.to_bytes(4, "big")


def ext(block_hash: bytes) -> int:
    """The default event form of a hash: its last 8 bytes as a big-endian int (SPEC EVT-2)."""
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)


def event_fields(event: Any) -> tuple[str, dict[str, Any]]:
    """An event as ``(class name, fields)``, for kvcore dataclasses and msgspec structs alike."""
    name = type(event).__name__
    if dataclasses.is_dataclass(event):
        names = [f.name for f in dataclasses.fields(event)]
    else:
        struct_fields = getattr(event, "__struct_fields__", None)
        names = list(event.__match_args__ if struct_fields is None else struct_fields)
    values: dict[str, Any] = {}
    for n in names:
        v = getattr(event, n)
        if isinstance(v, tuple):
            v = list(v)
        values[n] = v
    return name, values


@dataclass(frozen=True)
class PoolState:
    """Everything observable about a pool, events aside."""

    free: list[int]
    num_free: int
    usage: float
    ref_cnts: list[int]
    block_hashes: list[bytes | None]
    block_hash_num_tokens: list[int | None]


def snapshot(pool: kvcore.BlockPool) -> PoolState:
    """The observable state of ``pool`` (does not touch its event queue)."""
    ids = range(pool.num_gpu_blocks)
    return PoolState(
        free=pool.get_all_free_block_ids(),
        num_free=pool.get_num_free_blocks(),
        usage=pool.get_usage(),
        ref_cnts=pool.get_ref_cnts(ids),
        block_hashes=pool.get_block_hashes(ids),
        block_hash_num_tokens=[pool.blocks[i].block_hash_num_tokens for i in ids],
    )


def lookups(pool: kvcore.BlockPool, keys: Iterable[bytes]) -> dict[bytes, int | None]:
    """``MAP-2`` for each key (``hash ‖ gid``) through ``get_cached_block``."""
    out: dict[bytes, int | None] = {}
    for k in keys:
        found = pool.get_cached_block(k[:-4], [int.from_bytes(k[-4:], "big")])
        out[k] = None if found is None else found[0]
    return out


def assert_same_state(a: kvcore.BlockPool, b: kvcore.BlockPool, keys: Iterable[bytes] = ()) -> None:
    """Asserts two pools are indistinguishable; drains and compares both event queues.

    Args:
        a: One pool.
        b: The other.
        keys: Prefix-cache keys whose lookups must agree as well.
    """
    a.check_invariants()
    b.check_invariants()
    assert snapshot(a) == snapshot(b)
    keys = list(keys)
    assert lookups(a, keys) == lookups(b, keys)
    assert [event_fields(e) for e in a.take_events()] == [event_fields(e) for e in b.take_events()]


@contextmanager
def tiny_switch_interval() -> Iterator[None]:
    """Makes the interpreter switch threads as often as it can, to force interleavings."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(old)
