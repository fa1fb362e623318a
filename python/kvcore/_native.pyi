"""Type stubs of the native extension ``kvcore._native``."""

__version__: str

class KvcoreError(Exception):
    """Base class of every exception kvcore raises."""

# --- hashing ---

def hash_object(hash_fn_name: str, obj: object) -> bytes | None:
    """``fn(obj)`` natively, or None when ``obj`` needs the Python serialiser."""

def digest(hash_fn_name: str, data: bytes) -> bytes:
    """Digests serialised bytes with the function's digest (SHA-256 or XXH3-128 big-endian)."""

def hash_block_tokens(
    hash_fn_name: str, none_hash: bytes, parent: object, tokens: object, extra: object
) -> bytes | None:
    """One block hash (SPEC HASH-11), or None when an argument needs the Python serialiser."""

def hash_request_blocks(
    hash_fn_name: str,
    none_hash: bytes,
    parent: bytes | None,
    token_ids: tuple[int, ...],
    block_size: int,
    extras: list[tuple[object, ...] | None] | None = None,
) -> list[bytes] | None:
    """Chained hashes of the full windows of ``token_ids`` (SPEC RH-1), GIL released."""
