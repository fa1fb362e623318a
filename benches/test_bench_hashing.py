"""Request block hashing, kvcore against the reference, in one run (SPEC §5.4).

Workloads: a 4096-token prompt (ids below a 128256-token vocabulary) hashed in 16-token windows (256 blocks) from scratch, without
extra keys and with a LoRA name and cache salt. For each hash function the kvcore and the
reference cases run in the same session; the ratios ``mean_reference / mean_kvcore`` are printed
at the end and written to ``benches/results/hashing.json``. Times are process CPU time.

Run with ``pytest benches/test_bench_hashing.py --benchmark-only``.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvcore import hashing as H

NAMES = ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]
PROMPT_LEN = 4096
HBS = 16
RESULTS = Path(__file__).parent / "results" / "hashing.json"
VOCAB_SIZE = 128_256  # token ids are below the vocabulary size (Llama 3)
_TOKENS = [random.Random(0).randrange(VOCAB_SIZE) for _ in range(PROMPT_LEN)]


@dataclass
class Lora:
    lora_name: str
    adapter_id: int = 1

    @property
    def name(self) -> str:
        return self.lora_name


@dataclass
class BenchRequest:
    """The request fields the hasher reads (SPEC §17)."""

    all_token_ids: list[int]
    lora_request: Lora | None = None
    cache_salt: str | None = None
    mm_features: list[Any] = field(default_factory=list)
    prompt_embeds: Any = None
    block_hashes: list[bytes] = field(default_factory=list)
    _prompt_embeds_per_block_hashes: dict[tuple[int, int], bytes] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


WORKLOADS: dict[str, Callable[[], BenchRequest]] = {
    "prompt4096": lambda: BenchRequest(list(_TOKENS)),
    "prompt4096_lora_salt": lambda: BenchRequest(
        list(_TOKENS), lora_request=Lora("lora-adapter-a"), cache_salt="tenant-42"
    ),
}


@pytest.fixture(scope="module")
def seeded() -> Iterator[None]:
    """PYTHONHASHSEED=0 so that both implementations share NONE_HASH."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONHASHSEED", "0")
        yield


@pytest.fixture(scope="session")
def ratios(request: pytest.FixtureRequest) -> Iterator[dict[str, dict[str, float]]]:
    """Collects mean times per (workload, function, implementation); reports ratios at the end."""
    means: dict[str, dict[str, float]] = {}
    yield means
    report: dict[str, Any] = {"prompt_tokens": PROMPT_LEN, "hash_block_size": HBS, "cases": {}}
    lines = []
    for case, impls in sorted(means.items()):
        entry: dict[str, float] = {f"{k}_mean_s": v for k, v in impls.items()}
        entry["kvcore_per_block_ns"] = impls.get("kvcore", 0.0) / (PROMPT_LEN // HBS) * 1e9
        if "kvcore" in impls and "reference" in impls:
            entry["ratio"] = impls["reference"] / impls["kvcore"]
            lines.append(f"  {case:40s} reference/kvcore = {entry['ratio']:7.1f}x")
        report["cases"][case] = entry
    if not means:
        return
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None or not lines:
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line("")
        reporter.write_line("hashing: mean_reference / mean_kvcore")
        for line in lines:
            reporter.write_line(line)


def _run(
    benchmark: Any,
    hasher: Callable[[Any], list[Any]],
    make: Callable[[], BenchRequest],
    rounds: int,
) -> list[Any]:
    out: list[list[Any]] = []

    def setup() -> tuple[tuple[BenchRequest], dict[str, Any]]:
        return (make(),), {}

    def target(req: BenchRequest) -> None:
        out.append(hasher(req))

    benchmark.pedantic(target, setup=setup, rounds=rounds, warmup_rounds=2)
    return out[-1]


def _hasher(impl: str, name: str) -> Callable[[Any], list[Any]]:
    """The request hasher of ``impl`` for ``name``, with NONE_HASH initialised."""
    if impl == "kvcore":
        fn = H.get_hash_fn_by_name(name)
        H.init_none_hash(fn)
        return H.get_request_block_hasher(HBS, fn)
    pytest.importorskip("vllm")
    import vllm.utils.hashing as ref_hashing
    import vllm.v1.core.kv_cache_utils as ref_utils

    ref_fn = ref_hashing.get_hash_fn_by_name(name)
    ref_utils.init_none_hash(ref_fn)
    hasher: Callable[[Any], list[Any]] = ref_utils.get_request_block_hasher(HBS, ref_fn)
    return hasher


# The implementation is the innermost parameter so that both run back to back per case. Times are
# process CPU time: the work is single-threaded, and wall time on a shared machine mostly
# measures the neighbours.
@pytest.mark.benchmark(timer=time.process_time)
@pytest.mark.parametrize("impl", ["kvcore", pytest.param("reference", marks=pytest.mark.reference)])
@pytest.mark.parametrize("workload", sorted(WORKLOADS))
@pytest.mark.parametrize("name", NAMES)
def test_bench_request_hasher(
    benchmark: Any,
    name: str,
    workload: str,
    impl: str,
    seeded: None,
    ratios: dict[str, dict[str, float]],
) -> None:
    """One implementation's request hasher on a whole prompt; hashes checked against kvcore."""
    assert os.environ["PYTHONHASHSEED"] == "0"
    hasher = _hasher(impl, name)
    benchmark.group = f"request-hash-{workload}-{name}"
    rounds = 300 if impl == "kvcore" else 40
    hashes = _run(benchmark, hasher, WORKLOADS[workload], rounds)
    assert len(hashes) == PROMPT_LEN // HBS
    assert hashes == _hasher("kvcore", name)(WORKLOADS[workload]())
    ratios.setdefault(f"{workload}/{name}", {})[impl] = benchmark.stats.stats.mean
