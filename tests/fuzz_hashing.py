"""Differential fuzzing of ``kvcore.hashing`` and ``kvcore.Request`` against the reference.

- :func:`check_hash_functions`: the four hash functions on nested tuples and lists of
  ``None``, bools, ints of any size, floats, strings (lone surrogates included) and bytes.
- :func:`check_hash_block_tokens`: one block hash from odd parents (``None``, ``b""``,
  strings, long bytes), odd tokens and extra keys.
- :class:`RequestFuzzer`: a kvcore ``Request`` and a reference ``Request`` built with each
  side's request block hasher from the same prompt and id (non-ASCII and lone-surrogate ids
  included), then fed the same output tokens (ints, bools, huge ints, lists, strings) and the
  same tampering with ``block_hashes``; after every call the hashes, the token views and the
  token count must agree.

``PYTHONHASHSEED`` is set for the duration of each check so that both ``NONE_HASH`` agree.
"""

from __future__ import annotations

import contextlib
from typing import Any

import hypothesis.strategies as st
from fuzz_harness import Divergence, attempt, judge
from fuzz_values import request_ids, token_values

import kvcore
from kvcore import hashing
from kvcore.hashing import python_hash_seed

__all__ = [
    "HASH_NAMES",
    "RequestFuzzer",
    "check_hash_block_tokens",
    "check_hash_functions",
    "hash_seed",
    "request_programs",
]

HASH_NAMES = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")


def hash_seed(seed: str = "0") -> contextlib.AbstractContextManager[None]:
    """Sets ``PYTHONHASHSEED`` (both ``init_none_hash`` read it when called)."""
    return python_hash_seed(seed)


def token_deviation(tokens: Any) -> str | None:
    """kvcore's token ids are ints of the int64 range (bools and int subclasses included);
    the reference stores any object."""
    items = [tokens] if isinstance(tokens, int) else tokens
    try:
        items = list(items)
    except TypeError:
        return None
    for t in items:
        if not isinstance(t, int) or not -(2**63) <= t < 2**63:
            return "token ids that are not int64 ints"
    return None


def _ref_fns() -> Any:
    from vllm.utils import hashing as ref_hashing

    return ref_hashing


def check_hash_functions(name: str, obj: Any) -> None:
    """``kvcore.hashing.<name>(obj)`` equals the reference's, or both raise."""
    ref = getattr(_ref_fns(), name)
    mine = getattr(hashing, name)
    k, r = attempt(lambda: mine(obj)), attempt(lambda: ref(obj))
    if judge(f"{name}({obj!r})", k, r, None, False) == "ok" and k.value != r.value:
        raise Divergence(f"{name}({obj!r}): kvcore {k.value.hex()}, reference {r.value.hex()}")


def check_hash_block_tokens(name: str, parent: Any, tokens: Any, extra: Any) -> None:
    """``hash_block_tokens`` agrees with the reference's (NONE_HASH from the same seed)."""
    from vllm.v1.core import kv_cache_utils as ref_utils

    with hash_seed():
        ref_fn = getattr(_ref_fns(), name)
        fn = hashing.get_hash_fn_by_name(name)
        ref_utils.init_none_hash(ref_fn)
        hashing.init_none_hash(fn)
        if ref_utils.NONE_HASH != hashing.NONE_HASH:
            raise Divergence(f"init_none_hash({name}) differs")
        what = f"hash_block_tokens({name}, {parent!r}, {tokens!r}, {extra!r})"
        k = attempt(lambda: hashing.hash_block_tokens(fn, parent, tokens, extra))
        r = attempt(lambda: ref_utils.hash_block_tokens(ref_fn, parent, tokens, extra))
        if judge(what, k, r, None, False) == "ok" and k.value != r.value:
            raise Divergence(f"{what}: kvcore {k.value!r}, reference {r.value!r}")


def parents() -> st.SearchStrategy[Any]:
    """Parent hashes: None, empty, digests, odd lengths, wrong types."""
    return st.one_of(
        st.none(),
        st.just(b""),
        st.binary(min_size=32, max_size=32),
        st.binary(min_size=16, max_size=16),
        st.binary(min_size=33, max_size=80),
        st.sampled_from(("parent", 0, 7, ())),
    )


def extra_keys() -> st.SearchStrategy[Any]:
    """Extra keys: None, tuples of strings, (identifier, offset) pairs, bytes, odd values."""
    item = st.one_of(
        st.text(max_size=5),
        st.tuples(st.text(max_size=4), st.integers(-3, 40)),
        st.binary(max_size=32),
        st.sampled_from(("\ud800", 1.5, None, True, 2**70)),
    )
    return st.one_of(st.none(), st.lists(item, max_size=3).map(tuple), st.just(()))


def token_lists() -> st.SearchStrategy[Any]:
    """A block's tokens: ints, boundaries, bools, huge ints, and a few non-ints."""
    return st.one_of(
        st.lists(token_values(), max_size=6),
        st.lists(st.sampled_from((2**63, -(2**63) - 1, 10**30, 1.5, "t", None)), max_size=3),
        st.lists(token_values(), max_size=6).map(tuple),
    )


def request_programs() -> st.SearchStrategy[list[tuple[Any, ...]]]:
    """Appends (ints, bools, huge ints, lists, strings, wrong types) and hash tampering."""
    appended = st.one_of(
        token_values(),
        st.lists(token_values(), max_size=12),
        st.lists(token_values(), max_size=12).map(tuple),
        st.sampled_from((2**63, -(2**64), 10**30, "ab", 1.5, None, [1.5], ["x", None])),
    )
    op = st.one_of(
        st.tuples(st.just("append"), appended),
        st.tuples(st.just("append"), appended),
        st.tuples(st.just("append"), appended),
        st.tuples(
            st.just("set_hashes"),
            st.sampled_from(("empty-bytes", "none", "str", "long", "drop-last", "clear")),
        ),
        st.tuples(
            st.just("update"),
        ),
        st.tuples(
            st.just("num_computed"), st.one_of(st.integers(0, 40), st.sampled_from((-1, 2**40)))
        ),
    )
    return st.lists(op, max_size=12)


class RequestFuzzer:
    """One kvcore ``Request`` and one reference ``Request`` fed the same calls."""

    def __init__(self, name: str, hbs: int, rid: str, prompt: list[Any], salt: str | None) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.core import kv_cache_utils as ref_utils
        from vllm.v1.request import Request as RefRequest

        self.what = f"Request({rid!r}, {prompt!r}, hbs={hbs}, {name}, salt={salt!r})"
        self.log: list[str] = [self.what]
        ref_fn = getattr(_ref_fns(), name)
        fn = hashing.get_hash_fn_by_name(name)
        ref_utils.init_none_hash(ref_fn)
        hashing.init_none_hash(fn)
        self.ref_hasher = ref_utils.get_request_block_hasher(hbs, ref_fn)
        self.hasher = hashing.get_request_block_hasher(hbs, fn)
        r = attempt(
            lambda: RefRequest(
                rid,
                list(prompt),
                SamplingParams(max_tokens=16),
                None,
                cache_salt=salt,
                block_hasher=self.ref_hasher,
            )
        )
        k = attempt(
            lambda: kvcore.Request(
                rid, list(prompt), cache_salt=salt, max_tokens=16, block_hasher=self.hasher
            )
        )
        self.alive = judge(self.what, k, r, token_deviation(prompt), False) == "ok"
        if self.alive:
            self.k, self.r = k.value, r.value
            self.compare("construction")

    def compare(self, what: str) -> None:
        k, r = self.k, self.r
        checks = [
            ("request_id", k.request_id, r.request_id),
            ("num_tokens", k.num_tokens, r.num_tokens),
            ("all_token_ids", list(k.all_token_ids), list(r.all_token_ids)),
            (
                "types of all_token_ids",
                [type(t) for t in k.all_token_ids],
                [type(t) for t in r.all_token_ids],
            ),
            ("output_token_ids", list(k.output_token_ids), list(r.output_token_ids)),
            ("block_hashes", list(k.block_hashes), list(r.block_hashes)),
        ]
        for name, kv, ref in checks:
            if kv != ref:
                history = "\n    ".join(self.log[-12:])
                raise Divergence(
                    f"after {what}: {name} differ\n  kvcore:    {kv!r}\n  reference: {ref!r}\n"
                    f"  calls:\n    {history}"
                )

    def run(self, program: list[tuple[Any, ...]]) -> None:
        if not self.alive:
            return  # both constructors raised (the same class)
        for op in program:
            getattr(self, "op_" + op[0])(*op[1:])

    def op_append(self, tokens: Any) -> None:
        what = f"append_output_token_ids({tokens!r})"
        self.log.append(what)
        k_arg = list(tokens) if isinstance(tokens, list) else tokens
        r_arg = list(tokens) if isinstance(tokens, list) else tokens
        before = (list(self.k.all_token_ids), list(self.k.block_hashes))
        k = attempt(lambda: self.k.append_output_token_ids(k_arg))
        r = attempt(lambda: self.r.append_output_token_ids(r_arg))
        if judge(what, k, r, token_deviation(tokens), False) in ("stricter", "both"):
            # kvcore refused and must have appended nothing; the reference may have appended
            # its tokens before its hasher failed (it is not atomic). Its request is rebuilt
            # from kvcore's tokens and hashes, so that both go on from the same state.
            after = (list(self.k.all_token_ids), list(self.k.block_hashes))
            if after != before:
                raise Divergence(f"{what}: kvcore refused but changed the request: {after!r}")
            self.r._all_token_ids[:] = list(self.k.all_token_ids)
            self.r._output_token_ids[:] = list(self.k.output_token_ids)
            self.r.block_hashes[:] = list(self.k.block_hashes)
        self.compare(what)

    def op_set_hashes(self, how: str) -> None:
        what = f"block_hashes tampered: {how}"
        self.log.append(what)
        for req in (self.k, self.r):
            hashes = req.block_hashes
            if how == "clear":
                hashes.clear()
            elif how == "drop-last":
                if hashes:
                    hashes.pop()
            else:
                value = {"empty-bytes": b"", "none": None, "str": "h", "long": b"\x01" * 70}[how]
                if hashes:
                    hashes[-1] = value
                else:
                    hashes.append(value)
        self.compare(what)

    def op_update(self) -> None:
        self.log.append("update_block_hashes()")
        k = attempt(self.k.update_block_hashes)
        r = attempt(self.r.update_block_hashes)
        judge("update_block_hashes()", k, r, None, False)
        self.compare("update_block_hashes()")

    def op_num_computed(self, n: int) -> None:
        self.log.append(f"num_computed_tokens = {n}")
        self.k.num_computed_tokens = n
        self.r.num_computed_tokens = n


def rids() -> st.SearchStrategy[str]:
    """Request ids, as in :func:`fuzz_values.request_ids`."""
    return request_ids()


def prompts() -> st.SearchStrategy[list[Any]]:
    """Prompts: token lists with repeats, bools and huge ints."""
    return st.one_of(
        st.lists(token_values(), max_size=20),
        st.lists(st.one_of(token_values(), st.sampled_from((2**63, 10**30, -(2**64)))), max_size=8),
    )
