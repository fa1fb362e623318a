"""Summaries of a simulation: the JSON object and the text table of ``kvcore simulate``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from kvcore.simulate.scheduler import Simulator


def percentile(values: Sequence[int], q: float) -> float:
    """Nearest-rank percentile.

    Args:
        values: The samples (any order).
        q: Fraction in ``[0, 1]``.

    Returns:
        The smallest sample with at least ``q`` of the samples at or below it; 0.0 when empty.
    """
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered)))
    return float(ordered[rank - 1])


def summarize(sim: Simulator, *, interrupted: bool = False) -> dict[str, Any]:
    """The figures of one run.

    Args:
        sim: The simulator, finished or interrupted.
        interrupted: Whether the run was cut short (Ctrl-C).

    Returns:
        A JSON-ready dict: ``backend``, ``requests`` (finished), ``requests_total``, ``steps``,
        ``prefix_hit_rate``, ``prefix_hit_rate_bound``, ``preemptions``, ``peak_usage``,
        ``mean_usage``, ``blocks_evicted`` (None with events off), ``kv_us_per_step_mean``,
        ``kv_us_per_step_p50``, ``kv_us_per_step_p99``, ``kv_seconds_total``,
        ``wall_seconds``, ``decisions_checksum`` and ``interrupted``; with cache control
        (``sim.retention``) also ``policy`` (``"retention"``) and ``retention`` (see
        :func:`retention_figures`).
    """
    st = sim.stats
    kv = st.kv_ns
    usage = st.sample_usage
    out = {
        "backend": sim.backend.name,
        "requests": st.finished,
        "requests_total": st.requests_total,
        "steps": st.steps,
        "prefix_hit_rate": st.hit_rate,
        "prefix_hit_rate_bound": sim.hit_rate_bound(),
        "preemptions": st.preemptions,
        "peak_usage": max(usage) if usage else 0.0,
        "mean_usage": sum(usage) / len(usage) if usage else 0.0,
        "blocks_evicted": st.blocks_evicted,
        "kv_us_per_step_mean": sum(kv) / len(kv) / 1e3 if kv else 0.0,
        "kv_us_per_step_p50": percentile(kv, 0.50) / 1e3,
        "kv_us_per_step_p99": percentile(kv, 0.99) / 1e3,
        "kv_seconds_total": sum(kv) / 1e9,
        "wall_seconds": st.wall_s,
        "decisions_checksum": sim.decisions_checksum,
        "interrupted": interrupted,
    }
    if sim.retention is not None:
        if sim.retention.enforce:
            out["policy"] = "retention"
        out["retention"] = retention_figures(sim)
    return out


def retention_figures(sim: Simulator) -> dict[str, Any]:
    """The cache-control figures of a run with ``sim.retention`` set.

    Returns:
        ``pinned_blocks_peak`` and ``pinned_blocks_mean`` (None without pinned system
        prompts), ``pin_calls`` and ``pins_refused`` (``pin_prefix`` calls, and those refused
        for the manager's limit on pinned blocks), ``requests_by_priority`` and
        ``hit_rate_by_priority`` (requests built, and their prefix hit rate, per tier
        priority, keyed by the priority as a string; empty without a priority mix).
    """
    pins = sim.pins
    tiers = sim.tiers
    pinned = sim.stats.sample_pinned
    by_priority: dict[str, int] = {}
    hit_by_priority: dict[str, float] = {}
    if tiers is not None:
        for tier, count, rate in zip(tiers.mix, tiers.requests, tiers.hit_rates(), strict=True):
            by_priority[str(tier.priority)] = count
            hit_by_priority[str(tier.priority)] = rate
    return {
        "pinned_blocks_peak": None if pins is None else pins.peak,
        "pinned_blocks_mean": (
            None if pins is None else (sum(pinned) / len(pinned) if pinned else 0.0)
        ),
        "pin_calls": 0 if pins is None else pins.calls,
        "pins_refused": 0 if pins is None else pins.refused,
        "requests_by_priority": by_priority,
        "hit_rate_by_priority": hit_by_priority,
    }


def combine(primary: dict[str, Any], reference: dict[str, Any] | None) -> dict[str, Any]:
    """Adds the reference's figures, the speed ratio and the decision match to a summary.

    Args:
        primary: kvcore's summary.
        reference: The reference's summary of the same workload, or None if it did not run.

    Returns:
        ``primary`` plus ``reference``, ``speedup`` (reference µs per step over kvcore's, None
        when either is zero) and ``decisions_match`` (identical checksums, both complete).
    """
    out = dict(primary)
    if reference is None:
        return out
    ours = primary["kv_us_per_step_mean"]
    theirs = reference["kv_us_per_step_mean"]
    out["reference"] = reference
    out["speedup"] = theirs / ours if ours > 0 and theirs > 0 else None
    out["decisions_match"] = bool(
        primary["decisions_checksum"] == reference["decisions_checksum"]
        and not primary["interrupted"]
        and not reference["interrupted"]
    )
    return out


def combine_lru(primary: dict[str, Any], lru: dict[str, Any] | None) -> dict[str, Any]:
    """Adds the plain-LRU run of the same workload (``--compare lru``) to a summary.

    Args:
        primary: The summary of the run with cache control.
        lru: The summary of the run without it, or None if it did not run.

    Returns:
        ``primary`` plus ``lru`` (with ``policy`` ``"lru"``) and ``vs_lru``:
        ``prefix_hit_rate_gain`` (primary minus LRU, a fraction), ``preemptions_change`` and
        ``blocks_evicted_change`` (primary minus LRU; None with events off).
    """
    out = dict(primary)
    if lru is None:
        return out
    out["lru"] = dict(lru, policy="lru")
    ours, theirs = primary["blocks_evicted"], lru["blocks_evicted"]
    out["vs_lru"] = {
        "prefix_hit_rate_gain": primary["prefix_hit_rate"] - lru["prefix_hit_rate"],
        "preemptions_change": primary["preemptions"] - lru["preemptions"],
        "blocks_evicted_change": None if ours is None or theirs is None else ours - theirs,
    }
    return out


def _pct(x: Any) -> str:
    return f"{100.0 * x:.1f} %"


def _int(x: Any) -> str:
    return "n/a" if x is None else f"{x:,}"


def _us(x: Any) -> str:
    return f"{x:,.1f}"


_ROWS: list[tuple[str, str, Any]] = [
    ("requests", "requests", _int),
    ("steps", "steps", _int),
    ("prefix hit rate", "prefix_hit_rate", _pct),
    ("  unlimited-cache bound", "prefix_hit_rate_bound", _pct),
    ("preemptions", "preemptions", _int),
    ("peak usage", "peak_usage", _pct),
    ("mean usage", "mean_usage", _pct),
    ("blocks evicted", "blocks_evicted", _int),
    ("KV-manager µs/step  mean", "kv_us_per_step_mean", _us),
    ("                    p50", "kv_us_per_step_p50", _us),
    ("                    p99", "kv_us_per_step_p99", _us),
    ("KV-manager seconds total", "kv_seconds_total", lambda x: f"{x:.3f}"),
    ("wall seconds", "wall_seconds", lambda x: f"{x:.2f}"),
]


def _pinned(r: dict[str, Any]) -> str:
    peak = r["pinned_blocks_peak"]
    return "-" if peak is None else f"{peak:,}"


def _pin_calls(key: str) -> Any:
    def cell(r: dict[str, Any]) -> str:
        return "-" if r["pinned_blocks_peak"] is None else f"{r[key]:,}"

    return cell


_RETENTION_ROWS: list[tuple[str, Any]] = [
    ("pinned blocks (peak)", _pinned),
    ("pin_prefix calls", _pin_calls("pin_calls")),
    ("  refused (over limit)", _pin_calls("pins_refused")),
]


def format_table(summary: dict[str, Any], header: str = "") -> str:
    """Renders a summary (from :func:`summarize` or :func:`combine`) as a text table.

    Args:
        summary: The figures; with a ``reference`` entry, a second column is shown.
        header: A first line describing the configuration.

    Returns:
        The table, lines joined by newlines, without a trailing newline.
    """
    ref = summary.get("reference")
    lru = summary.get("lru")
    other = ref if ref is not None else lru
    cols = [summary] + ([other] if other is not None else [])
    names = [c.get("policy", c["backend"]) for c in cols]
    width = max(len(r[0]) for r in _ROWS) + 2
    lines = [header] if header else []
    if summary.get("interrupted") or (other is not None and other.get("interrupted")):
        lines.append("(interrupted: partial figures)")
    lines.append(" " * width + "".join(f"{n:>14}" for n in names))
    for label, key, fmt in _ROWS:
        if summary.get(key) is None and key == "blocks_evicted":
            cells = ["n/a (events off)"]
        else:
            cells = [fmt(c[key]) for c in cols]
        lines.append(f"{label:<{width}}" + "".join(f"{c:>14}" for c in cells))
    if any("retention" in c for c in cols):
        for label, fmt in _RETENTION_ROWS:
            cells = [fmt(c["retention"]) if "retention" in c else "-" for c in cols]
            lines.append(f"{label:<{width}}" + "".join(f"{c:>14}" for c in cells))
        tiers = summary.get("retention", {}).get("hit_rate_by_priority", {})
        for priority in tiers:
            rates = [c.get("retention", {}).get("hit_rate_by_priority", {}) for c in cols]
            cells = [_pct(r[priority]) if priority in r else "-" for r in rates]
            label = f"  hit rate, priority {priority}"
            lines.append(f"{label:<{width}}" + "".join(f"{c:>14}" for c in cells))
    if summary["requests"] < summary["requests_total"]:
        lines.append(f"({summary['requests']} of {summary['requests_total']} requests finished)")
    if ref is not None:
        speedup = summary.get("speedup")
        lines.append(
            f"{'speedup (reference/kvcore)':<{width}}"
            + f"{'n/a' if speedup is None else f'{speedup:.2f}x':>14}"
        )
        match = "yes" if summary.get("decisions_match") else "NO"
        lines.append(f"{'decisions match':<{width}}{match:>14}")
    if lru is not None:
        vs = summary["vs_lru"]
        gain = f"{100.0 * vs['prefix_hit_rate_gain']:+.1f} pts"
        lines.append(f"{'hit-rate gain vs LRU':<{width}}{gain:>14}")
        lines.append(f"{'preemptions vs LRU':<{width}}{vs['preemptions_change']:>+14,}")
    lines.append(f"{'decisions checksum':<{width}}  {summary['decisions_checksum']}")
    return "\n".join(lines)
