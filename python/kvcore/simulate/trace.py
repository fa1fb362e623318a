"""The JSONL trace format of ``kvcore simulate --trace`` (see ``docs/trace-format.md``).

One JSON object per line, one request per object::

    {"id": "a", "arrival": 0, "prompt": [1, 2, 3], "output_len": 8}
    {"id": "b", "arrival": 4, "prompt_len": 900, "prefix_group": "sys", "prefix_len": 800,
     "output_len": 64}
    {"id": "c", "after": "a", "arrival": 2, "prompt": [1, 2, 3, 7, 7], "output_token_ids": [5]}

Every problem is reported as a :class:`TraceError` naming the line and the field.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kvcore.simulate.workload import VOCAB_SIZE, RequestSpec

MAX_TOKEN_ID = 2**31 - 1
"""Largest token id a trace may contain."""

FIELDS: dict[str, str] = {
    "id": "request id (string); default: 'line<N>'",
    "arrival": "step of arrival (integer >= 0); with 'after': steps to wait after it finishes",
    "after": "id of an earlier request this one waits for (a later conversation turn)",
    "prompt": "prompt token ids (non-empty list of integers in [0, 2**31))",
    "prompt_len": "prompt length (integer >= 1), instead of 'prompt'",
    "prefix_group": "name of a shared-prefix group (with 'prompt_len')",
    "prefix_len": "tokens taken from the group's shared stream (0..prompt_len; default prompt_len)",
    "output_len": "number of tokens to generate (integer >= 1)",
    "output_token_ids": "the generated token ids (non-empty list), instead of or with 'output_len'",
}
"""Every field a trace line may carry, with its meaning."""


class TraceError(ValueError):
    """A malformed trace: the message names the file, the line and the field.

    Attributes:
        line: 1-based line number.
        field: The offending field, or None when the line as a whole is wrong.
    """

    def __init__(self, source: str, line: int, field: str | None, message: str) -> None:
        where = f"{source}:{line}"
        what = f"field {field!r}: " if field is not None else ""
        super().__init__(f"{where}: {what}{message}")
        self.line = line
        self.field = field


class _GroupStreams:
    """Deterministic token streams, one per shared-prefix group, extended on demand."""

    def __init__(self, seed: int) -> None:
        self._seed = seed
        self._streams: dict[str, tuple[random.Random, list[int]]] = {}

    def take(self, group: str, n: int) -> tuple[int, ...]:
        rng, toks = self._streams.setdefault(
            group, (random.Random(f"{self._seed}:group:{group}"), [])
        )
        while len(toks) < n:
            toks.append(rng.randrange(VOCAB_SIZE))
        return tuple(toks[:n])


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_list(value: Any, err: Any, field: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not value:
        raise err(field, f"expected a non-empty list of token ids, got {_short(value)}")
    for i, tok in enumerate(value):
        if not _is_int(tok) or not 0 <= tok <= MAX_TOKEN_ID:
            raise err(field, f"item {i}: expected an integer in [0, 2**31), got {_short(tok)}")
    return tuple(value)


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def parse_trace(lines: Iterable[str], seed: int = 0, source: str = "<trace>") -> list[RequestSpec]:
    """Parses trace lines into requests.

    Blank lines are skipped. Generated tokens (for ``prompt_len`` and ``output_len``) are
    drawn from streams seeded by ``seed`` and the group name or request id, so the same trace
    and seed always give the same tokens.

    Args:
        lines: The lines of the file.
        seed: Seed of generated tokens.
        source: File name used in error messages.

    Returns:
        The requests in file order.

    Raises:
        TraceError: On the first malformed line.
    """
    groups = _GroupStreams(seed)
    out: list[RequestSpec] = []
    ids: set[str] = set()
    for lineno, raw in enumerate(lines, start=1):
        text = raw.strip()
        if not text:
            continue

        def err(field: str | None, message: str, _n: int = lineno) -> TraceError:
            return TraceError(source, _n, field, message)

        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise err(None, f"invalid JSON: {exc.msg} (column {exc.colno})") from None
        if not isinstance(obj, dict):
            raise err(None, f"expected a JSON object, got {_short(obj)}")
        for key in obj:
            if key not in FIELDS:
                raise err(key, f"unknown field (known: {', '.join(FIELDS)})")

        rid = obj.get("id", f"line{lineno}")
        if not isinstance(rid, str) or not rid:
            raise err("id", f"expected a non-empty string, got {_short(rid)}")
        if rid in ids:
            raise err("id", f"duplicate request id {rid!r}")

        if "arrival" not in obj:
            raise err("arrival", "missing (the step at which the request arrives)")
        arrival = obj["arrival"]
        if not _is_int(arrival) or arrival < 0:
            raise err("arrival", f"expected an integer >= 0, got {_short(arrival)}")

        after = obj.get("after")
        if after is not None and (not isinstance(after, str) or after not in ids):
            raise err("after", f"expected the id of an earlier request, got {_short(after)}")

        if ("prompt" in obj) == ("prompt_len" in obj):
            raise err("prompt", "exactly one of 'prompt' and 'prompt_len' is required")
        if "prompt" in obj:
            for key in ("prefix_group", "prefix_len"):
                if key in obj:
                    raise err(key, "only allowed with 'prompt_len'")
            prompt = _token_list(obj["prompt"], err, "prompt")
        else:
            plen = obj["prompt_len"]
            if not _is_int(plen) or plen < 1:
                raise err("prompt_len", f"expected an integer >= 1, got {_short(plen)}")
            group = obj.get("prefix_group")
            if "prefix_len" in obj and group is None:
                raise err("prefix_len", "requires 'prefix_group'")
            shared: tuple[int, ...] = ()
            if group is not None:
                if not isinstance(group, str) or not group:
                    raise err("prefix_group", f"expected a non-empty string, got {_short(group)}")
                prefix_len: Any = obj.get("prefix_len", plen)
                if not _is_int(prefix_len) or not 0 <= prefix_len <= plen:
                    raise err(
                        "prefix_len",
                        f"expected an integer in [0, prompt_len={plen}], got {_short(prefix_len)}",
                    )
                shared = groups.take(group, prefix_len)
            rng = random.Random(f"{seed}:prompt:{rid}")
            prompt = shared + tuple(rng.randrange(VOCAB_SIZE) for _ in range(plen - len(shared)))

        if "output_len" not in obj and "output_token_ids" not in obj:
            raise err("output_len", "missing ('output_len' or 'output_token_ids' is required)")
        output: tuple[int, ...]
        if "output_token_ids" in obj:
            output = _token_list(obj["output_token_ids"], err, "output_token_ids")
        if "output_len" in obj:
            olen = obj["output_len"]
            if not _is_int(olen) or olen < 1:
                raise err("output_len", f"expected an integer >= 1, got {_short(olen)}")
            if "output_token_ids" in obj:
                if olen != len(output):
                    raise err(
                        "output_len",
                        f"{olen} does not match the {len(output)} 'output_token_ids'",
                    )
            else:
                rng = random.Random(f"{seed}:output:{rid}")
                output = tuple(rng.randrange(VOCAB_SIZE) for _ in range(olen))

        ids.add(rid)
        out.append(RequestSpec(rid, arrival, prompt, output, after=after, line=lineno))
    return out


def load_trace(path: str | Path, seed: int = 0) -> list[RequestSpec]:
    """Reads a JSONL trace file.

    Args:
        path: The file.
        seed: Seed of generated tokens (see :func:`parse_trace`).

    Returns:
        The requests in file order.

    Raises:
        TraceError: If a line is malformed.
        OSError: If the file cannot be read.
    """
    p = Path(path)
    with p.open(encoding="utf-8") as fh:
        return parse_trace(fh, seed=seed, source=str(p))
