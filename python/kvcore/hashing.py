"""Block hashing for prefix caching (SPEC §5).

A block's hash is ``fn((parent, tuple(tokens), extra))``: the digest of the serialised triple
of the previous block's hash (or the process-wide :data:`NONE_HASH`), the block's token ids and
its extra keys (LoRA name, multimodal items, cache salt, prompt-embedding digest). The four
functions serialise with CPython pickle (protocol 5) or canonical CBOR and digest with SHA-256
or XXH3-128, byte-identical to the reference.

The serialisation and digests run in Rust (``kvcore._native``). Inputs whose exact bytes the
native serialisers do not reproduce (ints beyond 64 bits, floats, bools, subclasses, lists under
pickle, an object that occurs twice in one pickle, pickles larger than one 64 KiB frame) are
serialised by :mod:`pickle` or ``cbor2`` instead, so every input hashes exactly as in the
reference.

Example:
    >>> init_none_hash(sha256_cbor)  # set PYTHONHASHSEED to share NONE_HASH across processes
    >>> len(hash_block_tokens(sha256_cbor, None, list(range(16))))
    32
    >>> hasher = get_request_block_hasher(16, sha256_cbor)  # hasher(request) -> new hashes
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import logging
import os
import pickle
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NewType, cast, overload

from kvcore import _native
from kvcore.errors import ArgumentTypeError, InvalidArgumentError

__all__ = [
    "NONE_HASH",
    "BlockHash",
    "BlockHashView",
    "generate_block_hash_extra_keys",
    "get_hash_fn_by_name",
    "get_request_block_hasher",
    "hash_block_tokens",
    "init_none_hash",
    "need_extra_keys",
    "python_hash_seed",
    "sha256",
    "sha256_cbor",
    "xxhash",
    "xxhash_cbor",
]

logger = logging.getLogger(__name__)

BlockHash = NewType("BlockHash", bytes)
"""The digest of one block's hash input (32 bytes for SHA-256, 16 for XXH3-128)."""

HashFunction = Callable[[Any], bytes]
"""A block-hash function: any object in, digest bytes out."""

_PICKLE_PROTOCOL = 5

_NATIVE_MAX_BLOCK_SIZE = 2**62
"""Largest hash block size the native hasher takes; larger ones (a window no request fills)
go to the Python closure, which computes with exact ints."""

_cbor2: Any
try:
    _cbor2 = importlib.import_module("cbor2")
except ImportError:  # pragma: no cover - cbor2 is a test dependency
    _cbor2 = None


def _serialize(obj: Any, cbor: bool) -> bytes:
    """Serialises ``obj`` with the Python library the reference uses (the slow path)."""
    if not cbor:
        return pickle.dumps(obj, protocol=_PICKLE_PROTOCOL)
    if _cbor2 is None:
        raise TypeError(
            f"cannot CBOR-serialise an object of type {type(obj).__name__} natively; "
            "install cbor2 to hash it"
        )
    data: bytes = _cbor2.dumps(obj, canonical=True)
    return data


def _hash(name: str, cbor: bool, obj: Any) -> bytes:
    native = _native.hash_object(name, obj)
    if native is not None:
        return native
    return _native.digest(name, _serialize(obj, cbor))


def sha256(obj: Any) -> bytes:
    """SHA-256 of ``pickle.dumps(obj, protocol=5)`` (SPEC §5.1).

    Args:
        obj: Any picklable object.

    Returns:
        The 32-byte digest.
    """
    return _hash("sha256", False, obj)


def sha256_cbor(obj: Any) -> bytes:
    """SHA-256 of the canonical CBOR encoding of ``obj`` (SPEC §5.1, HASH-3).

    Args:
        obj: None, int, str, bytes or tuples/lists of them natively; anything cbor2 encodes
            when cbor2 is installed.

    Returns:
        The 32-byte digest.

    Raises:
        TypeError: ``obj`` needs cbor2 and cbor2 is not installed, or cbor2 cannot encode it.
    """
    return _hash("sha256_cbor", True, obj)


def xxhash(obj: Any) -> bytes:
    """XXH3-128 (big-endian) of ``pickle.dumps(obj, protocol=5)`` (SPEC §5.1, HASH-1).

    Args:
        obj: Any picklable object.

    Returns:
        The 16-byte digest.
    """
    return _hash("xxhash", False, obj)


def xxhash_cbor(obj: Any) -> bytes:
    """XXH3-128 (big-endian) of the canonical CBOR encoding of ``obj`` (SPEC §5.1).

    Args:
        obj: As for :func:`sha256_cbor`.

    Returns:
        The 16-byte digest.

    Raises:
        TypeError: As for :func:`sha256_cbor`.
    """
    return _hash("xxhash_cbor", True, obj)


_FUNCTIONS: dict[str, HashFunction] = {
    "sha256": sha256,
    "sha256_cbor": sha256_cbor,
    "xxhash": xxhash,
    "xxhash_cbor": xxhash_cbor,
}
_NATIVE_NAMES: dict[HashFunction, str] = {fn: name for name, fn in _FUNCTIONS.items()}
_CBOR_HASH_FUNCTIONS = frozenset({sha256_cbor, xxhash_cbor})


def get_hash_fn_by_name(hash_fn_name: str) -> HashFunction:
    """The hash function configured by name (SPEC §5.1).

    Args:
        hash_fn_name: ``"sha256"``, ``"sha256_cbor"``, ``"xxhash"`` or ``"xxhash_cbor"``.

    Returns:
        The function.

    Raises:
        InvalidArgumentError: (a ValueError) any other name.
    """
    try:
        return _FUNCTIONS[hash_fn_name]
    except (KeyError, TypeError):
        raise InvalidArgumentError(f"Unsupported hash function: {hash_fn_name}") from None


NONE_HASH: BlockHash
"""The parent hash of every first block; set by :func:`init_none_hash` (SPEC HASH-10)."""


@contextlib.contextmanager
def python_hash_seed(value: str) -> Iterator[None]:
    """Sets ``PYTHONHASHSEED`` for the duration of the block (``init_none_hash`` reads it when
    called, so the NONE_HASH of the CBOR functions becomes reproducible); restores it after.

    Args:
        value: The seed, as the environment variable's text.
    """
    old = os.environ.get("PYTHONHASHSEED")
    os.environ["PYTHONHASHSEED"] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ["PYTHONHASHSEED"]
        else:
            os.environ["PYTHONHASHSEED"] = old


def init_none_hash(hash_fn: HashFunction) -> None:
    """Sets the module-global :data:`NONE_HASH` (SPEC HASH-10).

    With ``PYTHONHASHSEED`` unset it is 32 random bytes whatever the function (and a warning
    is logged for the CBOR functions, whose point is reproducibility); when it is set, even to
    the empty string, it is ``hash_fn(seed)``.

    Args:
        hash_fn: The block-hash function in use.
    """
    global NONE_HASH
    seed = os.getenv("PYTHONHASHSEED")
    if seed is None:
        if hash_fn in _CBOR_HASH_FUNCTIONS:
            logger.warning(
                "PYTHONHASHSEED is not set: block hashes from the CBOR hash functions "
                "(sha256_cbor, xxhash_cbor) will differ between processes. Set "
                "PYTHONHASHSEED to a fixed value to make them reproducible."
            )
        NONE_HASH = BlockHash(os.urandom(32))
    else:
        NONE_HASH = BlockHash(hash_fn(seed))


def _none_hash() -> bytes:
    try:
        return NONE_HASH
    except NameError:
        raise NameError(
            "kvcore.hashing.NONE_HASH is not initialised; call init_none_hash(hash_fn) first"
        ) from None


def hash_block_tokens(
    hash_function: HashFunction,
    parent_block_hash: bytes | None,
    curr_block_token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> BlockHash:
    """The hash of one block, chained to its parent (SPEC HASH-11).

    Args:
        hash_function: One of the four functions (native path) or any callable.
        parent_block_hash: The previous block's hash; None or ``b""`` means :data:`NONE_HASH`.
        curr_block_token_ids: The block's token ids.
        extra_keys: The block's extra keys (see :func:`generate_block_hash_extra_keys`).

    Returns:
        ``hash_function((parent or NONE_HASH, tuple(tokens), extra_keys))``.

    Raises:
        NameError: No parent and :func:`init_none_hash` was never called.
    """
    parent = parent_block_hash if parent_block_hash else _none_hash()
    name = _NATIVE_NAMES.get(hash_function)
    if name is not None and type(parent) is bytes:
        out = _native.hash_block_tokens(name, parent, parent, curr_block_token_ids, extra_keys)
        if out is not None:
            return BlockHash(out)
    return BlockHash(hash_function((parent, tuple(curr_block_token_ids), extra_keys)))


def need_extra_keys(request: Any) -> bool:
    """Whether the request's blocks may carry extra keys (SPEC XK-3).

    Args:
        request: A request (SPEC §17).

    Returns:
        True with multimodal features, a LoRA request or a cache salt (even empty).
    """
    return (
        bool(request.mm_features)
        or request.lora_request is not None
        or request.cache_salt is not None
    )


def _mm_extra_keys(
    request: Any, start: int, end: int, mm_idx: int
) -> tuple[list[tuple[Any, int]], int]:
    """Multimodal extra keys of the window ``[start, end)`` (SPEC XK-2)."""
    features = request.mm_features
    if not features:
        return [], mm_idx
    last = features[-1].mm_position
    if last.offset + last.length <= start:
        return [], mm_idx
    count = len(features)
    if mm_idx < 0:
        if -mm_idx > count:
            raise AssertionError(f"multimodal index {mm_idx} out of range for {count} items")
        mm_idx += count
    keys: list[tuple[Any, int]] = []
    while mm_idx < count:
        feature = features[mm_idx]
        if feature.identifier is None:
            raise AssertionError("multimodal feature without identifier")
        offset = feature.mm_position.offset
        feature_end = offset + feature.mm_position.length
        if end <= offset:
            break
        if start >= feature_end:
            mm_idx += 1
            continue
        keys.append((feature.identifier, offset - start))
        if end < feature_end:
            break
        mm_idx += 1
    return keys, mm_idx


def _tensor_bytes(tensor: Any) -> memoryview:
    """The raw bytes of a tensor, flattened, on the CPU, in native byte order."""
    torch: Any = importlib.import_module("torch")
    data: memoryview = tensor.flatten().cpu().contiguous().view(torch.uint8).numpy().data
    return data


def _prompt_embeds_key(request: Any, start: int, end: int) -> bytes:
    """SHA-256 of the window's prompt embeddings, cached on the request per ``(start, end)``."""
    cache: dict[tuple[int, int], bytes] | None = getattr(
        request, "_prompt_embeds_per_block_hashes", None
    )
    if cache is None:
        cache = {}
        with contextlib.suppress(AttributeError):  # a request without the cache attribute
            request._prompt_embeds_per_block_hashes = cache
    key = cache.get((start, end))
    if key is None:
        key = hashlib.sha256(_tensor_bytes(request.prompt_embeds[start:end])).digest()
        cache[(start, end)] = key
    return key


def generate_block_hash_extra_keys(
    request: Any, start_token_idx: int, end_token_idx: int, start_mm_idx: int
) -> tuple[tuple[Any, ...] | None, int]:
    """Extra keys of the window ``[start_token_idx, end_token_idx)`` (SPEC XK-1, XK-2).

    Args:
        request: A request (SPEC §17).
        start_token_idx: First token of the window.
        end_token_idx: One past the last token of the window.
        start_mm_idx: Multimodal item to start scanning from; negative counts from the end.

    Returns:
        ``(keys, next_mm_idx)``: ``keys`` is ``lora ++ mm ++ salt ++ embeds`` as a tuple, or
        None when all four are empty.

    Raises:
        AssertionError: A multimodal item without identifier, or ``start_mm_idx`` below
            ``-len(mm_features)``.
    """
    mm_keys, next_mm_idx = _mm_extra_keys(request, start_token_idx, end_token_idx, start_mm_idx)
    keys: list[Any] = []
    lora = request.lora_request
    if lora:
        keys.append(lora.lora_name)
    keys.extend(mm_keys)
    salt = request.cache_salt
    if start_token_idx == 0 and salt:
        keys.append(salt)
    if getattr(request, "prompt_embeds", None) is not None:
        keys.append(_prompt_embeds_key(request, start_token_idx, end_token_idx))
    return (tuple(keys) if keys else None), next_mm_idx


_native.register_extra_keys_fn(generate_block_hash_extra_keys)


def _may_have_extra_keys(request: Any) -> bool:
    """False only when every window's extra keys are certainly None (no per-window work)."""
    return bool(
        request.mm_features
        or request.lora_request
        or request.cache_salt
        or getattr(request, "prompt_embeds", None) is not None
    )


def _window_extras(
    request: Any, start: int, end: int, hbs: int
) -> list[tuple[Any, ...] | None] | None:
    """Extra keys of every window in ``[start, end)`` (RH-1), or None when all are None."""
    if not _may_have_extra_keys(request):
        return None
    if not request.mm_features and getattr(request, "prompt_embeds", None) is None:
        # Only LoRA and salt: the same keys in every window, the salt in window 0 only.
        lora = request.lora_request
        base: tuple[Any, ...] = (lora.lora_name,) if lora else ()
        extras: list[tuple[Any, ...] | None] = [base or None] * ((end - start) // hbs)
        salt = request.cache_salt
        if start == 0 and salt:
            extras[0] = (*base, salt)
        return extras
    extras = []
    mm_idx = 0 if start == 0 else -1
    for s in range(start, end, hbs):
        extra, mm_idx = generate_block_hash_extra_keys(request, s, s + hbs, mm_idx)
        extras.append(extra)
    return extras


def get_request_block_hasher(
    hash_block_size: int,
    caching_hash_fn: HashFunction,
    *,
    none_hash: Callable[[], bytes] | None = None,
    list_view: tuple[type, str] | None = None,
) -> Callable[[Any], list[BlockHash]]:
    """A function returning the hashes of a request's new full windows (SPEC RH-1).

    The returned callable hashes every new full ``hash_block_size`` window after the request's
    existing ``block_hashes`` in one native call (without the GIL for long runs). For the four
    built-in functions it is a ``kvcore._native.RequestBlockHasher``, which reads the tokens
    itself; requests with extra keys (multimodal, LoRA, salt, embeddings) go through a Python
    closure that computes the per-window keys first. Either has a ``hash_block_size``
    attribute.

    Args:
        hash_block_size: Tokens per hashed window.
        caching_hash_fn: The block-hash function.
        none_hash: Where the first block's parent comes from, read at every call (a kvcore
            extension, e.g. ``lambda: vllm.v1.core.kv_cache_utils.NONE_HASH`` to chain from
            vLLM's); by default this module's :data:`NONE_HASH`.
        list_view: A read-only sequence class and the attribute holding the list it wraps,
            whose exact instances index as that list (a kvcore extension, e.g. vLLM's
            ``(ConstantList, "_x")``): the native hasher reads a request's ``all_token_ids`` of
            that class from the list, where it would otherwise hand the request to the Python
            closure.

    Returns:
        ``hasher(request) -> list[BlockHash]``; the caller extends ``block_hashes`` with it.

    Raises:
        ArgumentTypeError: ``hash_block_size`` is not an int.
        InvalidArgumentError: ``hash_block_size`` is not positive (the reference accepts it,
            and its hasher then never returns).
    """
    if not isinstance(hash_block_size, int):
        raise ArgumentTypeError(
            f"hash_block_size must be an int, not {type(hash_block_size).__name__}"
        )
    if hash_block_size <= 0:
        # The reference's hasher never returns for such a size (its window never ends).
        raise InvalidArgumentError(f"hash_block_size must be positive, got {hash_block_size}")
    hbs = hash_block_size
    name = _NATIVE_NAMES.get(caching_hash_fn)
    first_parent = _none_hash if none_hash is None else none_hash

    def request_block_hasher(request: Any) -> list[BlockHash]:
        block_hashes = request.block_hashes
        start = len(block_hashes) * hbs
        num_tokens = request.num_tokens
        if start + hbs > num_tokens:
            return []
        parent: bytes | None = block_hashes[-1] if block_hashes else None
        num_blocks = (num_tokens - start) // hbs
        end = start + num_blocks * hbs
        extras = _window_extras(request, start, end, hbs)
        if name is not None:
            all_tokens = request.all_token_ids
            if start == 0 and type(all_tokens) is list and end == len(all_tokens):
                tokens = tuple(all_tokens)  # one copy instead of slice + tuple
            else:
                tokens = tuple(all_tokens[start:end])
            root = b"" if parent else first_parent()
            out = _native.hash_request_blocks(name, root, parent, tokens, hbs, extras)
            if out is not None:
                return out  # type: ignore[return-value]
        new_hashes: list[BlockHash] = []
        all_tokens = request.all_token_ids
        for i, s in enumerate(range(start, end, hbs)):
            extra = extras[i] if extras is not None else None
            parent = hash_block_tokens(
                caching_hash_fn, parent or first_parent(), all_tokens[s : s + hbs], extra
            )
            new_hashes.append(BlockHash(parent))
        return new_hashes

    request_block_hasher.hash_block_size = hbs  # type: ignore[attr-defined]
    if name is not None and hbs <= _NATIVE_MAX_BLOCK_SIZE:
        # Requests without extra keys are hashed entirely in Rust; the closure above serves
        # the others.
        native = _native.RequestBlockHasher(
            name, hbs, first_parent, request_block_hasher, list_view
        )
        return cast("Callable[[Any], list[BlockHash]]", native)
    return request_block_hasher


class BlockHashView(Sequence[BlockHash]):
    """Block hashes at ``target_block_size`` read from hashes at ``hash_block_size`` (RH-3).

    Every fine hash chains over its whole prefix, so a coarse block's hash is the fine hash at
    its last fine boundary: ``view[i] = fine[(i + 1) * k - 1]`` with ``k = target / hash``.
    Nothing is copied or rehashed; the view follows the list as it grows.

    Args:
        block_hashes: Hashes computed at ``hash_block_size``.
        hash_block_size: Tokens per fine hash.
        target_block_size: Tokens per coarse block; a multiple of ``hash_block_size``.

    Raises:
        AssertionError: ``target_block_size`` is not a multiple of ``hash_block_size``.
    """

    __slots__ = ("block_hashes", "scale_factor")

    def __init__(
        self, block_hashes: list[BlockHash], hash_block_size: int, target_block_size: int
    ) -> None:
        if target_block_size % hash_block_size != 0:
            raise AssertionError(
                f"block size {target_block_size} is not a multiple of the hash block size "
                f"{hash_block_size}"
            )
        self.block_hashes = block_hashes
        self.scale_factor = target_block_size // hash_block_size

    def __len__(self) -> int:
        return len(self.block_hashes) // self.scale_factor

    @overload
    def __getitem__(self, idx: int) -> BlockHash: ...

    @overload
    def __getitem__(self, idx: slice) -> list[BlockHash]: ...

    def __getitem__(self, idx: int | slice) -> BlockHash | list[BlockHash]:
        """Coarse hash ``idx`` (not normalised: ``view[-1]`` is the last fine hash) or a slice.

        Raises:
            TypeError: Any other index type.
        """
        if isinstance(idx, int):
            return self.block_hashes[(idx + 1) * self.scale_factor - 1]
        if isinstance(idx, slice):
            k = self.scale_factor
            fine = self.block_hashes
            return [fine[(i + 1) * k - 1] for i in range(*idx.indices(len(self)))]
        raise TypeError(f"Invalid index type: {type(idx)!r}")

    def __iter__(self) -> Iterator[BlockHash]:
        k = self.scale_factor
        fine = self.block_hashes
        for i in range(len(self)):
            yield fine[(i + 1) * k - 1]
