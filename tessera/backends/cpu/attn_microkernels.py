"""Register-blocked micro-kernels for decode-shaped attention, written with the explicit vectors of :mod:`.simd`.

Two products make up a decode step for one kv head and a chunk of keys:

* scores ``S[r, c] = q_r . k_c``: :func:`qk_4x4` keeps 4 query rows x 4 keys = 16 accumulators in registers over the
  head dim, so each loaded K vector feeds 4 FMAs and each Q vector 4, and the 16 dot products are reduced together
  by one shuffle tree (:func:`.simd.store_sums_4x4`) instead of 16 separate horizontal sums.
* values ``acc[r, :] += sum_c P[r, c] v_c``: :func:`pv_4x4` holds 4 rows x 4 vectors of the output in registers
  while it walks every key of the chunk, so the accumulator is loaded and stored once per chunk, not once per key.

Each micro-kernel also walks a *prefetch cursor* (:func:`prefetch_run`): it hints a stretch of memory that a later
phase reads into the caches, a few lines per step of its own loop, in address order. Where the hints go is the
caller's choice (``decode_kernel.py``: V of the keys being scored, then K of the next chunk); spreading them evenly
over the compute, and in address order, is what lets a core stream at the machine's read bandwidth (see
``docs/performance.md``, "Read order and prefetch").

Offsets are flat element offsets into C-contiguous arrays: ``q_off`` of a query row in ``qrows [rows, D]``,
``k_off`` / ``v_off`` of a key's head vector in ``k`` / ``v [rows, Hkv, D]`` (so ``(row * Hkv + hk) * D``). ``D`` is a
multiple of ``LANES``; the caller falls back to the scalar kernel otherwise.
"""

from __future__ import annotations

from numba import njit

from tessera.backends.cpu.numba_math import FASTMATH
from tessera.backends.cpu.simd import (
    LANES,
    line_elements,
    prefetch,
    store_sums_4x4,
    vbroadcast,
    vfma,
    vload,
    vstore,
    vsum,
    vzero,
)

@njit(inline="always", fastmath=FASTMATH)
def prefetch_run(arr, rows, row, col, left, n, row_elems):  # pragma: no cover - compiled
    """Hint the next ``min(n, left)`` elements of a run of token rows into the caches, one per cache line, in address
    order.

    The run is ``arr``'s rows at flat offsets ``rows[row], rows[row + 1], ...``, each ``row_elems`` long, taken end
    to end; the cursor ``(row, col)`` says where it stands and ``left`` how many elements it may still cover (so it
    never reads ``rows`` past the rows it was given). Returns the cursor and budget after the step.
    """
    line = line_elements(arr)
    stop = min(n, left)
    for _ in range(0, stop, line):
        prefetch(arr, rows[row] + col)
        col += line
        while col >= row_elems:  # (a line can be longer than a row: 16-bit storage, Hkv * D < 32)
            col -= row_elems
            row += 1
    return row, col, left - stop


#: output vectors per row that :func:`pv_4x4` keeps in registers (4 rows x 4 = 16 accumulators)
PV_COLS = 4


@njit(inline="always", fastmath=FASTMATH)
def qk_4x4(
    qrows, q_off, d, k, k0, k1, k2, k3, sc, s_off, s_stride, pf, pf_rows, pf_row, pf_col, pf_left, pf_step, pf_row_elems,
):  # pragma: no cover - compiled
    """Scores of query rows ``q_off + i * d`` (``i < 4``) against keys at ``k0..k3`` into
    ``sc.flat[s_off + i * s_stride + c]``.

    Once per cache line of K read, advances the prefetch cursor over ``pf`` by ``pf_step`` elements (see
    :func:`prefetch_run` for ``pf_rows, pf_row, pf_col, pf_left, pf_row_elems``); returns the cursor after the tile.
    """
    a0 = vzero()
    a1 = vzero()
    a2 = vzero()
    a3 = vzero()
    a4 = vzero()
    a5 = vzero()
    a6 = vzero()
    a7 = vzero()
    a8 = vzero()
    a9 = vzero()
    a10 = vzero()
    a11 = vzero()
    a12 = vzero()
    a13 = vzero()
    a14 = vzero()
    a15 = vzero()
    line_mask = line_elements(k) - 1  # a power of two: prefetch once per cache line of K
    for x in range(0, d, LANES):
        if x & line_mask == 0 and pf_left > 0:
            pf_row, pf_col, pf_left = prefetch_run(pf, pf_rows, pf_row, pf_col, pf_left, pf_step, pf_row_elems)
        c0 = vload(k, k0 + x)
        c1 = vload(k, k1 + x)
        c2 = vload(k, k2 + x)
        c3 = vload(k, k3 + x)
        qv = vload(qrows, q_off + x)
        a0 = vfma(qv, c0, a0)
        a1 = vfma(qv, c1, a1)
        a2 = vfma(qv, c2, a2)
        a3 = vfma(qv, c3, a3)
        qv = vload(qrows, q_off + d + x)
        a4 = vfma(qv, c0, a4)
        a5 = vfma(qv, c1, a5)
        a6 = vfma(qv, c2, a6)
        a7 = vfma(qv, c3, a7)
        qv = vload(qrows, q_off + 2 * d + x)
        a8 = vfma(qv, c0, a8)
        a9 = vfma(qv, c1, a9)
        a10 = vfma(qv, c2, a10)
        a11 = vfma(qv, c3, a11)
        qv = vload(qrows, q_off + 3 * d + x)
        a12 = vfma(qv, c0, a12)
        a13 = vfma(qv, c1, a13)
        a14 = vfma(qv, c2, a14)
        a15 = vfma(qv, c3, a15)
    store_sums_4x4(sc, s_off, s_stride, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15)
    return pf_row, pf_col, pf_left


@njit(inline="always", fastmath=FASTMATH)
def qk_1x1(qrows, q_off, d, k, k_off):  # pragma: no cover - compiled
    """One score: the query row at ``q_off`` against the key at ``k_off`` (edges of the 4 x 4 blocking)."""
    a0 = vzero()
    for x in range(0, d, LANES):
        a0 = vfma(vload(qrows, q_off + x), vload(k, k_off + x), a0)
    return vsum(a0)


@njit(inline="always", fastmath=FASTMATH)
def pv_4x4(
    acc, a_off, d, v, v_offs, v_add, sc, s_off, s_stride, cn, pf, pf_rows, pf_row, pf_col, pf_left, pf_step, pf_row_elems,
):  # pragma: no cover - compiled
    """``acc`` rows ``a_off + i * d`` (``i < 4``), columns ``[0, 4 * LANES)`` from there, plus
    ``sum_c sc.flat[s_off + i * s_stride + c] * v[v_offs[c] + v_add : + 4 * LANES]`` over the chunk's ``cn`` keys.

    Advances the prefetch cursor over ``pf`` by ``pf_step`` elements per key (see :func:`qk_4x4`); returns it."""
    r1 = a_off + d
    r2 = a_off + 2 * d
    r3 = a_off + 3 * d
    a0 = vload(acc, a_off)
    a1 = vload(acc, a_off + LANES)
    a2 = vload(acc, a_off + 2 * LANES)
    a3 = vload(acc, a_off + 3 * LANES)
    a4 = vload(acc, r1)
    a5 = vload(acc, r1 + LANES)
    a6 = vload(acc, r1 + 2 * LANES)
    a7 = vload(acc, r1 + 3 * LANES)
    a8 = vload(acc, r2)
    a9 = vload(acc, r2 + LANES)
    a10 = vload(acc, r2 + 2 * LANES)
    a11 = vload(acc, r2 + 3 * LANES)
    a12 = vload(acc, r3)
    a13 = vload(acc, r3 + LANES)
    a14 = vload(acc, r3 + 2 * LANES)
    a15 = vload(acc, r3 + 3 * LANES)
    s1 = s_off + s_stride
    s2 = s_off + 2 * s_stride
    s3 = s_off + 3 * s_stride
    for c in range(cn):
        if pf_left > 0:
            pf_row, pf_col, pf_left = prefetch_run(pf, pf_rows, pf_row, pf_col, pf_left, pf_step, pf_row_elems)
        base = v_offs[c] + v_add
        c0 = vload(v, base)
        c1 = vload(v, base + LANES)
        c2 = vload(v, base + 2 * LANES)
        c3 = vload(v, base + 3 * LANES)
        p = vbroadcast(sc, s_off + c)
        a0 = vfma(p, c0, a0)
        a1 = vfma(p, c1, a1)
        a2 = vfma(p, c2, a2)
        a3 = vfma(p, c3, a3)
        p = vbroadcast(sc, s1 + c)
        a4 = vfma(p, c0, a4)
        a5 = vfma(p, c1, a5)
        a6 = vfma(p, c2, a6)
        a7 = vfma(p, c3, a7)
        p = vbroadcast(sc, s2 + c)
        a8 = vfma(p, c0, a8)
        a9 = vfma(p, c1, a9)
        a10 = vfma(p, c2, a10)
        a11 = vfma(p, c3, a11)
        p = vbroadcast(sc, s3 + c)
        a12 = vfma(p, c0, a12)
        a13 = vfma(p, c1, a13)
        a14 = vfma(p, c2, a14)
        a15 = vfma(p, c3, a15)
    vstore(acc, a_off, a0)
    vstore(acc, a_off + LANES, a1)
    vstore(acc, a_off + 2 * LANES, a2)
    vstore(acc, a_off + 3 * LANES, a3)
    vstore(acc, r1, a4)
    vstore(acc, r1 + LANES, a5)
    vstore(acc, r1 + 2 * LANES, a6)
    vstore(acc, r1 + 3 * LANES, a7)
    vstore(acc, r2, a8)
    vstore(acc, r2 + LANES, a9)
    vstore(acc, r2 + 2 * LANES, a10)
    vstore(acc, r2 + 3 * LANES, a11)
    vstore(acc, r3, a12)
    vstore(acc, r3 + LANES, a13)
    vstore(acc, r3 + 2 * LANES, a14)
    vstore(acc, r3 + 3 * LANES, a15)
    return pf_row, pf_col, pf_left


@njit(inline="always", fastmath=FASTMATH)
def pv_1x4(
    acc, a_off, v, v_offs, v_add, sc, s_off, cn, pf, pf_rows, pf_row, pf_col, pf_left, pf_step, pf_row_elems,
):  # pragma: no cover - compiled
    """:func:`pv_4x4` for one row (GQA groups below 4 leave 1-3 rows per kv head)."""
    a0 = vload(acc, a_off)
    a1 = vload(acc, a_off + LANES)
    a2 = vload(acc, a_off + 2 * LANES)
    a3 = vload(acc, a_off + 3 * LANES)
    for c in range(cn):
        if pf_left > 0:
            pf_row, pf_col, pf_left = prefetch_run(pf, pf_rows, pf_row, pf_col, pf_left, pf_step, pf_row_elems)
        base = v_offs[c] + v_add
        p = vbroadcast(sc, s_off + c)
        a0 = vfma(p, vload(v, base), a0)
        a1 = vfma(p, vload(v, base + LANES), a1)
        a2 = vfma(p, vload(v, base + 2 * LANES), a2)
        a3 = vfma(p, vload(v, base + 3 * LANES), a3)
    vstore(acc, a_off, a0)
    vstore(acc, a_off + LANES, a1)
    vstore(acc, a_off + 2 * LANES, a2)
    vstore(acc, a_off + 3 * LANES, a3)
    return pf_row, pf_col, pf_left


@njit(inline="always", fastmath=FASTMATH)
def pv_1x1(acc, a_off, v, v_offs, v_add, sc, s_off, cn):  # pragma: no cover - compiled
    """One output vector: ``acc[a_off : + LANES] += sum_c sc.flat[s_off + c] * v[v_offs[c] + v_add : + LANES]`` over
    the chunk's ``cn`` keys."""
    a0 = vload(acc, a_off)
    for c in range(cn):
        a0 = vfma(vbroadcast(sc, s_off + c), vload(v, v_offs[c] + v_add), a0)
    vstore(acc, a_off, a0)
