"""Property tests: random specs and ragged batches, every non-reference backend against the float64 oracle, plus
split-KV merging, batching and permutation invariance."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tessera.attention import AttentionSpec, custom_mask, merge_states, varlen_attention
from tests.attention import strategies as S
from tests.attention.cases import Layout, backend_params, make_inputs, oracle, run_api, varlen_layout
from tests.attention.tolerances import assert_matches_oracle

BACKENDS = backend_params(include_reference=False)


def _draw_case(data, batch_independent: bool = False, max_seqs: int = 4, dense: bool = False):
    hq, hkv, d = data.draw(S.heads(), label="heads")
    if dense:
        q_lens, kv_lens = data.draw(S.dense_lens(), label="lens")
        layout = Layout(hq, hkv, d, q_lens, kv_lens, dense=True)
    else:
        q_lens, kv_lens = data.draw(S.ragged_lens(max_seqs=max_seqs), label="lens")
        layout = varlen_layout(q_lens, kv_lens, hq, hkv, d)
    spec = AttentionSpec(
        hq, hkv, d,
        mask=data.draw(S.masks(layout.batch, layout.max_kv + (0 if dense else 3), batch_independent), label="mask"),
        score=data.draw(S.scores(hq, batch_independent), label="score"),
        sinks=data.draw(S.sinks(hq), label="sinks"),
        scale=data.draw(S.scales, label="scale"),
    )
    dtype = data.draw(S.dtypes, label="dtype")
    gen = torch.Generator().manual_seed(data.draw(S.seeds, label="seed"))
    return layout, spec, dtype, gen


def _varlen(q, k, v, layout: Layout, spec: AttentionSpec, backend: str):
    return varlen_attention(q, k, v, list(layout.q_lens), list(layout.kv_lens), spec, backend=backend, return_lse=True)


@pytest.mark.parametrize("backend", BACKENDS)
@S.PROPERTY_SETTINGS
@given(data=st.data())
def test_matches_oracle(backend: str, data) -> None:
    layout, spec, dtype, gen = _draw_case(data, dense=data.draw(st.booleans(), label="dense"))
    q, k, v = make_inputs(layout, dtype, gen)
    out, lse = run_api(q, k, v, layout, spec, backend)
    assert_matches_oracle(out, lse, *oracle(q, k, v, layout, spec), dtype, f"{spec!r} {layout}")


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@S.PROPERTY_SETTINGS
@given(data=st.data())
def test_split_kv_merges_to_whole(backend: str, data) -> None:
    """Attention over kv positions < split merged (by lse) with attention over the rest equals the whole.

    The sinks join only the first part's denominator, so the merge must also place them correctly.
    """
    layout, spec, dtype, gen = _draw_case(data)
    split = data.draw(st.integers(0, layout.max_kv), label="split")
    left = custom_mask(lambda b, h, q_pos, kv_pos: kv_pos < split)
    right = custom_mask(lambda b, h, q_pos, kv_pos: kv_pos >= split)
    base, sizes = spec.mask, (spec.num_q_heads, spec.num_kv_heads, spec.head_dim)
    spec_a = AttentionSpec(*sizes, mask=left if base is None else base & left, score=spec.score, sinks=spec.sinks,
                           scale=spec.scale)
    spec_b = AttentionSpec(*sizes, mask=right if base is None else right & base, score=spec.score, scale=spec.scale)
    q, k, v = make_inputs(layout, dtype, gen)
    out, lse = merge_states(*_varlen(q, k, v, layout, spec_a, backend), *_varlen(q, k, v, layout, spec_b, backend))
    assert_matches_oracle(out, lse, *oracle(q, k, v, layout, spec), dtype, f"split at {split}: {spec!r} {layout}")


def _sequence(t: torch.Tensor, starts: list[int], lens: tuple[int, ...], s: int) -> torch.Tensor:
    return t[starts[s] : starts[s] + lens[s]]


def _starts(lens: tuple[int, ...]) -> list[int]:
    return [sum(lens[:i]) for i in range(len(lens))]


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@S.PROPERTY_SETTINGS
@given(data=st.data())
def test_batch_equals_sequences_alone(backend: str, data) -> None:
    """Each sequence of a ragged batch gets what it gets run alone (masks that ignore the batch index)."""
    layout, spec, dtype, gen = _draw_case(data, batch_independent=True, max_seqs=5)
    q, k, v = make_inputs(layout, dtype, gen)
    out, lse = _varlen(q, k, v, layout, spec, backend)
    qs, ks = _starts(layout.q_lens), _starts(layout.kv_lens)
    for s, (ql, kl) in enumerate(zip(layout.q_lens, layout.kv_lens)):
        one = varlen_layout((ql,), (kl,), spec.num_q_heads, spec.num_kv_heads, spec.head_dim)
        parts = ((q, qs, layout.q_lens), (k, ks, layout.kv_lens), (v, ks, layout.kv_lens))
        alone = _varlen(*(_sequence(t, starts, lens, s) for t, starts, lens in parts), one, spec, backend)
        rows = slice(qs[s], qs[s] + ql)
        assert_matches_oracle(out[rows], lse[rows], alone[0].double(), alone[1].double(), dtype,
                              f"sequence {s} batched vs alone: {spec!r} {layout}")


@pytest.mark.parametrize("backend", BACKENDS)
@S.PROPERTY_SETTINGS
@given(data=st.data())
def test_permuting_sequences_permutes_outputs(backend: str, data) -> None:
    layout, spec, dtype, gen = _draw_case(data, batch_independent=True, max_seqs=5)
    perm = data.draw(st.permutations(range(layout.batch)), label="perm")
    q, k, v = make_inputs(layout, dtype, gen)
    out, lse = _varlen(q, k, v, layout, spec, backend)
    qs, ks = _starts(layout.q_lens), _starts(layout.kv_lens)
    pick = lambda t, starts, lens: torch.cat([_sequence(t, starts, lens, s) for s in perm])  # noqa: E731
    permuted = varlen_layout([layout.q_lens[s] for s in perm], [layout.kv_lens[s] for s in perm],
                             spec.num_q_heads, spec.num_kv_heads, spec.head_dim)
    p_out, p_lse = _varlen(pick(q, qs, layout.q_lens), pick(k, ks, layout.kv_lens), pick(v, ks, layout.kv_lens),
                           permuted, spec, backend)
    expect_out, expect_lse = pick(out, qs, layout.q_lens), pick(lse, qs, layout.q_lens)
    assert_matches_oracle(p_out, p_lse, expect_out.double(), expect_lse.double(), dtype,
                          f"permutation {perm}: {spec!r} {layout}")


@S.PROPERTY_SETTINGS
@given(seed=S.seeds, rows=st.integers(1, 5), heads=st.integers(1, 4), empty=st.floats(0.0, 1.0))
def test_merge_states_identities(seed: int, rows: int, heads: int, empty: float) -> None:
    """Merging with an empty state is the identity; merging is commutative; empty with empty stays 0 / -inf."""
    g = torch.Generator().manual_seed(seed)
    out_a, out_b = torch.randn(rows, heads, 8, generator=g), torch.randn(rows, heads, 8, generator=g)
    lse_a, lse_b = torch.randn(rows, heads, generator=g) * 4, torch.randn(rows, heads, generator=g) * 4
    gone = torch.rand(rows, heads, generator=g) < empty
    lse_b = lse_b.masked_fill(gone, float("-inf"))
    out_b = out_b.masked_fill(gone.unsqueeze(-1), 0.0)
    none_out, none_lse = torch.zeros_like(out_a), torch.full_like(lse_a, float("-inf"))

    same_out, same_lse = merge_states(out_a, lse_a, none_out, none_lse)
    torch.testing.assert_close(same_out, out_a)
    torch.testing.assert_close(same_lse, lse_a)
    ab, ba = merge_states(out_a, lse_a, out_b, lse_b), merge_states(out_b, lse_b, out_a, lse_a)
    torch.testing.assert_close(ab, ba)
    empty_out, empty_lse = merge_states(none_out, none_lse, none_out, none_lse)
    assert torch.equal(empty_out, none_out) and torch.equal(empty_lse, none_lse)
