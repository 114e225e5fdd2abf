"""Unit tests of the cpu backend's building blocks: Numba math, the fused softmax step, kv runs, threading."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from numba import njit

from tessera.attention import AttentionSpec, attention, causal, sliding_window, varlen_attention
from tessera.attention.tiles import EMPTY, FULL, PARTIAL
from tessera.backends.cpu.numba_math import FASTMATH, fast_exp, row_max, widen
from tessera.backends.cpu.prefill import kv_runs
from tessera.backends.cpu.softmax_kernel import online_softmax_tile


@njit(fastmath=FASTMATH)
def _exp_all(x, out):
    for i in range(x.shape[0]):
        out[i] = fast_exp(x[i])


@njit(fastmath=FASTMATH)
def _max_of(x):
    return row_max(x, x.shape[0], np.empty(16, dtype=np.float32))


@njit
def _widen_all(bits, out):
    for i in range(bits.shape[0]):
        out[i] = widen(bits[i])


def test_fast_exp_relative_error_and_limits() -> None:
    rng = np.random.default_rng(0)
    x = rng.uniform(-87.0, 88.0, 100_003).astype(np.float32)
    out = np.empty_like(x)
    _exp_all(x, out)
    ref = np.exp(x.astype(np.float64))
    assert np.max(np.abs(out - ref) / ref) < 5e-7
    specials = np.array([-np.inf, -200.0, -87.5, 0.0], dtype=np.float32)
    out = np.empty_like(specials)
    _exp_all(specials, out)
    assert out.tolist() == [0.0, 0.0, 0.0, 1.0]


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 100, 513])
def test_row_max_matches_numpy(n: int) -> None:
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    if n > 3:
        x[3] = -np.inf
    assert _max_of(x) == (x.max() if n else -np.inf)


def test_widen_bf16_and_fp16_bits_exactly() -> None:
    values = torch.randn(257) * 100
    for dtype, view in ((torch.bfloat16, np.uint16), (torch.float16, np.int16)):
        stored = values.to(dtype)
        out = np.empty(257, dtype=np.float32)
        _widen_all(stored.view(torch.int16).numpy().view(view), out)
        assert np.array_equal(out, stored.float().numpy())


def test_online_softmax_tile_matches_two_step_reference() -> None:
    gen = torch.Generator().manual_seed(1)
    first, second = torch.randn(6, 37, generator=gen) * 4, torch.randn(6, 37, generator=gen) * 4
    first[2] = -math.inf  # a row fully masked in the first tile only
    second[2, :5] = -math.inf
    first[4] = -math.inf
    second[4] = -math.inf  # fully masked in both tiles
    m, l, alpha = torch.full((6,), -math.inf), torch.zeros(6), torch.empty(6)
    tiles = [first.clone(), second.clone()]
    for tile in tiles:
        online_softmax_tile(tile.numpy(), m.numpy(), l.numpy(), alpha.numpy())
    both = torch.cat([first, second], dim=1).double()
    expected_m = both.amax(dim=1)
    kept = torch.isfinite(expected_m)
    assert torch.equal(torch.isfinite(m), kept)
    torch.testing.assert_close(m[kept].double(), expected_m[kept])
    expected_l = torch.exp(both[kept] - expected_m[kept, None]).sum(dim=1)
    torch.testing.assert_close(l[kept].double(), expected_l, rtol=1e-6, atol=0)
    assert l[4] == 0 and torch.all(tiles[1][4] == 0)  # a row with nothing kept contributes nothing
    # float32 rounding of (score - max) for scores ~20 apart already moves exp by ~1e-6 relative
    torch.testing.assert_close(tiles[1][kept].double(), torch.exp(second[kept].double() - expected_m[kept, None]),
                               rtol=3e-6, atol=1e-30)


def test_kv_runs_merge_visited_tiles_and_keep_partial_subranges() -> None:
    lo = np.arange(0, 640, 64)
    hi = lo + 64
    classes = np.array([EMPTY, PARTIAL, FULL, FULL, FULL, FULL, FULL, FULL, FULL, PARTIAL], dtype=np.int8)
    runs = kv_runs(classes, lo, hi, max_len=256)
    assert [(r.start, r.stop) for r in runs] == [(64, 320), (320, 576), (576, 640)]
    assert [r.partial for r in runs] == [[(64, 128)], [], [(576, 640)]]
    assert [r.has_full for r in runs] == [True, True, False]
    gap = np.array([PARTIAL, PARTIAL, EMPTY, PARTIAL], dtype=np.int8)
    runs = kv_runs(gap, lo[:4], hi[:4], max_len=512)
    assert [(r.start, r.stop, r.partial) for r in runs] == [(0, 128, [(0, 128)]), (192, 256, [(192, 256)])]


@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_restores_thread_settings_and_agrees_across_thread_counts(threads: int) -> None:
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 200, 4, 32, generator=gen) for _ in range(3))
    k, v = k[:, :, :2], v[:, :, :2]
    spec = AttentionSpec(4, 2, 32, mask=causal() & sliding_window(70))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = attention(q, k.contiguous(), v.contiguous(), spec, backend="cpu")
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(previous)
    ref = attention(q, k.contiguous(), v.contiguous(), spec, backend="reference")  # float64 inside
    torch.testing.assert_close(out, ref, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("q_tile", [48, 64, 128, 256])
def test_every_prefill_q_tile_matches_the_reference(q_tile: int) -> None:
    """The ``prefill_q_tile`` candidates (and an odd size, not a power of two) against the float64 reference:
    a sliding window and a ragged batch whose prompts end inside a tile, with prefix keys before the queries."""
    from tessera.tuning import overriding

    gen = torch.Generator().manual_seed(3)
    spec = AttentionSpec(6, 2, 32, mask=causal() & sliding_window(150))
    q_lens, kv_lens = (300, 1, 77), (300, 40, 200)
    q = torch.randn(sum(q_lens), 6, 32, generator=gen)
    k, v = (torch.randn(sum(kv_lens), 2, 32, generator=gen) for _ in range(2))
    with overriding("prefill_q_tile", q_tile):
        out = varlen_attention(q, k, v, q_lens, kv_lens, spec, backend="cpu")
    ref = varlen_attention(q, k, v, q_lens, kv_lens, spec, backend="reference")
    torch.testing.assert_close(out, ref, rtol=2e-4, atol=2e-5)
