"""Shared pytest fixtures for kvcore's tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest


@pytest.fixture
def hash_seed(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Sets ``PYTHONHASHSEED=0`` so that ``init_none_hash`` is deterministic (SPEC HASH-10).

    Both the reference's and kvcore's ``init_none_hash`` read the variable when called, so
    tests that compare hashes call them after requesting this fixture.
    """
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    yield "0"


@pytest.fixture
def make_reference_request() -> Callable[..., Any]:
    """Factory for the reference's ``Request`` with minimal vLLM objects.

    Call it as ``make(request_id, prompt_token_ids, block_hasher=None, cache_salt=None,
    max_tokens=16, **kwargs)``; extra keyword arguments go to the reference constructor.
    """
    pytest.importorskip("vllm.v1.request")
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    def make(
        request_id: str,
        prompt_token_ids: list[int],
        block_hasher: Any = None,
        cache_salt: str | None = None,
        max_tokens: int = 16,
        **kwargs: Any,
    ) -> Any:
        return Request(
            request_id,
            list(prompt_token_ids),
            SamplingParams(max_tokens=max_tokens),
            None,
            cache_salt=cache_salt,
            block_hasher=block_hasher,
            **kwargs,
        )

    return make
