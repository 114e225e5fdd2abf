"""The engine over a quantized KV cache (int8, fp8 e4m3)."""

from __future__ import annotations

import pytest

from tessera.engine import SamplingParams
from tessera.kv.quantized import KV_FORMATS
from tests.engine.conftest import random_prompts

FORMATS = sorted(KV_FORMATS)


@pytest.mark.parametrize("fmt", FORMATS)
def test_engine_over_a_quantized_cache(make_llm, fmt: str) -> None:
    """Batching, chunked prefill and the prefix cache do not change greedy outputs over quantized pages either (a
    token's codes do not depend on its batch), and the memory budget buys more pages."""
    greedy = SamplingParams(temperature=0.0, max_tokens=10)
    system = random_prompts([9], seed=3)[0]
    prompts = [system + tail for tail in random_prompts([3, 14, 1, 6], seed=4)]
    llm = make_llm(kv_cache_dtype=fmt, max_num_batched_tokens=12)
    batched = [o.token_ids for o in llm.generate(prompts, greedy)]
    single = [make_llm(kv_cache_dtype=fmt, enable_prefix_caching=False).generate([p], greedy)[0].token_ids
              for p in prompts]
    assert batched == single
    assert all(len(t) >= 1 for t in batched)
    memory = 1 << 18
    plain = make_llm(num_pages=None, kv_cache_memory=memory)
    packed = make_llm(num_pages=None, kv_cache_memory=memory, kv_cache_dtype=fmt)
    assert packed.block_manager.num_pages > plain.block_manager.num_pages
