"""Request block hashing for vLLM's requests, native and byte-identical to vLLM's own hasher.

:func:`get_request_block_hasher` has vLLM's signature: give it vLLM's hash function
(``vllm.utils.hashing.sha256`` and the other three) and it returns kvcore's native hasher for
the same function, chaining from vLLM's ``NONE_HASH`` (read at every call, so vLLM's own
``init_none_hash`` keeps deciding it). A vLLM request's ``all_token_ids`` (a ``ConstantList``)
is read from the list it wraps, so its appends are hashed natively too. An unknown function is
used as it is, through kvcore's Python path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm.utils import hashing as _vllm_hashing
from vllm.v1.core import kv_cache_utils as _vllm_kv_cache_utils
from vllm.v1.utils import ConstantList

from kvcore import hashing as _hashing

_KVCORE_FUNCTIONS: dict[Any, _hashing.HashFunction] = {
    getattr(_vllm_hashing, name): _hashing.get_hash_fn_by_name(name)
    for name in ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
}


def _vllm_none_hash() -> bytes:
    value: bytes = _vllm_kv_cache_utils.NONE_HASH
    return value


def get_request_block_hasher(
    hash_block_size: int, caching_hash_fn: Callable[[Any], bytes]
) -> Callable[[Any], list[Any]]:
    """kvcore's block hasher for vLLM requests (vLLM's signature, vLLM's hashes).

    Args:
        hash_block_size: Tokens per hashed block.
        caching_hash_fn: vLLM's block-hash function.

    Returns:
        ``hasher(request) -> list[BlockHash]`` for ``Request(..., block_hasher=...)``.
    """
    fn = _KVCORE_FUNCTIONS.get(caching_hash_fn, caching_hash_fn)
    return _hashing.get_request_block_hasher(
        hash_block_size, fn, none_hash=_vllm_none_hash, list_view=(ConstantList, "_x")
    )
