"""``kvcore simulate`` cache control: ``--pin-system-prompts``, ``--priority-mix``, ``--compare lru``.

The options parse (and their mistakes are one-line errors, exit 2, before any work), runs are
deterministic, ``--compare lru`` reports both runs of the same workload, and pinned system
prompts raise the prefix hit rate of the synthetic chat workload over plain LRU when the cache
is under pressure.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import check_one_line, refuse_work, run_main

from kvcore import cli
from kvcore.simulate.backends import KvcoreBackend, ManagerSettings, make_backend, model_preset
from kvcore.simulate.retention import (
    DEFAULT_PRIORITY_MIX,
    STEP_SECONDS,
    PriorityTier,
    PriorityTiers,
    RetentionSettings,
    parse_priority_mix,
)
from kvcore.simulate.scheduler import SchedulerSettings, Simulator
from kvcore.simulate.workload import ChatWorkloadParams, SyntheticChat, synthetic_chat

DATA = Path(__file__).parent / "data"
GOOD_TRACE = str(DATA / "trace_good.jsonl")

# A small synthetic workload under memory pressure (it preempts and evicts), about a second.
SMALL = ["--requests", "60", "--num-blocks", "600", "--max-model-len", "4096", "--no-progress"]
# The same with 16 system prompts of Zipf popularity: plain LRU evicts the less popular ones
# between their uses.
MANY_PROMPTS = [*SMALL, "--system-prompts", "16", "--system-prompt-skew", "1"]


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Makes building a backend or a simulator fail the test."""
    refuse_work(monkeypatch)


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    """Runs ``kvcore simulate ARGS --json`` in-process; returns the parsed object."""
    rc, out, err = run_main(capsys, "simulate", *args, "--json")
    assert rc == 0, err
    obj: dict[str, Any] = json.loads(out)
    return obj


# --------------------------------------------------------------------------------------------
# Parsing.


def test_options_parse() -> None:
    parser = cli.build_parser()
    off = parser.parse_args(["simulate"])
    assert off.pin_system_prompts is None and off.priority_mix is None
    assert cli._retention(off) is None

    bare = parser.parse_args(["simulate", "--pin-system-prompts", "--priority-mix"])
    assert bare.pin_system_prompts == math.inf
    assert bare.priority_mix == parse_priority_mix(DEFAULT_PRIORITY_MIX)
    settings = cli._retention(bare)
    assert settings == RetentionSettings(
        pin_system_prompts=True,
        pin_ttl_s=None,
        priority_mix=(PriorityTier(90, 0.2), PriorityTier(50, 0.6), PriorityTier(10, 0.2)),
        seed=0,
    )

    given = parser.parse_args(
        ["simulate", "--pin-system-prompts", "12.5", "--priority-mix", "80:0.5:30,20:0.5"]
    )
    settings = cli._retention(given)
    assert settings is not None
    assert settings.pin_system_prompts and settings.pin_ttl_s == 12.5
    assert settings.priority_mix == (PriorityTier(80, 0.5, 30.0), PriorityTier(20, 0.5))
    assert parser.parse_args(["simulate", "--compare", "lru"]).compare == "lru"


@pytest.mark.parametrize(
    ("text", "tiers"),
    [
        ("50:1", (PriorityTier(50, 1.0),)),
        (" 0:0.25 , 100:0.75:0 ", (PriorityTier(0, 0.25), PriorityTier(100, 0.75, 0.0))),
        (
            "90:0.1,50:0.2,10:0.7",
            (PriorityTier(90, 0.1), PriorityTier(50, 0.2), PriorityTier(10, 0.7)),
        ),
    ],
)
def test_priority_mix_syntax(text: str, tiers: tuple[PriorityTier, ...]) -> None:
    assert parse_priority_mix(text) == tiers


@pytest.mark.usefixtures("no_work")
@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--pin-system-prompts", "abc"], ["expected a TTL in seconds", "(0, 10**9]", "'abc'"]),
        (["--pin-system-prompts", "0"], ["(0, 10**9], got '0'"]),
        (["--pin-system-prompts", "-1"], ["got '-1'"]),
        (["--pin-system-prompts", "nan"], ["got 'nan'"]),
        (["--pin-system-prompts", "inf"], ["got 'inf'"]),
        (["--pin-system-prompts", "1e10"], ["got '1e10'"]),
        (["--priority-mix", ""], ["PRIORITY:SHARE[:TTL]", "got ''"]),
        (["--priority-mix", "90"], ["expected a tier PRIORITY:SHARE[:TTL], got '90'"]),
        (["--priority-mix", "90:0.5:1:2,10:0.5"], ["got '90:0.5:1:2'"]),
        (["--priority-mix", "101:1"], ["priority in [0, 100], got '101'"]),
        (["--priority-mix=-1:1"], ["priority in [0, 100], got '-1'"]),
        (["--priority-mix", "high:1"], ["priority in [0, 100], got 'high'"]),
        (["--priority-mix", "50:0,60:1"], ["share in (0, 1], got '0'"]),
        (["--priority-mix", "50:nan"], ["share in (0, 1], got 'nan'"]),
        (["--priority-mix", "50:0.5,60:0.6"], ["the shares sum to 1.1, not 1"]),
        (["--priority-mix", "50:0.5"], ["the shares sum to 0.5, not 1"]),
        (["--priority-mix", "50:0.5,50:0.5"], ["priority 50 appears twice"]),
        (["--priority-mix", "50:1:-1"], ["TTL in [0, 10**9] seconds, got '-1'"]),
        (["--priority-mix", "50:1:inf"], ["got 'inf'"]),
        (["--compare", "fifo"], ["invalid choice: 'fifo'", "lru"]),
        (["--system-prompts", "-1"], ["expected an integer >= 0, got '-1'"]),
        (["--system-prompts", "1001"], ["expected an integer <= 1000, got '1001'"]),
        (["--system-prompts", "many"], ["expected an integer >= 0, got 'many'"]),
        (["--system-prompt-skew", "-0.5"], ["expected a number in [0, 10], got '-0.5'"]),
        (["--system-prompt-skew", "11"], ["expected a number in [0, 10], got '11'"]),
        (["--system-prompt-skew", "nan"], ["expected a number in [0, 10], got 'nan'"]),
    ],
)
def test_bad_values(
    capsys: pytest.CaptureFixture[str], args: list[str], fragments: list[str]
) -> None:
    flag = args[0].split("=")[0]
    check_one_line(
        *run_main(capsys, "simulate", *args), f"kvcore simulate: error: {flag}: ", *fragments
    )


@pytest.mark.usefixtures("no_work")
@pytest.mark.parametrize(
    ("args", "flag", "fragment"),
    [
        (
            ["--pin-system-prompts", "--trace", GOOD_TRACE],
            "--pin-system-prompts",
            "not with --trace",
        ),
        (["--pin-system-prompts", "--no-prefix-caching"], "--pin-system-prompts", "needs prefix"),
        (["--priority-mix", "--no-prefix-caching"], "--priority-mix", "needs prefix caching"),
        (
            ["--pin-system-prompts", "--compare", "reference"],
            "--pin-system-prompts",
            "not with --compare reference (use --compare lru)",
        ),
        (
            ["--priority-mix", "--backend", "reference"],
            "--priority-mix",
            "a kvcore extension, not with --backend reference",
        ),
        (
            ["--compare", "lru", "--backend", "reference"],
            "--compare lru",
            "only with --backend kvcore",
        ),
        (["--trace", GOOD_TRACE, "--system-prompts", "8"], "--system-prompts", "not with --trace"),
        (
            ["--trace", GOOD_TRACE, "--system-prompt-skew", "1"],
            "--system-prompt-skew",
            "not with --trace",
        ),
    ],
)
def test_flags_that_do_not_go_together(
    capsys: pytest.CaptureFixture[str], args: list[str], flag: str, fragment: str
) -> None:
    check_one_line(
        *run_main(capsys, "simulate", *args), f"kvcore simulate: error: {flag}: ", fragment
    )


def test_bad_value_on_the_command_line() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvcore", "simulate", "--priority-mix", "90:0.5"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    check_one_line(
        proc.returncode,
        proc.stdout,
        proc.stderr,
        "kvcore simulate: error: --priority-mix: the shares sum to 0.5, not 1",
    )


def test_help_documents_the_options(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_main(capsys, "simulate", "--help")
    assert rc == 0
    text = " ".join(out.split())
    for needle in (
        "--pin-system-prompts [TTL]",
        "--priority-mix [MIX]",
        "PRIORITY:SHARE[:TTL]",
        f"Without MIX: {DEFAULT_PRIORITY_MIX} (20% high, 60% default, 20% low)",
        "(0, 10**9]",
        f"{STEP_SECONDS:g} s per scheduler step",
        "lru: also replay the same workload with plain LRU eviction",
    ):
        assert needle in text, needle


# --------------------------------------------------------------------------------------------
# Tiers of the priority mix.


def test_tiers_follow_conversations_and_shares() -> None:
    mix = parse_priority_mix("90:0.2,50:0.6,10:0.2")
    tiers = PriorityTiers(mix, seed=7)
    specs = synthetic_chat(ChatWorkloadParams(num_requests=3000, seed=7, max_model_len=4096))
    got: dict[str, int] = {}
    for spec in specs:  # creation order is the release order: parents come first
        tiers.pulled(spec.request_id, spec.after)
    for spec in specs:
        got[spec.request_id] = tiers.take(spec.request_id)
    for spec in specs:
        if spec.after is not None:
            assert got[spec.request_id] == got[spec.after]
    roots = [got[s.request_id] for s in specs if s.after is None]
    for k, tier in enumerate(mix):
        share = sum(t == k for t in roots) / len(roots)
        assert share == pytest.approx(tier.share, abs=0.05), (tier, share)
    assert sum(tiers.requests) == len(specs)
    # Seeded: the same draws again, other ones with another seed.
    again = PriorityTiers(mix, seed=7)
    other = PriorityTiers(mix, seed=8)
    for spec in specs[:200]:
        again.pulled(spec.request_id, spec.after)
        other.pulled(spec.request_id, spec.after)
    first = [again.take(s.request_id) for s in specs[:200]]
    assert first == [got[s.request_id] for s in specs[:200]]
    assert [other.take(s.request_id) for s in specs[:200]] != first


def test_synthetic_requests_name_their_system_prompt() -> None:
    specs = synthetic_chat(ChatWorkloadParams(num_requests=200, seed=5, max_model_len=4096))
    named = [s for s in specs if s.system_prompt is not None]
    assert named and len(named) < len(specs)  # unique prompts have none
    prompts: dict[str, list[int]] = {}
    for s in specs:
        if s.system_prompt is None:
            assert s.system_prompt_len == 0
            continue
        head = list(s.prompt[: s.system_prompt_len])
        assert prompts.setdefault(s.system_prompt, head) == head
    assert len(prompts) == ChatWorkloadParams().num_system_prompts


def test_system_prompt_popularity() -> None:
    def uses(skew: float) -> list[int]:
        params = ChatWorkloadParams(
            num_requests=3000,
            seed=4,
            max_model_len=4096,
            num_system_prompts=8,
            system_prompt_skew=skew,
        )
        counts = [0] * 8
        for spec in synthetic_chat(params):
            if spec.system_prompt is not None and spec.after is None:
                counts[int(spec.system_prompt.removeprefix("system-"))] += 1
        return counts

    flat = uses(0.0)
    zipf = uses(1.0)
    assert max(flat) < 1.5 * min(flat)
    # Weights 1/(k+1): the first prompt about 8 times as popular as the last.
    assert zipf[0] > 5 * zipf[7] and zipf[0] > 1.6 * zipf[1]
    assert sum(zipf) == pytest.approx(sum(flat), rel=0.1)


def test_default_popularity_keeps_the_workload(capsys: pytest.CaptureFixture[str]) -> None:
    # Skew 0 and 4 prompts are the defaults: the same decisions as without the flags.
    plain = run_json(capsys, *SMALL)
    given = run_json(capsys, *SMALL, "--system-prompts", "4", "--system-prompt-skew", "0")
    assert given["decisions_checksum"] == plain["decisions_checksum"]
    assert given["config"]["system_prompts"] == 4
    assert given["config"]["system_prompt_skew"] == 0.0
    none = run_json(capsys, *SMALL, "--system-prompts", "0", "--pin-system-prompts")
    assert none["retention"]["pin_calls"] == 0 and none["retention"]["pinned_blocks_peak"] == 0


def test_requests_carry_their_tier(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, tuple[Any, Any]] = {}
    real = KvcoreBackend.request_factory

    def factory(self: KvcoreBackend, request_id: str, *args: Any, **kw: Any) -> Any:
        build = real(self, request_id, *args, **kw)

        def built() -> Any:
            req = build()
            seen[request_id] = (req.retention_priority, req.retention_ttl_s)
            return req

        return built

    monkeypatch.setattr(KvcoreBackend, "request_factory", factory)
    mix = parse_priority_mix("90:0.5:2.5,10:0.5")
    params = ChatWorkloadParams(num_requests=40, seed=3, max_model_len=4096)
    sim = Simulator(
        make_backend("kvcore"),
        model_preset("full", 16),
        ManagerSettings(num_blocks=600, max_model_len=4096, max_num_batched_tokens=2048),
        SchedulerSettings(),
        SyntheticChat(params),
        RetentionSettings(priority_mix=mix, seed=3),
    )
    sim.run()
    assert len(seen) == 40
    assert set(seen.values()) == {(90, 2.5), (10, None)}
    by_id = {s.request_id: s for s in synthetic_chat(params)}
    for rid, value in seen.items():
        parent = by_id[rid].after
        if parent is not None:
            assert seen[parent] == value


# --------------------------------------------------------------------------------------------
# --compare lru.


def test_compare_lru_reports_both_runs(capsys: pytest.CaptureFixture[str]) -> None:
    # No cache control: the two runs are the same run.
    obj = run_json(capsys, *SMALL, "--compare", "lru")
    lru = obj["lru"]
    assert lru["policy"] == "lru" and lru["backend"] == "kvcore"
    assert "policy" not in obj and "retention" not in obj
    assert lru["decisions_checksum"] == obj["decisions_checksum"]
    assert obj["vs_lru"] == {
        "prefix_hit_rate_gain": 0.0,
        "preemptions_change": 0,
        "blocks_evicted_change": 0,
    }
    assert obj["config"]["compare"] == "lru"
    assert "reference" not in obj and "decisions_match" not in obj
    rc, out, err = run_main(capsys, "simulate", *SMALL, "--compare", "lru")
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[1].split() == ["kvcore", "lru"]
    assert any(line.startswith("hit-rate gain vs LRU") and "+0.0 pts" in line for line in lines)
    assert any(line.startswith("preemptions vs LRU") for line in lines)


def test_plain_runs_keep_their_output(capsys: pytest.CaptureFixture[str]) -> None:
    # Without the new flags, no new keys and no new rows.
    obj = run_json(capsys, *SMALL)
    assert not {"lru", "vs_lru", "policy", "retention"} & set(obj)
    assert "compare" not in obj["config"] and "retention" not in obj["config"]
    rc, out, _ = run_main(capsys, "simulate", *SMALL)
    assert rc == 0
    assert "pinned" not in out and "LRU" not in out


# --------------------------------------------------------------------------------------------
# With the cache control on.

RETAINED = [*SMALL, "--pin-system-prompts", "--priority-mix", "--compare", "lru"]


def test_retention_run_is_deterministic(capsys: pytest.CaptureFixture[str]) -> None:
    a = run_json(capsys, *RETAINED)
    b = run_json(capsys, *RETAINED)
    for key in ("decisions_checksum", "steps", "preemptions", "prefix_hit_rate"):
        assert a[key] == b[key], key
        assert a["lru"][key] == b["lru"][key], key
    assert a["retention"] == b["retention"]
    assert a["vs_lru"] == b["vs_lru"]
    assert a["policy"] == "retention" and a["lru"]["policy"] == "lru"
    # The lru run draws the same tiers, to count its hit rate per tier, and pins nothing.
    theirs = a["lru"]["retention"]
    assert theirs["pinned_blocks_peak"] is None and theirs["pin_calls"] == 0
    assert theirs["requests_by_priority"] == a["retention"]["requests_by_priority"]
    assert set(theirs["hit_rate_by_priority"]) == {"90", "50", "10"}
    assert a["decisions_checksum"] != a["lru"]["decisions_checksum"]
    assert a["config"]["retention"] == {
        "pin_system_prompts": True,
        "pin_ttl_s": None,
        "priority_mix": DEFAULT_PRIORITY_MIX,
        "step_seconds": STEP_SECONDS,
    }
    figures = a["retention"]
    assert figures["pinned_blocks_peak"] > 0
    assert figures["pin_calls"] >= 1 and figures["pins_refused"] == 0
    assert sum(figures["requests_by_priority"].values()) == a["requests"] == 60
    assert set(figures["requests_by_priority"]) == {"90", "50", "10"}
    other = run_json(capsys, *RETAINED, "--seed", "1")
    assert other["decisions_checksum"] != a["decisions_checksum"]


def test_pins_raise_the_hit_rate_under_pressure(capsys: pytest.CaptureFixture[str]) -> None:
    # The lru run preempts and evicts: the less popular system prompts are evicted between
    # their uses, unless pinned. Three seeds, each a real gain (over 2 points) over the same
    # workload replayed with plain LRU.
    for seed in ("0", "1", "2"):
        obj = run_json(
            capsys, *MANY_PROMPTS, "--seed", seed, "--pin-system-prompts", "--compare", "lru"
        )
        lru = obj["lru"]
        assert lru["preemptions"] > 0 and lru["blocks_evicted"] > 0, seed
        assert obj["requests"] == lru["requests"] == 60
        gain = obj["vs_lru"]["prefix_hit_rate_gain"]
        assert gain == obj["prefix_hit_rate"] - lru["prefix_hit_rate"]
        assert gain > 0.02, (seed, gain)
        assert obj["prefix_hit_rate"] <= obj["prefix_hit_rate_bound"] + 1e-12
        assert obj["prefix_hit_rate_bound"] == lru["prefix_hit_rate_bound"]  # the same workload
        assert 0 < obj["retention"]["pinned_blocks_peak"] <= 600 // 2  # the manager's limit
        assert obj["config"]["system_prompts"] == 16


def test_pins_with_a_ttl_lapse(capsys: pytest.CaptureFixture[str]) -> None:
    # A TTL shorter than the gaps between a system prompt's uses: its pin lapses between them,
    # so fewer blocks stay pinned on average than with pins for good.
    forever = run_json(capsys, *SMALL, "--pin-system-prompts")
    brief = run_json(capsys, *SMALL, "--pin-system-prompts", str(STEP_SECONDS))
    assert brief["config"]["retention"]["pin_ttl_s"] == STEP_SECONDS
    assert brief["retention"]["pin_calls"] > forever["retention"]["pin_calls"]
    assert brief["retention"]["pinned_blocks_mean"] < forever["retention"]["pinned_blocks_mean"]


def test_table_and_plot_show_both(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "lru.png"
    rc, out, err = run_main(capsys, "simulate", *RETAINED, "--plot", str(png))
    assert rc == 0, err
    lines = out.splitlines()
    assert "system prompts pinned, priority mix 90:0.2,50:0.6,10:0.2" in lines[0]
    assert lines[1].split() == ["retention", "lru"]
    pinned = next(line for line in lines if line.startswith("pinned blocks (peak)"))
    assert pinned.split()[-1] == "-" and int(pinned.split()[-2].replace(",", "")) > 0
    tiers = [line.split() for line in lines if line.startswith("  hit rate, priority")]
    assert [t[3] for t in tiers] == ["90", "50", "10"]
    assert all(t[5] == t[7] == "%" for t in tiers)  # both columns
    assert any(line.startswith("hit-rate gain vs LRU") for line in lines)
    assert f"plot written to {png}" in out
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5_000


def test_interrupted_compare_lru(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Ctrl-C during the first run: its partial summary, no lru run.
    real_step = Simulator.step
    calls = {"n": 0}

    def step(self: Simulator) -> None:
        calls["n"] += 1
        if calls["n"] == 40:
            raise KeyboardInterrupt
        real_step(self)

    monkeypatch.setattr(Simulator, "step", step)
    rc, out, err = run_main(capsys, "simulate", *RETAINED, "--json")
    assert rc == 130, err
    obj = json.loads(out)
    assert obj["interrupted"] is True and obj["steps"] == 39
    assert "lru" not in obj and "vs_lru" not in obj
    assert obj["policy"] == "retention"
