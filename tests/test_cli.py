"""Tests of ``kvcore simulate`` and ``kvcore bench`` (subprocess and in-process).

Subprocess tests run ``python -m kvcore`` (and the ``kvcore`` console script) as a user would.
Tests marked ``reference`` compare against the reference implementation and need it installed.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest

from kvcore import cli
from kvcore.simulate.backends import ManagerSettings, make_backend, model_preset
from kvcore.simulate.report import percentile
from kvcore.simulate.scheduler import (
    ConfigError,
    SchedulerSettings,
    SimulationStalled,
    Simulator,
    check_config,
)
from kvcore.simulate.trace import TraceError, parse_trace
from kvcore.simulate.workload import (
    ChatWorkloadParams,
    RequestSpec,
    synthetic_chat,
    unlimited_cache_hit_bound,
)

DATA = Path(__file__).parent / "data"
HAVE_REFERENCE = importlib.util.find_spec("vllm") is not None
needs_reference = pytest.mark.skipif(not HAVE_REFERENCE, reason="reference not installed")

# A small synthetic workload that runs in about a second.
SMALL = ["--requests", "30", "--num-blocks", "700", "--max-model-len", "4096", "--no-progress"]

JSON_KEYS = {
    "backend": str,
    "requests": int,
    "requests_total": int,
    "steps": int,
    "prefix_hit_rate": float,
    "prefix_hit_rate_bound": float,
    "preemptions": int,
    "peak_usage": float,
    "mean_usage": float,
    "kv_us_per_step_mean": float,
    "kv_us_per_step_p50": float,
    "kv_us_per_step_p99": float,
    "kv_seconds_total": float,
    "wall_seconds": float,
    "decisions_checksum": str,
    "interrupted": bool,
    "config": dict,
}


def run_cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """Runs ``python -m kvcore ARGS`` and returns the finished process."""
    return subprocess.run(
        [sys.executable, "-m", "kvcore", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def run_json(*args: str) -> dict[str, Any]:
    """Runs ``kvcore simulate ARGS --json`` and returns the parsed object."""
    proc = run_cli("simulate", *SMALL, "--json", *args)
    assert proc.returncode == 0, proc.stderr
    out: dict[str, Any] = json.loads(proc.stdout)
    return out


def check_schema(obj: dict[str, Any]) -> None:
    for key, typ in JSON_KEYS.items():
        assert key in obj, key
        value = obj[key]
        if typ is float:
            assert isinstance(value, (int, float)) and not isinstance(value, bool), key
        else:
            assert isinstance(value, typ), key
    assert obj["blocks_evicted"] is None or isinstance(obj["blocks_evicted"], int)
    assert len(obj["decisions_checksum"]) == 32
    assert 0.0 <= obj["prefix_hit_rate"] <= 1.0
    assert 0.0 <= obj["peak_usage"] <= 1.0
    assert obj["mean_usage"] <= obj["peak_usage"] + 1e-12
    assert obj["kv_us_per_step_p50"] <= obj["kv_us_per_step_p99"]
    assert obj["kv_us_per_step_mean"] > 0


# --------------------------------------------------------------------------------------------
# Subprocess: the default run, JSON schema, options.


def test_json_schema_and_figures() -> None:
    obj = run_json()
    check_schema(obj)
    assert obj["backend"] == "kvcore"
    assert obj["requests"] == obj["requests_total"] == 30
    assert obj["steps"] > 0
    assert obj["interrupted"] is False
    # The synthetic chat mix shares system prompts: the cache must hit, and never beat the
    # unlimited-cache bound.
    assert 0.0 < obj["prefix_hit_rate"] <= obj["prefix_hit_rate_bound"] + 1e-12
    assert obj["config"]["num_blocks"] == 700
    assert "reference" not in obj and "speedup" not in obj


def test_table_output() -> None:
    proc = run_cli("simulate", *SMALL)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for label in (
        "requests",
        "steps",
        "prefix hit rate",
        "unlimited-cache bound",
        "preemptions",
        "peak usage",
        "mean usage",
        "blocks evicted",
        "µs/step",
        "p50",
        "p99",
        "decisions checksum",
    ):
        assert label in out, label
    assert "700 blocks x 16 tokens" in out
    assert proc.stderr == ""  # no progress bar when stderr is not a terminal


def test_default_run_imports_neither_torch_nor_reference() -> None:
    code = (
        "import sys\n"
        "from kvcore.cli import main\n"
        f"rc = main({['simulate', *SMALL, '--json']!r})\n"
        "assert rc == 0, rc\n"
        "bad = sorted(m for m in ('torch', 'vllm') if m in sys.modules)\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=240, check=False
    )
    assert proc.returncode == 0, proc.stderr


def test_same_seed_same_decisions_other_seed_differs() -> None:
    a = run_json("--seed", "3")
    b = run_json("--seed", "3")
    c = run_json("--seed", "4")
    assert a["decisions_checksum"] == b["decisions_checksum"]
    assert a["decisions_checksum"] != c["decisions_checksum"]
    assert c["config"]["seed"] == 4


@pytest.mark.parametrize("fn", ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"])
def test_hash_option(fn: str) -> None:
    obj = run_json("--hash", fn)
    assert obj["config"]["hash"] == fn
    assert obj["requests"] == 30
    assert obj["prefix_hit_rate"] > 0


@pytest.mark.parametrize("model", ["full", "hybrid-swa", "hybrid-mamba"])
def test_model_option(model: str) -> None:
    obj = run_json("--model", model, "--num-blocks", "1500")
    check_schema(obj)
    assert obj["config"]["model"] == model
    assert obj["requests"] == 30


def test_block_size_option() -> None:
    a = run_json("--block-size", "32", "--num-blocks", "400")
    assert a["config"]["block_size"] == 32
    assert a["requests"] == 30
    assert a["decisions_checksum"] != run_json()["decisions_checksum"]


def test_events_option() -> None:
    on = run_json("--events")
    off = run_json("--no-events")
    assert isinstance(on["blocks_evicted"], int)
    assert off["blocks_evicted"] is None
    assert on["config"]["events"] is True and off["config"]["events"] is False
    # Events do not change a single decision.
    assert on["decisions_checksum"] == off["decisions_checksum"]
    proc = run_cli("simulate", *SMALL, "--no-events")
    assert "n/a (events off)" in proc.stdout


def test_small_cache_preempts_and_evicts() -> None:
    obj = run_json("--num-blocks", "260", "--requests", "40")
    assert obj["preemptions"] > 0
    assert obj["blocks_evicted"] > 0
    assert obj["peak_usage"] == pytest.approx(1.0, abs=0.02)
    assert obj["requests"] == 40


def test_prefix_caching_off_never_hits() -> None:
    obj = run_json("--no-prefix-caching")
    assert obj["prefix_hit_rate"] == 0.0
    assert obj["prefix_hit_rate_bound"] > 0.0


@pytest.mark.parametrize(
    ("args", "key", "value"),
    [
        (["--watermark", "0.05"], "watermark", 0.05),
        (["--max-num-seqs", "4"], "max_num_seqs", 4),
        (["--max-num-batched-tokens", "256"], "max_num_batched_tokens", 256),
        (["--no-admission-gate"], "admission_gate", False),
        (
            ["--model", "hybrid-swa", "--sliding-window", "256", "--num-blocks", "1500"],
            "model",
            "hybrid-swa",
        ),
        (["--arrival-rate", "2.0"], "workload", "synthetic-chat"),
        (["--requests", "12"], "workload", "synthetic-chat"),
    ],
)
def test_scheduler_options(args: list[str], key: str, value: Any) -> None:
    obj = run_json(*args)
    assert obj["config"][key] == value
    assert obj["requests"] == obj["requests_total"]


def test_max_num_seqs_limits_running(tmp_path: Path) -> None:
    # With one running request at a time there is nothing to preempt for.
    obj = run_json("--max-num-seqs", "1")
    assert obj["preemptions"] == 0
    assert obj["steps"] > run_json()["steps"]


def test_plot_file(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "sim.png"
    proc = run_cli("simulate", *SMALL, "--plot", str(png))
    assert proc.returncode == 0, proc.stderr
    assert f"plot written to {png}" in proc.stdout
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 5_000


# --------------------------------------------------------------------------------------------
# Traces and bad input.


def test_trace_good_file() -> None:
    proc = run_cli("simulate", "--trace", str(DATA / "trace_good.jsonl"), "--json", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    obj = json.loads(proc.stdout)
    check_schema(obj)
    assert obj["requests"] == obj["requests_total"] == 6
    assert obj["config"]["workload"].endswith("trace_good.jsonl")
    # sys-2 and sys-3 share bot's prefix with sys-1; chat-2 extends chat-1 with its output.
    assert obj["prefix_hit_rate"] > 0.3


@pytest.mark.parametrize(
    ("name", "line", "field"),
    [("trace_bad_field.jsonl", 3, "output_len"), ("trace_bad_json.jsonl", 2, None)],
)
def test_trace_bad_files(name: str, line: int, field: str | None) -> None:
    path = DATA / name
    proc = run_cli("simulate", "--trace", str(path), "--no-progress")
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert f"{path}:{line}:" in proc.stderr
    if field is not None:
        assert f"field {field!r}" in proc.stderr
    else:
        assert "invalid JSON" in proc.stderr


def test_trace_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.jsonl"
    proc = run_cli("simulate", "--trace", str(path))
    assert proc.returncode == 2
    assert proc.stderr == (
        f"kvcore simulate: error: --trace: cannot read {str(path)!r}: No such file or directory\n"
    )


def test_config_that_cannot_hold_one_request() -> None:
    proc = run_cli("simulate", *SMALL, "--num-blocks", "20")
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "cannot hold even one request" in proc.stderr
    assert "--num-blocks" in proc.stderr


def test_prompt_longer_than_model(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"id": "big", "arrival": 0, "prompt_len": 5000, "output_len": 3}\n')
    proc = run_cli("simulate", "--trace", str(trace), "--max-model-len", "4096")
    assert proc.returncode == 2
    assert "'big' (trace line 1)" in proc.stderr
    assert "--max-model-len" in proc.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--num-blocks", "0"], "--num-blocks"),
        (["--hash", "md5"], "--hash"),
        (["--model", "moe"], "--model"),
        (["--watermark", "1.5"], "--watermark"),
    ],
)
def test_bad_options(args: list[str], needle: str) -> None:
    proc = run_cli("simulate", *args)
    assert proc.returncode == 2
    assert needle in proc.stderr


def test_console_script() -> None:
    candidates = [
        Path(sysconfig.get_path("scripts")) / "kvcore",
        Path(sys.executable).parent / "kvcore",
    ]
    on_path = shutil.which("kvcore")
    if on_path is not None:
        candidates.append(Path(on_path))
    found = [c for c in candidates if c.exists()]
    assert found, f"the kvcore console script is not installed (looked in {candidates})"
    script = found[0]
    proc = subprocess.run(
        [str(script), "simulate", "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0
    assert "--trace" in proc.stdout and "--compare" in proc.stdout


# --------------------------------------------------------------------------------------------
# Against the reference.


@pytest.mark.reference
@needs_reference
def test_compare_reference_subprocess() -> None:
    proc = run_cli("simulate", *SMALL, "--compare", "reference", "--json", timeout=400)
    assert proc.returncode == 0, proc.stderr[-2000:]
    obj = json.loads(proc.stdout)
    check_schema(obj)
    check_schema(obj["reference"] | {"config": {}})
    assert obj["reference"]["backend"] == "reference"
    assert obj["decisions_match"] is True
    assert obj["decisions_checksum"] == obj["reference"]["decisions_checksum"]
    assert obj["speedup"] > 0
    for key in ("steps", "preemptions", "prefix_hit_rate", "blocks_evicted", "peak_usage"):
        assert obj[key] == obj["reference"][key], key


@pytest.mark.reference
@needs_reference
@pytest.mark.parametrize(
    ("model", "blocks", "fn"),
    [
        ("full", 260, "sha256"),
        ("full", 700, "xxhash_cbor"),
        ("hybrid-swa", 700, "sha256_cbor"),
        ("hybrid-mamba", 700, "sha256"),
    ],
)
def test_decisions_identical_to_reference(model: str, blocks: int, fn: str) -> None:
    workload = synthetic_chat(ChatWorkloadParams(num_requests=30, seed=1, max_model_len=4096))
    settings = ManagerSettings(
        num_blocks=blocks, max_model_len=4096, max_num_batched_tokens=512, hash_name=fn
    )
    preset = model_preset(model, 16, sliding_window=256)
    sims = []
    for name in ("kvcore", "reference"):
        sim = Simulator(make_backend(name), preset, settings, SchedulerSettings(), workload)
        sim.run()
        sims.append(sim)
    ours, theirs = sims
    assert ours.stats.finished == theirs.stats.finished == 30
    assert ours.decisions_checksum == theirs.decisions_checksum
    assert list(ours.stats.sample_usage) == list(theirs.stats.sample_usage)
    assert ours.stats.blocks_evicted == theirs.stats.blocks_evicted
    assert ours.stats.preemptions == theirs.stats.preemptions


@pytest.mark.slow
def test_bench_quick() -> None:
    proc = run_cli("bench", "--quick", "--json", timeout=400)
    assert proc.returncode == 0, proc.stderr[-2000:]
    obj = json.loads(proc.stdout)
    names = [r["name"] for r in obj["results"]]
    assert any(n.startswith("pool:") for n in names)
    assert any(n.startswith("hashing:") for n in names)
    assert any(n.startswith("replay:") for n in names)
    for r in obj["results"]:
        assert r["kvcore_us"] > 0
        assert (r["ratio"] is None) == (not obj["reference"])
    if obj["reference"]:
        assert obj["replay_decisions_match"] is True


# --------------------------------------------------------------------------------------------
# In-process: trace validation, bound, config check, interruption.


def _parse(*lines: str) -> list[RequestSpec]:
    return parse_trace(lines, source="t.jsonl")


@pytest.mark.parametrize(
    ("line", "field", "fragment"),
    [
        (
            '{"arrival": 0, "prompt": [1, 2], "output_len": 2, "colour": 1}',
            "colour",
            "unknown field",
        ),
        ('{"prompt": [1, 2], "output_len": 2}', "arrival", "missing"),
        ('{"arrival": -1, "prompt": [1, 2], "output_len": 2}', "arrival", "integer >= 0"),
        ('{"arrival": true, "prompt": [1, 2], "output_len": 2}', "arrival", "integer >= 0"),
        ('{"arrival": 0, "output_len": 2}', "prompt", "exactly one"),
        (
            '{"arrival": 0, "prompt": [1], "prompt_len": 1, "output_len": 2}',
            "prompt",
            "exactly one",
        ),
        ('{"arrival": 0, "prompt": [], "output_len": 2}', "prompt", "non-empty list"),
        ('{"arrival": 0, "prompt": [1, "x"], "output_len": 2}', "prompt", "item 1"),
        ('{"arrival": 0, "prompt": [1, -5], "output_len": 2}', "prompt", "item 1"),
        ('{"arrival": 0, "prompt_len": 0, "output_len": 2}', "prompt_len", "integer >= 1"),
        (
            '{"arrival": 0, "prompt_len": 9, "prefix_len": 3, "output_len": 2}',
            "prefix_len",
            "requires",
        ),
        (
            '{"arrival": 0, "prompt_len": 9, "prefix_group": "g", "prefix_len": 10, "output_len": 2}',
            "prefix_len",
            "[0, prompt_len=9]",
        ),
        (
            '{"arrival": 0, "prompt_len": 9, "prefix_group": "", "output_len": 2}',
            "prefix_group",
            "non-empty",
        ),
        (
            '{"arrival": 0, "prompt": [1], "prefix_group": "g", "output_len": 2}',
            "prefix_group",
            "only allowed",
        ),
        ('{"arrival": 0, "prompt": [1]}', "output_len", "missing"),
        ('{"arrival": 0, "prompt": [1], "output_len": 0}', "output_len", "integer >= 1"),
        ('{"arrival": 0, "prompt": [1], "output_token_ids": []}', "output_token_ids", "non-empty"),
        (
            '{"arrival": 0, "prompt": [1], "output_len": 3, "output_token_ids": [1]}',
            "output_len",
            "does not match",
        ),
        (
            '{"arrival": 0, "prompt": [1], "output_len": 1, "after": "zz"}',
            "after",
            "earlier request",
        ),
        ('{"arrival": 0, "prompt": [1], "output_len": 1, "id": 7}', "id", "non-empty string"),
    ],
)
def test_trace_field_errors(line: str, field: str, fragment: str) -> None:
    good = '{"id": "ok", "arrival": 0, "prompt": [1, 2, 3], "output_len": 2}'
    with pytest.raises(TraceError) as info:
        _parse(good, "", line)
    assert info.value.line == 3
    assert info.value.field == field
    assert str(info.value).startswith(f"t.jsonl:3: field {field!r}: ")
    assert fragment in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("line", "fragment"), [("[1, 2]", "expected a JSON object"), ("{oops", "invalid JSON")]
)
def test_trace_line_errors(line: str, fragment: str) -> None:
    with pytest.raises(TraceError) as info:
        _parse(line)
    assert info.value.line == 1 and info.value.field is None
    assert fragment in str(info.value)


def test_trace_duplicate_id() -> None:
    with pytest.raises(TraceError, match=r"t.jsonl:2: field 'id': duplicate"):
        _parse(*['{"id": "a", "arrival": 0, "prompt": [1], "output_len": 1}'] * 2)


def test_trace_generation_is_deterministic_and_groups_share() -> None:
    lines = [
        '{"id": "a", "arrival": 0, "prompt_len": 50, "prefix_group": "g", "prefix_len": 40, "output_len": 4}',
        '{"id": "b", "arrival": 1, "prompt_len": 30, "prefix_group": "g", "prefix_len": 20, "output_len": 4}',
        '{"id": "c", "arrival": 1, "prompt_len": 30, "output_len": 4, "output_token_ids": [1, 2, 3, 4]}',
    ]
    a, b, c = _parse(*lines)
    assert a.prompt[:20] == b.prompt[:20]
    assert tuple(a.prompt[20:30]) != tuple(b.prompt[20:30])
    assert len(a.prompt) == 50 and len(b.prompt) == 30
    assert tuple(c.output) == (1, 2, 3, 4)
    assert [r.line for r in (a, b, c)] == [1, 2, 3]
    again = _parse(*lines)
    assert again == [a, b, c]
    other = parse_trace(lines, seed=1)
    assert other[0].prompt != a.prompt


def test_unlimited_bound_by_hand() -> None:
    shared = tuple(range(32))
    w = [
        RequestSpec("a", 0, (*shared, 100), (7,)),
        RequestSpec("b", 0, (*shared, 200), (7,)),  # hits both shared blocks: 32 of 33
        RequestSpec("c", 0, shared, (7,)),  # capped at (32 - 1) // 16 = 1 block: 16 of 32
        RequestSpec("d", 0, (5,) * 16, (7,)),  # a miss
    ]
    assert unlimited_cache_hit_bound(w, 16, 4096) == pytest.approx((32 + 16) / (33 + 33 + 32 + 16))
    assert unlimited_cache_hit_bound([], 16, 4096) == 0.0


def test_synthetic_workload_shape() -> None:
    w = synthetic_chat(ChatWorkloadParams(num_requests=200, seed=5, max_model_len=4096))
    assert len(w) == 200
    assert len({r.request_id for r in w}) == 200
    by_id = {r.request_id: r for r in w}
    later = [r for r in w if r.after is not None]
    assert later, "no multi-turn conversations"
    for r in later:
        prev = by_id[r.after]  # type: ignore[index]
        assert list(r.prompt[: len(prev.prompt) + len(prev.output)]) == [*prev.prompt, *prev.output]
    assert all(len(r.prompt) + len(r.output) <= 4096 for r in w)
    assert synthetic_chat(ChatWorkloadParams(num_requests=200, seed=5, max_model_len=4096)) == w


def test_check_config_messages() -> None:
    w = [RequestSpec("x", 0, tuple(range(100)), (1,) * 28)]
    preset = model_preset("full", 16)
    s = SchedulerSettings()
    check_config(preset, ManagerSettings(9, 4096, 512), s, w)  # 128 tokens = 8 blocks + null
    with pytest.raises(ConfigError, match=r"needs 8 blocks .* leaves only 7 usable blocks \("):
        check_config(preset, ManagerSettings(8, 4096, 512), s, w)
    # One usable block, one block needed: singular nouns.
    one = [RequestSpec("y", 0, tuple(range(20)), (1,) * 12)]
    with pytest.raises(ConfigError, match=r"needs 2 blocks .* leaves only 1 usable block \("):
        check_config(preset, ManagerSettings(2, 4096, 512), s, one)
    with pytest.raises(ConfigError, match="at least 2"):
        check_config(preset, ManagerSettings(1, 4096, 512), s, w)


def test_percentile() -> None:
    assert percentile([], 0.5) == 0.0
    assert percentile([5, 1, 3], 0.5) == 3.0
    assert percentile(list(range(1, 101)), 0.99) == 99.0
    assert percentile([4], 0.99) == 4.0


def test_interrupt_in_process(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    real_step = Simulator.step
    calls = {"n": 0}

    def step(self: Simulator) -> None:
        calls["n"] += 1
        if calls["n"] == 40:
            raise KeyboardInterrupt
        real_step(self)

    monkeypatch.setattr(Simulator, "step", step)
    rc = cli.main(["simulate", *SMALL, "--json"])
    assert rc == 130
    obj = json.loads(capsys.readouterr().out)
    assert obj["interrupted"] is True
    assert obj["steps"] == 39
    assert obj["requests"] < obj["requests_total"]


@pytest.mark.parametrize(
    ("gate", "fragment"),
    [(True, "cannot be admitted even into an empty cache"), (False, "only running request")],
)
def test_stall_is_reported(monkeypatch: pytest.MonkeyPatch, gate: bool, fragment: str) -> None:
    # Bypass the up-front check to reach the run-time guards: a 128-token request needs 8
    # blocks of 16 but only 5 are usable.
    import kvcore.simulate.scheduler as sched_mod

    monkeypatch.setattr(sched_mod, "check_config", lambda *a: None)
    w = [RequestSpec("x", 0, tuple(range(100)), (1,) * 28)]
    settings = ManagerSettings(6, 4096, 64)
    sim = Simulator(
        make_backend("kvcore"), model_preset("full", 16), settings, SchedulerSettings(16, gate), w
    )
    with pytest.raises(SimulationStalled, match=fragment):
        sim.run()


def test_compare_without_reference_installed() -> None:
    # The reference (and torch) made unimportable: a clear error before anything runs.
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "sys.modules['vllm'] = None\n"
        "from kvcore.cli import main\n"
        f"sys.exit(main({['simulate', *SMALL, '--compare', 'reference']!r}))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=240, check=False
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("kvcore simulate: error: --compare reference: ")
    assert "the reference (vLLM 0.25.1) is not installed" in proc.stderr
    assert "install it with scripts/install-reference.sh from a kvcore checkout" in proc.stderr
    assert "make install-reference" not in proc.stderr
