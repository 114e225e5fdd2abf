"""Hypothesis strategies for attention specs and ragged batches (shared by the property tests)."""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from tessera.attention import (
    Mask,
    ScoreMod,
    alibi,
    alibi_slopes,
    causal,
    chunked,
    custom_mask,
    custom_score,
    document,
    prefix_lm,
    sliding_window,
    softcap,
)
from tests.attention.cases import (
    DTYPES, batch_dependent, dilated, distance_bias, head_dependent, head_temperature, nothing,
)

#: Stable in CI: derandomized (the examples follow from the test), no example database, no deadline (the first
#: call of a Numba kernel compiles it). For a longer bug hunt set TESSERA_PROPERTY_EXAMPLES=500: examples then
#: become random (reproduce a failure with the printed @reproduce_failure blob).
_EXAMPLES = os.environ.get("TESSERA_PROPERTY_EXAMPLES")
PROPERTY_SETTINGS = settings(
    max_examples=int(_EXAMPLES) if _EXAMPLES else 30,
    deadline=None,
    derandomize=not _EXAMPLES,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

dtypes = st.sampled_from(DTYPES)
seeds = st.integers(0, 2**32 - 1)


@st.composite
def heads(draw) -> tuple[int, int, int]:
    """``(num_q_heads, num_kv_heads, head_dim)`` with GQA groups 1, 2, 3, 4 or 8."""
    hkv = draw(st.sampled_from([1, 2, 3]))
    group = draw(st.sampled_from([1, 2, 3, 4, 8]))
    d = draw(st.sampled_from([16, 32, 64, 80, 96, 128, 256]))
    return hkv * group, hkv, d


def _seq_lens(max_kv: int) -> st.SearchStrategy[tuple[int, int]]:
    """One sequence's ``(q_len, kv_len)``, biased towards decode and prefill shapes."""
    kv = st.integers(0, max_kv)
    return kv.flatmap(lambda n: st.tuples(
        st.one_of(st.just(min(n, 1)), st.just(n), st.integers(0, n)), st.just(n)))


@st.composite
def ragged_lens(draw, max_seqs: int = 4, max_kv: int = 600) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(q_lens, kv_lens)`` of 1 .. max_seqs sequences in shuffled order; at least one has a query."""
    kv = draw(st.integers(1, max_kv))
    first = (draw(st.one_of(st.just(1), st.just(kv), st.integers(1, kv))), kv)
    pairs = draw(st.permutations([first] + draw(st.lists(_seq_lens(max_kv), max_size=max_seqs - 1))))
    return tuple(q for q, _ in pairs), tuple(k for _, k in pairs)


@st.composite
def dense_lens(draw, max_batch: int = 3, max_kv: int = 600) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(q_lens, kv_lens)`` of a dense batch: every sequence has the same ``Sq <= Skv``, ``Sq >= 1``."""
    batch = draw(st.integers(1, max_batch))
    kv = draw(st.integers(1, max_kv))
    q = draw(st.one_of(st.just(1), st.just(kv), st.integers(1, kv)))
    return (q,) * batch, (kv,) * batch


def _doc_ids(seed: int, rows: int | None, length: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (length,) if rows is None else (rows, length)
    return torch.cumsum((torch.rand(shape, generator=g) < 0.1).long(), dim=-1)


def base_masks(num_seqs: int, doc_len: int, batch_independent: bool = False) -> st.SearchStrategy[Mask]:
    """Every built-in mask plus a few custom ones; ``doc_len`` is the length of document ids to draw."""
    options = [
        st.just(causal()),
        st.builds(sliding_window, st.integers(1, 700)),
        st.builds(chunked, st.integers(1, 300)),
        st.builds(prefix_lm, st.integers(0, 700)),
        seeds.map(lambda s: document(_doc_ids(s, None, doc_len))),
        st.sampled_from([custom_mask(head_dependent), custom_mask(dilated), custom_mask(nothing)]),
    ]
    if not batch_independent:
        options.append(seeds.map(lambda s: document(_doc_ids(s, num_seqs, doc_len))))
        options.append(st.just(custom_mask(batch_dependent)))
    return st.one_of(*options)


def masks(num_seqs: int, doc_len: int, batch_independent: bool = False) -> st.SearchStrategy[Mask | None]:
    """None, a base mask, or a composition of up to three with ``& | ~``."""
    base = base_masks(num_seqs, doc_len, batch_independent)
    composed = st.recursive(base, lambda inner: st.one_of(
        st.tuples(inner, inner).map(lambda ab: ab[0] & ab[1]),
        st.tuples(inner, inner).map(lambda ab: ab[0] | ab[1]),
        inner.map(lambda m: ~m),
    ), max_leaves=3)
    return st.one_of(st.none(), composed)


def scores(num_q_heads: int, batch_independent: bool = False) -> st.SearchStrategy[ScoreMod | None]:
    """None, softcap, ALiBi (paper slopes or random ones of either sign) or a custom score function."""
    custom = [custom_score(head_temperature)] + ([] if batch_independent else [custom_score(distance_bias)])
    return st.one_of(
        st.none(),
        st.floats(1.0, 50.0).map(softcap),
        st.just(alibi(alibi_slopes(num_q_heads))),
        st.lists(st.floats(-0.5, 0.5), min_size=num_q_heads, max_size=num_q_heads).map(
            lambda s: alibi(torch.tensor(s))),
        st.sampled_from(custom),
    )


def sinks(num_q_heads: int) -> st.SearchStrategy[torch.Tensor | None]:
    return st.one_of(st.none(), st.lists(st.floats(-5.0, 8.0), min_size=num_q_heads, max_size=num_q_heads).map(
        lambda s: torch.tensor(s)))


scales = st.one_of(st.none(), st.floats(0.01, 1.0))
