"""Instruction counts of one workload under two Python interpreters (two kvcore builds), by
callgrind: repeatable on a noisy machine where wall-clock times drift by tens of percent.

Each workload of ``retention_workload.py`` (``--runner``) runs under ``valgrind
--tool=callgrind`` twice per interpreter, for a small and a large number of iterations; the
difference of the two runs' totals, divided by the difference of their iteration counts, is the
cost of one iteration with the interpreter's start, the imports and the setup cancelled out.
The same difference per native method (every function whose name matches ``--functions``,
by default pyo3's ``__pymethod_*__`` wrappers: the whole Rust side of one call, argument
conversion included) gives instructions per call.

Usage::

    python benches/compare_instructions.py OLD_PY NEW_PY pool-off manager-off
    python benches/compare_instructions.py PY PY pool-off/churn_16:pool-on/churn_16

``OLD_PY`` / ``NEW_PY`` are interpreters with the two kvcore builds installed (e.g. a venv with
the previous commit's wheel, and the working tree's). A workload is a name of
``retention_workload.WORKLOADS``, a prefix of names (``pool-off`` is every ``pool-off/...``),
or ``BASE:NEW`` to run a different workload on the new side (the cost of turning a feature on,
on one interpreter). Results are printed and, with ``--json``, written to a file.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from retention_workload import WORKLOADS  # noqa: E402

_HASH_SUFFIX = re.compile(r"::h[0-9a-f]{16}$")


@dataclass
class Profile:
    """One callgrind run: the total, and calls and inclusive instructions per function."""

    total: int
    iters: int
    functions: dict[str, tuple[int, int]] = field(default_factory=dict)
    result: dict[str, Any] = field(default_factory=dict)


def parse_callgrind(path: Path, pattern: re.Pattern[str]) -> tuple[int, dict[str, list[int]]]:
    """The total ``Ir`` and, for each function matching ``pattern``, ``[calls, inclusive Ir]``.

    Inclusive cost is the function's own cost plus that of the calls it makes, as callgrind
    records them (call lines carry the callee's inclusive cost); call counts sum every call
    line naming the function. Needs the default output (``positions: line``, ``events: Ir``).
    """
    names: dict[str, str] = {}
    out: dict[str, list[int]] = {}
    total = 0
    current: list[int] | None = None
    callee: str | None = None

    def name_of(spec: str) -> str:
        spec = spec.strip()
        if spec.startswith("("):
            ident, _, rest = spec.partition(")")
            rest = rest.strip()
            if rest:
                names[ident] = _HASH_SUFFIX.sub("", rest)
            return names[ident]
        return _HASH_SUFFIX.sub("", spec)

    with path.open() as f:
        for line in f:
            c = line[:1]
            if c.isdigit() or c in "+-*":
                parts = line.split()
                cost = int(parts[1]) if len(parts) > 1 else 0
                if current is not None:
                    current[1] += cost
                continue
            if line.startswith("fn="):
                name = name_of(line[3:])
                current = out.setdefault(name, [0, 0]) if pattern.search(name) else None
            elif line.startswith("cfn="):
                callee = name_of(line[4:])
            elif line.startswith("calls="):
                if callee is not None and pattern.search(callee):
                    out.setdefault(callee, [0, 0])[0] += int(line[6:].split()[0])
            elif line.startswith(("totals:", "summary:")):
                total = int(line.split()[1])
    return total, out


def python_executable(python: str) -> str:
    """The interpreter binary itself (valgrind must not trace a wrapper such as a pyenv shim);
    a virtual environment's ``bin/python`` is kept, so that it still finds its packages."""
    exe = subprocess.run(
        [python, "-c", "import sys; print(sys.executable)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    return exe or python


def run_callgrind(
    python: str, runner: Path, workload: str, iters: int, pattern: re.Pattern[str], tmp: Path
) -> Profile:
    """One callgrind run of ``runner WORKLOAD ITERS`` under ``python``."""
    out = tmp / f"cg.{abs(hash((python, workload, iters)))}.out"
    env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={out}",
            python,
            str(runner),
            workload,
            str(iters),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp,
    )
    if proc.returncode != 0:
        raise SystemExit(
            f"{python} {runner.name} {workload} {iters} failed:\n{proc.stdout}\n{proc.stderr}"
        )
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    result: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    total, fns = parse_callgrind(out, pattern)
    out.unlink()
    done = int(result.get("steps", result.get("iters", iters)))
    return Profile(total, done, {k: (v[0], v[1]) for k, v in fns.items()}, result)


@dataclass
class Side:
    """One side's cost per iteration, and per call of each native method."""

    python: str
    workload: str
    per_iter: float
    iters: int
    methods: dict[str, tuple[float, float]]
    """name -> (calls per iteration, instructions per call)."""
    result: dict[str, Any]


def per_iteration(small: Profile, big: Profile, python: str, workload: str) -> Side:
    """The cost of the iterations ``big`` ran beyond ``small``."""
    di = big.iters - small.iters
    if di <= 0:
        raise SystemExit(f"{workload}: the large run did no more iterations than the small one")
    methods: dict[str, tuple[float, float]] = {}
    for name, (calls, incl) in big.functions.items():
        c0, i0 = small.functions.get(name, (0, 0))
        if calls > c0:
            methods[name] = ((calls - c0) / di, (incl - i0) / (calls - c0))
    return Side(python, workload, (big.total - small.total) / di, di, methods, big.result)


def expand(spec: str) -> list[tuple[str, str]]:
    """``NAME``, a prefix of names, or ``BASE:NEW`` -> (base workload, new workload) pairs."""
    if ":" in spec:
        base, new = spec.split(":", 1)
        return [(base, new)]
    names = [w for w in WORKLOADS if w == spec or w.startswith(spec + "/")]
    if not names:
        raise SystemExit(f"unknown workload {spec!r}; one of: {', '.join(WORKLOADS)}")
    return [(n, n) for n in names]


def _short(name: str) -> str:
    m = re.search(r"(\w+)::__pymethod_(\w+?)__$", name)
    return f"{m.group(1)}.{m.group(2)}" if m else name


def report(base: Side, new: Side) -> str:
    """A table of one comparison."""
    label = base.workload if base.workload == new.workload else f"{base.workload} -> {new.workload}"
    unit = "step" if "steps" in base.result else "iteration"
    lines = [
        f"{label} ({base.iters} / {new.iters} {unit}s)",
        f"  {'':44s} {'base Ir':>14s} {'new Ir':>14s} {'new/base':>9s}",
        f"  {'whole ' + unit:44s} {base.per_iter:14,.0f} {new.per_iter:14,.0f} "
        f"{new.per_iter / base.per_iter:9.4f}",
    ]
    counted = [sum(c * i for c, i in side.methods.values()) for side in (base, new)]
    if counted[0]:
        lines.append(
            f"  {'counted functions, per ' + unit:44s} {counted[0]:14,.0f} {counted[1]:14,.0f} "
            f"{counted[1] / counted[0]:9.4f}"
        )
    for name in sorted(set(base.methods) | set(new.methods)):
        bc, bi = base.methods.get(name, (0.0, 0.0))
        nc, ni = new.methods.get(name, (0.0, 0.0))
        ratio = f"{ni / bi:9.4f}" if bi else f"{'-':>9s}"
        lines.append(
            f"  {_short(name) + f' per call ({bc:.3g} / {nc:.3g} calls/{unit})':44s} "
            f"{bi:14,.0f} {ni:14,.0f} {ratio}"
        )
    for key in ("checksum", "hit_tokens", "preemptions"):
        if key in base.result or key in new.result:
            lines.append(f"  {key}: {base.result.get(key)} / {new.result.get(key)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Command line: see the module docstring."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base_python")
    ap.add_argument("new_python")
    ap.add_argument("workloads", nargs="+")
    ap.add_argument("--runner", type=Path, default=HERE / "retention_workload.py")
    ap.add_argument(
        "--iters",
        type=int,
        nargs=2,
        metavar=("SMALL", "LARGE"),
        help="iteration counts of the two runs (default: the workload's own)",
    )
    ap.add_argument("--functions", default=r"__pymethod_", help="regex of the functions counted")
    ap.add_argument("--jobs", type=int, default=2, help="callgrind runs at a time")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)
    pattern = re.compile(args.functions)
    pys = {"base": python_executable(args.base_python), "new": python_executable(args.new_python)}
    pairs = [p for spec in args.workloads for p in expand(spec)]
    runner = args.runner.resolve()
    jobs: list[tuple[str, str, int]] = []
    for base_w, new_w in pairs:
        for side, w in (("base", base_w), ("new", new_w)):
            small, large = args.iters or WORKLOADS[w]
            jobs.extend((side, w, n) for n in (small, large))
    with tempfile.TemporaryDirectory() as d, ThreadPoolExecutor(args.jobs) as ex:
        futures = {
            key: ex.submit(run_callgrind, pys[key[0]], runner, key[1], key[2], pattern, Path(d))
            for key in dict.fromkeys(jobs)
        }
        profiles = {k: f.result() for k, f in futures.items()}
    out: list[dict[str, Any]] = []
    for base_w, new_w in pairs:
        sides = []
        for side, w in (("base", base_w), ("new", new_w)):
            small, large = args.iters or WORKLOADS[w]
            sides.append(
                per_iteration(profiles[(side, w, small)], profiles[(side, w, large)], pys[side], w)
            )
        print(report(*sides) + "\n", flush=True)
        out.append(
            {
                "base": vars(sides[0]),
                "new": vars(sides[1]),
                "ratio": sides[1].per_iter / sides[0].per_iter,
            }
        )
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
