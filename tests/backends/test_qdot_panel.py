"""The row-panel int8-activation kernels (``backends/cpu/ops/_qdot_panel.py``): the repacked layout, every output
written and no other, against the float64 oracle of the quantized activation, and their place in ``qmatmul``."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from tessera.backends.cpu.ops import (
    _qdot, _qdot_kernels, _qdot_kpanel, _qdot_panel, _qdot_q6panel, _qdot_q8panel,
)
from tessera.backends.cpu.ops._int8_simd import VNNI512
from tessera.backends.reference.ops.quant import qmatmul_f64
from tessera.kernels import quant as Q
from tessera.tuning.random_weights import random_ggml_weight
from tests.cpu_variants import skip_unless_runs
from tests.kernels.conftest import gen  # noqa: F401  (the seeded-generator fixture)
from tests.kernels.tolerances import assert_close_to_oracle


def _weight(fmt: str, n: int, k: int, half: bool, gen: torch.Generator) -> Q.QuantizedWeight:
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen).add(0.1)
    qw = Q.quantize(w, fmt, 32)
    if half:  # GGUF keeps its scales (and Q4_1 mins) in float16
        qw = dataclasses.replace(qw, scales=qw.scales.half(), mins=None if qw.mins is None else qw.mins.half())
    return qw


@pytest.mark.parametrize("fmt", ["int4", "int4_min"])
@pytest.mark.parametrize("n", [1, 16, 37])
def test_repack_moves_each_row_block_four_bytes_at_a_time(fmt: str, n: int, gen: torch.Generator) -> None:
    """Panel p, block b, chunk c, lane j holds bytes 4c .. 4c + 3 of row 16p + j's block b; scales and offsets in
    the same lane order; rows past N are zero."""
    qw = _weight(fmt, n, 96, True, gen)
    packed, scales, offsets, _, _ = _qdot.weight_arrays(qw)
    codes, sc, of = _qdot_panel.repack_int4_g32(packed, scales, offsets)
    p_count, nb = (n + 15) // 16, 3
    assert codes.shape == (p_count, nb * 256) and sc.shape == of.shape == (p_count, nb * 16)
    grid = codes.reshape(p_count, nb, 4, 16, 4)  # panel, block, chunk, lane, byte
    rows = np.zeros((p_count * 16, nb, 16), dtype=np.uint8)
    rows[:n] = packed.reshape(n, nb, 16)
    want = rows.reshape(p_count, 16, nb, 4, 4).transpose(0, 2, 3, 1, 4)
    assert np.array_equal(grid, want)
    lanes = lambda a: a.reshape(p_count, nb, 16).transpose(0, 2, 1).reshape(p_count * 16, nb)[:n]
    assert np.array_equal(lanes(sc), scales) and np.array_equal(lanes(of), offsets)
    assert not grid[-1, :, :, n % 16 or 16:].any() and not sc.reshape(p_count, nb, 16)[-1, :, n % 16 or 16:].any()


@pytest.mark.parametrize("fmt", ["int4", "int4_min"])
@pytest.mark.parametrize("half", [False, True])
def test_panel_kernels_write_every_output_and_match_the_oracle(fmt: str, half: bool, gen: torch.Generator) -> None:
    """NaN-poisoned outputs, serial and parallel: N not a multiple of the panel (a partial last panel), 1 to 9 blocks
    and a long K, activation rows in blocks of four and alone; against the float64 product of the quantized
    activation (fp32 tolerance)."""
    skip_unless_runs("qgemv", "vnni512")
    for n, k in ((37, 32), (16, 96), (5, 288), (70, 2048 + 32)):
        qw = _weight(fmt, n, k, half, gen)
        codes, sc, of, n_rows = _qdot.panel_arrays(qw)
        assert n_rows == n
        for m in (1, 3, 4, 7):
            x = torch.randn(m, k, generator=gen)
            want = qmatmul_f64(_qdot.quantized_activation(x), qw)
            xq, xd, xs = _qdot_kernels.quantize_activations(x.numpy())
            for kernel in (_qdot_panel.gemv_panel_serial, _qdot_panel.gemv_panel):
                got = np.full((m, n), np.nan, np.float32)
                kernel(VNNI512, xq, xd, xs, codes, sc, of, got)
                assert_close_to_oracle(torch.from_numpy(got), want, torch.float32,
                                       f"{fmt} half={half} N={n} K={k} M={m} {kernel.__name__}", reduction=True)


def test_q4_0_panels_keep_no_zero_points(gen: torch.Generator) -> None:
    """Zero points all 8 (every GGUF Q4_0 block): the panel copy drops them (the file's bytes) and the kernels use
    the constant, serial and parallel, against the oracle; any other zero point keeps the array."""
    skip_unless_runs("qgemv", "vnni512")
    qw = _weight("int4", 37, 96, True, gen)
    q4_0 = dataclasses.replace(qw, zeros=torch.full_like(qw.zeros, 8))
    of = _qdot.panel_arrays(q4_0)[2]
    assert of.shape == (3, 0) and of.flags.c_contiguous
    other = dataclasses.replace(qw, zeros=torch.randint(0, 16, qw.zeros.shape, dtype=qw.zeros.dtype, generator=gen))
    assert _qdot.panel_arrays(other)[2].shape == (3, 3 * 16)
    for m in (1, 5):
        x = torch.randn(m, 96, generator=gen)
        xq, xd, xs = _qdot_kernels.quantize_activations(x.numpy())
        for w in (q4_0, other):
            want = qmatmul_f64(_qdot.quantized_activation(x), w)
            for kernel in (_qdot_panel.gemv_panel_serial, _qdot_panel.gemv_panel):
                got = np.full((m, 37), np.nan, np.float32)
                kernel(VNNI512, xq, xd, xs, *_qdot.panel_arrays(w)[:3], got)
                assert_close_to_oracle(torch.from_numpy(got), want, torch.float32, f"M={m} {kernel.__name__}",
                                       reduction=True)


def test_a_row_range_writes_only_its_rows(gen: torch.Generator) -> None:
    """``panel_row_range(lo, hi)`` with ``hi`` inside a panel (the fused layer's chunks) leaves every other output
    untouched."""
    skip_unless_runs("qgemv", "vnni512")
    qw = _weight("int4", 53, 64, False, gen)
    codes, sc, of, _ = _qdot.panel_arrays(qw)
    x = torch.randn(5, 64, generator=gen)
    xq, xd, xs = _qdot_kernels.quantize_activations(x.numpy())
    got = np.full((5, 53), np.nan, np.float32)
    _qdot_panel.panel_row_range(VNNI512, xq, xd, xs, codes, sc, of, got, 16, 41)
    assert not np.isnan(got[:, 16:41]).any() and np.isnan(got[:, :16]).all() and np.isnan(got[:, 41:]).all()
    want = qmatmul_f64(_qdot.quantized_activation(x), qw)[:, 16:41]
    assert_close_to_oracle(torch.from_numpy(got[:, 16:41]), want, torch.float32, "rows 16:41", reduction=True)


def test_rows_do_not_depend_on_their_neighbours(gen: torch.Generator) -> None:
    """A token's row is bit-identical alone, in a block of four and as a tail: batched decode and speculative
    verification reproduce a lone decode's greedy token."""
    skip_unless_runs("qgemv", "vnni512")
    qw = _weight("int4_min", 37, 576, True, gen)
    x = torch.randn(9, 576, generator=gen)
    together = _qdot.qmatmul(x, qw, VNNI512, True)
    for m in range(9):
        assert torch.equal(together[m], _qdot.qmatmul(x[m:m + 1], qw, VNNI512, True)[0]), f"row {m}"


def test_qmatmul_takes_panels_at_every_m_under_vnni512(monkeypatch, gen: torch.Generator) -> None:
    """Group-32 int4 under ``vnni512`` runs the panels for decode rows and prefill chunks alike (no bf16 tiles):
    int8-activation accuracy at M = 64; other groups (int8 per channel too) and variants keep their kernels."""
    skip_unless_runs("qgemv", "vnni512")
    monkeypatch.setenv("TESSERA_CPU_VARIANTS", "qgemv=vnni512")
    qw = _weight("int4", 40, 128, True, gen)
    assert _qdot.takes_panels(qw, VNNI512) and not _qdot.takes_panels(qw, None)
    assert not _qdot.takes_panels(Q.quantize(torch.randn(8, 128, generator=gen), "int4", 64), VNNI512)
    assert not _qdot.takes_panels(Q.quantize(torch.randn(8, 128, generator=gen), "int8", 128), VNNI512)
    x = torch.randn(64, 128, generator=gen)
    assert_close_to_oracle(Q.qmatmul(x, qw, backend="cpu"), qmatmul_f64(_qdot.quantized_activation(x), qw),
                           torch.float32, "M=64 through qmatmul", reduction=True)


def test_the_panel_copy_is_built_once_and_dropped_with_its_weight(gen: torch.Generator) -> None:
    qw = _weight("int4", 20, 64, False, gen)
    first = _qdot.panel_arrays(qw)
    assert _qdot.panel_arrays(qw) is first
    other = dataclasses.replace(qw, scales=qw.scales * 2)  # shares the codes: a layout of its own
    assert _qdot.panel_arrays(other)[1] is not first[1]
    assert np.array_equal(_qdot.panel_arrays(other)[1], first[1] * 2)
    keys = {tuple(map(id, (w.data, w.scales, w.zeros))) for w in (qw, other)}
    del qw, first, other
    assert not keys & set(_qdot._PANELS)


# --- Q4_K in its row-panel layout (_qdot_kpanel) ---------------------------------------------------------------------


def _decode_q4k_panels(codes: np.ndarray, sc: np.ndarray, mn: np.ndarray, d: np.ndarray, dmin: np.ndarray,
                       n: int) -> np.ndarray:
    """The weights ``[n, K]`` (float64) a Q4_K panel layout stands for, read back from its arrays in NumPy."""
    p_count, nb = sc.shape[0], sc.shape[1] // 16
    grid = codes.reshape(p_count, nb, 4, 16, 4)  # panel, sub-block, chunk, lane, byte
    lo, hi = grid & 15, grid >> 4  # codes 4c + t and 16 + 4c + t of the lane's row
    q = np.concatenate([lo.transpose(0, 3, 1, 2, 4).reshape(p_count, 16, nb, 16),
                        hi.transpose(0, 3, 1, 2, 4).reshape(p_count, 16, nb, 16)], axis=-1)
    lanes = lambda a, g: a.reshape(p_count, g, 16).transpose(0, 2, 1).reshape(p_count * 16, g)
    half = lambda a: lanes(a, a.shape[1] // 16).astype(np.int16).view(np.float16).astype(np.float64)
    scale = lanes(sc, nb).astype(np.float64) * np.repeat(half(d), 8, axis=1)
    low = lanes(mn, nb).astype(np.float64) * np.repeat(half(dmin), 8, axis=1)  # dmin is stored negated
    q = q.reshape(p_count * 16, nb, 32).astype(np.float64)
    return (q * scale[:, :, None] + low[:, :, None]).reshape(p_count * 16, nb * 32)[:n]


@pytest.mark.parametrize("n", [1, 16, 37])
def test_q4k_repack_holds_the_weights_of_the_file(n: int, gen: torch.Generator) -> None:
    """Read back from the panels (codes, six-bit scales and mins, d and the negated dmin), the weights equal
    gguf-py's de-quantization of the Q4_K bytes; rows past N are zero."""
    import gguf

    qw = random_ggml_weight("q4_k", n, 512, gen)
    codes, sc, mn, d, dmin = _qdot_kpanel.repack_q4k(qw.data.numpy())
    p_count = (n + 15) // 16
    assert codes.shape == (p_count, 16 * 256) and sc.shape == mn.shape == (p_count, 16 * 16)
    assert d.shape == dmin.shape == (p_count, 2 * 16) and d.dtype == np.int16
    want = gguf.quants.dequantize(qw.data.numpy().reshape(-1), gguf.GGMLQuantizationType.Q4_K).reshape(n, 512)
    np.testing.assert_allclose(_decode_q4k_panels(codes, sc, mn, d, dmin, n), want, rtol=1e-6, atol=1e-7)
    assert not codes.reshape(p_count, 16, 4, 16, 4)[-1, :, :, n % 16 or 16:].any()


def test_q4k_panel_kernels_write_every_output_and_match_the_oracle(gen: torch.Generator) -> None:
    """NaN-poisoned outputs, serial and parallel, a partial last panel, one to nine blocks of 256, activation rows
    in blocks of four and alone; against the float64 product of the quantized activation and the de-quantized
    weight (fp32 tolerance). A row range ending inside a panel leaves the other outputs untouched."""
    skip_unless_runs("qgemv", "vnni512")
    for n, k in ((37, 256), (16, 768), (5, 2304)):
        qw = random_ggml_weight("q4_k", n, k, gen)
        arrays = _qdot.panel_arrays(qw)
        assert arrays[5] == n
        for m in (1, 3, 4, 7):
            x = torch.randn(m, k, generator=gen)
            want = qmatmul_f64(_qdot.quantized_activation(x), qw)
            xq, xd, xs = _qdot_kernels.quantize_activations(x.numpy())
            for kernel in (_qdot_kpanel.gemv_kpanel_serial, _qdot_kpanel.gemv_kpanel):
                got = np.full((m, n), np.nan, np.float32)
                kernel(VNNI512, xq, xd, xs, *arrays[:5], got)
                assert_close_to_oracle(torch.from_numpy(got), want, torch.float32,
                                       f"q4_k N={n} K={k} M={m} {kernel.__name__}", reduction=True)
    qw = random_ggml_weight("q4_k", 53, 256, gen)
    x = torch.randn(5, 256, generator=gen)
    xq, xd, xs = _qdot_kernels.quantize_activations(x.numpy())
    got = np.full((5, 53), np.nan, np.float32)
    _qdot_kpanel.kpanel_row_range(VNNI512, xq, xd, xs, *_qdot.panel_arrays(qw)[:5], got, 16, 41)
    assert not np.isnan(got[:, 16:41]).any() and np.isnan(got[:, :16]).all() and np.isnan(got[:, 41:]).all()


def test_q4k_takes_the_panels_at_every_m_and_rows_do_not_depend_on_their_neighbours(monkeypatch,
                                                                                   gen: torch.Generator) -> None:
    """Under ``vnni512`` a Q4_K weight runs its panels for decode rows and prefill chunks alike (M = 40 is past the
    block-format GEMV's rows: no bf16 tiles), and a token's row is bit-identical alone and in a batch; a two-format
    weight (Q4_K_M's q|k|v) and Q5_K keep the block rows."""
    skip_unless_runs("qgemv", "vnni512")
    monkeypatch.setenv("TESSERA_CPU_VARIANTS", "qgemv=vnni512")
    qw = random_ggml_weight("q4_k", 40, 512, gen)
    assert _qdot.takes_panels(qw, VNNI512) and not _qdot.takes_panels(qw, None)
    assert not _qdot.takes_panels(Q.StackedWeight((qw, random_ggml_weight("q6_k", 8, 512, gen))), VNNI512)
    assert not _qdot.takes_panels(random_ggml_weight("q5_k", 8, 512, gen), VNNI512)
    x = torch.randn(40, 512, generator=gen)
    calls = []
    serial = _qdot_kpanel.gemv_kpanel_serial
    recorded = lambda *a: calls.append(a) or serial(*a)
    monkeypatch.setitem(_qdot.PANEL_GEMVS, "q4_k", (recorded, recorded))  # the serial threshold is a tunable
    out = Q.qmatmul(x, qw, backend="cpu")
    assert calls, "M = 40 did not run the Q4_K panels"
    assert_close_to_oracle(out, qmatmul_f64(_qdot.quantized_activation(x), qw), torch.float32,
                           "M=40 through qmatmul", reduction=True)
    together = _qdot.qmatmul(x[:9], qw, VNNI512, True)
    for m in range(9):
        assert torch.equal(together[m], _qdot.qmatmul(x[m:m + 1], qw, VNNI512, True)[0]), f"row {m}"


# --- Q6_K in its row-panel layout (_qdot_q6panel) ---------------------------------------------------------------------


def _decode_q6k_panels(codes: np.ndarray, sc: np.ndarray, d: np.ndarray, n: int) -> np.ndarray:
    """The weights ``[n, K]`` (float64) a Q6_K panel layout stands for, read back from its arrays in NumPy."""
    p_count, groups = codes.shape[0], codes.shape[1] // 384
    grid = codes.reshape(p_count, groups, 384)
    nib = grid[:, :, :256].reshape(p_count, groups, 4, 16, 4)  # panel, group, chunk, lane, byte
    tops = [grid[:, :, 256 + 64 * h:320 + 64 * h].reshape(p_count, groups, 16, 4) for h in range(2)]
    q = np.zeros((p_count, 16, groups, 32), dtype=np.int64)
    for c in range(4):
        for h, plane in enumerate(tops):
            low = (nib[:, :, c] >> (4 * h)) & 15  # [panel, group, lane, byte]
            top = (plane >> (2 * c)) & 3
            q[:, :, :, 16 * h + 4 * c:16 * h + 4 * c + 4] = (low | (top << 4)).transpose(0, 2, 1, 3)
    lanes = lambda a, g: a.reshape(p_count, g, 16).transpose(0, 2, 1).reshape(p_count * 16, g)
    half = lanes(d, d.shape[1] // 16).astype(np.int16).view(np.float16).astype(np.float64)
    scale = lanes(sc, 2 * groups).astype(np.float64) * np.repeat(half, 16, axis=1)
    q = q.reshape(p_count * 16, 2 * groups, 16).astype(np.float64) - 32
    return (q * scale[:, :, None]).reshape(p_count * 16, groups * 32)[:n]


@pytest.mark.parametrize("n", [1, 16, 37])
def test_q6k_repack_holds_the_weights_of_the_file(n: int, gen: torch.Generator) -> None:
    """Read back from the panels (nibbles, two planes of top bits, int8 scales, d), the weights equal gguf-py's
    de-quantization of the Q6_K bytes; rows past N are zero."""
    import gguf

    qw = random_ggml_weight("q6_k", n, 512, gen)
    codes, sc, d = _qdot_q6panel.repack_q6k(qw.data.numpy())
    p_count = (n + 15) // 16
    assert codes.shape == (p_count, 16 * 384) and sc.shape == (p_count, 32 * 16) and sc.dtype == np.int8
    assert d.shape == (p_count, 2 * 16) and d.dtype == np.int16
    want = gguf.quants.dequantize(qw.data.numpy().reshape(-1), gguf.GGMLQuantizationType.Q6_K).reshape(n, 512)
    np.testing.assert_allclose(_decode_q6k_panels(codes, sc, d, n), want, rtol=1e-6, atol=1e-7)
    lanes = codes.reshape(p_count, 16, 384)[-1]
    assert not lanes[:, :256].reshape(16, 4, 16, 4)[:, :, n % 16 or 16:].any()


def test_q6k_panel_kernels_write_every_output_and_match_the_oracle(monkeypatch, gen: torch.Generator) -> None:
    """NaN-poisoned outputs, serial and parallel, a partial last panel, one to nine blocks of 256, activation rows
    in blocks of four and alone, against the float64 oracle; a row range ending inside a panel writes only its
    rows; ``qmatmul`` runs the panels past the block-format GEMV's rows, and rows do not depend on their
    neighbours."""
    skip_unless_runs("qgemv", "vnni512")
    for n, k in ((37, 256), (16, 768), (5, 2304)):
        qw = random_ggml_weight("q6_k", n, k, gen)
        arrays = _qdot.panel_arrays(qw)
        assert arrays[3] == n and _qdot.takes_panels(qw, VNNI512)
        for m in (1, 3, 4, 7):
            x = torch.randn(m, k, generator=gen)
            want = qmatmul_f64(_qdot.quantized_activation(x), qw)
            xq, xd, xs = _qdot_kernels.quantize_activations(x.numpy())
            for kernel in (_qdot_q6panel.gemv_q6panel_serial, _qdot_q6panel.gemv_q6panel):
                got = np.full((m, n), np.nan, np.float32)
                kernel(VNNI512, xq, xd, xs, *arrays[:3], got)
                assert_close_to_oracle(torch.from_numpy(got), want, torch.float32,
                                       f"q6_k N={n} K={k} M={m} {kernel.__name__}", reduction=True)
    qw = random_ggml_weight("q6_k", 53, 256, gen)
    x = torch.randn(5, 256, generator=gen)
    xq, xd, _ = _qdot_kernels.quantize_activations(x.numpy())
    got = np.full((5, 53), np.nan, np.float32)
    _qdot_q6panel.q6panel_row_range(VNNI512, xq, xd, _qdot_q6panel.offsets16(xq, xd), *_qdot.panel_arrays(qw)[:3],
                                    got, 16, 41)
    assert not np.isnan(got[:, 16:41]).any() and np.isnan(got[:, :16]).all() and np.isnan(got[:, 41:]).all()
    monkeypatch.setenv("TESSERA_CPU_VARIANTS", "qgemv=vnni512")
    x = torch.randn(40, 256, generator=gen)
    assert_close_to_oracle(Q.qmatmul(x, qw, backend="cpu"), qmatmul_f64(_qdot.quantized_activation(x), qw),
                           torch.float32, "M=40 through qmatmul", reduction=True)
    together = _qdot.qmatmul(x[:9], qw, VNNI512, True)
    for m in range(9):
        assert torch.equal(together[m], _qdot.qmatmul(x[m:m + 1], qw, VNNI512, True)[0]), f"row {m}"


# --- group-32 int8 (Q8_0) in its row-panel layout (_qdot_q8panel) -----------------------------------------------------


@pytest.mark.parametrize("n", [1, 16, 37])
def test_int8_repack_biases_the_codes_four_bytes_at_a_time(n: int, gen: torch.Generator) -> None:
    """Panel p, block b, chunk c, lane j holds codes 4c .. 4c + 3 of row 16p + j's block b plus 128 (every int8,
    -128 included); scales in the same lane order; rows past N are zero."""
    q = torch.randint(-128, 128, (n, 96), dtype=torch.int8, generator=gen).numpy()
    scales = torch.rand(n, 3, generator=gen).half().view(torch.int16).numpy()
    codes, sc = _qdot_q8panel.repack_int8_g32(q, scales)
    p_count = (n + 15) // 16
    assert codes.shape == (p_count, 3 * 512) and sc.shape == (p_count, 3 * 16) and sc.dtype == np.int16
    rows = np.zeros((p_count * 16, 3, 8, 4), dtype=np.int64)
    rows[:n] = q.reshape(n, 3, 8, 4).astype(np.int64) + 128
    want = rows.reshape(p_count, 16, 3, 8, 4).transpose(0, 2, 3, 1, 4)  # panel, block, chunk, lane, byte
    got = codes.reshape(p_count, 3, 8, 16, 4).astype(np.int64)
    assert np.array_equal(got, want)  # the padding rows of `rows` are zero, as the panels' must be
    lanes = sc.reshape(p_count, 3, 16).transpose(0, 2, 1).reshape(p_count * 16, 3)
    assert np.array_equal(lanes[:n], scales) and not lanes[n:].any()


@pytest.mark.parametrize("half", [False, True])
def test_int8_panel_kernels_write_every_output_and_match_the_oracle(half: bool, monkeypatch,
                                                                    gen: torch.Generator) -> None:
    """NaN-poisoned outputs, serial and parallel, a partial last panel, 1 to 64 blocks, activation rows in blocks of
    four and alone, float16 and float32 scales, against the float64 oracle; a row range ending inside a panel writes
    only its rows; ``qmatmul`` takes the panels at M = 64 and a token's row is the same alone and in a batch."""
    skip_unless_runs("qgemv", "vnni512")
    for n, k in ((37, 32), (16, 96), (5, 2048)):
        qw = _weight("int8", n, k, half, gen)
        codes, sc, n_rows = _qdot.panel_arrays(qw)
        assert n_rows == n and codes.dtype == np.uint8
        for m in (1, 3, 4, 7):
            x = torch.randn(m, k, generator=gen)
            want = qmatmul_f64(_qdot.quantized_activation(x), qw)
            xq, xd, xs = _qdot_kernels.quantize_activations(x.numpy())
            for kernel in (_qdot_q8panel.gemv_q8panel_serial, _qdot_q8panel.gemv_q8panel):
                got = np.full((m, n), np.nan, np.float32)
                kernel(VNNI512, xq, xd, xs, codes, sc, got)
                assert_close_to_oracle(torch.from_numpy(got), want, torch.float32,
                                       f"int8 half={half} N={n} K={k} M={m} {kernel.__name__}", reduction=True)
    qw = _weight("int8", 53, 64, half, gen)
    x = torch.randn(5, 64, generator=gen)
    xq, xd, xs = _qdot_kernels.quantize_activations(x.numpy())
    got = np.full((5, 53), np.nan, np.float32)
    _qdot_q8panel.q8panel_row_range(VNNI512, xq, xd, xs, *_qdot.panel_arrays(qw)[:2], got, 16, 41)
    assert not np.isnan(got[:, 16:41]).any() and np.isnan(got[:, :16]).all() and np.isnan(got[:, 41:]).all()
    monkeypatch.setenv("TESSERA_CPU_VARIANTS", "qgemv=vnni512")
    assert _qdot.takes_panels(qw, VNNI512)
    x = torch.randn(64, 64, generator=gen)
    assert_close_to_oracle(Q.qmatmul(x, qw, backend="cpu"), qmatmul_f64(_qdot.quantized_activation(x), qw),
                           torch.float32, "M=64 through qmatmul", reduction=True)
    together = _qdot.qmatmul(x[:9], qw, VNNI512, True)
    for m in range(9):
        assert torch.equal(together[m], _qdot.qmatmul(x[m:m + 1], qw, VNNI512, True)[0]), f"row {m}"
