"""Row-panel int8-activation GEMV/GEMM for group-32 int4 weights (GGUF Q4_0 / Q4_1) on ``vnni512``.

Layout (:func:`repack_int4_g32`): the weight's rows are cut into panels of :data:`PANEL` = 16 rows; within a panel,
block ``b`` (32 weights of each row) is 256 bytes, four chunks of 64: chunk ``c`` holds, for row ``j`` at bytes
``4j .. 4j + 3``, the packed bytes ``4c .. 4c + 3`` of row ``j``'s block, i.e. codes ``4c .. 4c + 3`` in their low
nibbles and ``16 + 4c .. 16 + 4c + 3`` in their high ones (GGUF's nibble order, moved four bytes at a time). The
sixteen rows' scales and zero points (or mins) of a block follow the same panel order, ``[panel, block, 16]``. The
bytes per weight are the packed weight's own: the repacked copy replaces it in the hot path.

Per block and activation row: eight ``VPDPBUSD`` (each low/high nibble chunk against the broadcast four activation
codes it meets, :func:`._panel_simd512.dot_bcast`) give the sixteen rows' exact int32 block dots; one conversion,
one multiply by ``weight scales * activation block scale`` and one FMA add them to the rows' float32 sums, and one
more FMA adds the zero-point (``-z * s``) or min term times the block's activation sum. No horizontal sums, no
per-row scale shuffles: against :mod:`._qdot_wide`'s rows that is ~13 instructions per 512 multiply-adds instead of
~90, and the four-row form shares each block's unpacked codes among four activation rows.

The arithmetic is the one of :mod:`._qdot_kernels` (exact integer block dots, float32 scaling), summed in another
order, so results agree with the row kernels to float32 rounding, not bit for bit.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from tessera.backends.cpu.numba_math import FASTMATH
from tessera.backends.cpu.ops._int8_simd import prefetch
from tessera.backends.cpu.ops._qdot_kernels import quantize_row
from tessera.backends.cpu.ops._ggml_simd512 import mul_f32x16
from tessera.backends.cpu.ops._int8_simd512 import add_f32x16, zero_f32x16
from tessera.backends.cpu.ops._panel_simd512 import (
    add_i32x16, dot_bcast, fma_bcast, fma_i32_bcast, lane_f32x16, load_scales16, offsets16, panel_high, panel_low,
    store_f32x16, zero_i32x16,
)

PANEL = 16  # weight rows per panel: the int32 lanes of a 512-bit vector
BLOCK = 32
PANEL_BLOCK_BYTES = PANEL * BLOCK // 2
#: the zero point of every GGUF Q4_0 block: a panel copy of such a weight keeps no zero points (one byte per 32
#: weights, 1/18 of its stream) and the kernels use the constant
Q4_0_ZERO = 8
#: bytes ahead of the block being dotted at which the panel stream is prefetched (a panel is one contiguous stream,
#: and a work item's panels follow each other). Every 64-byte line of the block is asked for: with one hint per block
#: (a quarter of the lines) and 2 KiB ahead, a 13 MB GEMV streamed from DRAM at 0.88x the read probe on a Zen 5 VM in
#: its fast phase (76-80 GB/s); every line 4 KiB ahead reached 0.93-1.01x, 8 KiB the same, 16 KiB 0.92-0.99x. In the
#: VM's slow phase (~50 GB/s) every choice, none included, reads at ~0.95x (2026-12-05).
PREFETCH_BYTES = 4096
#: activation rows that meet every panel of a work item before the next rows do: a prefill chunk's int8 rows
#: (X_ROWS x K bytes, 128 KiB at K = 2048) then stay in L2 while the item's panels pass over them, instead of the
#: whole chunk (1 MiB at 512 x 2048) streaming from L3 once per panel. A reasoned choice: the 1B prefill A/B with and
#: without it (and the parallel quantizer) overlapped, 320-474 against 323-456 tok/s
X_ROWS = 64


@njit(cache=True, nogil=True, error_model="numpy")
def repack_int4_g32(packed, scales, offsets):  # pragma: no cover - compiled
    """Panel layout (module docstring) of group-32 int4 weights: ``packed`` uint8 ``[N, K / 2]``, ``scales`` and
    ``offsets`` ``[N, K / 32]`` (float32 or float16 bits; offsets uint8 zero points or mins in the scales' type).
    Returns ``(codes uint8 [P, K / 32 * 256], scales [P, K / 32 * 16], offsets [P, K / 32 * 16])``, P = ceil(N / 16);
    rows past N are zero (their outputs are never stored)."""
    n, half_k = packed.shape
    nb = half_k // 16
    p_count = (n + PANEL - 1) // PANEL
    codes = np.zeros((p_count, nb * PANEL_BLOCK_BYTES), dtype=np.uint8)
    sc = np.zeros((p_count, nb * PANEL), dtype=scales.dtype)
    of = np.zeros((p_count, nb * PANEL), dtype=offsets.dtype)
    for r in range(n):
        p = r // PANEL
        j = r - p * PANEL
        for b in range(nb):
            base = b * PANEL_BLOCK_BYTES + 4 * j
            for c in range(4):
                for t in range(4):
                    codes[p, base + 64 * c + t] = packed[r, b * 16 + 4 * c + t]
            sc[p, b * PANEL + j] = scales[r, b]
            of[p, b * PANEL + j] = offsets[r, b]
    return codes, sc, of


@njit(inline="always", error_model="numpy")
def prefetch_ahead(codes, o, nbytes):  # pragma: no cover - compiled
    """Ask for the ``nbytes`` (a multiple of 64, a constant: the loop unrolls) of the panel stream
    :data:`PREFETCH_BYTES` past flat offset ``o``, one hint per cache line."""
    for line in range(0, nbytes, 64):
        prefetch(codes, o + PREFETCH_BYTES + line)


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _block_dot(isa, l0, l1, l2, l3, h0, h1, h2, h3, xq, x):  # pragma: no cover - compiled
    """The sixteen rows' exact int32 dots of one block with the activation block at flat offset ``x`` (two
    chains of four, summed)."""
    lo = dot_bcast(isa, zero_i32x16(), l0, xq, x)
    hi = dot_bcast(isa, zero_i32x16(), h0, xq, x + 16)
    lo = dot_bcast(isa, lo, l1, xq, x + 4)
    hi = dot_bcast(isa, hi, h1, xq, x + 20)
    lo = dot_bcast(isa, lo, l2, xq, x + 8)
    hi = dot_bcast(isa, hi, h2, xq, x + 24)
    lo = dot_bcast(isa, lo, l3, xq, x + 12)
    hi = dot_bcast(isa, hi, h3, xq, x + 28)
    return add_i32x16(lo, hi)


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _offsets(of, index, s):  # pragma: no cover - compiled
    """The sixteen rows' additive term per unit of activation for the block at ``index``: from their zero points or
    mins (:func:`._panel_simd512.offsets16`), or ``-8 * s`` when ``of`` has no columns (GGUF Q4_0, whose zero point
    is always 8: :data:`Q4_0_ZERO`; the branch is the same for the whole call)."""
    if of.shape[1] == 0:
        return mul_f32x16(s, np.float32(-Q4_0_ZERO))
    return offsets16(of, index, s)


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _store(out, m, lo, hi, v):  # pragma: no cover - compiled
    """Lanes ``0 .. hi - lo - 1`` of ``v`` into ``out[m, lo:hi]`` (a whole panel as one vector store)."""
    n = out.shape[1]
    count = hi - lo
    if count == PANEL:
        store_f32x16(out, m * n + lo, v)
    else:
        for j in range(count):
            out[m, lo + j] = lane_f32x16(v, j)


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _panel_x4(isa, xq, xd, xs, codes, sc, of, p, m, out, lo, hi):  # pragma: no cover - compiled
    """Panel ``p`` dotted with activation rows ``m .. m + 3`` into ``out[m:m + 4, lo:hi]``."""
    k = xq.shape[1]
    nb = xd.shape[1]
    cb = p * codes.shape[1]
    sb = p * sc.shape[1]
    a0 = zero_f32x16()
    a1 = zero_f32x16()
    a2 = zero_f32x16()
    a3 = zero_f32x16()
    z0 = zero_f32x16()
    z1 = zero_f32x16()
    z2 = zero_f32x16()
    z3 = zero_f32x16()
    for b in range(nb):
        o = cb + b * PANEL_BLOCK_BYTES
        prefetch_ahead(codes, o, PANEL_BLOCK_BYTES)
        l0 = panel_low(codes, o)
        h0 = panel_high(codes, o)
        l1 = panel_low(codes, o + 64)
        h1 = panel_high(codes, o + 64)
        l2 = panel_low(codes, o + 128)
        h2 = panel_high(codes, o + 128)
        l3 = panel_low(codes, o + 192)
        h3 = panel_high(codes, o + 192)
        s = load_scales16(sc, sb + b * PANEL)
        z = _offsets(of, sb + b * PANEL, s)
        x = b * BLOCK
        a0 = fma_i32_bcast(_block_dot(isa, l0, l1, l2, l3, h0, h1, h2, h3, xq, m * k + x), s, xd, m * nb + b, a0)
        a1 = fma_i32_bcast(_block_dot(isa, l0, l1, l2, l3, h0, h1, h2, h3, xq, (m + 1) * k + x), s, xd,
                           (m + 1) * nb + b, a1)
        a2 = fma_i32_bcast(_block_dot(isa, l0, l1, l2, l3, h0, h1, h2, h3, xq, (m + 2) * k + x), s, xd,
                           (m + 2) * nb + b, a2)
        a3 = fma_i32_bcast(_block_dot(isa, l0, l1, l2, l3, h0, h1, h2, h3, xq, (m + 3) * k + x), s, xd,
                           (m + 3) * nb + b, a3)
        z0 = fma_bcast(z, xs, m * nb + b, z0)
        z1 = fma_bcast(z, xs, (m + 1) * nb + b, z1)
        z2 = fma_bcast(z, xs, (m + 2) * nb + b, z2)
        z3 = fma_bcast(z, xs, (m + 3) * nb + b, z3)
    _store(out, m, lo, hi, add_f32x16(a0, z0))
    _store(out, m + 1, lo, hi, add_f32x16(a1, z1))
    _store(out, m + 2, lo, hi, add_f32x16(a2, z2))
    _store(out, m + 3, lo, hi, add_f32x16(a3, z3))


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _panel_x1(isa, xq, xd, xs, codes, sc, of, p, m, out, lo, hi):  # pragma: no cover - compiled
    """Panel ``p`` dotted with activation row ``m`` into ``out[m, lo:hi]``."""
    k = xq.shape[1]
    nb = xd.shape[1]
    cb = p * codes.shape[1]
    sb = p * sc.shape[1]
    a0 = zero_f32x16()
    z0 = zero_f32x16()
    for b in range(nb):
        o = cb + b * PANEL_BLOCK_BYTES
        prefetch_ahead(codes, o, PANEL_BLOCK_BYTES)
        s = load_scales16(sc, sb + b * PANEL)
        d = _block_dot(isa, panel_low(codes, o), panel_low(codes, o + 64), panel_low(codes, o + 128),
                       panel_low(codes, o + 192), panel_high(codes, o), panel_high(codes, o + 64),
                       panel_high(codes, o + 128), panel_high(codes, o + 192), xq, m * k + b * BLOCK)
        a0 = fma_i32_bcast(d, s, xd, m * nb + b, a0)
        z0 = fma_bcast(_offsets(of, sb + b * PANEL, s), xs, m * nb + b, z0)
    _store(out, m, lo, hi, add_f32x16(a0, z0))


@njit(nogil=True, cache=True, fastmath=FASTMATH, error_model="numpy")
def panel_row_range(isa, xq, xd, xs, codes, sc, of, out, n_lo, n_hi):  # pragma: no cover - compiled
    """Output rows ``n_lo .. n_hi - 1`` of ``out [M, N]`` (``n_lo`` a multiple of :data:`PANEL`) from the panel
    layout; ``xq, xd, xs`` from :func:`._qdot_kernels.quantize_rows`. A called function, shared by the standalone
    GEMV and the fused decode layer (see ``_qdot_kernels.int4_row_range``)."""
    m_rows = xq.shape[0]
    for m0 in range(0, m_rows, X_ROWS):
        m1 = min(m_rows, m0 + X_ROWS)
        quads = m0 + (m1 - m0) // 4 * 4
        for p in range(n_lo // PANEL, (n_hi + PANEL - 1) // PANEL):
            lo = p * PANEL
            hi = min(n_hi, lo + PANEL)
            for m in range(m0, quads, 4):
                _panel_x4(isa, xq, xd, xs, codes, sc, of, p, m, out, lo, hi)
            for m in range(quads, m1):
                _panel_x1(isa, xq, xd, xs, codes, sc, of, p, m, out, lo, hi)


#: output rows per parallel work item of every row-panel GEMV (a multiple of PANEL; the Q4_K, Q6_K and int8
#: panel modules take it from here)
ROWS = 64


@njit(parallel=True, nogil=True, cache=True, fastmath=FASTMATH, error_model="numpy")
def quantize_activations_parallel(x):  # pragma: no cover - compiled
    """:func:`._qdot_kernels.quantize_activations` with the rows split over threads (the same codes, bit for bit),
    for prefill chunks: a 512-row chunk quantizes ~1 M values per projection. Its effect on a 1B prefill was within
    the machine's noise in an alternating A/B (2026-12-05), together with :data:`X_ROWS`."""
    m_rows, k = x.shape
    xq = np.empty((m_rows, k), dtype=np.int8)
    xd = np.empty((m_rows, k // BLOCK), dtype=np.float32)
    xs = np.empty((m_rows, k // BLOCK), dtype=np.float32)
    for m in prange(m_rows):
        quantize_row(x, m, xq, xd, xs)
    return xq, xd, xs


@njit(parallel=True, nogil=True, cache=True, fastmath=FASTMATH, error_model="numpy")
def gemv_panel(isa, xq, xd, xs, codes, sc, of, out):  # pragma: no cover - compiled
    """:func:`panel_row_range` over all ``out.shape[1]`` rows, split over threads in blocks of :data:`ROWS`."""
    n_rows = out.shape[1]
    for blk in prange((n_rows + ROWS - 1) // ROWS):
        panel_row_range(isa, xq, xd, xs, codes, sc, of, out, blk * ROWS, min(n_rows, (blk + 1) * ROWS))


@njit(nogil=True, cache=True, fastmath=FASTMATH, error_model="numpy")
def gemv_panel_serial(isa, xq, xd, xs, codes, sc, of, out):  # pragma: no cover - compiled
    """:func:`gemv_panel` on the calling thread."""
    panel_row_range(isa, xq, xd, xs, codes, sc, of, out, np.int64(0), out.shape[1])
