"""Cache control in ``kvcore simulate``: pinned system prompts and retention priorities.

Both are kvcore extensions of the reference's manager (see ``KVCacheManager.pin_prefix`` and
the ``retention_priority`` / ``retention_ttl_s`` attributes of ``kvcore.Request``):

- ``--pin-system-prompts [TTL]``: once a request's system prompt is computed (its blocks
  cached), the simulator pins the prompt's full blocks with ``pin_prefix``. Without a TTL a
  system prompt stays pinned for the rest of the run; with one, every request that uses the
  prompt pins it again (which refreshes the TTL), so a prompt loses its pin after TTL simulated
  seconds without a request.
- ``--priority-mix [MIX]``: every conversation (a first request and the later turns that wait
  for it) draws a tier from the mix, seeded; its requests carry the tier's priority (and TTL)
  and their freed blocks are evicted lowest priority first.

Time is simulated: the manager's clock reads :data:`STEP_SECONDS` per scheduler step (idle
stretches between arrivals included), so runs are deterministic.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcore.errors import InvalidArgumentError

STEP_SECONDS = 0.05
"""Simulated seconds per scheduler step (the manager's clock, for pin and request TTLs)."""

MAX_TTL_S = 1e9
"""Largest TTL the options accept, in simulated seconds."""
MAX_TTL_TEXT = "10**9"
"""How messages write :data:`MAX_TTL_S`."""

DEFAULT_PRIORITY_MIX = "90:0.2,50:0.6,10:0.2"
"""The mix ``--priority-mix`` uses without a value: 20 % high (90), 60 % default (50), 20 %
low (10), no TTLs."""


@dataclass(slots=True, frozen=True)
class PriorityTier:
    """One tier of a priority mix.

    Attributes:
        priority: ``retention_priority`` of the tier's requests (0..100, higher kept longer).
        share: The tier's fraction of the conversations (the mix's shares sum to 1).
        ttl_s: ``retention_ttl_s`` of the tier's requests (simulated seconds), or None.
    """

    priority: int
    share: float
    ttl_s: float | None = None

    def describe(self) -> str:
        """The tier as the mix syntax writes it (``PRIORITY:SHARE[:TTL]``)."""
        text = f"{self.priority}:{self.share:g}"
        return text if self.ttl_s is None else f"{text}:{self.ttl_s:g}"


def describe_mix(mix: Sequence[PriorityTier]) -> str:
    """A mix in the syntax :func:`parse_priority_mix` reads."""
    return ",".join(tier.describe() for tier in mix)


def parse_priority_mix(text: str) -> tuple[PriorityTier, ...]:
    """Reads a priority mix: comma-separated ``PRIORITY:SHARE[:TTL]`` tiers.

    ``PRIORITY`` is an integer in [0, 100], ``SHARE`` a number in (0, 1] (the shares sum to 1),
    ``TTL`` a number of simulated seconds in [0, 10**9]. No priority may appear twice.

    Args:
        text: The mix, e.g. ``90:0.2,50:0.6,10:0.2`` or ``90:0.3:60,10:0.7``.

    Returns:
        The tiers, in the order given.

    Raises:
        ValueError: With a message naming the faulty tier.
    """
    if not text.strip():
        raise ValueError(f"expected PRIORITY:SHARE[:TTL] tiers separated by commas, got {text!r}")
    tiers: list[PriorityTier] = []
    for item in text.split(","):
        parts = item.strip().split(":")
        if len(parts) not in (2, 3):
            raise ValueError(f"expected a tier PRIORITY:SHARE[:TTL], got {item.strip()!r}")
        try:
            priority = int(parts[0])
        except ValueError:
            priority = -1
        if not 0 <= priority <= 100:
            raise ValueError(
                f"tier {item.strip()!r}: expected a priority in [0, 100], got {parts[0]!r}"
            )
        share = _float(parts[1])
        if not 0.0 < share <= 1.0:
            raise ValueError(f"tier {item.strip()!r}: expected a share in (0, 1], got {parts[1]!r}")
        ttl: float | None = None
        if len(parts) == 3:
            ttl = _float(parts[2])
            if not 0.0 <= ttl <= MAX_TTL_S:
                raise ValueError(
                    f"tier {item.strip()!r}: expected a TTL in [0, {MAX_TTL_TEXT}] seconds, "
                    f"got {parts[2]!r}"
                )
        if any(t.priority == priority for t in tiers):
            raise ValueError(f"priority {priority} appears twice")
        tiers.append(PriorityTier(priority, share, ttl))
    total = math.fsum(t.share for t in tiers)
    if abs(total - 1.0) > 1e-9:
        raise ValueError(f"the shares sum to {total:g}, not 1")
    return tuple(tiers)


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan


@dataclass(slots=True, frozen=True)
class RetentionSettings:
    """What ``--pin-system-prompts`` and ``--priority-mix`` ask for.

    Attributes:
        pin_system_prompts: Pin the synthetic workload's system prompts.
        pin_ttl_s: TTL of those pins in simulated seconds (None: no limit).
        priority_mix: Tiers conversations draw from (empty: every request at the default
            priority).
        seed: Seed of the tier draws (the workload's seed).
        enforce: False: nothing is pinned and requests keep the default priority; the tiers
            are drawn only to count hit rates per tier (the plain-LRU run of
            ``--compare lru``).
    """

    pin_system_prompts: bool = False
    pin_ttl_s: float | None = None
    priority_mix: tuple[PriorityTier, ...] = ()
    seed: int = 0
    enforce: bool = True

    def describe(self) -> str:
        """A short description for the summary header."""
        parts = []
        if self.pin_system_prompts:
            ttl = "" if self.pin_ttl_s is None else f" (TTL {self.pin_ttl_s:g} s)"
            parts.append(f"system prompts pinned{ttl}")
        if self.priority_mix:
            parts.append(f"priority mix {describe_mix(self.priority_mix)}")
        return ", ".join(parts) if parts else "no pins, no priorities"


class PriorityTiers:
    """Draws each conversation's tier (seeded) as requests are pulled from the workload.

    A request without ``after`` draws a tier; a request that waits for another takes that
    request's tier. Tiers are kept from a request's pull to its construction only (the later
    turns of a conversation are pulled right after its first request).

    Args:
        mix: The tiers.
        seed: Seed of the draws.
    """

    def __init__(self, mix: Sequence[PriorityTier], seed: int) -> None:
        self.mix = tuple(mix)
        self._rng = random.Random(f"{seed}:priority-mix")
        self._weights = [t.share for t in self.mix]
        self._tier: dict[str, int] = {}
        self._parent: dict[str, int] = {}
        self.requests = [0] * len(self.mix)
        """Requests built in each tier, in the order of the mix."""
        self.hit_tokens = [0] * len(self.mix)
        """Prefix-hit tokens at first admissions, per tier."""
        self.query_tokens = [0] * len(self.mix)
        """Prompt tokens at first admissions, per tier."""

    def pulled(self, request_id: str, after: str | None) -> None:
        """Notes a request taken from the workload (its parent, if any, was pulled before)."""
        if after is not None and after in self._parent:
            tier = self._parent[after]
        else:
            tier = self._rng.choices(range(len(self.mix)), self._weights)[0]
        self._tier[request_id] = tier
        self._parent[request_id] = tier

    def take(self, request_id: str) -> int:
        """The tier (an index into :attr:`mix`) of a request about to be built (each request
        once)."""
        tier = self._tier.pop(request_id)
        self.requests[tier] += 1
        return tier

    def admitted(self, tier: int, hit_tokens: int, prompt_tokens: int) -> None:
        """Counts a first admission of a request of ``tier``."""
        self.hit_tokens[tier] += hit_tokens
        self.query_tokens[tier] += prompt_tokens

    def hit_rates(self) -> list[float]:
        """Hit tokens over prompt tokens at first admissions, per tier (0 when none)."""
        return [
            h / q if q else 0.0 for h, q in zip(self.hit_tokens, self.query_tokens, strict=True)
        ]

    def finished(self, request_id: str) -> None:
        """Forgets a finished request (every request waiting for it was pulled already)."""
        self._parent.pop(request_id, None)


@dataclass(slots=True)
class _Prompt:
    tokens: list[int]
    blocks: int
    pinned: int = 0


@dataclass(slots=True)
class SystemPromptPins:
    """Pins the system prompts of the synthetic workload as their blocks get cached.

    Args:
        ttl_s: TTL of the pins (None: no limit; a prompt is pinned once and for good).
        block_size: The hash block size (only full blocks are pinned).

    Attributes:
        calls: ``pin_prefix`` calls made.
        refused: Calls the manager refused (the pinned fraction would exceed its limit).
        peak: Most blocks pinned at once, read after each step.
    """

    ttl_s: float | None
    block_size: int
    calls: int = 0
    refused: int = 0
    peak: int = 0
    _prompts: dict[str, _Prompt] = field(default_factory=dict)

    def prompt(self, group: str, prompt: Sequence[int], length: int) -> _Prompt:
        """The state of a system prompt (the first ``length`` tokens of ``prompt``)."""
        state = self._prompts.get(group)
        if state is None:
            tokens = [int(t) for t in prompt[:length]]
            state = self._prompts[group] = _Prompt(tokens, length // self.block_size)
        return state

    def pin(self, manager: Any, group: str, prompt: Sequence[int], length: int) -> int | None:
        """Pins a system prompt whose blocks a request has just had cached.

        Without a TTL a prompt already pinned whole is not pinned again.

        Returns:
            The number of blocks ``pin_prefix`` reported pinned, -1 if it refused, or None
            when no call was needed.
        """
        state = self.prompt(group, prompt, length)
        if state.blocks == 0 or (self.ttl_s is None and state.pinned >= state.blocks):
            return None
        self.calls += 1
        try:
            state.pinned = int(manager.pin_prefix(state.tokens, ttl_s=self.ttl_s))
        except InvalidArgumentError:  # over the manager's limit on pinned blocks
            self.refused += 1
            return -1
        return state.pinned


__all__ = [
    "DEFAULT_PRIORITY_MIX",
    "MAX_TTL_S",
    "MAX_TTL_TEXT",
    "STEP_SECONDS",
    "PriorityTier",
    "PriorityTiers",
    "RetentionSettings",
    "SystemPromptPins",
    "describe_mix",
    "parse_priority_mix",
]
