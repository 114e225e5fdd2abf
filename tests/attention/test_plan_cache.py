"""``attention`` / ``varlen_attention`` reuse a backend plan for specs of the same structure and the same lengths,
and only then."""

from __future__ import annotations

import pytest
import torch

from tessera.attention import AttentionSpec, api, attention, causal, chunked, document, prefix_lm, sliding_window, softcap
from tessera.attention.plan_cache import PlanCache
from tests.attention.cases import dense_layout, oracle, randn
from tests.attention.tolerances import assert_matches_oracle


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_same_structure_and_lengths_reuse_the_plan(gen: torch.Generator, backend: str) -> None:
    api.PLANS.clear()
    for kv_len in (50, 50, 70):  # the second call hits (with a new but equal spec), the third has new lengths
        spec = AttentionSpec(8, 2, 32, mask=causal() & sliding_window(20))
        layout = dense_layout(2, 1, kv_len, 8, 2, 32)
        q, k, v = randn(gen, 2, 1, 8, 32), randn(gen, 2, kv_len, 2, 32), randn(gen, 2, kv_len, 2, 32)
        out, lse = attention(q, k, v, spec, backend=backend, return_lse=True)
        assert_matches_oracle(out, lse, *oracle(q, k, v, layout, spec), torch.float32, f"kv_len={kv_len}")
    assert [key[2:] for key in api.PLANS._plans] == [((1, 1), (50, 50)), ((1, 1), (70, 70))]
    assert {key[0] for key in api.PLANS._plans} == {backend}


def test_structure_keys_tell_specs_apart() -> None:
    def key(**kw):
        return AttentionSpec(8, 2, 32, **kw).structure_key()

    assert key(mask=causal()) == key(mask=causal())
    assert key(mask=sliding_window(20) & causal()) == key(mask=sliding_window(20) & causal())
    distinct = [key(), key(mask=causal()), key(mask=sliding_window(20)), key(mask=sliding_window(21)),
                key(mask=chunked(20)), key(mask=prefix_lm(20)), key(mask=~causal()),
                key(mask=causal() & sliding_window(20)), key(mask=causal() | sliding_window(20)),
                key(mask=causal(), score=softcap(30.0)), key(mask=causal(), score=softcap(50.0)),
                key(mask=causal(), scale=0.5), AttentionSpec(8, 8, 32, mask=causal()).structure_key()]
    assert len(set(distinct)) == len(distinct)
    assert key(mask=causal(), sinks=torch.zeros(8)) is None  # tensors a caller may change in place
    assert key(mask=document(torch.zeros(8, dtype=torch.int64))) is None
    assert key(mask=causal() & document(torch.zeros(8, dtype=torch.int64))) is None


def test_specs_with_tensors_are_planned_every_call(gen: torch.Generator) -> None:
    doc_ids = torch.tensor([0] * 20 + [1] * 20)
    spec = AttentionSpec(4, 2, 16, mask=document(doc_ids) & causal())
    q, k, v = randn(gen, 1, 3, 4, 16), randn(gen, 1, 40, 2, 16), randn(gen, 1, 40, 2, 16)
    api.PLANS.clear()
    first = attention(q, k, v, spec, backend="cpu")
    spec.mask.a.doc_ids[:] = 0  # changed in place: a cached plan would be stale
    spec.mask.a._np[:] = 0
    second = attention(q, k, v, spec, backend="cpu")
    assert not len(api.PLANS)
    assert not torch.equal(first, second)
    ref, _ = oracle(q, k, v, dense_layout(1, 3, 40, 4, 2, 16), spec)
    assert torch.allclose(second.double(), ref, atol=1e-5)


def test_plan_cache_evicts_the_least_recently_used() -> None:
    from tessera.backends.base import RaggedBatch

    cache, spec, built = PlanCache(capacity=2), AttentionSpec(4, 2, 16, mask=causal()), []

    def get(n: int) -> object:
        return cache.get("cpu", spec, RaggedBatch((1,), (n,)), lambda: built.append(n) or n)

    assert [get(1), get(2), get(1), get(3), get(2), get(1)] == [1, 2, 1, 3, 2, 1]
    # the hit on 1 made 2 the oldest, so 3 evicted 2; the second 2 then evicted 1
    assert built == [1, 2, 3, 2, 1]
    with pytest.raises(ValueError, match="capacity"):
        PlanCache(capacity=0)
