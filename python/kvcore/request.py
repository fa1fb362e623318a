"""Requests as the block manager sees them (SPEC §17, RH-2).

A :class:`Request` carries its tokens, the state the manager reads (REQ-1), the inputs of block
hashing (REQ-2) and its append-only ``block_hashes``. Build it with a block hasher (for example
``kvcore.hashing.get_request_block_hasher(hash_block_size, fn)``): the hasher runs when the
request is built and after every :meth:`Request.append_output_token_ids` (RH-2).

Examples:
    >>> r = Request("r1", [1, 2, 3])
    >>> r.num_tokens, r.num_prompt_tokens, r.status.name
    (3, 3, 'WAITING')
    >>> r.append_output_token_ids([4, 5])
    >>> r.num_tokens, list(r.output_token_ids)
    (5, [4, 5])
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvcore._native import RequestCore, append_output_token_ids_batch
from kvcore.errors import InvalidArgumentError

__all__ = ["BlockHasher", "Request", "RequestStatus", "append_output_token_ids_batch"]


class RequestStatus(enum.IntEnum):
    """Request status (REQ-3); a value above PREEMPTED means finished."""

    WAITING = 1
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR = 2
    WAITING_FOR_REMOTE_KVS = 3
    WAITING_FOR_STREAMING_REQ = 4
    RUNNING = 5
    PREEMPTED = 6
    FINISHED_STOPPED = 7
    FINISHED_LENGTH_CAPPED = 8
    FINISHED_ABORTED = 9
    FINISHED_IGNORED = 10
    FINISHED_ERROR = 11
    FINISHED_REPETITION = 12

    def __str__(self) -> str:
        return self.name

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        """Whether ``status`` is a finished status."""
        return status > RequestStatus.PREEMPTED


BlockHasher = Callable[[Any], Sequence[bytes]]
"""Returns the hashes of a request's new full hash blocks (RH-1)."""


def _prompt_length(prompt_token_ids: Sequence[int] | None, prompt_embeds: Any) -> int:
    n_ids = None if prompt_token_ids is None else len(prompt_token_ids)
    n_embeds = None if prompt_embeds is None else len(prompt_embeds)
    if n_ids is None:
        if n_embeds is None:
            raise InvalidArgumentError("neither prompt_token_ids nor prompt_embeds were given")
        return n_embeds
    if n_embeds is not None and n_embeds != n_ids:
        raise InvalidArgumentError(
            f"prompt_token_ids ({n_ids}) and prompt_embeds ({n_embeds}) differ in length"
        )
    return n_ids


class Request(RequestCore):
    """A generation request, as read by the KV cache manager and the block hasher.

    The fields every scheduler step touches (id, token counts and the prompt length, status,
    the token ids, block hashes) live in the native base ``kvcore._native.RequestCore``: the
    token ids are a native int64 buffer (token ids must be ints in that range),
    ``all_token_ids`` and ``output_token_ids`` are live read-only views of it,
    ``append_output_token_ids`` and block hashing run without Python ints, and kvcore's Rust
    manager reads the counts and a native copy of the hashes directly. Any object with the SPEC §17 attributes works with the manager
    as well.

    Attributes:
        request_id: Unique id.
        prompt_token_ids: The prompt, or None for an embeddings-only prompt.
        prompt_embeds: Prompt embeddings (a tensor) or None.
        num_prompt_tokens: Prompt length.
        num_computed_tokens: Tokens whose KV is computed; the scheduler maintains it.
        status: The request status (REQ-3).
        num_preemptions: Times the request was preempted.
        skip_reading_prefix_cache: Whether lookups are skipped (MGR-6).
        lora_request: None, or an object with ``lora_name``, ``name`` and ``adapter_id``.
        cache_salt: Salt mixed into the first block's hash, or None.
        mm_features: Multimodal features (``identifier``, ``mm_position.offset/.length``).
        block_hashes: Hashes of the full hash blocks, append-only (RH-2).
        spec_token_ids: Draft tokens proposed for the next step.
        max_tokens: Output token budget.
        sampling_params: Sampling parameters (duck-typed) or None.
        pooling_params: Pooling parameters (duck-typed) or None.
        priority: Scheduling priority.
        arrival_time: Arrival wall-clock time.
        client_index: Front-end client index.
        retention_priority: How long the request's cached blocks are kept once freed, 0..100
            (higher is kept longer); None counts as 50 (kvcore extension, CC-1).
        retention_ttl_s: Seconds after the free until those blocks become the next to evict,
            or None (kvcore extension, CC-2).
    """

    __slots__ = (
        "_prompt_embeds_per_block_hashes",
        "arrival_time",
        "cache_salt",
        "client_index",
        "is_prefill_chunk",
        "kv_transfer_params",
        "lora_request",
        "max_tokens",
        "mm_features",
        "num_output_placeholders",
        "num_preemptions",
        "pooling_params",
        "priority",
        "prompt_embeds",
        "prompt_is_token_ids",
        "prompt_token_ids",
        "retention_priority",
        "retention_ttl_s",
        "sampling_params",
        "skip_reading_prefix_cache",
        "spec_token_ids",
        "stop_reason",
        "trace_headers",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int] | None,
        sampling_params: Any = None,
        pooling_params: Any = None,
        client_index: int = 0,
        arrival_time: float | None = None,
        prompt_embeds: Any = None,
        prompt_is_token_ids: list[bool] | None = None,
        mm_features: list[Any] | None = None,
        lora_request: Any = None,
        cache_salt: str | None = None,
        priority: int = 0,
        trace_headers: Mapping[str, str] | None = None,
        block_hasher: BlockHasher | None = None,
        *,
        skip_reading_prefix_cache: bool | None = None,
        max_tokens: int | None = None,
        retention_priority: int | None = None,
        retention_ttl_s: float | None = None,
    ) -> None:
        """Builds a request and hashes its full prompt blocks.

        Args:
            request_id: Unique id.
            prompt_token_ids: Prompt token ids, or None when only embeddings are given.
            sampling_params: Sampling parameters (duck-typed: ``max_tokens``,
                ``skip_reading_prefix_cache``), or None.
            pooling_params: Pooling parameters (duck-typed), or None.
            client_index: Front-end client index.
            arrival_time: Arrival time; defaults to now.
            prompt_embeds: Prompt embeddings (a tensor of ``num_prompt_tokens`` rows), or None.
            prompt_is_token_ids: Per-position mask for mixed prompts, or None.
            mm_features: Multimodal features, or None.
            lora_request: LoRA request, or None.
            cache_salt: Cache salt, or None.
            priority: Scheduling priority.
            trace_headers: Tracing headers, or None.
            block_hasher: Called with the request to get new block hashes, or None.
            skip_reading_prefix_cache: Overrides the value taken from the parameters.
            max_tokens: Overrides the output budget taken from the parameters.
            retention_priority: Retention priority of the freed blocks (CC-1), or None.
            retention_ttl_s: Retention time to live in seconds (CC-2), or None.

        Raises:
            InvalidArgumentError: (a ValueError) no prompt, or prompt ids and embeddings of
                different lengths.
        """
        self.request_id = request_id
        self.client_index = client_index
        self.priority = priority
        self.sampling_params = sampling_params
        self.pooling_params = pooling_params
        self.lora_request = lora_request
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.kv_transfer_params: dict[str, Any] | None = None
        if max_tokens is None:
            if pooling_params is not None:
                max_tokens = 1
            else:
                max_tokens = getattr(sampling_params, "max_tokens", None)
        self.max_tokens = max_tokens

        self.prompt_token_ids = prompt_token_ids
        self.prompt_embeds = prompt_embeds
        self.prompt_is_token_ids = prompt_is_token_ids
        self._prompt_embeds_per_block_hashes: dict[tuple[int, int], bytes] = {}
        self.num_prompt_tokens = _prompt_length(prompt_token_ids, prompt_embeds)
        self._output_token_ids = []
        # Copied into the native token buffer (ints in the int64 range).
        self._all_token_ids = (
            prompt_token_ids if prompt_token_ids is not None else [0] * self.num_prompt_tokens
        )
        self.num_output_placeholders = 0
        self.spec_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.cache_salt = cache_salt
        self.mm_features: list[Any] = mm_features or []
        self.trace_headers = trace_headers
        self.is_prefill_chunk = False
        self.num_preemptions = 0
        self.retention_priority = retention_priority
        self.retention_ttl_s = retention_ttl_s

        if skip_reading_prefix_cache is None:
            skip_reading_prefix_cache = False
            for params in (sampling_params, pooling_params):
                value = getattr(params, "skip_reading_prefix_cache", None)
                if params is not None and value is not None:
                    skip_reading_prefix_cache = bool(value)
                    break
        self.skip_reading_prefix_cache = skip_reading_prefix_cache

        self.num_tokens = len(self._all_token_ids)
        """Prompt plus output tokens (kept equal to ``len(all_token_ids)``)."""
        self.block_hashes = []
        self._block_hasher = block_hasher
        # The hasher produces nothing until the next window is full; a hasher that says its
        # window size lets appends skip the call until then.
        hbs = getattr(block_hasher, "hash_block_size", None)
        self._hash_block_size = hbs if type(hbs) is int and 0 < hbs < 2**62 else None
        self._next_hash_at = 0
        self.update_block_hashes()

    @property
    def num_tokens_with_spec(self) -> int:
        """Tokens including the current draft tokens."""
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def num_encoder_inputs(self) -> int:
        """Multimodal inputs."""
        return len(self.mm_features)

    @property
    def has_encoder_inputs(self) -> bool:
        """Whether the request has multimodal inputs."""
        return bool(self.mm_features)

    def is_finished(self) -> bool:
        """Whether the request finished."""
        return bool(self.status > RequestStatus.PREEMPTED)

    def __lt__(self, other: Request) -> bool:
        if self.priority != other.priority:
            return self.priority < other.priority
        if self.arrival_time != other.arrival_time:
            return self.arrival_time < other.arrival_time
        if self.request_id != other.request_id:
            return self.request_id < other.request_id
        return id(self) < id(other)

    def __repr__(self) -> str:
        return (
            f"Request(request_id={self.request_id!r}, num_tokens={self.num_tokens}, "
            f"num_computed_tokens={self.num_computed_tokens}, status={self.status!s})"
        )
