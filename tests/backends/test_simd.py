"""The explicit-SIMD building blocks of the cpu kernels (tessera/backends/cpu/simd.py) against NumPy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from numba import njit
from numba.core.errors import TypingError

from tessera.backends.cpu.attn_microkernels import prefetch_run
from tessera.backends.cpu.simd import (
    LANES,
    prefetch,
    store_sums_4x4,
    vadd,
    vbroadcast,
    vexp,
    vfma,
    vhmax,
    vload,
    vmax,
    vmul,
    vsplat,
    vstore,
    vsub,
    vsum,
    vzero,
)


@njit
def _load_store(src, offset, out):
    vstore(out, 0, vload(src, offset))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_vload_widens_every_storage_dtype(dtype: torch.dtype) -> None:
    x = torch.randn(3 * LANES + 5, generator=torch.Generator().manual_seed(1)).to(dtype)
    bits = {torch.float32: lambda t: t.numpy(), torch.bfloat16: lambda t: t.view(torch.int16).numpy().view(np.uint16),
            torch.float16: lambda t: t.view(torch.int16).numpy()}[dtype](x)
    out = np.full(LANES, np.nan, dtype=np.float32)
    _load_store(bits, 5, out)  # an unaligned offset
    np.testing.assert_array_equal(out, x.float().numpy()[5 : 5 + LANES])


@njit
def _arith(a, b, out):
    x, y = vload(a, 0), vload(b, 0)
    vstore(out, 0, vfma(x, y, vsplat(0.5)))
    vstore(out, LANES, vadd(vmul(x, y), vsub(x, y)))
    vstore(out, 2 * LANES, vmax(x, y))
    vstore(out, 3 * LANES, vbroadcast(a, 3))
    vstore(out, 4 * LANES, vzero())
    return vsum(x), vhmax(y)


def test_lane_arithmetic_matches_numpy() -> None:
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal(LANES, dtype=np.float32), rng.standard_normal(LANES, dtype=np.float32)
    b[4] = -np.inf  # max must keep -inf semantics
    out = np.full(5 * LANES, np.nan, dtype=np.float32)
    total, top = _arith(a, b, out)
    np.testing.assert_allclose(out[:LANES], a * b + 0.5, rtol=1e-6)
    np.testing.assert_allclose(out[LANES : 2 * LANES], a * b + (a - b), rtol=1e-6)
    np.testing.assert_array_equal(out[2 * LANES : 3 * LANES], np.maximum(a, b))
    np.testing.assert_array_equal(out[3 * LANES : 4 * LANES], np.full(LANES, a[3]))
    np.testing.assert_array_equal(out[4 * LANES :], 0.0)
    assert total == pytest.approx(float(a.astype(np.float64).sum()), rel=1e-5, abs=1e-5)
    assert top == b.max()


@njit
def _exp(x, out):
    for i in range(0, x.size, LANES):
        vstore(out, i, vexp(vload(x, i)))


def test_vexp_accuracy_and_limits() -> None:
    x = np.linspace(-90.0, 88.0, 64 * LANES).astype(np.float32)
    x[:4] = [-np.inf, -1e30, -87.5, 0.0]
    out = np.full_like(x, np.nan)
    _exp(x, out)
    ref = np.exp(x.astype(np.float64))
    keep = x > -87.0
    np.testing.assert_allclose(out[keep], ref[keep], rtol=1e-6)
    assert (out[~keep] == 0.0).all()  # exp(-inf) and deep underflow are exactly 0


@njit
def _dots_4x4(q, k, d, out, stride):
    acc0 = vzero(); acc1 = vzero(); acc2 = vzero(); acc3 = vzero()  # noqa: E702
    acc4 = vzero(); acc5 = vzero(); acc6 = vzero(); acc7 = vzero()  # noqa: E702
    acc8 = vzero(); acc9 = vzero(); acc10 = vzero(); acc11 = vzero()  # noqa: E702
    acc12 = vzero(); acc13 = vzero(); acc14 = vzero(); acc15 = vzero()  # noqa: E702
    for x in range(0, d, LANES):
        k0, k1, k2, k3 = vload(k, x), vload(k, d + x), vload(k, 2 * d + x), vload(k, 3 * d + x)
        q0, q1, q2, q3 = vload(q, x), vload(q, d + x), vload(q, 2 * d + x), vload(q, 3 * d + x)
        acc0 = vfma(q0, k0, acc0); acc1 = vfma(q0, k1, acc1); acc2 = vfma(q0, k2, acc2); acc3 = vfma(q0, k3, acc3)  # noqa: E702,E501
        acc4 = vfma(q1, k0, acc4); acc5 = vfma(q1, k1, acc5); acc6 = vfma(q1, k2, acc6); acc7 = vfma(q1, k3, acc7)  # noqa: E702,E501
        acc8 = vfma(q2, k0, acc8); acc9 = vfma(q2, k1, acc9); acc10 = vfma(q2, k2, acc10); acc11 = vfma(q2, k3, acc11)  # noqa: E702,E501
        acc12 = vfma(q3, k0, acc12); acc13 = vfma(q3, k1, acc13); acc14 = vfma(q3, k2, acc14); acc15 = vfma(q3, k3, acc15)  # noqa: E702,E501
        prefetch(k, x + 100_000_000)  # far past the end: a prefetch never faults
    store_sums_4x4(out, 1, stride, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, acc8, acc9, acc10, acc11, acc12,
                   acc13, acc14, acc15)


def test_store_sums_4x4_is_a_4x4_matmul() -> None:
    rng = np.random.default_rng(3)
    d = 3 * LANES
    q, k = rng.standard_normal((4, d), dtype=np.float32), rng.standard_normal((4, d), dtype=np.float32)
    out = np.full(1 + 4 * 7, np.nan, dtype=np.float32)
    _dots_4x4(q, k, d, out, 7)
    got = out[1:].reshape(4, 7)[:, :4]
    np.testing.assert_allclose(got, q.astype(np.float64) @ k.T.astype(np.float64), rtol=1e-5, atol=1e-5)
    untouched = np.delete(np.arange(out.size), [1 + 7 * r + c for r in range(4) for c in range(4)])
    assert np.isnan(out[untouched]).all()  # nothing outside the 4 x 4 block is written


def test_non_contiguous_arrays_are_refused_at_compile_time() -> None:
    x = np.zeros((4, 2 * LANES), dtype=np.float32)[:, ::2]
    with pytest.raises(TypingError, match="C-contiguous"):
        _load_store(x, 0, np.zeros(LANES, dtype=np.float32))
    with pytest.raises(TypingError, match=r"expected an array of \[.float32., .uint16., .int16., .int8., .uint8.\]"):
        _load_store(np.zeros(LANES, dtype=np.float64), 0, np.zeros(LANES, dtype=np.float32))


@njit
def _walk(arr, rows, row, col, left, step, row_elems, out):
    """Step a prefetch cursor until its budget is spent, recording the cursor after every step."""
    n = 0
    while left > 0:
        row, col, left = prefetch_run(arr, rows, row, col, left, step, row_elems)
        out[n, 0] = row
        out[n, 1] = col
        out[n, 2] = left
        n += 1
    return n


@pytest.mark.parametrize(("dtype", "row_elems", "step"), [
    (np.float32, 1024, 64),  # Hkv=8, D=128: 4 lines per step
    (np.float32, 80, 48),  # rows that are not a whole number of lines
    (np.uint16, 16, 32),  # a 16-bit line (32 elements) longer than a row
])
def test_prefetch_run_cursor_covers_its_budget_in_address_order(dtype, row_elems: int, step: int) -> None:
    """The cursor moves one cache line per hint, wraps from a row's end into the next row, and stops at its budget:
    the steps cover exactly ``left`` elements, which is what keeps it from reading offsets past the rows it was
    given."""
    line = 64 // np.dtype(dtype).itemsize
    rows = np.random.default_rng(4).permutation(7).astype(np.int64) * row_elems  # shuffled token rows (pages)
    arr = np.zeros(7 * row_elems, dtype=dtype)
    start_row, start_col = 2, line  # mid-row start
    budget = (7 - start_row) * row_elems - start_col
    out = np.zeros((budget, 3), dtype=np.int64)
    n = _walk(arr, rows, start_row, start_col, budget, step, row_elems, out)
    assert n == -(-budget // step)
    assert (out[:n, 2] == np.maximum(budget - step * np.arange(1, n + 1), 0)).all()
    for i in range(n):  # every step advanced by its hints: whole lines, in address order
        covered = min(step * (i + 1), budget)
        hints = -(-step // line) * i + -(-(covered - step * i) // line)
        pos = start_row * row_elems + start_col + hints * line
        assert (out[i, 0], out[i, 1]) == (pos // row_elems, pos % row_elems)
