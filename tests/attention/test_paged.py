"""The conformance suite over a paged KV cache: plan once, run per layer, against the float64 oracle.

Pages are shuffled (a sequence's pages are scattered through the pool), last pages are partial, unused pages hold
random data that must never leak in, and one batch mixes prefill, prefill after a cached prefix, decode and
multi-token verification.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.attention import AttentionSpec, causal, plan, sliding_window
from tests.attention.cases import (
    DTYPE_PARAMS,
    VARIANT_PARAMS,
    VARIANTS,
    Layout,
    backend_params,
    oracle,
    randn,
    seed_of,
    varlen_layout,
)
from tests.attention.tolerances import assert_matches_oracle

BACKENDS = backend_params()
# prefill, prefill after a cached prefix, decode, verification (q 2..8), a one-token sequence, a page-boundary length
MIXED_Q = (37, 9, 1, 4, 1, 1)
MIXED_KV = (37, 70, 131, 50, 1, 64)


def paged_inputs(layout: Layout, page_size: int, dtype: torch.dtype, gen: torch.Generator):
    """q, a shuffled page pool holding every sequence's K/V, its page table, and the same K/V packed contiguously."""
    hkv, d = layout.num_kv_heads, layout.head_dim
    pages_per_seq = [math.ceil(kl / page_size) for kl in layout.kv_lens]
    num_pages = sum(pages_per_seq) + 3  # spare pages full of random data that must never be read
    k_pages = randn(gen, num_pages, page_size, hkv, d, dtype=dtype)
    v_pages = randn(gen, num_pages, page_size, hkv, d, dtype=dtype)
    order = torch.randperm(num_pages, generator=gen)
    table = torch.full((layout.batch, max(max(pages_per_seq, default=0), 1)), -1, dtype=torch.int32)
    ks, vs, used = [], [], 0
    for s, (n, kl) in enumerate(zip(pages_per_seq, layout.kv_lens)):
        table[s, :n] = order[used : used + n].to(torch.int32)
        used += n
        ks.append(k_pages[table[s, :n].long()].reshape(-1, hkv, d)[:kl])
        vs.append(v_pages[table[s, :n].long()].reshape(-1, hkv, d)[:kl])
    q = randn(gen, sum(layout.q_lens), layout.num_q_heads, d, dtype=dtype)
    return q, k_pages, v_pages, table, torch.cat(ks), torch.cat(vs)


def check_paged(backend: str, layout: Layout, spec: AttentionSpec, page_size: int, dtype: torch.dtype,
                gen: torch.Generator) -> None:
    q, k_pages, v_pages, table, k, v = paged_inputs(layout, page_size, dtype, gen)
    p = plan(spec, list(layout.q_lens), list(layout.kv_lens), table, page_size, backend=backend)
    out, lse = p.run(q, k_pages, v_pages, return_lse=True)
    ref_out, ref_lse = oracle(q, k, v, layout, spec)
    assert_matches_oracle(out, lse, ref_out, ref_lse, dtype, f"{backend} paged ps={page_size} {spec!r} {layout}")


@pytest.mark.parametrize("variant", VARIANT_PARAMS)
@pytest.mark.parametrize("dtype", DTYPE_PARAMS[:2])
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_variant_over_pages(backend: str, dtype: torch.dtype, variant, request) -> None:
    gen = torch.Generator().manual_seed(seed_of(request.node.nodeid))
    layout = varlen_layout(MIXED_Q, MIXED_KV, 8, 2, 64)
    check_paged(backend, layout, variant.spec(layout, gen), 16, dtype, gen)


PAGE_VARIANTS = [v for v in VARIANTS if v.name in {
    "causal", "window16", "chunked16_causal", "document2d_causal", "custom_dilated", "alibi_causal", "sinks_causal",
}]


@pytest.mark.parametrize("variant", [pytest.param(v, id=v.name) for v in PAGE_VARIANTS])
@pytest.mark.parametrize("page_size", [1, 8, 64])
@pytest.mark.parametrize("backend", BACKENDS)
def test_page_sizes(backend: str, page_size: int, variant, request) -> None:
    gen = torch.Generator().manual_seed(seed_of(request.node.nodeid))
    layout = varlen_layout(MIXED_Q, MIXED_KV, 6, 2, 32)  # GQA ratio 3
    check_paged(backend, layout, variant.spec(layout, gen), page_size, torch.float32, gen)


@pytest.mark.parametrize("backend", BACKENDS)
def test_long_decode_splits_kv_over_pages(backend: str, request) -> None:
    gen = torch.Generator().manual_seed(seed_of(request.node.nodeid))
    layout = varlen_layout((1, 3), (1500, 777), 8, 1, 64)  # MQA; split-KV parts cross page boundaries
    check_paged(backend, layout, AttentionSpec(8, 1, 64, mask=sliding_window(900)), 16, torch.bfloat16, gen)


@pytest.mark.parametrize("backend", BACKENDS)
def test_batched_equals_each_request_alone(backend: str, request) -> None:
    gen = torch.Generator().manual_seed(seed_of(request.node.nodeid))
    layout = varlen_layout(MIXED_Q, MIXED_KV, 4, 2, 32)
    spec = AttentionSpec(4, 2, 32, mask=causal() & sliding_window(40))
    q, k_pages, v_pages, table, _, _ = paged_inputs(layout, 8, torch.float32, gen)
    batched = plan(spec, list(layout.q_lens), list(layout.kv_lens), table, 8, backend=backend).run(q, k_pages, v_pages)
    start = 0
    for s, (ql, kl) in enumerate(zip(layout.q_lens, layout.kv_lens)):
        alone = plan(spec, [ql], [kl], table[s : s + 1], 8, backend=backend).run(q[start : start + ql], k_pages, v_pages)
        torch.testing.assert_close(batched[start : start + ql], alone, rtol=1e-5, atol=1e-6)
        start += ql


def test_one_plan_serves_every_layer() -> None:
    gen = torch.Generator().manual_seed(7)
    layout = varlen_layout(MIXED_Q, MIXED_KV, 4, 2, 32)
    spec = AttentionSpec(4, 2, 32, mask=causal())
    p = None
    for _layer in range(3):
        q, k_pages, v_pages, table, k, v = paged_inputs(layout, 16, torch.float32, torch.Generator().manual_seed(7))
        q, k_pages, v_pages = q + randn(gen, *q.shape), k_pages + randn(gen, *k_pages.shape), v_pages * 2
        k, v = _repack(k_pages, v_pages, table, layout, 16)
        p = p or plan(spec, list(layout.q_lens), list(layout.kv_lens), table, 16, backend="cpu")
        out, lse = p.run(q, k_pages, v_pages, return_lse=True)
        assert_matches_oracle(out, lse, *oracle(q, k, v, layout, spec), torch.float32, "layer reuse")


def _repack(k_pages, v_pages, table, layout: Layout, page_size: int):
    ks, vs = [], []
    for s, kl in enumerate(layout.kv_lens):
        pages = table[s, : math.ceil(kl / page_size)].long()
        ks.append(k_pages[pages].reshape(-1, *k_pages.shape[2:])[:kl])
        vs.append(v_pages[pages].reshape(-1, *v_pages.shape[2:])[:kl])
    return torch.cat(ks), torch.cat(vs)


@settings(max_examples=30, deadline=None, derandomize=True, database=None)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 9), st.integers(0, 90)), min_size=1, max_size=4),
    page_size=st.sampled_from([1, 3, 8, 16]),
    window=st.integers(1, 50),
    kv_heads=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 2**16),
)
def test_property_cpu_matches_reference_over_pages(lengths, page_size, window, kv_heads, seed) -> None:
    q_lens = tuple(ql for ql, extra in lengths)
    kv_lens = tuple(ql + extra for ql, extra in lengths)
    layout = varlen_layout(q_lens, kv_lens, 4, kv_heads, 16)
    spec = AttentionSpec(4, kv_heads, 16, mask=causal() & sliding_window(window))
    check_paged("cpu", layout, spec, page_size, torch.float32, torch.Generator().manual_seed(seed))


def test_plan_errors_are_clear() -> None:
    spec = AttentionSpec(4, 2, 16, mask=causal())
    table = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="needs 3 pages"):
        plan(spec, [1, 1], [20, 5], table, 8)
    with pytest.raises(ValueError, match="q_len 6 > kv_len 5"):
        plan(spec, [1, 6], [4, 5], table, 8)
    with pytest.raises(TypeError, match="int32 tensor"):
        plan(spec, [1, 1], [4, 5], table.float(), 8)
    with pytest.raises(ValueError, match=r"\[batch, max_pages\] with batch = 2"):
        plan(spec, [1, 1], [4, 5], table[:1], 8)
    with pytest.raises(ValueError, match="page_size must be an int >= 1"):
        plan(spec, [1, 1], [4, 5], table, 0)
    with pytest.raises(ValueError, match="negative page id"):
        plan(spec, [1, 1], [4, 5], torch.tensor([[0, 1], [-1, 0]], dtype=torch.int32), 8)
    p = plan(spec, [1, 1], [4, 5], torch.tensor([[0, 9], [3, 9]], dtype=torch.int32), 8)
    q, pages = torch.randn(2, 4, 16), torch.randn(4, 8, 2, 16)
    with pytest.raises(ValueError, match="uses page 3 but the cache has only 3 pages"):
        p.run(q, pages[:3], pages[:3])
    with pytest.raises(ValueError, match=r"\[num_pages, 8, 2, 16\]"):
        p.run(q, pages[:, :4], pages[:, :4])
    with pytest.raises(ValueError, match=r"q must be \[sum\(q_lens\), Hq, D\]"):
        p.run(q[:1], pages, pages)
    with pytest.raises(TypeError, match="share one dtype"):
        p.run(q, pages.bfloat16(), pages.bfloat16())


def shared_prefix_batch(gen: torch.Generator, dtype: torch.dtype, prefix_pages: int, suffix_lens: list[int],
                        hkv: int = 2, d: int = 32):
    """Decode requests whose first ``prefix_pages`` pages are the same pages, plus one unrelated decode."""
    page_size = 16
    own = [math.ceil((prefix_pages * page_size + n) / page_size) - prefix_pages for n in suffix_lens]
    num_pages = prefix_pages + sum(own) + 30
    order = torch.randperm(num_pages, generator=gen).to(torch.int32)
    shared, rest = order[:prefix_pages], order[prefix_pages:]
    kv_lens = [prefix_pages * page_size + n for n in suffix_lens] + [300]
    table = torch.zeros(len(kv_lens), max(kv_lens) // page_size + 1, dtype=torch.int32)
    used = 0
    for s, n in enumerate(own):
        table[s, :prefix_pages] = shared
        table[s, prefix_pages : prefix_pages + n] = rest[used : used + n]
        used += n
    table[-1, :19] = rest[used : used + 19]  # the unrelated request
    k_pages = randn(gen, num_pages, page_size, hkv, d, dtype=dtype)
    v_pages = randn(gen, num_pages, page_size, hkv, d, dtype=dtype)
    layout = varlen_layout([1] * len(kv_lens), kv_lens, 8, hkv, d)
    k, v = _repack(k_pages, v_pages, table, layout, page_size)
    q = randn(gen, len(kv_lens), 8, d, dtype=dtype)
    return layout, q, k_pages, v_pages, table, k, v


@pytest.mark.parametrize("mask_name", ["none", "causal", "window", "alibi"])
@pytest.mark.parametrize("dtype", DTYPE_PARAMS[:2])
def test_shared_prefix_cascade_matches_oracle(mask_name: str, dtype: torch.dtype) -> None:
    from tessera.attention import alibi, alibi_slopes
    from tessera.backends.cpu.cascade import MIN_PREFIX_KEYS

    gen = torch.Generator().manual_seed(seed_of(mask_name))
    prefix_pages = MIN_PREFIX_KEYS // 16 + 3
    layout, q, k_pages, v_pages, table, k, v = shared_prefix_batch(gen, dtype, prefix_pages, [1, 17, 40, 5])
    extra = {"none": {}, "causal": {"mask": causal()}, "window": {"mask": sliding_window(100)},
             "alibi": {"mask": causal(), "score": alibi(alibi_slopes(8))}}[mask_name]
    spec = AttentionSpec(8, 2, 32, sinks=randn(gen, 8), **extra)
    p = plan(spec, list(layout.q_lens), list(layout.kv_lens), table, 16, backend="cpu")
    out, lse = p.run(q, k_pages, v_pages, return_lse=True)
    assert_matches_oracle(out, lse, *oracle(q, k, v, layout, spec), dtype, f"cascade {mask_name}")
    cascades = p._state.cascades  # white-box: the cascade is used exactly where it cannot change the result
    if mask_name in ("none", "causal"):
        assert [c.members for c in cascades] == [[0, 1, 2, 3]] and cascades[0].prefix_len == prefix_pages * 16
    else:
        assert cascades == []


def test_shared_prefix_option_off_reads_each_cache_alone() -> None:
    """``plan(shared_prefix=False)`` plans no cascade and computes the same attention (to float32 rounding)."""
    from tessera.backends.cpu.cascade import MIN_PREFIX_KEYS

    gen = torch.Generator().manual_seed(seed_of("shared_prefix_off"))
    layout, q, k_pages, v_pages, table, k, v = shared_prefix_batch(gen, torch.float32, MIN_PREFIX_KEYS // 16 + 2,
                                                                   [1, 9, 30])
    spec = AttentionSpec(8, 2, 32, mask=causal())
    on, off = (plan(spec, list(layout.q_lens), list(layout.kv_lens), table, 16, backend="cpu", shared_prefix=flag)
               for flag in (True, False))
    out_on = on.run(q, k_pages, v_pages)
    out_off, lse_off = off.run(q, k_pages, v_pages, return_lse=True)
    assert len(on._state.cascades) == 1 and off._state.cascades == []
    assert_matches_oracle(out_off, lse_off, *oracle(q, k, v, layout, spec), torch.float32, "shared_prefix=False")
    torch.testing.assert_close(out_on, out_off, rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="shared_prefix must be a bool"):
        plan(spec, list(layout.q_lens), list(layout.kv_lens), table, 16, shared_prefix="no")


CASCADE_SHAPES = [
    pytest.param(2, 32, None, id="kernel"),
    pytest.param(1, 64, None, id="kernel-mqa-key-parts"),  # one kv head: the prefix is cut into parts, then merged
    pytest.param(4, 48, "softcap", id="kernel-softcap"),  # head dim 48: 3 vectors; 5 members x 2 rows pad to a block
    pytest.param(2, 40, None, id="blas-fallback"),  # not a multiple of the SIMD width: BLAS query tiles
]


@pytest.mark.parametrize(("hkv", "d", "score"), CASCADE_SHAPES)
@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_cascade_prefix_paths_match_oracle(hkv: int, d: int, score: str | None, dtype: torch.dtype) -> None:
    """Both implementations of the cascade's prefix pass (the Numba kernel and BLAS tiles) against the oracle,
    with more than one key tile, a partial last tile and every storage dtype."""
    from tessera.attention import softcap
    from tessera.backends.cpu.cascade import MIN_PREFIX_KEYS

    gen = torch.Generator().manual_seed(seed_of(f"{hkv}-{d}-{score}-{dtype}"))
    prefix_pages = MIN_PREFIX_KEYS // 16 + 5  # 336 keys: 5 tiles of 60 keys and a partial one
    layout, q, k_pages, v_pages, table, k, v = shared_prefix_batch(gen, dtype, prefix_pages, [1, 17, 40, 5, 9],
                                                                   hkv=hkv, d=d)
    spec = AttentionSpec(8, hkv, d, mask=causal(), score=softcap(20.0) if score else None)
    p = plan(spec, list(layout.q_lens), list(layout.kv_lens), table, 16, backend="cpu")
    out, lse = p.run(q, k_pages, v_pages, return_lse=True)
    assert [c.members for c in p._state.cascades] == [[0, 1, 2, 3, 4]]
    assert_matches_oracle(out, lse, *oracle(q, k, v, layout, spec), dtype, f"cascade hkv={hkv} d={d} {score}")


@pytest.mark.parametrize("serial_limit", [0, 1 << 20], ids=["pool-merge", "serial-merge"])
def test_cascade_merge_paths_match_oracle(serial_limit: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefix merge on the pool (large groups) and on the calling thread (small ones) give the oracle's result."""
    from tessera.backends.cpu import cascade

    monkeypatch.setattr(cascade, "SERIAL_MERGE_ELEMENTS", serial_limit)
    gen = torch.Generator().manual_seed(seed_of(f"merge-{serial_limit}"))
    layout, q, k_pages, v_pages, table, k, v = shared_prefix_batch(gen, torch.float32, cascade.MIN_PREFIX_KEYS // 16 + 3,
                                                                   [1, 7, 30], d=64)
    spec = AttentionSpec(8, 2, 64, mask=causal())
    p = plan(spec, list(layout.q_lens), list(layout.kv_lens), table, 16, backend="cpu")
    out, lse = p.run(q, k_pages, v_pages, return_lse=True)
    assert len(p._state.cascades) == 1
    assert_matches_oracle(out, lse, *oracle(q, k, v, layout, spec), torch.float32, f"cascade merge {serial_limit}")
