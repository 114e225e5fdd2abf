"""Every usable backend against the float64 oracle: variants, dtypes, GQA ratios, head dims, lengths, batching.

Backends come from the registry; those unusable on this machine (e.g. triton without CUDA) are skipped with their
reasons. Inputs are fresh random values per test; the oracle runs on the same inputs upcast to float64.
"""

from __future__ import annotations

import pytest
import torch

from tessera.attention import AttentionSpec, attention, causal, sliding_window, varlen_attention
from tests.attention.cases import (
    DTYPE_PARAMS,
    VARIANT_PARAMS,
    Layout,
    Variant,
    backend_params,
    check_against_oracle,
    dense_layout,
    make_inputs,
    oracle,
    randn,
    varlen_layout,
)
from tests.attention.tolerances import assert_matches_oracle

BACKENDS = backend_params()

# Each variant runs on a dense batch (MQA, head_dim 80, queries the last part of the kv) and on a ragged batch
# mixing decode (q_len 1 .. 7, kv up to 520), prefill (q_len = kv_len), chunked prefill (70 queries over 600 keys)
# and empty sequences. Lengths straddle the cpu backend's tiles (64 queries, 256 and 512 keys) without matching them.
LAYOUTS = [
    pytest.param(dense_layout(batch=2, sq=70, skv=100, hq=4, hkv=1, d=80), id="dense"),
    pytest.param(varlen_layout((1, 33, 70, 0, 0, 7, 5), (300, 33, 600, 0, 9, 7, 520), hq=4, hkv=2, d=64), id="varlen"),
]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("variant", VARIANT_PARAMS)
@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_variant(backend: str, dtype: torch.dtype, variant: Variant, layout: Layout, gen: torch.Generator) -> None:
    spec = variant.spec(layout, gen)
    check_against_oracle(backend, layout, spec, dtype, gen)


# (batch, q_len, kv_len, Hq, Hkv, head_dim): GQA ratios 1, 2, 3, 4, 8; head dims 16 .. 256; lengths that are not
# tile multiples; decode (q_len 1), prefill (q_len = kv_len) and chunked prefill (in between).
SHAPES = [
    (1, 1, 1, 8, 8, 16),
    (2, 7, 7, 8, 4, 16),
    (1, 63, 63, 8, 2, 64),
    (2, 65, 65, 8, 1, 64),
    (3, 1, 130, 6, 2, 80),
    (2, 130, 130, 6, 2, 96),
    (2, 1, 257, 8, 1, 128),
    (1, 100, 257, 8, 4, 128),
    (1, 63, 65, 8, 8, 256),
    (1, 1, 600, 8, 2, 256),
    pytest.param((1, 600, 600, 4, 2, 64), marks=pytest.mark.slow),
    pytest.param((1, 257, 600, 6, 2, 128), marks=pytest.mark.slow),
]


def _shape_id(shape: tuple[int, ...]) -> str:
    b, sq, skv, hq, hkv, d = shape
    return f"b{b}-q{sq}-kv{skv}-h{hq}x{hkv}-d{d}"


@pytest.mark.parametrize("masked", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: _shape_id(s) if isinstance(s, tuple) else None)
@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_shapes(backend: str, dtype: torch.dtype, shape: tuple[int, ...], masked: bool, gen: torch.Generator) -> None:
    b, sq, skv, hq, hkv, d = shape
    layout = dense_layout(b, sq, skv, hq, hkv, d)
    spec = AttentionSpec(hq, hkv, d, mask=causal() if masked else None)
    check_against_oracle(backend, layout, spec, dtype, gen)


RAGGED = [
    pytest.param((1,), (1,), id="one-token"),
    pytest.param((0,), (0,), id="empty-seq"),
    pytest.param((0, 3, 0), (0, 3, 5), id="zero-q-and-zero-kv"),
    pytest.param((0, 0), (7, 0), id="no-queries-at-all"),
    pytest.param((1, 1, 1, 1), (1, 63, 65, 257), id="decode-batch"),
    pytest.param((63, 65, 1, 130), (63, 130, 600, 130), id="mixed"),
    pytest.param((1, 8, 1, 3, 2), (1100, 700, 512, 1025, 2), id="long-decode-split-kv", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("q_lens", "kv_lens"), RAGGED)
@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_ragged_lengths(backend: str, dtype: torch.dtype, q_lens, kv_lens, gen: torch.Generator) -> None:
    layout = varlen_layout(q_lens, kv_lens, hq=6, hkv=3, d=64)
    spec = AttentionSpec(6, 3, 64, mask=sliding_window(50))
    check_against_oracle(backend, layout, spec, dtype, gen)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lengths_as_tensors(backend: str, gen: torch.Generator) -> None:
    layout = varlen_layout((3, 1, 5), (3, 9, 12), hq=4, hkv=2, d=32)
    spec = AttentionSpec(4, 2, 32, mask=causal())
    q, k, v = make_inputs(layout, torch.float32, gen)
    for as_tensor in (lambda x: torch.tensor(x), lambda x: torch.tensor(x, dtype=torch.int32)):
        out, lse = varlen_attention(q, k, v, as_tensor(layout.q_lens), as_tensor(layout.kv_lens), spec,
                                    backend=backend, return_lse=True)
        assert_matches_oracle(out, lse, *oracle(q, k, v, layout, spec), torch.float32)


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_return_lse_false_gives_same_output(backend: str, dtype: torch.dtype, gen: torch.Generator) -> None:
    layout = dense_layout(2, 9, 40, 4, 2, 64)
    spec = AttentionSpec(4, 2, 64, mask=causal())
    q, k, v = make_inputs(layout, dtype, gen)
    plain = attention(q, k, v, spec, backend=backend)
    assert isinstance(plain, torch.Tensor)
    with_lse, _ = attention(q, k, v, spec, backend=backend, return_lse=True)
    torch.testing.assert_close(plain, with_lse, rtol=0, atol=0)
    lens = list(layout.q_lens), list(layout.kv_lens)
    flat = [t.reshape(-1, *t.shape[2:]) for t in (q, k, v)]
    plain_varlen = varlen_attention(*flat, *lens, spec, backend=backend)
    assert isinstance(plain_varlen, torch.Tensor) and plain_varlen.shape == (18, 4, 64)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_inputs(backend: str, gen: torch.Generator) -> None:
    """Head-major tensors viewed as token-major, and a strided slice of a larger kv."""
    layout = dense_layout(2, 17, 33, 4, 2, 64)
    spec = AttentionSpec(4, 2, 64, mask=causal())
    q = randn(gen, 2, 4, 17, 64).transpose(1, 2)
    k_big = randn(gen, 2, 33, 4, 64)
    k, v = k_big[:, :, ::2], k_big[:, :, 1::2]
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    out, lse = attention(q, k, v, spec, backend=backend, return_lse=True)
    assert_matches_oracle(out, lse, *oracle(q, k, v, layout, spec), torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_inputs_not_modified(backend: str, gen: torch.Generator) -> None:
    layout = varlen_layout((5, 1), (9, 20), hq=4, hkv=2, d=16)
    q, k, v = make_inputs(layout, torch.bfloat16, gen)
    copies = [t.clone() for t in (q, k, v)]
    varlen_attention(q, k, v, [5, 1], [9, 20], AttentionSpec(4, 2, 16, mask=causal()), backend=backend)
    for before, after in zip(copies, (q, k, v)):
        assert torch.equal(before, after)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dense_without_queries(backend: str, gen: torch.Generator) -> None:
    """Sq = 0 (and B = 0) is a valid, empty call: empty out and lse of the documented shapes."""
    spec = AttentionSpec(4, 2, 16, mask=causal())
    for b, sq, skv in ((2, 0, 5), (0, 3, 5)):
        q, k, v = randn(gen, b, sq, 4, 16), randn(gen, b, skv, 2, 16), randn(gen, b, skv, 2, 16)
        out, lse = attention(q, k, v, spec, backend=backend, return_lse=True)
        assert out.shape == (b, sq, 4, 16) and lse.shape == (b, sq, 4) and lse.dtype == torch.float32


@pytest.mark.parametrize("backend", BACKENDS)
def test_repeated_calls_are_deterministic(backend: str, gen: torch.Generator) -> None:
    layout = varlen_layout((1, 40), (70, 40), hq=8, hkv=2, d=64)
    spec = AttentionSpec(8, 2, 64, mask=causal())
    q, k, v = make_inputs(layout, torch.float32, gen)
    first = varlen_attention(q, k, v, [1, 40], [70, 40], spec, backend=backend, return_lse=True)
    second = varlen_attention(q, k, v, [1, 40], [70, 40], spec, backend=backend, return_lse=True)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
