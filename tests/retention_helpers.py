"""Shared helpers of the cache-control tests (issue 15: retention priorities and TTLs, pins,
invalidation, router-exact events; the contract is ``/work/notes/retention-contract.md``).

- :class:`FakeClock`: a clock the test moves by hand, passed to the manager as ``clock=``.
- :class:`Harness`: one ``KVCacheManager`` (events on, ``hash_fn=sha256_cbor``) on a chosen
  configuration (``single``: one full-attention group, ``hybrid``: full attention plus a
  sliding window), with requests hashed
  by ``kvcore.hashing.get_request_block_hasher(16, sha256_cbor)`` so that ``pin_prefix``
  hashes exactly as they do, and the probes the tests observe eviction through: a lookup of a
  fresh request (:meth:`Harness.hits`), the block ids a new request is handed
  (:meth:`Harness.flood`) and the ``BlockRemoved`` / ``BlockStored`` events.
- :func:`tokens`: distinct token runs (no two calls with different seeds share a block).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvcore import hashing
from kvcore.config import KVCacheConfig, KVCacheGroupSpec
from kvcore.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvcore.manager import KVCacheManager
from kvcore.request import Request, RequestStatus
from kvcore.specs import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec

__all__ = [
    "BS",
    "PATHS",
    "FakeClock",
    "Harness",
    "LoRA",
    "ext",
    "tokens",
]

BS = 16
"""Block size (= hash block size) of every configuration here."""

ATTN: dict[str, Any] = {"num_kv_heads": 1, "head_size": 64, "dtype": "float16"}

PATHS = ("single", "hybrid")
"""The configurations: one full-attention group, and full attention plus a 32-token sliding
window (the hybrid coordinator)."""

SENTINEL = 10**9
"""A token appended to probe prompts (a lookup hits at most ``num_tokens - 1`` tokens)."""


def ext(h: bytes) -> int:
    """The event form of a hash or key's hash part (EVT-2, int form: its last 8 bytes)."""
    return int.from_bytes(h[-8:], "big")


def tokens(seed: int, n: int) -> list[int]:
    """``n`` tokens that share no block with another seed's (seeds 0..999, ``n`` < 10**6)."""
    return [seed * 10**6 + i + 1 for i in range(n)]


class FakeClock:
    """A monotonic clock the test advances (seconds)."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        """Moves the clock on by ``dt`` seconds."""
        self.t += dt


@dataclass(frozen=True)
class LoRA:
    """The LoRA fields the hasher and the pool read (``lora_name``, ``name``, ``adapter_id``)."""

    lora_name: str
    adapter_id: int

    @property
    def name(self) -> str:
        return self.lora_name


def specs_for(path: str) -> list[KVCacheSpec]:
    """The KV cache groups of a configuration in :data:`PATHS`."""
    full = FullAttentionSpec(block_size=BS, **ATTN)
    if path == "hybrid":
        return [full, SlidingWindowSpec(block_size=BS, sliding_window=32, **ATTN)]
    return [full]


class Harness:
    """One manager plus the request factory and probes of the cache-control tests.

    Args:
        path: ``single`` or ``hybrid``.
        num_blocks: Pool size, null block included.
        clock: The manager's clock (a new :class:`FakeClock` at 0 when None).
        hash_fn: Passed as ``hash_fn`` (the requests' hash function); ``False`` passes none.
        events: ``enable_kv_cache_events``.
        max_model_len: The manager's ``max_model_len``.
        legacy: Build with the reference's arguments only (no ``clock``, no ``hash_fn``).
        **kw: More constructor arguments (``max_pinned_fraction``, ``exact_router_events``,
            ``watermark``...).
    """

    def __init__(
        self,
        path: str = "single",
        num_blocks: int = 16,
        *,
        clock: FakeClock | None = None,
        hash_fn: Any = None,
        events: bool = True,
        max_model_len: int = 2048,
        legacy: bool = False,
        **kw: Any,
    ) -> None:
        self.path = path
        self.clock = clock if clock is not None else FakeClock()
        fn = hashing.sha256_cbor
        hashing.init_none_hash(fn)
        self.hasher: Any = hashing.get_request_block_hasher(BS, fn)
        if legacy:
            pass
        elif hash_fn is None:
            kw["hash_fn"] = fn
        elif hash_fn is not False:
            kw["hash_fn"] = hash_fn
        if not legacy:
            kw["clock"] = self.clock
        specs = specs_for(path)
        groups = [KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(specs)]
        self.num_groups = len(groups)
        self.mgr = KVCacheManager(
            KVCacheConfig(num_blocks, [], groups),
            max_model_len=max_model_len,
            scheduler_block_size=BS,
            hash_block_size=BS,
            enable_kv_cache_events=events,
            **kw,
        )
        self.pool: Any = self.mgr.block_pool
        self.num_blocks = num_blocks
        self._probe = 0

    # -- requests ---------------------------------------------------------------------------

    def request(
        self,
        rid: str,
        prompt: Sequence[int],
        *,
        priority: int | None = None,
        ttl: float | None = None,
        **kw: Any,
    ) -> Request:
        """A ``kvcore.Request``; the retention arguments are passed only when given."""
        if priority is not None:
            kw["retention_priority"] = priority
        if ttl is not None:
            kw["retention_ttl_s"] = ttl
        return Request(rid, list(prompt), block_hasher=self.hasher, **kw)

    def admit(self, r: Request, *, use_hits: bool = True, **kw: Any) -> bool:
        """Looks the prompt up (unless ``use_hits`` is false) and allocates all of it.

        Returns:
            Whether ``allocate_slots`` gave the blocks (the request is then running with
            every token computed).
        """
        if use_hits:
            hit, n = self.mgr.get_computed_blocks(r)
        else:
            hit, n = None, 0
        out = self.mgr.allocate_slots(r, r.num_tokens - n, n, hit, **kw)
        if out is None:
            return False
        r.num_computed_tokens = r.num_tokens
        r.status = RequestStatus.RUNNING
        return True

    def run(self, rid: str, prompt: Sequence[int], **kw: Any) -> Request:
        """A request (``priority``/``ttl``/request keywords) admitted in full; it must fit."""
        use_hits = kw.pop("use_hits", True)
        r = self.request(rid, prompt, **kw)
        assert self.admit(r, use_hits=use_hits), f"{rid} did not fit"
        return r

    def decode(self, r: Request, new_tokens: Sequence[int]) -> bool:
        """Appends tokens and allocates them (a decode / continued prefill step)."""
        r.append_output_token_ids(list(new_tokens))
        out = self.mgr.allocate_slots(r, len(new_tokens))
        if out is None:
            return False
        r.num_computed_tokens = r.num_tokens
        return True

    def free(self, r: Request) -> None:
        """Frees a request's blocks (the retention attributes are read here)."""
        self.mgr.free(r)
        r.status = RequestStatus.FINISHED_STOPPED

    # -- probes -----------------------------------------------------------------------------

    def hits(self, prompt: Sequence[int], **kw: Any) -> int:
        """Tokens a fresh request with ``prompt``'s full blocks would hit (no state change)."""
        self._probe += 1
        full = list(prompt[: len(prompt) // BS * BS])
        r = Request(f"probe{self._probe}", [*full, SENTINEL], block_hasher=self.hasher, **kw)
        _, n = self.mgr.get_computed_blocks(r)
        return int(n)

    def block_ids(self, r: Request) -> list[int]:
        """The request's non-null blocks, group by group."""
        return [b for g in self.mgr.get_block_ids(r.request_id) for b in g if b != 0]

    def group_ids(self, r: Request, gid: int = 0) -> list[int]:
        """The request's block list in one group (null blocks included)."""
        return list(self.mgr.get_block_ids(r.request_id)[gid])

    def flood(self, rid: str, num_blocks: int, seed: int) -> Request | None:
        """Admits a request of unique tokens that needs ``num_blocks`` new blocks in all.

        In the hybrid configuration each 16 tokens take one block in each group, so
        ``num_blocks`` must be even there. Returns the running request, or None when
        ``allocate_slots`` refused.
        """
        per_group = num_blocks // self.num_groups
        assert per_group * self.num_groups == num_blocks
        r = self.request(rid, tokens(seed, per_group * BS))
        return r if self.admit(r) else None

    def evicted_order(self, seed: int = 999) -> list[int]:
        """The ids of every free block in the order eviction hands them out.

        Single-group configurations only: one request takes every free block, and its block
        list is the eviction order (POOL-5). The request is left running.
        """
        assert self.num_groups == 1
        # Pins whose time ran out are released by the manager's calls; this one applies them
        # first, so the count below includes their blocks (test_retention checks the pool's
        # own counts separately).
        getattr(self.mgr, "num_pinned_blocks", None)
        n = self.pool.get_num_free_blocks()
        if n == 0:
            return []
        r = self.flood(f"drain{seed}", n, seed)
        assert r is not None
        return self.group_ids(r)

    def free_ids(self) -> list[int]:
        return list(self.pool.get_all_free_block_ids())

    def num_free(self) -> int:
        return int(self.pool.get_num_free_blocks())

    def ref_cnts(self, ids: Sequence[int]) -> list[int]:
        return list(self.pool.get_ref_cnts(list(ids)))

    def keys(self, ids: Sequence[int]) -> list[bytes | None]:
        return list(self.pool.get_block_hashes(list(ids)))

    def hashes(self, r: Request) -> list[int]:
        """The event form of the request's block hashes."""
        return [ext(h) for h in r.block_hashes]

    # -- events -----------------------------------------------------------------------------

    def events(self) -> list[Any]:
        return list(self.mgr.take_events())

    @staticmethod
    def removed(events: Sequence[Any], group: int | None = None) -> list[Any]:
        """The hashes of the ``BlockRemoved`` events, in order (one group, or all)."""
        return [
            h
            for e in events
            if isinstance(e, BlockRemoved) and (group is None or (e.group_idx or 0) == group)
            for h in e.block_hashes
        ]

    @staticmethod
    def stored(events: Sequence[Any], group: int | None = None) -> list[Any]:
        """The hashes listed by the ``BlockStored`` events, in order (one group, or all)."""
        return [
            h
            for e in events
            if isinstance(e, BlockStored) and (group is None or (e.group_idx or 0) == group)
            for h in e.block_hashes
        ]

    @staticmethod
    def cleared(events: Sequence[Any]) -> int:
        return sum(isinstance(e, AllBlocksCleared) for e in events)

    def check(self) -> None:
        """The pool's own invariants (POOL-2, queue links, index)."""
        self.pool.check_invariants()
