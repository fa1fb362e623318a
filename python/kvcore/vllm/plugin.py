"""The ``vllm.general_plugins`` entry point: kvcore's native block hasher and request class in
vLLM's engine.

vLLM's engine core builds its request block hasher itself, right after it built the scheduler
(``vllm.v1.engine.core.EngineCore.__init__`` calls the module's ``get_request_block_hasher``),
and builds each request with the module's ``Request.from_engine_core_request``. vLLM loads
every ``vllm.general_plugins`` entry point before that; kvcore's (declared in its package
metadata) wraps that one function so that, in a process where a ``kvcore.vllm.Scheduler`` or
``AsyncScheduler`` was built, the engine gets :func:`kvcore.vllm.hashing.get_request_block_hasher`
(native, byte-identical hashes) and otherwise vLLM's own. When kvcore's scheduler is built, the
engine module's ``Request`` becomes :class:`kvcore.vllm.Request` (vLLM's class with its decode
fields in slots, which kvcore's manager reads fastest). Nothing else is changed, and without
kvcore's scheduler nothing changes. Set ``VLLM_PLUGINS`` to a list without ``kvcore`` to switch
it off.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_scheduler_built = False
_registered = False


def note_scheduler_built() -> None:
    """Called by kvcore's scheduler classes: this process runs kvcore's manager. With the plugin
    registered, the engine builds its requests as :class:`kvcore.vllm.Request` from now on."""
    global _scheduler_built
    _scheduler_built = True
    if _registered:
        import vllm.v1.engine.core as engine_core

        from kvcore.vllm.request import Request

        engine_core.Request = Request


def kvcore_selected() -> bool:
    """Whether a kvcore scheduler was built in this process."""
    return _scheduler_built


def register() -> None:
    """Wraps ``vllm.v1.engine.core.get_request_block_hasher`` (idempotent), and has
    :func:`note_scheduler_built` give the engine kvcore's request class."""
    import vllm.v1.engine.core as engine_core

    global _registered
    _registered = True

    original: Callable[..., Any] = engine_core.get_request_block_hasher
    if getattr(original, "__kvcore_wrapper__", False):
        return

    def get_request_block_hasher(
        hash_block_size: int, caching_hash_fn: Callable[[Any], bytes]
    ) -> Callable[[Any], list[Any]]:
        if kvcore_selected():
            from kvcore.vllm.hashing import get_request_block_hasher as native

            return native(hash_block_size, caching_hash_fn)
        return original(hash_block_size, caching_hash_fn)  # type: ignore[no-any-return]

    get_request_block_hasher.__kvcore_wrapper__ = True  # type: ignore[attr-defined]
    get_request_block_hasher.__wrapped__ = original  # type: ignore[attr-defined]
    engine_core.get_request_block_hasher = get_request_block_hasher
