"""``kvcore simulate --plot``: usage, hit rate and running requests over steps (matplotlib)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvcore.simulate.scheduler import Simulator


def plot(sim: Simulator, path: str | Path, title: str = "", lru: Simulator | None = None) -> None:
    """Draws three panels over the executed steps and saves them (PNG, PDF or SVG, by suffix).

    The panels are pool usage, the cumulative prefix hit rate (with the unlimited-cache bound
    as a dashed line) and the running and waiting request counts.

    With ``lru`` (``--compare lru``: the same workload with plain LRU eviction) the usage and
    hit-rate panels show both runs, the pinned blocks are drawn under the usage, and a fourth
    panel shows both runs' cumulative preemptions.

    Args:
        sim: A finished (or interrupted) simulation.
        path: Output file; its suffix (``.png``, ``.pdf``, ``.svg``) picks the format.
        title: Figure title.
        lru: The plain-LRU run of the same workload, or None.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    st = sim.stats
    steps = list(st.sample_step)
    fig: Any
    if lru is None:
        fig, axes = plt.subplots(3, 1, figsize=(8, 6.5), sharex=True, constrained_layout=True)
        ax0, ax1, ax2 = axes
        ax3 = None
    else:
        fig, axes = plt.subplots(4, 1, figsize=(8, 8.5), sharex=True, constrained_layout=True)
        ax0, ax1, ax3, ax2 = axes
    label = "retention" if lru is not None and sim.retention is not None else sim.backend.name
    ax0.plot(steps, [100 * u for u in st.sample_usage], color="tab:blue", lw=1, label=label)
    ax0.set_ylabel("KV usage (%)")
    ax0.set_ylim(0, 105)
    ax1.plot(
        steps,
        [100 * h for h in st.sample_hit_rate],
        color="tab:green",
        lw=1,
        label=label,
    )
    if lru is not None:
        ls = lru.stats
        lru_steps = list(ls.sample_step)
        blocks = max(1, sim.settings.num_blocks - 1)
        if st.sample_pinned:
            ax0.fill_between(
                steps,
                [100 * p / blocks for p in st.sample_pinned],
                color="tab:blue",
                alpha=0.2,
                lw=0,
                label="pinned",
            )
        ax0.plot(
            lru_steps,
            [100 * u for u in ls.sample_usage],
            color="tab:purple",
            ls=":",
            lw=1,
            label="lru",
        )
        ax0.legend(loc="lower right", fontsize="small")
        ax1.plot(
            lru_steps,
            [100 * h for h in ls.sample_hit_rate],
            color="tab:purple",
            ls=":",
            lw=1,
            label="lru",
        )
        assert ax3 is not None
        ax3.plot(steps, list(st.sample_preemptions), color="tab:green", lw=1, label=label)
        ax3.plot(
            lru_steps, list(ls.sample_preemptions), color="tab:purple", ls=":", lw=1, label="lru"
        )
        ax3.set_ylabel("preemptions")
        ax3.legend(loc="upper left", fontsize="small")
    ax1.axhline(
        100 * sim.hit_rate_bound(), color="tab:gray", ls="--", lw=1, label="unlimited cache"
    )
    ax1.set_ylabel("prefix hit rate (%)")
    ax1.set_ylim(0, 105)
    ax1.legend(loc="lower right", fontsize="small")
    ax2.plot(steps, list(st.sample_running), color="tab:orange", lw=1, label="running")
    ax2.plot(steps, list(st.sample_waiting), color="tab:red", lw=1, label="waiting")
    ax2.set_ylabel("requests")
    ax2.set_xlabel("step")
    ax2.legend(loc="upper right", fontsize="small")
    if title:
        fig.suptitle(title, fontsize="medium")
    fig.savefig(str(path), dpi=80)
    plt.close(fig)
