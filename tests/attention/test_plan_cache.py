"""``attention`` / ``varlen_attention`` reuse a cpu plan for the same spec object and lengths, and only then."""

from __future__ import annotations

import torch

from tessera.attention import AttentionSpec, api, attention, causal, document, sliding_window
from tests.attention.cases import dense_layout, oracle, randn
from tests.attention.tolerances import assert_matches_oracle


def test_same_spec_and_lengths_reuse_the_plan(gen: torch.Generator) -> None:
    spec = AttentionSpec(8, 2, 32, mask=causal() & sliding_window(20))
    api._PLANS.clear()
    for kv_len in (50, 50, 70):  # the second call hits, the third has new lengths
        layout = dense_layout(2, 1, kv_len, 8, 2, 32)
        q, k, v = randn(gen, 2, 1, 8, 32), randn(gen, 2, kv_len, 2, 32), randn(gen, 2, kv_len, 2, 32)
        out, lse = attention(q, k, v, spec, backend="cpu", return_lse=True)
        assert_matches_oracle(out, lse, *oracle(q, k, v, layout, spec), torch.float32, f"kv_len={kv_len}")
    assert [key[1:] for key in api._PLANS] == [((1, 1), (50, 50)), ((1, 1), (70, 70))]


def test_specs_with_tensors_are_planned_every_call(gen: torch.Generator) -> None:
    doc_ids = torch.tensor([0] * 20 + [1] * 20)
    spec = AttentionSpec(4, 2, 16, mask=document(doc_ids) & causal())
    q, k, v = randn(gen, 1, 3, 4, 16), randn(gen, 1, 40, 2, 16), randn(gen, 1, 40, 2, 16)
    api._PLANS.clear()
    first = attention(q, k, v, spec, backend="cpu")
    spec.mask.a.doc_ids[:] = 0  # changed in place: a cached plan would be stale
    spec.mask.a._np[:] = 0
    second = attention(q, k, v, spec, backend="cpu")
    assert not api._PLANS
    assert not torch.equal(first, second)
    ref, _ = oracle(q, k, v, dense_layout(1, 3, 40, 4, 2, 16), spec)
    assert torch.allclose(second.double(), ref, atol=1e-5)
