"""Type stubs of the native extension ``kvcore._native``."""

from typing import Any

__version__: str

class KvcoreError(Exception):
    """Base class of every exception kvcore raises."""

# --- events ---

def encode_event_batch(
    ts: float, events: list[Any] | tuple[Any, ...], data_parallel_rank: int | None = None
) -> bytes:
    """Encodes ``[ts, [events], data_parallel_rank]`` as msgpack (SPEC WIRE-2, WIRE-3).

    Events are recognised by class name (``BlockStored``, ``BlockRemoved``,
    ``AllBlocksCleared``); their field values may be None, bool, int, float, str, bytes,
    bytearray, list or tuple (exact types), nested.

    Raises:
        TypeError: An unknown event class or value type, or ``events`` not a list or tuple.
        OverflowError: An int outside ``[-2**63, 2**64 - 1]``.
        RecursionError: Values nested more than 1000 deep.
    """

def msgpack_encode(obj: object) -> bytes:
    """Encodes one value with the msgpack forms of SPEC WIRE-3.

    Raises:
        TypeError: A value of another type.
        OverflowError: An int outside ``[-2**63, 2**64 - 1]``.
        RecursionError: Values nested more than 1000 deep.
    """
