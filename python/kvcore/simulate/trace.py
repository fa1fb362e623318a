"""The JSONL trace format of ``kvcore simulate --trace`` (see ``docs/trace-format.md``).

One JSON object per line, one request per object::

    {"id": "a", "arrival": 0, "prompt": [1, 2, 3], "output_len": 8}
    {"id": "b", "arrival": 4, "prompt_len": 900, "prefix_group": "sys", "prefix_len": 800,
     "output_len": 64}
    {"id": "c", "after": "a", "arrival": 2, "prompt": [1, 2, 3, 7, 7], "output_token_ids": [5]}

Every problem is reported as a :class:`TraceError` naming the line and the field.

:class:`TraceWorkload` checks a whole file first, keeping a few numbers per line, and reads
each line again (and generates its tokens) only when the simulation needs the request;
:func:`parse_trace` and :func:`load_trace` build every request at once.
"""

from __future__ import annotations

import json
import random
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcore.simulate.workload import (
    VOCAB_SIZE,
    RequestShape,
    RequestSpec,
    Workload,
    describe_request,
    release_order,
)

MAX_TOKEN_ID = 2**31 - 1
"""Largest token id a trace may contain."""

MAX_COUNT = 2**31 - 1
"""Largest ``arrival``, ``prompt_len``, ``prefix_len`` and ``output_len`` a trace may give."""

TOKEN_TYPE = "I" if array("I").itemsize >= 4 else "L"
"""Array type code of a trace's token ids (unsigned, at least 32 bits)."""

FIELDS: dict[str, str] = {
    "id": "request id (string); default: 'line<N>'",
    "arrival": "step of arrival (integer in [0, 2**31)); with 'after': steps to wait after it "
    "finishes",
    "after": "id of an earlier request this one waits for (a later conversation turn)",
    "prompt": "prompt token ids (non-empty list of integers in [0, 2**31))",
    "prompt_len": "prompt length (integer in [1, 2**31)), instead of 'prompt'",
    "prefix_group": "name of a shared-prefix group (with 'prompt_len')",
    "prefix_len": "tokens taken from the group's shared stream (0..prompt_len; default prompt_len)",
    "output_len": "number of tokens to generate (integer in [1, 2**31))",
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
        self._streams: dict[str, tuple[random.Random, array[int]]] = {}

    def take(self, group: str, n: int) -> array[int]:
        rng, toks = self._streams.setdefault(
            group, (random.Random(f"{self._seed}:group:{group}"), array(TOKEN_TYPE))
        )
        if len(toks) < n:
            draw = rng.randrange
            toks.extend([draw(VOCAB_SIZE) for _ in range(n - len(toks))])
        return toks[:n]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


_Err = Callable[[str | None, str], TraceError]


def _count(obj: dict[str, Any], key: str, lo: int, err: _Err) -> int:
    value = obj[key]
    if not _is_int(value) or value < lo:
        raise err(key, f"expected an integer >= {lo}, got {_short(value)}")
    if value > MAX_COUNT:
        raise err(key, f"expected an integer < 2**31, got {_short(value)}")
    return int(value)


def _token_list(value: Any, err: _Err, field: str) -> array[int]:
    if not isinstance(value, list) or not value:
        raise err(field, f"expected a non-empty list of token ids, got {_short(value)}")
    for i, tok in enumerate(value):
        if not _is_int(tok) or not 0 <= tok <= MAX_TOKEN_ID:
            raise err(field, f"item {i}: expected an integer in [0, 2**31), got {_short(tok)}")
    return array(TOKEN_TYPE, value)


@dataclass(slots=True)
class _Line:
    """One checked trace line: everything but the generated tokens."""

    rid: str
    arrival: int
    after: str | None
    prompt: array[int] | None
    prompt_len: int
    group: str | None
    prefix_len: int
    output: array[int] | None
    output_len: int


def _check(text: str, err: _Err, lineno: int, ids: dict[str, int] | None) -> _Line:
    """Checks one non-blank line; with ``ids`` (the ids of earlier lines), its references."""
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
    if ids is not None and rid in ids:
        raise err("id", f"duplicate request id {rid!r}")

    if "arrival" not in obj:
        raise err("arrival", "missing (the step at which the request arrives)")
    arrival = _count(obj, "arrival", 0, err)

    after = obj.get("after")
    if after is not None and (not isinstance(after, str) or (ids is not None and after not in ids)):
        raise err("after", f"expected the id of an earlier request, got {_short(after)}")

    if ("prompt" in obj) == ("prompt_len" in obj):
        raise err("prompt", "exactly one of 'prompt' and 'prompt_len' is required")
    prompt: array[int] | None = None
    group: str | None = None
    prefix_len = 0
    if "prompt" in obj:
        for key in ("prefix_group", "prefix_len"):
            if key in obj:
                raise err(key, "only allowed with 'prompt_len'")
        prompt = _token_list(obj["prompt"], err, "prompt")
        plen = len(prompt)
    else:
        plen = _count(obj, "prompt_len", 1, err)
        group = obj.get("prefix_group")
        if "prefix_len" in obj and group is None:
            raise err("prefix_len", "requires 'prefix_group'")
        if group is not None:
            if not isinstance(group, str) or not group:
                raise err("prefix_group", f"expected a non-empty string, got {_short(group)}")
            prefix_len = plen
            if "prefix_len" in obj:
                value = obj["prefix_len"]
                if not _is_int(value) or not 0 <= value <= plen:
                    raise err(
                        "prefix_len",
                        f"expected an integer in [0, prompt_len={plen}], got {_short(value)}",
                    )
                prefix_len = int(value)

    if "output_len" not in obj and "output_token_ids" not in obj:
        raise err("output_len", "missing ('output_len' or 'output_token_ids' is required)")
    output: array[int] | None = None
    if "output_token_ids" in obj:
        output = _token_list(obj["output_token_ids"], err, "output_token_ids")
    if "output_len" in obj:
        olen = _count(obj, "output_len", 1, err)
        if output is not None and olen != len(output):
            raise err("output_len", f"{olen} does not match the {len(output)} 'output_token_ids'")
    else:
        assert output is not None
        olen = len(output)
    return _Line(rid, arrival, after, prompt, plen, group, prefix_len, output, olen)


def _build(line: _Line, lineno: int, seed: int, groups: _GroupStreams) -> RequestSpec:
    """The request of a checked line, its generated tokens drawn."""
    prompt = line.prompt
    if prompt is None:
        prompt = groups.take(line.group, line.prefix_len) if line.group else array(TOKEN_TYPE)
        rng = random.Random(f"{seed}:prompt:{line.rid}")
        draw = rng.randrange
        prompt.extend([draw(VOCAB_SIZE) for _ in range(line.prompt_len - len(prompt))])
    output = line.output
    if output is None:
        rng = random.Random(f"{seed}:output:{line.rid}")
        draw = rng.randrange
        output = array(TOKEN_TYPE, [draw(VOCAB_SIZE) for _ in range(line.output_len)])
    return RequestSpec(line.rid, line.arrival, prompt, output, after=line.after, line=lineno)


def _errors(source: str, lineno: int) -> _Err:
    def err(field: str | None, message: str) -> TraceError:
        return TraceError(source, lineno, field, message)

    return err


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
    ids: dict[str, int] = {}
    for lineno, raw in enumerate(lines, start=1):
        text = raw.strip()
        if not text:
            continue
        line = _check(text, _errors(source, lineno), lineno, ids)
        ids[line.rid] = len(out)
        out.append(_build(line, lineno, seed, groups))
    return out


def load_trace(path: str | Path, seed: int = 0) -> list[RequestSpec]:
    """Reads a whole JSONL trace file into memory (see :class:`TraceWorkload` to stream it).

    Args:
        path: The file.
        seed: Seed of generated tokens (see :func:`parse_trace`).

    Returns:
        The requests in file order.

    Raises:
        TraceError: If a line is malformed.
        OSError: If the file cannot be read.
    """
    workload = TraceWorkload(path, seed=seed)
    return [spec for _, spec in sorted(workload.releases(), key=lambda item: item[0])]


class TraceWorkload(Workload):
    """A trace file as a workload: checked whole up front, then read as the run needs it.

    The check (every line, every field, as :func:`parse_trace` does) keeps per request its
    file offset, line number, id, arrival, the request it waits for and its sizes, a few
    dozen bytes; it generates no tokens. :meth:`releases` reads the lines again in release
    order and builds each request when the simulation pulls it.

    Args:
        path: The JSONL file.
        seed: Seed of generated tokens (see :func:`parse_trace`).

    Raises:
        TraceError: On the first malformed line (or a line that is not UTF-8).
        OSError: If the file cannot be read.
    """

    def __init__(self, path: str | Path, seed: int = 0) -> None:
        super().__init__()
        self.path = Path(path)
        self.seed = seed
        self._name = str(path)
        self._offsets = array("q")
        self._lines = array("q")
        self._ids: list[str] = []
        self._parents = array("q")
        self._arrivals = array("q")
        self._prompt_lens = array("q")
        self._output_lens = array("q")
        index: dict[str, int] = {}
        offset = 0
        with self.path.open("rb") as fh:
            for lineno, raw in enumerate(fh, start=1):
                start = offset
                offset += len(raw)
                text = self._decode(raw, lineno).strip()
                if not text:
                    continue
                line = _check(text, _errors(self._name, lineno), lineno, index)
                index[line.rid] = len(self._ids)
                self._offsets.append(start)
                self._lines.append(lineno)
                self._ids.append(line.rid)
                self._parents.append(-1 if line.after is None else index[line.after])
                self._arrivals.append(line.arrival)
                self._prompt_lens.append(line.prompt_len)
                self._output_lens.append(line.output_len)
        self._order = release_order(self._arrivals, self._parents)

    def _decode(self, raw: bytes, lineno: int) -> str:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise TraceError(
                self._name, lineno, None, f"not UTF-8 text (byte {exc.start + 1})"
            ) from None

    @property
    def source(self) -> str:
        return self._name

    def __len__(self) -> int:
        return len(self._ids)

    def shapes(self) -> Iterator[RequestShape]:
        for i, rid in enumerate(self._ids):
            yield RequestShape(
                describe_request(rid, self._lines[i]), self._prompt_lens[i], self._output_lens[i]
            )

    def releases(self) -> Iterator[tuple[int, RequestSpec]]:
        groups = _GroupStreams(self.seed)
        with self.path.open("rb") as fh:
            for i in self._order:
                lineno = self._lines[i]
                fh.seek(self._offsets[i])
                text = self._decode(fh.readline(), lineno).strip()
                err = _errors(self._name, lineno)
                line = _check(text, err, lineno, None) if text else None
                if (
                    line is None
                    or line.rid != self._ids[i]
                    or line.prompt_len != self._prompt_lens[i]
                    or line.output_len != self._output_lens[i]
                ):
                    raise err(None, "the file changed while it was being replayed")
                yield i, _build(line, lineno, self.seed, groups)
