"""vLLM's ``Request`` with its decode fields in slots: what kvcore's engine builds.

``Request`` is a subclass of ``vllm.v1.request.Request`` that changes nothing of its behaviour:
same constructor, same methods, same attributes. It keeps four attributes in ``__slots__``
instead of the instance dict: ``request_id``, ``num_prompt_tokens``, ``num_computed_tokens``
and ``_all_token_ids``. Those are the fields a decode ``allocate_slots`` call reads, and kvcore's
manager reads slots at fixed offsets in the object, with no dict lookup: a decode call of such
a request costs what one of kvcore's own ``kvcore.request.Request`` costs (the README's
request-decode table). Python code reads and writes slots at least as fast as dict attributes.

When kvcore's scheduler class is built, kvcore's ``vllm.general_plugins`` entry point has vLLM's
engine build its requests as this class (:mod:`kvcore.vllm.plugin`). A plain
``vllm.v1.request.Request`` still works everywhere, read from its instance dict.
"""

from __future__ import annotations

from vllm.v1.request import Request as VllmRequest

__all__ = ["Request"]


class Request(VllmRequest):  # type: ignore[misc]
    """``vllm.v1.request.Request``, its decode fields kept in slots (see the module)."""

    __slots__ = (
        "_all_token_ids",
        "_kvcore_state",
        "num_computed_tokens",
        "num_prompt_tokens",
        "request_id",
    )
