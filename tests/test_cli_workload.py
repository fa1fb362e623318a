"""Lazy workloads of ``kvcore simulate``: the same decisions as a list, without holding it."""

from __future__ import annotations

import json
import operator
import random
import time
import tracemalloc
from array import array
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvcore.simulate.backends import ManagerSettings, make_backend, model_preset
from kvcore.simulate.scheduler import ConfigError, SchedulerSettings, Simulator, check_config
from kvcore.simulate.trace import TraceError, TraceWorkload, load_trace, parse_trace
from kvcore.simulate.workload import (
    ChatWorkloadParams,
    HitBound,
    KeySet,
    RequestSpec,
    SpecList,
    SyntheticChat,
    Tokens,
    Workload,
    release_order,
    synthetic_chat,
    unlimited_cache_hit_bound,
)

PRESET = model_preset("full", 16)
SETTINGS = ManagerSettings(num_blocks=400, max_model_len=4096, max_num_batched_tokens=512)


def run(workload: Workload | Sequence[RequestSpec]) -> Simulator:
    sim = Simulator(make_backend("kvcore"), PRESET, SETTINGS, SchedulerSettings(16), workload)
    sim.run()
    return sim


def same_run(a: Simulator, b: Simulator) -> None:
    assert a.decisions_checksum == b.decisions_checksum
    assert a.stats.finished == b.stats.finished == a.stats.requests_total
    assert a.stats.steps == b.stats.steps
    assert a.stats.preemptions == b.stats.preemptions
    assert list(a.stats.sample_usage) == list(b.stats.sample_usage)
    assert a.hit_rate_bound() == b.hit_rate_bound()


def test_synthetic_lazy_equals_list() -> None:
    params = ChatWorkloadParams(num_requests=40, seed=2, max_model_len=4096)
    lazy = run(SyntheticChat(params))
    eager = run(synthetic_chat(params))
    same_run(lazy, eager)
    assert lazy.stats.preemptions > 0  # the small cache makes the check meaningful
    assert lazy.hit_rate_bound() == unlimited_cache_hit_bound(
        synthetic_chat(params), 16, SETTINGS.max_model_len
    )


def test_synthetic_is_generated_on_demand() -> None:
    workload = SyntheticChat(ChatWorkloadParams(num_requests=10**9))
    start = time.monotonic()
    first = next(workload.releases())
    assert time.monotonic() - start < 1.0
    assert first[0] == 0 and len(workload) == 10**9
    # Pulling requests one by one holds only the conversation being generated.
    tracemalloc.start()
    try:
        for _, (_, spec) in zip(range(500), workload.releases(), strict=False):
            assert spec.prompt
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2_000_000, peak


def test_check_config_needs_no_generation_when_the_bound_fits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    workload = SyntheticChat(ChatWorkloadParams(num_requests=10**9))

    def refuse() -> None:
        raise AssertionError("the workload was generated")

    monkeypatch.setattr(workload, "_generate", refuse)
    settings = ManagerSettings(num_blocks=2000, max_model_len=8192, max_num_batched_tokens=2048)
    check_config(PRESET, settings, SchedulerSettings(), workload)


def test_check_config_goes_through_the_requests_when_the_bound_does_not_fit() -> None:
    workload = SyntheticChat(ChatWorkloadParams(num_requests=30, max_model_len=4096))
    bound = workload.size_bound()
    longest = max(len(s.prompt) + len(s.output) for s in synthetic_chat(workload.params))
    assert longest <= bound.total_len
    # Enough for the longest request of these 30, not for the bound: it runs.
    blocks = -(-longest // 16) + 1
    assert blocks < -(-bound.total_len // 16) + 1
    settings = ManagerSettings(blocks, 4096, 512)
    check_config(PRESET, settings, SchedulerSettings(), workload)
    assert (PRESET, blocks, 4096, 512) in workload.checked
    with pytest.raises(ConfigError, match=f"use --num-blocks {blocks} or more"):
        check_config(PRESET, ManagerSettings(blocks - 1, 4096, 512), SchedulerSettings(), workload)


def write_trace(path: Path, seed: int, n: int = 80) -> None:
    """An unsorted trace with conversation chains, shared prefixes and equal arrivals."""
    rng = random.Random(seed)
    lines: list[str] = []
    ids: list[str] = []
    for i in range(n):
        obj: dict[str, object] = {"id": f"r{i}", "arrival": rng.randint(0, 30)}
        if ids and rng.random() < 0.35:
            obj["after"] = rng.choice(ids)
            obj["arrival"] = rng.randint(0, 4)
        if rng.random() < 0.5:
            plen = rng.randint(1, 600)
            obj.update(prompt_len=plen, prefix_group=rng.choice("ab"))
            obj["prefix_len"] = rng.randint(0, plen)
        else:
            obj["prompt"] = [rng.randrange(40) for _ in range(rng.randint(1, 200))]
        obj["output_len"] = rng.randint(1, 40)
        lines.append(json.dumps(obj))
        ids.append(f"r{i}")
        if rng.random() < 0.1:
            lines.append("")
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("seed", [0, 1])
def test_trace_streamed_equals_list(tmp_path: Path, seed: int) -> None:
    path = tmp_path / "t.jsonl"
    write_trace(path, seed)
    workload = TraceWorkload(path, seed=3)
    listed = parse_trace(path.read_text().splitlines(), seed=3, source=str(path))
    assert load_trace(path, seed=3) == listed
    assert len(workload) == len(listed)
    # Release order: first turns by arrival, each followed by the turns that wait for it.
    order = [i for i, _ in workload.releases()]
    assert sorted(order) == list(range(len(listed)))
    released = {i: spec for i, spec in workload.releases()}
    assert [released[i] for i in range(len(listed))] == listed
    same_run(run(workload), run(listed))


def test_unsorted_trace_serves_by_arrival(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"id": "late", "arrival": 50, "prompt_len": 40, "output_len": 3}\n'
        '{"id": "early", "arrival": 0, "prompt_len": 40, "output_len": 3}\n'
        '{"id": "next", "after": "early", "arrival": 0, "prompt_len": 60, "output_len": 2}\n'
    )
    workload = TraceWorkload(path)
    assert [i for i, _ in workload.releases()] == [1, 2, 0]
    sim = run(workload)
    assert sim.stats.finished == 3
    assert sim.stats.sample_step[0] == 0
    assert sim.stats.sample_step[-1] >= 50


def test_trace_changed_while_replayed(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"id": "a", "arrival": 0, "prompt_len": 40, "output_len": 3}\n')
    workload = TraceWorkload(path)
    path.write_text('{"id": "b", "arrival": 0, "prompt_len": 40, "output_len": 3}\n')
    with pytest.raises(TraceError, match=r"t.jsonl:1: the file changed"):
        list(workload.releases())


def test_trace_scan_generates_no_tokens(tmp_path: Path) -> None:
    # A prompt far too long is reported by the configuration check without drawing its tokens.
    path = tmp_path / "t.jsonl"
    path.write_text(f'{{"id": "huge", "arrival": 0, "prompt_len": {2**31 - 1}, "output_len": 1}}\n')
    start = time.monotonic()
    workload = TraceWorkload(path)
    with pytest.raises(ConfigError, match=r"'huge' \(trace line 1\) has a 2147483647-token"):
        check_config(PRESET, SETTINGS, SchedulerSettings(), workload)
    assert time.monotonic() - start < 5


def test_release_order() -> None:
    #            0   1   2   3   4   5
    arrivals = [5, 0, 1, 0, 5, 2]
    parents = [-1, -1, 0, -1, 2, 1]
    assert release_order(arrivals, parents) == [1, 5, 3, 0, 2, 4]
    assert release_order([], []) == []


def test_spec_list_rejects_a_wait_for_a_later_request() -> None:
    with pytest.raises(ValueError, match="waits for 'b', which is not an earlier request"):
        SpecList([RequestSpec("a", 0, (1,), (2,), after="b"), RequestSpec("b", 0, (1,), (2,))])


def test_hit_bound_out_of_order_equals_in_order() -> None:
    specs = synthetic_chat(ChatWorkloadParams(num_requests=60, seed=4, max_model_len=4096))
    in_order = HitBound(16, 4096)
    for i, spec in enumerate(specs):
        in_order.add(i, spec)
    shuffled = HitBound(16, 4096)
    order = list(range(len(specs)))
    random.Random(0).shuffle(order)
    for i in order:
        shuffled.add(i, specs[i])
    assert shuffled.added == in_order.added == 60
    assert (shuffled.hit_tokens, shuffled.prompt_tokens) == (
        in_order.hit_tokens,
        in_order.prompt_tokens,
    )
    assert 0 < in_order.rate < 1


def test_conversation_turns_share_their_tokens() -> None:
    specs = synthetic_chat(ChatWorkloadParams(num_requests=80, seed=1, max_model_len=4096))
    by_id = {s.request_id: s for s in specs}
    later = [s for s in specs if s.after is not None]
    assert later
    for spec in later:
        prev = by_id[spec.after]  # type: ignore[index]
        assert isinstance(spec.prompt, Tokens) and isinstance(prev.prompt, Tokens)
        # The earlier turn's segments are reused, not copied.
        assert spec.prompt.parts[: len(prev.prompt.parts)] == prev.prompt.parts
        assert any(part is prev.output for part in spec.prompt.parts)


def test_tokens_sequence() -> None:
    a = array("H", [1, 2, 3])
    b = array("H", [4, 5])
    t = Tokens((a, array("H"), b))
    assert len(t) == 5 and list(t) == [1, 2, 3, 4, 5]
    assert [t[i] for i in range(-5, 5)] == [1, 2, 3, 4, 5] * 2
    for i in (5, -6):
        with pytest.raises(IndexError):
            t[i]
    assert t[1:4] == [2, 3, 4] and t[::-2] == [5, 3, 1]
    assert t == (1, 2, 3, 4, 5) and t == array("I", [1, 2, 3, 4, 5])
    assert operator.eq((1, 2, 3, 4, 5), t)  # the tuple defers to Tokens
    assert t != (1, 2, 3, 4) and t != (1, 2, 3, 4, 6) and t != "12345"
    u = t + array("H", [6])
    assert list(u) == [1, 2, 3, 4, 5, 6] and list(t) == [1, 2, 3, 4, 5]
    assert u.parts[:2] == (a, b)
    assert list(t + t) == [1, 2, 3, 4, 5] * 2
    with pytest.raises(TypeError):
        hash(t)
    assert "5 tokens" in repr(t)


def test_key_set_matches_a_set() -> None:
    rng = random.Random(7)
    keys = [rng.getrandbits(64) - 2**63 for _ in range(5000)] + [0, 1, -1, 2**63 - 1, -(2**63)]
    got = KeySet(4)
    want: set[int] = set()
    for key in keys + keys[:500]:
        assert got.add(key) == ((key or 1) not in want)  # 0 and 1 share a slot
        want.add(key or 1)
    assert len(got) == len(want)
    assert all(key in got for key in keys)
    assert 12345 not in got and "x" not in got
    with pytest.raises(ValueError, match="power of two"):
        KeySet(3)
