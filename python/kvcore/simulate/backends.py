"""Backends of the simulator: kvcore and the reference behind one small adapter.

A backend builds the KV-cache configuration and specs of a model preset, initialises block
hashing (with a fixed ``NONE_HASH`` seed, so both backends produce the same hashes), builds the
``KVCacheManager`` and builds requests with the block hasher. Everything else the scheduler
does goes through the manager's public calls, which kvcore and the reference share.

Only :class:`KvcoreBackend` is imported by a default run; :class:`ReferenceBackend` imports
the reference (and torch) when it is built.
"""

from __future__ import annotations

import importlib
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import redirect_stdout
from dataclasses import dataclass
from typing import Any, Literal

from kvcore.hashing import python_hash_seed

GroupKind = Literal["full", "swa", "mamba"]

BACKENDS = ("kvcore", "reference")
"""Names accepted by :func:`make_backend`."""

MODEL_PRESETS = ("full", "hybrid-swa", "hybrid-mamba")
"""Model presets: full attention; full + sliding window; full + Mamba."""

REFERENCE_INSTALL = "install it with scripts/install-reference.sh from a kvcore checkout"
"""How to install the reference, for messages."""


def _first_line(exc: BaseException) -> str:
    """The first line of an exception's message (import errors can run over many lines)."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


@dataclass(slots=True, frozen=True)
class GroupSpec:
    """One KV-cache group of a model preset.

    Attributes:
        kind: ``full`` (full attention), ``swa`` (sliding window) or ``mamba``.
        block_size: Tokens per block.
        sliding_window: Window in tokens (``swa`` only).
    """

    kind: GroupKind
    block_size: int
    sliding_window: int | None = None


@dataclass(slots=True, frozen=True)
class ModelPreset:
    """The KV-cache groups of a simulated model.

    Attributes:
        name: One of :data:`MODEL_PRESETS`.
        groups: The groups in group-id order.
    """

    name: str
    groups: tuple[GroupSpec, ...]

    @property
    def block_size(self) -> int:
        """The scheduler (and hash) block size: every group uses the same one."""
        return self.groups[0].block_size


def model_preset(name: str, block_size: int, sliding_window: int = 1024) -> ModelPreset:
    """Builds a model preset.

    Args:
        name: One of :data:`MODEL_PRESETS`.
        block_size: Tokens per block, for every group.
        sliding_window: Window of the ``hybrid-swa`` sliding-window group.

    Returns:
        The preset.

    Raises:
        ValueError: On an unknown name or a non-positive size.
    """
    if block_size < 1:
        raise ValueError("block size must be >= 1")
    full = GroupSpec("full", block_size)
    if name == "full":
        return ModelPreset(name, (full,))
    if name == "hybrid-swa":
        if sliding_window < 1:
            raise ValueError("sliding window must be >= 1")
        return ModelPreset(name, (full, GroupSpec("swa", block_size, sliding_window)))
    if name == "hybrid-mamba":
        return ModelPreset(name, (full, GroupSpec("mamba", block_size)))
    raise ValueError(f"unknown model preset {name!r} (choose from {', '.join(MODEL_PRESETS)})")


@dataclass(slots=True, frozen=True)
class ManagerSettings:
    """What the manager is built with.

    Attributes:
        num_blocks: Blocks in the pool, the null block included.
        max_model_len: Longest sequence.
        max_num_batched_tokens: Token budget of one step.
        enable_caching: Prefix caching on or off.
        enable_events: KV-cache events on or off.
        watermark: Fraction of blocks kept free when admitting requests.
        hash_name: Block hash function name (``sha256``, ``sha256_cbor``, ``xxhash``,
            ``xxhash_cbor``).
        hash_seed: The ``PYTHONHASHSEED`` value ``NONE_HASH`` is derived from.
    """

    num_blocks: int
    max_model_len: int
    max_num_batched_tokens: int
    enable_caching: bool = True
    enable_events: bool = True
    watermark: float = 0.0
    hash_name: str = "sha256"
    hash_seed: str = "0"


class Backend(ABC):
    """A KV-cache manager implementation the scheduler can drive.

    Attributes:
        name: ``kvcore`` or ``reference``.
        WAITING: The request status of a new request.
        RUNNING: The status of a scheduled request.
        PREEMPTED: The status of a preempted request.
        FINISHED: The status of a request that finished by length.
        batch_calls: Whether the manager has ``allocate_slots_batch`` and requests can be
            appended with ``append_batch`` (kvcore's one-call-per-step extensions).
    """

    name: str
    WAITING: Any
    RUNNING: Any
    PREEMPTED: Any
    FINISHED: Any
    batch_calls: bool = False

    def append_batch(self, requests: list[Any], token_ids: list[int]) -> None:
        """Appends ``token_ids[i]`` to ``requests[i]`` (one call each unless overridden)."""
        for request, token in zip(requests, token_ids, strict=True):
            request.append_output_token_ids(token)

    @abstractmethod
    def build_manager(
        self,
        model: ModelPreset,
        settings: ManagerSettings,
        *,
        clock: Callable[[], float] | None = None,
    ) -> Any:
        """Initialises hashing and returns a fresh ``KVCacheManager``.

        Args:
            model: The KV-cache groups.
            settings: Pool size, limits and hashing.
            clock: kvcore only: the manager's clock (seconds) for pin and request TTLs; with
                it the manager is also given the requests' block-hash function, which
                ``pin_prefix`` needs. None: built as the reference builds it.

        Returns:
            The manager.

        Raises:
            ValueError: If the backend has no retention extensions and ``clock`` is given.
        """

    @abstractmethod
    def request_factory(
        self,
        request_id: str,
        prompt: list[int],
        max_tokens: int,
        *,
        retention_priority: int | None = None,
        retention_ttl_s: float | None = None,
    ) -> Callable[[], Any]:
        """Prepares a request so that building it costs only the manager-side work.

        Must be called after :meth:`build_manager`.

        Args:
            request_id: The id.
            prompt: Prompt token ids (the request may keep this list).
            max_tokens: Output length.
            retention_priority: kvcore only: the request's retention priority (None: the
                default).
            retention_ttl_s: kvcore only: its retention TTL in seconds (None: none).

        Returns:
            A callable that builds the request (and hashes its full blocks).

        Raises:
            ValueError: If the backend has no retention extensions and a retention value is
                given.
        """


class KvcoreBackend(Backend):
    """kvcore's ``KVCacheManager`` (Rust block pool)."""

    name = "kvcore"
    batch_calls = True

    def __init__(self) -> None:
        from kvcore import request

        # kvcore.hashing is imported by name while it is being written (typed as Any).
        self._hashing: Any = importlib.import_module("kvcore.hashing")
        self._request = request
        self._hasher: Callable[[Any], list[bytes]] | None = None
        status = request.RequestStatus
        self.WAITING = status.WAITING
        self.RUNNING = status.RUNNING
        self.PREEMPTED = status.PREEMPTED
        self.FINISHED = status.FINISHED_LENGTH_CAPPED

    def append_batch(self, requests: list[Any], token_ids: list[int]) -> None:
        """One native call for the whole step (``append_output_token_ids_batch``)."""
        self._request.append_output_token_ids_batch(requests, token_ids)

    def build_manager(
        self,
        model: ModelPreset,
        settings: ManagerSettings,
        *,
        clock: Callable[[], float] | None = None,
    ) -> Any:
        from kvcore import config, manager, specs

        hash_fn = self._hashing.get_hash_fn_by_name(settings.hash_name)
        with python_hash_seed(settings.hash_seed):
            self._hashing.init_none_hash(hash_fn)
        bs = model.block_size
        self._hasher = self._hashing.get_request_block_hasher(bs, hash_fn)
        groups = []
        for i, g in enumerate(model.groups):
            spec: Any
            if g.kind == "full":
                spec = specs.FullAttentionSpec(
                    block_size=g.block_size, num_kv_heads=1, head_size=64, dtype="float16"
                )
            elif g.kind == "swa":
                spec = specs.SlidingWindowSpec(
                    block_size=g.block_size,
                    num_kv_heads=1,
                    head_size=64,
                    dtype="float16",
                    sliding_window=g.sliding_window or 0,
                )
            else:
                spec = specs.MambaSpec(
                    block_size=g.block_size,
                    shapes=((64,),),
                    dtypes=("float16",),
                    mamba_cache_mode="all",
                )
            groups.append(config.KVCacheGroupSpec([f"layer{i}"], spec))
        cfg = config.KVCacheConfig(settings.num_blocks, [], groups)
        extensions: dict[str, Any] = {}
        if clock is not None:
            extensions = {"hash_fn": hash_fn, "clock": clock}
        return manager.KVCacheManager(
            cfg,
            max_model_len=settings.max_model_len,
            scheduler_block_size=bs,
            hash_block_size=bs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            enable_caching=settings.enable_caching,
            enable_kv_cache_events=settings.enable_events,
            watermark=settings.watermark,
            **extensions,
        )

    def request_factory(
        self,
        request_id: str,
        prompt: list[int],
        max_tokens: int,
        *,
        retention_priority: int | None = None,
        retention_ttl_s: float | None = None,
    ) -> Callable[[], Any]:
        cls = self._request.Request
        hasher = self._hasher
        if retention_priority is None and retention_ttl_s is None:

            def build() -> Any:
                return cls(request_id, prompt, max_tokens=max_tokens, block_hasher=hasher)

            return build

        def build_retained() -> Any:
            return cls(
                request_id,
                prompt,
                max_tokens=max_tokens,
                block_hasher=hasher,
                retention_priority=retention_priority,
                retention_ttl_s=retention_ttl_s,
            )

        return build_retained


class ReferenceBackend(Backend):
    """The reference implementation (vLLM 0.25.1's ``vllm.v1.core``); imports torch."""

    name = "reference"

    def __init__(self) -> None:
        # Imported by name so that type checking never needs the reference (or torch)
        # installed. The reference logs to stdout while importing: keep stdout clean (--json).
        try:
            with redirect_stdout(sys.stderr):
                torch = importlib.import_module("torch")
                sampling_params = importlib.import_module("vllm.sampling_params")
                hashing = importlib.import_module("vllm.utils.hashing")
                kv_cache_interface = importlib.import_module("vllm.v1.kv_cache_interface")
                request = importlib.import_module("vllm.v1.request")
                kv_cache_manager = importlib.import_module("vllm.v1.core.kv_cache_manager")
                kv_cache_utils = importlib.import_module("vllm.v1.core.kv_cache_utils")
        except ImportError as exc:
            raise BackendUnavailable(
                f"the reference (vLLM 0.25.1) is not installed ({_first_line(exc)}); "
                f"{REFERENCE_INSTALL}"
            ) from exc
        except Exception as exc:  # a broken installation fails in other ways too
            raise BackendUnavailable(
                f"the reference (vLLM 0.25.1) cannot be imported ({type(exc).__name__}: "
                f"{_first_line(exc)}); {REFERENCE_INSTALL}"
            ) from exc
        self._torch = torch
        self._sampling = sampling_params
        self._hashing = hashing
        self._iface = kv_cache_interface
        self._request = request
        self._mgr = kv_cache_manager
        self._utils = kv_cache_utils
        self._hasher: Callable[[Any], list[bytes]] | None = None
        status = request.RequestStatus
        self.WAITING = status.WAITING
        self.RUNNING = status.RUNNING
        self.PREEMPTED = status.PREEMPTED
        self.FINISHED = status.FINISHED_LENGTH_CAPPED

    def build_manager(
        self,
        model: ModelPreset,
        settings: ManagerSettings,
        *,
        clock: Callable[[], float] | None = None,
    ) -> Any:
        if clock is not None:
            raise ValueError("the reference has no pins or retention priorities (kvcore only)")
        hash_fn = self._hashing.get_hash_fn_by_name(settings.hash_name)
        with python_hash_seed(settings.hash_seed):
            self._utils.init_none_hash(hash_fn)
        bs = model.block_size
        self._hasher = self._utils.get_request_block_hasher(bs, hash_fn)
        iface = self._iface
        f16 = self._torch.float16
        groups = []
        for i, g in enumerate(model.groups):
            spec: Any
            if g.kind == "full":
                spec = iface.FullAttentionSpec(
                    block_size=g.block_size, num_kv_heads=1, head_size=64, dtype=f16
                )
            elif g.kind == "swa":
                spec = iface.SlidingWindowSpec(
                    block_size=g.block_size,
                    num_kv_heads=1,
                    head_size=64,
                    dtype=f16,
                    sliding_window=g.sliding_window,
                )
            else:
                spec = iface.MambaSpec(
                    block_size=g.block_size,
                    shapes=((64,),),
                    dtypes=(f16,),
                    mamba_cache_mode="all",
                )
            groups.append(iface.KVCacheGroupSpec([f"layer{i}"], spec))
        cfg = iface.KVCacheConfig(
            num_blocks=settings.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups
        )
        return self._mgr.KVCacheManager(
            cfg,
            max_model_len=settings.max_model_len,
            scheduler_block_size=bs,
            hash_block_size=bs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            enable_caching=settings.enable_caching,
            enable_kv_cache_events=settings.enable_events,
            watermark=settings.watermark,
        )

    def request_factory(
        self,
        request_id: str,
        prompt: list[int],
        max_tokens: int,
        *,
        retention_priority: int | None = None,
        retention_ttl_s: float | None = None,
    ) -> Callable[[], Any]:
        if retention_priority is not None or retention_ttl_s is not None:
            raise ValueError("the reference has no retention priorities (kvcore only)")
        cls = self._request.Request
        params = self._sampling.SamplingParams(max_tokens=max_tokens)
        hasher = self._hasher

        def build() -> Any:
            return cls(request_id, prompt, params, None, block_hasher=hasher)

        return build


class BackendUnavailable(RuntimeError):
    """The requested backend cannot be imported."""


def make_backend(name: str) -> Backend:
    """Returns a backend by name.

    Args:
        name: One of :data:`BACKENDS`.

    Returns:
        A new backend.

    Raises:
        BackendUnavailable: If its implementation cannot be imported.
        ValueError: On an unknown name.
    """
    if name == "kvcore":
        try:
            return KvcoreBackend()
        except ImportError as exc:  # pragma: no cover - only while kvcore is incomplete
            raise BackendUnavailable(f"kvcore's manager is not importable ({exc})") from exc
    if name == "reference":
        return ReferenceBackend()
    raise ValueError(f"unknown backend {name!r} (choose from {', '.join(BACKENDS)})")
