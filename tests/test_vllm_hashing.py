"""kvcore's native block hasher for vLLM's requests, and the engine plugin that selects it."""

from __future__ import annotations

import random
import subprocess
import sys
from typing import Any

import pytest

pytest.importorskip("vllm.v1.core.kv_cache_utils")

from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.utils import hashing as vllm_hashing
from vllm.v1.core import kv_cache_utils
from vllm.v1.request import Request

import kvcore.hashing
import kvcore.vllm
import kvcore.vllm.plugin
from kvcore._native import RequestBlockHasher

pytestmark = pytest.mark.reference


@pytest.mark.parametrize("name", ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"])
@pytest.mark.parametrize("extra", ["none", "salt", "lora"])
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_hashes_identical_to_vllm(name: str, extra: str, block_size: int) -> None:
    """Same hashes as vLLM's hasher through prefill and decode, for each function and key."""
    fn = getattr(vllm_hashing, name)
    kv_cache_utils.init_none_hash(fn)
    rng = random.Random(f"{name}{extra}{block_size}")
    prompt = [rng.randrange(50_000) for _ in range(rng.randrange(100, 400))]
    kwargs: dict[str, Any] = {}
    if extra == "salt":
        kwargs["cache_salt"] = "tenant-7"
    elif extra == "lora":
        kwargs["lora_request"] = LoRARequest("adapter", 3, "/nonexistent")
    ours_hasher = kvcore.vllm.get_request_block_hasher(block_size, fn)
    assert isinstance(ours_hasher, RequestBlockHasher)
    reqs = [
        Request("r", list(prompt), SamplingParams(max_tokens=99), None, block_hasher=h, **kwargs)
        for h in (kv_cache_utils.get_request_block_hasher(block_size, fn), ours_hasher)
    ]
    for _ in range(3 * block_size + 5):
        token = rng.randrange(50_000)
        for r in reqs:
            r.append_output_token_ids(token)
    ref, ours = reqs
    assert ours.block_hashes == ref.block_hashes
    assert len(ref.block_hashes) == ref.num_tokens // block_size


def test_hasher_follows_vllms_none_hash() -> None:
    """The first block chains from vLLM's NONE_HASH as it is when the hasher runs."""
    fn = vllm_hashing.sha256
    hasher = kvcore.vllm.get_request_block_hasher(4, fn)
    firsts = []
    for _ in range(2):
        kv_cache_utils.init_none_hash(fn)
        ref = kv_cache_utils.get_request_block_hasher(4, fn)
        a = Request("a", [1, 2, 3, 4], SamplingParams(max_tokens=2), None, block_hasher=ref)
        b = Request("b", [1, 2, 3, 4], SamplingParams(max_tokens=2), None, block_hasher=hasher)
        assert a.block_hashes == b.block_hashes
        firsts.append(b.block_hashes[0])
    assert firsts[0] != firsts[1]  # a new random NONE_HASH each time (no PYTHONHASHSEED)


def test_plugin_selects_native_hasher_only_with_kvcore_scheduler(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine gets kvcore's hasher after a kvcore scheduler was built, vLLM's otherwise."""
    import vllm.v1.engine.core as engine_core

    original = engine_core.get_request_block_hasher
    monkeypatch.setattr(engine_core, "get_request_block_hasher", original)
    monkeypatch.setattr(kvcore.vllm.plugin, "_scheduler_built", False)
    monkeypatch.setattr(kvcore.vllm.plugin, "_registered", False)
    monkeypatch.setattr(engine_core, "Request", engine_core.Request)
    kvcore.vllm.plugin.register()
    kvcore.vllm.plugin.register()  # idempotent
    wrapped = engine_core.get_request_block_hasher
    assert wrapped.__wrapped__ is original
    fn = vllm_hashing.sha256
    assert not isinstance(wrapped(16, fn), RequestBlockHasher)
    kvcore.vllm.plugin.note_scheduler_built()
    assert isinstance(wrapped(16, fn), RequestBlockHasher)


def test_plugin_gives_the_engine_kvcores_request_class(monkeypatch: pytest.MonkeyPatch) -> None:
    """After a kvcore scheduler was built, the engine builds its requests as
    ``kvcore.vllm.Request`` (vLLM's own class until then, and without the plugin)."""
    import vllm.v1.engine.core as engine_core
    from vllm.v1.engine import EngineCoreRequest

    monkeypatch.setattr(engine_core, "Request", Request)
    monkeypatch.setattr(
        engine_core, "get_request_block_hasher", engine_core.get_request_block_hasher
    )
    monkeypatch.setattr(kvcore.vllm.plugin, "_scheduler_built", False)
    monkeypatch.setattr(kvcore.vllm.plugin, "_registered", False)
    kvcore.vllm.plugin.note_scheduler_built()
    assert engine_core.Request is Request  # not registered: nothing changes
    kvcore.vllm.plugin.register()
    assert engine_core.Request is Request
    kvcore.vllm.plugin.note_scheduler_built()
    assert engine_core.Request is kvcore.vllm.Request
    hasher = kvcore.vllm.get_request_block_hasher(4, vllm_hashing.sha256)
    core_request = EngineCoreRequest(
        request_id="e",
        prompt_token_ids=[1, 2, 3, 4, 5],
        mm_features=None,
        sampling_params=SamplingParams(max_tokens=3),
        pooling_params=None,
        arrival_time=0.0,
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
    )
    built = engine_core.Request.from_engine_core_request(core_request, hasher)
    assert type(built) is kvcore.vllm.Request
    assert isinstance(built, Request)
    assert (built.request_id, built.num_prompt_tokens, built.num_tokens) == ("e", 5, 5)
    assert "num_computed_tokens" not in vars(built)  # a slot, not an instance attribute
    assert len(built.block_hashes) == 1


def test_vllm_loads_the_entry_point() -> None:
    """vLLM's own plugin loader finds kvcore's entry point in the installed metadata."""
    code = (
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "import vllm.v1.engine.core as c\n"
        "assert getattr(c.get_request_block_hasher, '__kvcore_wrapper__', False)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_hasher_reads_vllm_token_lists_natively() -> None:
    """A vLLM request's ``all_token_ids`` (a ``ConstantList``) is read from the list it wraps:
    its hashes are vLLM's and the Python closure never runs; any other view goes to it. As
    vLLM's hasher, the tokens are read only when a window is full."""
    from vllm.v1.utils import ConstantList

    fn = vllm_hashing.sha256
    kv_cache_utils.init_none_hash(fn)
    python_calls: list[Any] = []
    fallback = kvcore.hashing.get_request_block_hasher(
        4, kvcore.hashing.sha256, none_hash=lambda: kv_cache_utils.NONE_HASH
    )

    def counted(request: Any) -> Any:
        python_calls.append(request)
        return fallback(request)

    def none_hash() -> bytes:
        value: bytes = kv_cache_utils.NONE_HASH
        return value

    hasher = RequestBlockHasher("sha256", 4, none_hash, counted, (ConstantList, "_x"))
    ref = kv_cache_utils.get_request_block_hasher(4, fn)
    reqs = [
        Request("r", list(range(10)), SamplingParams(max_tokens=99), None, block_hasher=h)
        for h in (ref, hasher)
    ]
    for token in range(30):
        for r in reqs:
            r.append_output_token_ids(token)
    assert reqs[1].block_hashes == reqs[0].block_hashes
    assert len(reqs[0].block_hashes) == 10
    assert python_calls == []

    class Other:
        """A request whose token view is no ConstantList, then one wrapping a tuple."""

        block_hashes: list[Any] = []  # noqa: RUF012
        num_tokens = 8
        all_token_ids: Any = tuple(range(8))
        lora_request = cache_salt = prompt_embeds = None
        mm_features: list[Any] = []  # noqa: RUF012

    other = Other()
    assert hasher(other) == fallback(other)
    assert len(python_calls) == 1
    other.all_token_ids = ConstantList(tuple(range(8)))
    assert hasher(other) == fallback(other)
    assert len(python_calls) == 2

    class NoFullWindow(Other):
        num_tokens = 3

        @property
        def all_token_ids(self) -> Any:
            raise AssertionError("read without a full window")

    assert hasher(NoFullWindow()) == []
    assert len(python_calls) == 2
