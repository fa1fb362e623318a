"""kvcore inside vLLM 0.25.1: a drop-in KV cache manager and scheduler classes.

``vllm serve MODEL --scheduler-cls kvcore.vllm.Scheduler`` (or ``kvcore.vllm.AsyncScheduler``)
runs vLLM's own scheduler with kvcore's KV cache manager; kvcore's ``vllm.general_plugins`` entry
point (:mod:`kvcore.vllm.plugin`) then gives vLLM's engine kvcore's native request block hasher
(:func:`get_request_block_hasher`, byte-identical hashes). This module imports vLLM; the rest of
kvcore never does.
"""

from kvcore.vllm._convert import convert_kv_cache_config, convert_spec
from kvcore.vllm.hashing import get_request_block_hasher
from kvcore.vllm.manager import KVCacheManager
from kvcore.vllm.request import Request
from kvcore.vllm.scheduler import AsyncScheduler, Scheduler

__all__ = [
    "AsyncScheduler",
    "KVCacheManager",
    "Request",
    "Scheduler",
    "convert_kv_cache_config",
    "convert_spec",
    "get_request_block_hasher",
]
