"""Paired kvcore / reference benchmarks and their ratio table.

Every bench file in this directory measures the same operation twice in one run, once on
kvcore and once on the reference (vLLM 0.25.1), and this plugin reports the ratio.

Convention:
- A benchmark calls the ``paired`` fixture once:
  ``paired(group, impl, fn, per=..., unit="block", target=..., setup=None, rounds=None)``.
  ``group`` names the operation (``"pool: touch 256"``), ``impl`` is ``"kvcore"`` or
  ``"reference"``; the two sides of a pair share the group. ``per`` is how many units (blocks,
  lookups...) one call of ``fn`` handles, so times are reported per unit. ``target`` is the
  speed-up (reference time / kvcore time) the pair must reach. With ``setup`` the call is timed
  with ``benchmark.pedantic`` (one call per round, ``setup`` untimed before each round).
  Usually the bench is parametrized with ``impl`` in ``["kvcore", "reference"]`` and skips the
  reference side when it is not installed.
- A measurement that is not a time (memory per block) goes through ``record_metric(group,
  impl, value, unit, target=...)``; for those the ratio is reference / kvcore as well (so
  higher is better for kvcore whenever smaller values are better).

At the end of the session the plugin prints one table per bench module (median time per unit
of each side, the ratio, the target and whether it was met) and writes it to
``benches/results/<name>.json``, where ``<name>`` is the module name without ``test_bench_``
(``test_bench_pool.py`` -> ``results/pool.json``).

Run: ``python -m pytest benches/test_bench_pool.py --benchmark-only`` on a release build
(``maturin develop --release``).
"""

from __future__ import annotations

import json
import math
import platform
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest

RESULTS_DIR = Path(__file__).parent / "results"


@dataclass
class Entry:
    """One side of a pair."""

    module: str
    group: str
    impl: str
    value: float  # seconds per unit for timings, the metric itself otherwise
    unit: str
    kind: str  # "time" or a metric name
    target: float | None
    rounds: int | None = None


_ENTRIES: list[Entry] = []


def _module_name(request: pytest.FixtureRequest) -> str:
    name: str = request.node.module.__name__.rsplit(".", 1)[-1]
    return name.removeprefix("test_bench_")


@pytest.fixture
def paired(benchmark: Any, request: pytest.FixtureRequest) -> Iterator[Callable[..., Any]]:
    """Benchmarks one side of a kvcore/reference pair (see the module docstring)."""
    state: dict[str, Any] = {}

    def run(
        group: str,
        impl: str,
        fn: Callable[[], Any],
        *,
        per: int = 1,
        unit: str = "block",
        target: float | None = None,
        setup: Callable[[], Any] | None = None,
        rounds: int | None = None,
    ) -> Any:
        assert impl in ("kvcore", "reference"), impl
        benchmark.group = group
        benchmark.extra_info.update(impl=impl, per=per, unit=unit)
        state.update(group=group, impl=impl, per=per, unit=unit, target=target)
        if setup is not None:

            def wrapped_setup() -> tuple[tuple[()], dict[str, Any]]:
                setup()
                return (), {}

            return benchmark.pedantic(
                fn, setup=wrapped_setup, rounds=rounds or 200, iterations=1, warmup_rounds=1
            )
        if rounds is not None:
            return benchmark.pedantic(fn, rounds=rounds, iterations=1, warmup_rounds=1)
        return benchmark(fn)

    yield run
    stats = getattr(benchmark, "stats", None)
    if state and stats is not None:
        s = stats.stats
        _ENTRIES.append(
            Entry(
                module=_module_name(request),
                group=state["group"],
                impl=state["impl"],
                value=s.median / state["per"],
                unit=state["unit"],
                kind="time",
                target=state["target"],
                rounds=s.rounds,
            )
        )


@pytest.fixture
def record_metric(request: pytest.FixtureRequest) -> Callable[..., None]:
    """Records a non-time measurement of one side of a pair (see the module docstring)."""

    def record(
        group: str, impl: str, value: float, unit: str, *, target: float | None = None
    ) -> None:
        assert impl in ("kvcore", "reference"), impl
        _ENTRIES.append(
            Entry(
                module=_module_name(request),
                group=group,
                impl=impl,
                value=value,
                unit=unit,
                kind="metric",
                target=target,
            )
        )

    return record


def _fmt_time(seconds: float) -> str:
    for scale, suffix in ((1e-9, "ns"), (1e-6, "us"), (1e-3, "ms")):
        if seconds < scale * 1000:
            return f"{seconds / scale:.1f} {suffix}"
    return f"{seconds:.2f} s"


def _rows(entries: list[Entry]) -> list[dict[str, Any]]:
    groups: dict[str, dict[str, Entry]] = {}
    for e in entries:
        groups.setdefault(e.group, {})[e.impl] = e
    rows = []
    for group, sides in groups.items():
        k, r = sides.get("kvcore"), sides.get("reference")
        any_side = k or r
        assert any_side is not None
        ratio = (r.value / k.value) if (k and r and k.value > 0) else None
        target = (k and k.target) or (r and r.target) or None
        rows.append(
            {
                "group": group,
                "kind": any_side.kind,
                "unit": any_side.unit,
                "kvcore": k.value if k else None,
                "reference": r.value if r else None,
                "ratio": ratio,
                "target": target,
                "met": (ratio >= target) if (ratio is not None and target) else None,
            }
        )
    return rows


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Prints the ratio tables and writes ``benches/results/<name>.json``."""
    if not _ENTRIES:
        return
    by_module: dict[str, list[Entry]] = {}
    for e in _ENTRIES:
        by_module.setdefault(e.module, []).append(e)
    tr = terminalreporter
    for module, entries in by_module.items():
        rows = _rows(entries)
        tr.write_sep("=", f"kvcore vs reference: {module} (ratio = reference / kvcore)")
        header = f"{'case':<44} {'kvcore':>14} {'reference':>14} {'ratio':>9} {'target':>7}  met"
        tr.write_line(header)
        for row in rows:

            def cell(v: float | None, row: dict[str, Any] = row) -> str:
                if v is None:
                    return "-"
                if row["kind"] == "time":
                    return f"{_fmt_time(v)}/{row['unit']}"
                return f"{v:.1f} {row['unit']}"

            ratio = "-" if row["ratio"] is None else f"{row['ratio']:.1f}x"
            target = "-" if not row["target"] else f"{row['target']:g}x"
            met = {True: "yes", False: "NO", None: ""}[row["met"]]
            tr.write_line(
                f"{row['group']:<44} {cell(row['kvcore']):>14} {cell(row['reference']):>14} "
                f"{ratio:>9} {target:>7}  {met}"
            )
        RESULTS_DIR.mkdir(exist_ok=True)
        out = {
            "module": module,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": {"python": platform.python_version(), "platform": platform.platform()},
            "rows": [
                {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()}
                for r in rows
            ],
            "entries": [asdict(e) for e in entries],
        }
        path = RESULTS_DIR / f"{module}.json"
        path.write_text(json.dumps(out, indent=2) + "\n")
        tr.write_line(f"written {path}")
