"""vLLM's ``Request`` with its decode fields in slots: what kvcore's engine builds.

``Request`` is a subclass of ``vllm.v1.request.Request`` that changes nothing of its behaviour:
same constructor, same methods, same attributes. It keeps the attributes kvcore reads in
``__slots__`` instead of the instance dict: the four a decode ``allocate_slots`` call reads
(``request_id``, ``num_prompt_tokens``, ``num_computed_tokens``, ``_all_token_ids``), the ones
a call that fills a block reads as well (``block_hashes`` and the fields that give its events
extra keys: ``lora_request``, ``cache_salt``, ``mm_features``, ``prompt_embeds``), and the ones
its append reads (``_output_token_ids``, ``_block_hasher``). kvcore's manager reads slots at
fixed offsets in the object, with no dict lookup, so no manager call reads the instance dict;
its native base (``kvcore._native.PlainRequestBase``) is where the manager keeps the request's
table key and slot hints, as kvcore's own ``kvcore.request.Request`` keeps them in its native
base. A decode call of such a request reads the request object and the field values only, as
one of kvcore's own requests does (the README's request-decode figures); the base holds the
token list once a call has checked it, and the list's length is read only when a call's answer
depends on it. Python code reads and writes slots at least as fast as dict attributes.

Its ``append_output_token_ids`` (the scheduler calls it for every new token) is vLLM's, run
natively by the base: the same list appends or extends in the same order, then
``update_block_hashes``'s work, except that kvcore's own block hasher is not called when the
request has no new full block (it would return no hashes). A subclass gets vLLM's Python
method. The base also notes, for the request its append served just before, where this one's
object and lists are, and each append prefetches what its own base noted: a scheduler appends
in the same order every step (docs/behaviour.md §17; an address, never a reference).

Its constructor is vLLM's, after which it reserves room in ``_all_token_ids`` for
``min(max_tokens, len(_all_token_ids) - 3)`` more tokens (the list's items stay the same): each
of a request's first decode appends then writes into room the list already has, where vLLM's
list grows by an eighth at a time and copies itself to new memory every few dozen appends.
CPython keeps a list's room when it shrinks to no less than half of it (its room is a multiple
of four, hence the 3), so the room is made by extending the list and deleting the extension;
where it does not keep it (a short prompt), nothing changes but the room.

When kvcore's scheduler class is built, kvcore's ``vllm.general_plugins`` entry point has vLLM's
engine build its requests as this class (:mod:`kvcore.vllm.plugin`). A plain
``vllm.v1.request.Request`` still works everywhere, read from its instance dict.
"""

from __future__ import annotations

import functools
from itertools import repeat
from typing import Any

from vllm.v1.request import Request as VllmRequest

from kvcore._native import PlainRequestBase

__all__ = ["Request"]


class Request(VllmRequest, PlainRequestBase):  # type: ignore[misc]
    """``vllm.v1.request.Request``, its decode fields kept in slots and kvcore's per-request
    table key and hints in its native base (see the module)."""

    __slots__ = (
        "_all_token_ids",
        "_block_hasher",
        "_output_token_ids",
        "block_hashes",
        "cache_salt",
        "lora_request",
        "mm_features",
        "num_computed_tokens",
        "num_prompt_tokens",
        "prompt_embeds",
        "request_id",
    )

    # vLLM's signature for `inspect`.
    @functools.wraps(VllmRequest.__init__)  # type: ignore[misc]
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        tokens = self._all_token_ids
        n = len(tokens)
        room = min(self.max_tokens, n - 3)
        if room > 0:
            tokens.extend(repeat(0, room))
            del tokens[n:]

    append_output_token_ids = PlainRequestBase.append_output_token_ids


PlainRequestBase._serve_append(Request, VllmRequest.append_output_token_ids)
