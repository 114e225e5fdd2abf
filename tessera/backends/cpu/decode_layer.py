"""Whole decoder layers for a small decode step: a run of layers as a single Numba call on one or all cores.

At batch 1 a SmolLM2-135M token spends ~12 ms streaming weights through four GEMVs per layer, and, before this
kernel, another ~8 ms in the Python around them: about fifteen op calls per layer, each a few layers of Python,
tensor allocations and checks, all running with caches just flushed by the weight stream. This kernel runs the
same ops, in the same order, with the same inline Numba helpers as the per-op cpu kernels (GEMV rows, RMSNorm rows,
RoPE rows, gated activation chunks, the paged decode item), so its results equal the per-op path's to float32
rounding (LLVM may vectorize a fastmath reduction in another order where a row kernel is compiled); only the Python
between them is gone. Intermediates are rounded to the model's storage dtype exactly where the per-op path
stores a tensor (a GEMV result, a bias add, a norm, RoPE, the attention output).

The layer is eleven phases: four GEMVs, whose output rows are split into :data:`CLAIMS_PER_WORKER` chunks per
worker; the attention, whose work items (a sequence, or a part of a long one) and then sequences (merging the
parts, preparing o's input row) are claimed the same way; and the small serial steps between them (input
quantization, q/k norms, RoPE and the cache write, residuals and norms, the gated activation).
With ``n_workers > 1`` the phases run inside *one* parallel region: every worker claims chunks from an atomic
counter per phase and waits until the phase's chunks are all done before the next phase
(:mod:`tessera.backends.cpu.atomics`). One region for a whole run of layers (:func:`decoder_layers_kernel`; a run
is every layer of most models), not one per GEMV or per layer, because waking the pool costs ~20 us under the
passive OpenMP wait policy, as much as a small GEMV, and each Python call ~5 us of argument typing: SmolLM2-135M
Q4_1 batch-1 decode went from 258-262 to 294-300 tok/s with one call per token instead of 30 (2 threads, Zen 5,
2026-12-05, alternating runs, other processes on the machine). Claiming, not fixed shares, means a worker that starts
late (or never: a pool of one runs the iterations in turn) only finds less work; nothing waits for a worker that has
not claimed anything, so the kernel cannot deadlock whatever the thread count. A row's result does not depend on which
worker computed it, so the output is the same for every ``n_workers``.

:mod:`tessera.backends.cpu.ops.fused_decode` calls :func:`decoder_layers_kernel` for decode-shaped steps of at most
``SMALL_M`` tokens (one new token per sequence, or a few: a speculative verification's drafted tokens) and chooses ``n_workers`` from the step's
work. The attention runs inside the region too: a batch of sequences, or one long context split into parts, spreads
over the same workers without a second pool wake-up per layer.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.typed import List
from numba.core.errors import TypingError
from numba.core.extending import overload

from tessera.backends.cpu import atomics
from tessera.backends.cpu.decode_kernel import NO_SCALES, _merge_sequence, decode_item
from tessera.backends.cpu.kv_storage import store_row
from tessera.backends.cpu.kernel_args import (
    DecodeSchedule,
    LayerBuffers,
    LayerConfig,
    LayerNorms,
    LayerWeights,
)
from tessera.backends.cpu.numba_math import FASTMATH, widen
from tessera.backends.cpu.ops._gemv import _rows as _gemv_rows
from tessera.backends.cpu.ops._int8_simd import IsaTokenType
from tessera.backends.cpu.ops._qdot_kernels import BLOCK, int4_row_range, int8_row_range, quantize_row
from tessera.backends.cpu.ops._quant_kernels import _int4_rows
from tessera.backends.cpu.ops._narrow import narrow
from tessera.backends.cpu.ops._qdot_ggml import ggml_rows
from tessera.backends.cpu.ops._qdot_kpanel import kpanel_row_range
from tessera.backends.cpu.ops._qdot_panel import panel_row_range
from tessera.backends.cpu.ops._qdot_q6panel import offsets16, q6panel_row_range
from tessera.backends.cpu.ops._qdot_q8panel import q8panel_row_range
from tessera.backends.cpu.ops.activations import CHUNK as ACT_CHUNK
from tessera.backends.cpu.ops.activations import _act_and_mul_item
from tessera.backends.cpu.ops.norms import _rms_norm_row
from tessera.backends.cpu.ops.rope import _rotate_item

#: GEMV output-row chunks per worker when several workers share a layer: each GEMV is cut into
#: ``workers * CLAIMS_PER_WORKER`` chunks (at least MIN_CLAIM_ROWS rows, a multiple of the float row kernel's 4-row
#: blocks), claimed through an atomic counter. Few long chunks keep each worker's weight reads one long stream
#: (likely what the hardware prefetchers and the row kernels' fixed-distance software prefetch, which runs into the
#: next chunk's rows at a chunk's end, serve best); two per worker still let one take over when the other is late.
#: 1B Q4_0 decode (22 layers, 2 threads, Zen 5, 2026-12-05, alternating runs): chunks of 128 rows 49.3-51.1 tok/s,
#: 2 per worker 53.4-56.4 (Q4_K_M 50.2-51.8 -> 60.8-61.9); 1 per worker was level with 2 on Q4_K_M.
CLAIMS_PER_WORKER = 2
MIN_CLAIM_ROWS = 64
#: multiply-adds of a step's biggest GEMV from which the layer runs over all threads: the default of the
#: ``fused_parallel_work`` tunable (:mod:`tessera.backends.cpu.tunables_fused_layer` measures it)
PARALLEL_WORK = 1 << 18
_PHASES = 11


def _is_ggml(w) -> bool:
    """A ggml block-format tuple ``(w0, w1, fmt0, fmt1, split)``: its second item is block bytes (uint8), where an
    int4 / int8 tuple has its scales (float32, or float16 bits as int16)."""
    return isinstance(w, types.BaseTuple) and len(w.types) == 5 and isinstance(w.types[1], types.Array) \
        and w.types[1].dtype == types.uint8


def _panel_layout(w) -> str | None:
    """Which row-panel layout a packed weight tuple holds (:func:`tessera.backends.cpu.ops._qdot.panel_arrays`; N
    is the last item of each), or None: told apart by length and by the dtype of the arrays that differ."""
    if not isinstance(w, types.BaseTuple):
        return None
    n = len(w.types)
    if n == 3 and w.types[0].dtype == types.uint8:
        return "int8"  # biased uint8 codes, where the int8 rows' tuple has int8 codes
    if n == 4:
        return "q6_k" if w.types[1].dtype == types.int8 else "int4"  # Q6_K's scales are int8
    if n == 6:
        return "q4_k"
    return None


def _kind(w, isa):
    """Which row kernel a projection runs: 0 float, 1 int8-activation (int4, int8 or a ggml block format), 2
    portable int4."""
    if isinstance(w, types.Array):
        return 0
    if not isinstance(w, types.BaseTuple) or len(w.types) not in (3, 4, 5, 6):
        raise TypingError(f"decoder layer: expected a float array or a packed weight tuple of 3 to 6 items, got {w}")
    if isinstance(isa, IsaTokenType):
        return 1
    if len(w.types) in (3, 4, 6) or _is_ggml(w):
        raise TypingError("decoder layer: int8 and ggml block-format weights need an int8-activation qgemv variant "
                          "(isa is None)")
    return 2


def _new_input(x, w, isa):  # pragma: no cover - replaced by the overload inside jitted code
    raise NotImplementedError


@overload(_new_input)
def _new_input_overload(x, w, isa):
    """Buffers for a projection's prepared input ``x [T, K]``: ``(xf, -, -)`` float32 for a float weight,
    ``(xq, xd, xs)`` (int8 codes, block scales, block sums) for the int8-activation kernels, ``(xlo, xhi, xsum)`` for
    the portable int4 kernel. Always three arrays (unused ones empty), so the parallel region can take them apart."""
    kind = _kind(w, isa)
    if kind == 0:
        return lambda x, w, isa: (np.empty(x.shape, dtype=np.float32), np.empty((0, 0), dtype=np.float32),
                                  np.empty((0, 0), dtype=np.float32))
    if kind == 1:
        def int8_activation(x, w, isa):
            t_count, k = x.shape
            return (np.empty((t_count, k), dtype=np.int8), np.empty((t_count, k // BLOCK), dtype=np.float32),
                    np.empty((t_count, k // BLOCK), dtype=np.float32))
        return int8_activation

    def portable_int4(x, w, isa):
        t_count, k = x.shape
        group = w[4]
        return (np.empty((t_count, k // 2), dtype=np.float32), np.empty((t_count, k // 2), dtype=np.float32),
                np.empty((t_count, k // group), dtype=np.float32))
    return portable_int4


def _fill_input_row(x, w, isa, inp, m):  # pragma: no cover - replaced by the overload inside jitted code
    raise NotImplementedError


@overload(_fill_input_row)
def _fill_input_row_overload(x, w, isa, inp, m):
    """Prepare row ``m`` of storage ``x [T, K]`` for a projection, as the per-op path does before its GEMV: widened
    to float32 (``x.float()``), quantized to int8 per block of 32, or split into the low/high-nibble halves and group
    sums of the portable int4 kernel. Row by row, so the attention phase can prepare each sequence's row as soon as
    its attention is done."""
    kind = _kind(w, isa)
    if kind == 0:
        def widened(x, w, isa, inp, m):
            xf = inp[0]
            for j in range(x.shape[1]):
                xf[m, j] = widen(x[m, j])
        return widened
    if kind == 1:
        def quantized(x, w, isa, inp, m):
            xq, xd, xs = inp
            quantize_row(x, m, xq, xd, xs)
        return quantized

    def nibble_halves(x, w, isa, inp, m):
        xlo, xhi, xsum = inp
        group = w[4]
        half = group // 2
        for g in range(x.shape[1] // group):
            for j in range(half):
                xlo[m, g * half + j] = widen(x[m, g * group + j])
                xhi[m, g * half + j] = widen(x[m, g * group + half + j])
            total = np.float32(0.0)
            for j in range(group):
                total += widen(x[m, g * group + j])
            xsum[m, g] = total
    return nibble_halves


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _fill_input(x, w, isa, inp):  # pragma: no cover - compiled
    """Every row of ``x`` prepared for a projection (:func:`_fill_input_row`)."""
    for m in range(x.shape[0]):
        _fill_input_row(x, w, isa, inp, m)


def _project_rows(inp, w, b, acc, out, isa, lo, hi):  # pragma: no cover - replaced by the overload
    raise NotImplementedError


@overload(_project_rows)
def _project_rows_overload(inp, w, b, acc, out, isa, lo, hi):
    """Columns ``lo .. hi - 1`` of ``out = x @ w.T (+ b)`` from the prepared input: ``w`` is a float storage array
    ``[N, K]`` or a packed weight as :func:`tessera.backends.cpu.ops._qdot.weight_arrays` gives it,
    ``(packed uint8 [N, K/2], scales f32 [N, K/g], offsets [N, K/g], has_min, g)`` for int4 / int4_min or
    ``(q int8 [N, K], scales, g)`` for int8, ``(codes, scales, offsets, N)`` for group-32 int4 in the row-panel
    layout (:mod:`tessera.backends.cpu.ops._qdot_panel`), ``(codes, sc, mn, d, dmin, N)`` for Q4_K,
    ``(codes, sc int8, d, N)`` for Q6_K and ``(codes uint8, scales, N)`` for group-32 int8 in theirs
    (:func:`_panel_layout`), ``(w0, w1, fmt0, fmt1, split)`` for ggml block formats
    (two row blocks, :func:`tessera.backends.cpu.ops._qdot_ggml.ggml_rows`).
    ``acc`` float32 ``[T, N]`` holds the GEMV result before
    :func:`_finish_rows` rounds it into ``out``."""
    kind = _kind(w, isa)
    if kind == 0:
        def float_rows(inp, w, b, acc, out, isa, lo, hi):
            _float_rows(inp[0], w, acc, lo, hi)
            _finish_rows(acc, b, out, lo, hi)
        return float_rows
    if kind == 1 and _is_ggml(w):
        def ggml_int8_activation_rows(inp, w, b, acc, out, isa, lo, hi):
            w0, w1, fmt0, fmt1, split = w
            _ggml_act_rows(isa, inp[0], inp[1], inp[2], w0, w1, fmt0, fmt1, split, acc, lo, hi)
            _finish_rows(acc, b, out, lo, hi)
        return ggml_int8_activation_rows
    layout = _panel_layout(w)
    if kind == 1 and layout == "int8":
        def q8_panel_int8_activation_rows(inp, w, b, acc, out, isa, lo, hi):
            codes, scales, n = w
            q8panel_row_range(isa, inp[0], inp[1], inp[2], codes, scales, acc, lo, hi)
            _finish_rows(acc, b, out, lo, hi)
        return q8_panel_int8_activation_rows
    if kind == 1 and layout == "q6_k":
        def q6k_panel_int8_activation_rows(inp, w, b, acc, out, isa, lo, hi):
            codes, sc, d, n = w
            q6panel_row_range(isa, inp[0], inp[1], offsets16(inp[0], inp[1]), codes, sc, d, acc, lo, hi)
            _finish_rows(acc, b, out, lo, hi)
        return q6k_panel_int8_activation_rows
    if kind == 1 and layout == "int4":
        def panel_int8_activation_rows(inp, w, b, acc, out, isa, lo, hi):
            codes, scales, offsets, n = w
            panel_row_range(isa, inp[0], inp[1], inp[2], codes, scales, offsets, acc, lo, hi)
            _finish_rows(acc, b, out, lo, hi)
        return panel_int8_activation_rows
    if kind == 1 and layout == "q4_k":
        def q4k_panel_int8_activation_rows(inp, w, b, acc, out, isa, lo, hi):
            codes, sc, mn, d, dmin, n = w
            kpanel_row_range(isa, inp[0], inp[1], inp[2], codes, sc, mn, d, dmin, acc, lo, hi)
            _finish_rows(acc, b, out, lo, hi)
        return q4k_panel_int8_activation_rows
    if kind == 1 and len(w.types) == 5:
        def int4_int8_activation_rows(inp, w, b, acc, out, isa, lo, hi):
            packed, scales, offsets, has_min, group = w
            int4_row_range(isa, inp[0], inp[1], inp[2], packed, scales, offsets, has_min, group, acc, lo, hi)
            _finish_rows(acc, b, out, lo, hi)
        return int4_int8_activation_rows
    if kind == 1:
        def int8_int8_activation_rows(inp, w, b, acc, out, isa, lo, hi):
            q, scales, group = w
            int8_row_range(isa, inp[0], inp[1], q, scales, group, acc, lo, hi)
            _finish_rows(acc, b, out, lo, hi)
        return int8_int8_activation_rows

    def portable_int4_rows(inp, w, b, acc, out, isa, lo, hi):
        packed, scales, offsets, has_min, group = w
        _portable_int4_rows(inp[0], inp[1], inp[2], packed, scales, offsets, has_min, group, acc, lo, hi)
        _finish_rows(acc, b, out, lo, hi)
    return portable_int4_rows


# The row kernels proper are called, not inlined: each compiles once per weight type and is shared by every layer
# specialization (inlining them into the layer made its compile several minutes long); the int4 / int8 ones
# (``int4_row_range``, ``int8_row_range``) are the standalone GEMVs' own. The ggml block formats keep a wrapper of
# their own here: sharing ``ggml_rows`` with the GEMVs the same way made this layer's Q4_K/Q6_K results differ from
# the per-op path in a full cold ``make test`` run, though never when the tests ran alone (docs/performance.md).
# Called with plain array arguments LLVM keeps their loads in registers, which it did not always do for arrays
# unpacked from tuples.
@njit(fastmath=FASTMATH, cache=True, error_model="numpy")
def _float_rows(xf, w, acc, lo, hi):  # pragma: no cover - compiled
    _gemv_rows(xf, w, acc, lo, hi)


@njit(fastmath=FASTMATH, cache=True, error_model="numpy")
def _ggml_act_rows(isa, xq, xd, xs, w0, w1, fmt0, fmt1, split, acc, lo, hi):  # pragma: no cover - compiled
    ggml_rows(isa, xq, xd, xs, w0, w1, fmt0, fmt1, split, acc, lo, hi, False)


@njit(fastmath=FASTMATH, cache=True, error_model="numpy")
def _portable_int4_rows(xlo, xhi, xsum, packed, scales, offsets, has_min, group, acc, lo, hi):  # pragma: no cover
    half_k = xlo.shape[1]
    wlo = np.empty(half_k, dtype=np.float32)
    whi = np.empty(half_k, dtype=np.float32)
    _int4_rows(xlo, xhi, xsum, packed, scales, offsets, has_min, group, acc, lo, hi, wlo, whi)


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _finish_rows(acc, b, out, lo, hi):  # pragma: no cover - compiled
    """Columns ``lo .. hi - 1`` of a GEMV's float32 result rounded to ``out``'s storage type, then the bias added
    and rounded again (torch's ``out + bias`` in the model dtype). Slices indexed from 0, so the loops vectorize
    (see ``activations._act_and_mul_item``)."""
    has_bias = b.shape[0] > 0
    bias = b[lo:hi] if has_bias else b
    for i in range(acc.shape[0]):
        src, dst = acc[i, lo:hi], out[i, lo:hi]
        if has_bias:
            for j in range(hi - lo):
                dst[j] = narrow(widen(narrow(src[j], out)) + widen(bias[j]), out)
        else:
            for j in range(hi - lo):
                dst[j] = narrow(src[j], out)


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _wait(sync, phase, total):  # pragma: no cover - compiled
    """Spin until ``total`` pieces of ``phase`` are done. Only claimed pieces are outstanding, and their workers are
    running, so the wait ends."""
    while atomics.load(sync, 2 * phase + 1) < total:
        pass


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _claim_serial(sync, phase):  # pragma: no cover - compiled
    """True for the one worker that runs the single piece of ``phase``."""
    return atomics.fetch_add(sync, 2 * phase, 1) == 0


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _finish_serial(sync, phase):  # pragma: no cover - compiled
    atomics.fetch_add(sync, 2 * phase + 1, 1)


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _rows_phase(sync, phase, inp, w, b, acc, out, isa, n_claims):  # pragma: no cover - compiled
    """A GEMV phase: cut the output rows into about ``n_claims`` chunks, claim chunks until none is left, then wait
    for the rest."""
    n_rows = acc.shape[1]
    # a multiple of 16: the row-panel kernels start a chunk on a whole panel (and the float rows on a 4-row block)
    claim_rows = max(MIN_CLAIM_ROWS, ((n_rows + n_claims - 1) // n_claims + 15) // 16 * 16)
    chunks = (n_rows + claim_rows - 1) // claim_rows
    while True:
        c = atomics.fetch_add(sync, 2 * phase, 1)
        if c >= chunks:
            break
        _project_rows(inp, w, b, acc, out, isa, c * claim_rows, min(n_rows, (c + 1) * claim_rows))
        atomics.fetch_add(sync, 2 * phase + 1, 1)
    _wait(sync, phase, chunks)


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _norm_rows(x, w, w_offset, eps):  # pragma: no cover - compiled
    """RMSNorm of every row of 2-D storage ``x`` into a new array (no residual)."""
    y = np.empty_like(x)
    for i in range(x.shape[0]):
        _rms_norm_row(x, x, w, w_offset, eps, y, x, i, False)
    return y


@njit(fastmath=FASTMATH, cache=True, error_model="numpy")
def _attention_inputs(qkv, q_norm_w, k_norm_w, w_offset, eps, positions, cos, sin, k_rows, v_rows, kv_quant,
                      slots, qf):  # pragma: no cover - compiled
    """qkv ``[T, (Hq + 2 Hkv) D]`` split into q, k, v; q/k norm; RoPE; k and v written to the cache rows ``slots``
    (quantized there for a cache of codes: ``kv_quant``, see :func:`decoder_layer_kernel`); the queries widened into
    ``qf`` float32 ``[T, Hq, D]`` for the decode items."""
    t_count = qkv.shape[0]
    hq = qf.shape[1]
    hkv = k_rows.shape[1]
    d = k_rows.shape[2]
    k_scales, v_scales, top = kv_quant[0], kv_quant[1], kv_quant[2]
    q = np.empty((t_count, hq, d), dtype=qkv.dtype)
    k = np.empty((t_count, hkv, d), dtype=qkv.dtype)
    v = np.empty((t_count, hkv, d), dtype=qkv.dtype)
    for t in range(t_count):
        for a in range(hq):
            for e in range(d):
                q[t, a, e] = qkv[t, a * d + e]
        for a in range(hkv):
            for e in range(d):
                k[t, a, e] = qkv[t, (hq + a) * d + e]
                v[t, a, e] = qkv[t, (hq + hkv + a) * d + e]
        store_row(v_rows, v_scales, v, t, slots[t], top)
    if q_norm_w.shape[0] > 0:
        q = _norm_rows(q.reshape(t_count * hq, d), q_norm_w, w_offset, eps).reshape(t_count, hq, d)
        k = _norm_rows(k.reshape(t_count * hkv, d), k_norm_w, w_offset, eps).reshape(t_count, hkv, d)
    for r in range(t_count * hq):
        _rotate_item(q, positions, cos, sin, r, False)
    for r in range(t_count * hkv):
        _rotate_item(k, positions, cos, sin, r, False)
    for t in range(t_count):
        store_row(k_rows, k_scales, k, t, slots[t], top)
    for t in range(t_count):
        for a in range(hq):
            for e in range(d):
                qf[t, a, e] = widen(q[t, a, e])


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _attention_items_phase(sync, phase, qf, k_rows, v_rows, kv_quant, part_out, part_lse,
                           schedule):  # pragma: no cover - compiled
    """Claim the plan's work items (a whole sequence, or one part of a long one split over the workers) until none
    is left, each into its own rows of ``part_out [items, Hq * max_q, D]`` / ``part_lse [items, Hq * max_q]`` (row
    ``h * q_len + i`` for head ``h`` of the sequence's ``i``-th query, as ``decode_kernel._write_item`` writes
    them); then wait for the rest."""
    n_items = schedule.item_seq.shape[0]
    k_scales, v_scales, unit = kv_quant[0], kv_quant[1], kv_quant[3]
    while True:
        item = atomics.fetch_add(sync, 2 * phase, 1)
        if item >= n_items:
            break
        decode_item(item, qf, k_rows, k_scales, v_rows, v_scales, unit, part_out, part_lse, schedule,
                    item + 1 if item + 1 < n_items else -1)
        atomics.fetch_add(sync, 2 * phase + 1, 1)
    _wait(sync, phase, n_items)


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _attention_rows_phase(sync, phase, part_out, part_lse, att, lse, schedule, att_s, o_w, isa, o_in):  # pragma: no cover
    """Claim sequences until none is left: merge a split sequence's parts by log-sum-exp into ``att [T, Hq, D]``,
    round each of its token rows (``seq_q_start[s] + i`` for ``i < seq_q_len[s]``) to storage into ``att_s [T, Hq D]``
    and prepare it as the o projection's input.

    A sequence of one item is read straight from its ``part_out`` rows, which the item wrote normalized: the merge
    of a single part multiplies by exactly 1, so skipping it changes no bit."""
    seq_q_start, seq_q_len = schedule.seq_q_start, schedule.seq_q_len
    seq_item_lo, seq_item_hi = schedule.seq_item_lo, schedule.seq_item_hi
    n_seqs = seq_q_len.shape[0]
    t_count, hq, d = att.shape[0], att.shape[1], att.shape[2]
    merged = att.reshape(t_count * hq, d)  # att's rows as head rows: token t, head a is row t * hq + a
    while True:
        s = atomics.fetch_add(sync, 2 * phase, 1)
        if s >= n_seqs:
            break
        t0, nq = seq_q_start[s], seq_q_len[s]
        # Head a of the sequence's i-th token is row base + a * head_step + i * token_step of src: head-major
        # (h * q_len + i) in an item's part_out, token-major in the merged att.
        if seq_item_hi[s] - seq_item_lo[s] == 1:
            src, base, head_step, token_step = part_out[seq_item_lo[s]], 0, nq, 1
        else:
            _merge_sequence(s, part_out, part_lse, seq_item_lo, seq_item_hi, seq_q_start, seq_q_len, att, lse)
            src, base, head_step, token_step = merged, t0 * hq, 1, hq
        for i in range(nq):
            t = t0 + i
            for a in range(hq):
                r = base + a * head_step + i * token_step
                for e in range(d):
                    att_s[t, a * d + e] = narrow(src[r, e], att_s)
            _fill_input_row(att_s, o_w, isa, o_in, t)
        atomics.fetch_add(sync, 2 * phase + 1, 1)
    _wait(sync, phase, n_seqs)


@njit(fastmath=FASTMATH, cache=True, error_model="numpy")
def _layer_worker(x, h, weights, norms, config, positions, cos, sin, k_rows, v_rows, kv_quant, slots, schedule, isa,
                  bufs, n_claims):  # pragma: no cover - compiled
    """One worker's share of the layer (see the module docstring); every worker runs this with the same arguments.
    ``bufs``: :class:`LayerBuffers`; ``n_claims``: chunks each GEMV is cut into (1: a single worker claims each GEMV
    whole)."""
    qkv_w, qkv_b, o_w, o_b = weights.qkv_w, weights.qkv_b, weights.o_w, weights.o_b
    gate_up_w, gate_up_b, down_w, down_b = weights.gate_up_w, weights.gate_up_b, weights.down_w, weights.down_b
    q_norm_w, k_norm_w, post_attn_w = norms.q_norm_w, norms.k_norm_w, norms.post_attn_w
    mlp_norm_w, post_mlp_w, next_norm_w = norms.mlp_norm_w, norms.post_mlp_w, norms.next_norm_w
    w_offset, eps, act_kind = config.w_offset, config.eps, config.act_kind
    qkv_in = (bufs.qkv_in0, bufs.qkv_in1, bufs.qkv_in2)
    o_in = (bufs.o_in0, bufs.o_in1, bufs.o_in2)
    gu_in = (bufs.gu_in0, bufs.gu_in1, bufs.gu_in2)
    down_in = (bufs.down_in0, bufs.down_in1, bufs.down_in2)
    qkv_acc, qkv, o_acc, a_out, gu_acc, gu = bufs.qkv_acc, bufs.qkv, bufs.o_acc, bufs.a_out, bufs.gu_acc, bufs.gu
    act, down_acc, m, att_s, h2, qf = bufs.act, bufs.down_acc, bufs.m, bufs.att_s, bufs.h2, bufs.qf
    part_out, part_lse, att, lse, sync = bufs.part_out, bufs.part_lse, bufs.att, bufs.lse, bufs.sync
    t_count = x.shape[0]
    # --- qkv projection
    if _claim_serial(sync, 0):
        _fill_input(h, qkv_w, isa, qkv_in)
        _finish_serial(sync, 0)
    _wait(sync, 0, 1)
    _rows_phase(sync, 1, qkv_in, qkv_w, qkv_b, qkv_acc, qkv, isa, n_claims)
    # --- split, q/k norm, RoPE, cache write; attention over the paged cache, item by item over the workers; each
    # sequence's parts merged, rounded and prepared as o's input
    if _claim_serial(sync, 2):
        _attention_inputs(qkv, q_norm_w, k_norm_w, w_offset, eps, positions, cos, sin, k_rows, v_rows, kv_quant,
                          slots, qf)
        _finish_serial(sync, 2)
    _wait(sync, 2, 1)
    _attention_items_phase(sync, 3, qf, k_rows, v_rows, kv_quant, part_out, part_lse, schedule)
    _attention_rows_phase(sync, 4, part_out, part_lse, att, lse, schedule, att_s, o_w, isa, o_in)
    _rows_phase(sync, 5, o_in, o_w, o_b, o_acc, a_out, isa, n_claims)
    # --- post-attention norm, residual + MLP norm, gate/up projection
    if _claim_serial(sync, 6):
        a_res = _norm_rows(a_out, post_attn_w, w_offset, eps) if post_attn_w.shape[0] > 0 else a_out
        for i in range(t_count):
            _rms_norm_row(a_res, x, mlp_norm_w, w_offset, eps, h2, x, i, True)
        _fill_input(h2, gate_up_w, isa, gu_in)
        _finish_serial(sync, 6)
    _wait(sync, 6, 1)
    _rows_phase(sync, 7, gu_in, gate_up_w, gate_up_b, gu_acc, gu, isa, n_claims)
    # --- gated activation, down projection
    if _claim_serial(sync, 8):
        chunks = (act.shape[1] + ACT_CHUNK - 1) // ACT_CHUNK
        for item in range(t_count * chunks):
            _act_and_mul_item(gu, act, act_kind, item, chunks)
        _fill_input(act, down_w, isa, down_in)
        _finish_serial(sync, 8)
    _wait(sync, 8, 1)
    _rows_phase(sync, 9, down_in, down_w, down_b, down_acc, m, isa, n_claims)
    # --- post-MLP norm, residual + the next layer's norm
    if _claim_serial(sync, 10):
        m_res = _norm_rows(m, post_mlp_w, w_offset, eps) if post_mlp_w.shape[0] > 0 else m
        for i in range(t_count):
            _rms_norm_row(m_res, x, next_norm_w, w_offset, eps, h, x, i, True)
        _finish_serial(sync, 10)
    _wait(sync, 10, 1)


def _n_out(w):  # pragma: no cover - replaced by the overload inside jitted code
    raise NotImplementedError


@overload(_n_out)
def _n_out_overload(w):
    """Output features of a projection: rows of a float weight, of a packed tuple's first array, or of both row
    blocks of a ggml tuple."""
    if isinstance(w, types.Array):
        return lambda w: w.shape[0]
    if _is_ggml(w):
        return lambda w: w[4] + w[1].shape[0]
    layout = _panel_layout(w)  # the row-panel layouts: N is given last, their arrays are per panel
    if layout == "int8":
        return lambda w: w[2]
    if layout in ("int4", "q6_k"):
        return lambda w: w[3]
    if layout == "q4_k":
        return lambda w: w[5]
    return lambda w: w[0].shape[0]


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _rows_per_item(schedule, hq):  # pragma: no cover - compiled
    """Query rows of the step's largest item: ``Hq`` times its longest sequence's query count (a plain loop, not
    ``max()``: in the parallel kernel an array reduction becomes a parfor, which wakes the pool)."""
    max_q = 1
    for s in range(schedule.seq_q_len.shape[0]):
        max_q = max(max_q, schedule.seq_q_len[s])
    return hq * max_q


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _buffers(x, h, weights, hq, d, n_items, item_rows, isa):  # pragma: no cover - compiled
    """The layer's :class:`LayerBuffers`: intermediates, the prepared inputs of its four projections, the attention
    items' partial results (``item_rows``: :func:`_rows_per_item`) and the zeroed phase counters."""
    qkv_w, o_w, gate_up_w, down_w = weights.qkv_w, weights.o_w, weights.gate_up_w, weights.down_w
    t_count = x.shape[0]
    n_qkv, n_o, n_gu, n_down = _n_out(qkv_w), _n_out(o_w), _n_out(gate_up_w), _n_out(down_w)
    att_s = np.empty((t_count, hq * d), dtype=x.dtype)
    a_out = np.empty((t_count, n_o), dtype=x.dtype)
    h2 = np.empty_like(x)
    act = np.empty((t_count, n_gu // 2), dtype=x.dtype)
    qi0, qi1, qi2 = _new_input(h, qkv_w, isa)
    oi0, oi1, oi2 = _new_input(att_s, o_w, isa)
    gi0, gi1, gi2 = _new_input(h2, gate_up_w, isa)
    di0, di1, di2 = _new_input(act, down_w, isa)
    sync = np.empty(2 * _PHASES, dtype=np.int64)
    for i in range(2 * _PHASES):  # not np.zeros: in a parallel=True function that becomes a parallel fill, which
        sync[i] = 0  # wakes the thread pool on every call
    return LayerBuffers(
        qkv_in0=qi0, qkv_in1=qi1, qkv_in2=qi2,
        qkv_acc=np.empty((t_count, n_qkv), dtype=np.float32), qkv=np.empty((t_count, n_qkv), dtype=x.dtype),
        o_in0=oi0, o_in1=oi1, o_in2=oi2, o_acc=np.empty((t_count, n_o), dtype=np.float32), a_out=a_out,
        gu_in0=gi0, gu_in1=gi1, gu_in2=gi2,
        gu_acc=np.empty((t_count, n_gu), dtype=np.float32), gu=np.empty((t_count, n_gu), dtype=x.dtype), act=act,
        down_in0=di0, down_in1=di1, down_in2=di2,
        down_acc=np.empty((t_count, n_down), dtype=np.float32), m=np.empty((t_count, n_down), dtype=x.dtype),
        att_s=att_s, h2=h2, qf=np.empty((t_count, hq, d), dtype=np.float32),
        part_out=np.empty((n_items, item_rows, d), dtype=np.float32),
        part_lse=np.empty((n_items, item_rows), dtype=np.float32),
        att=np.empty((t_count, hq, d), dtype=np.float32), lse=np.empty((t_count, hq), dtype=np.float32),
        sync=sync,
    )


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _syncs(n_layers):  # pragma: no cover - compiled
    """Zeroed phase counters, one row per layer: a worker that leaves a layer's last wait early starts the next layer
    on counters no other worker still reads, so nothing is reset between layers."""
    syncs = np.empty((n_layers, 2 * _PHASES), dtype=np.int64)
    for i in range(n_layers):  # not np.zeros: in a parallel=True function that becomes a parallel fill, which
        for j in range(2 * _PHASES):  # wakes the thread pool on every call
            syncs[i, j] = 0
    return syncs


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _with_sync(b, sync):  # pragma: no cover - compiled
    """``b`` with its phase counters replaced by ``sync``."""
    return LayerBuffers(
        qkv_in0=b.qkv_in0, qkv_in1=b.qkv_in1, qkv_in2=b.qkv_in2, qkv_acc=b.qkv_acc, qkv=b.qkv,
        o_in0=b.o_in0, o_in1=b.o_in1, o_in2=b.o_in2, o_acc=b.o_acc, a_out=b.a_out,
        gu_in0=b.gu_in0, gu_in1=b.gu_in1, gu_in2=b.gu_in2, gu_acc=b.gu_acc, gu=b.gu, act=b.act,
        down_in0=b.down_in0, down_in1=b.down_in1, down_in2=b.down_in2, down_acc=b.down_acc, m=b.m,
        att_s=b.att_s, h2=b.h2, qf=b.qf, part_out=b.part_out, part_lse=b.part_lse, att=b.att, lse=b.lse,
        sync=sync,
    )


@njit(fastmath=FASTMATH, cache=True, error_model="numpy")
def _layers_worker(x, h, layers, kvs, config, positions, cos, sin, slots, schedule, isa, bufs, syncs,
                   n_claims):  # pragma: no cover - compiled
    """One worker's share of every layer of ``layers`` in turn (:func:`_layer_worker` per layer). The buffers are
    shared by the layers: a layer's last phase ends with every worker waiting for it, so nothing still reads them
    when the next layer starts writing."""
    for i in range(len(layers)):
        weights, norms = layers[i]
        k_rows, v_rows, kv_quant = kvs[i]
        _layer_worker(x, h, LayerWeights(*weights), LayerNorms(*norms), config, positions, cos, sin, k_rows, v_rows,
                      kv_quant, slots, schedule, isa, _with_sync(bufs, syncs[i]), n_claims)


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _run_buffers(x, h, layers, kvs, config, schedule, isa):  # pragma: no cover - compiled
    """The buffers every layer of the run shares (they have the same shapes: ``layer_lists`` groups them so)."""
    return _buffers(x, h, LayerWeights(*layers[0][0]), config.num_q_heads, kvs[0][0].shape[2],
                    schedule.item_seq.shape[0], _rows_per_item(schedule, config.num_q_heads), isa)


@njit(fastmath=FASTMATH, cache=True, error_model="numpy")
def _serial_layers(x, h, layers, kvs, config, positions, cos, sin, slots, schedule, isa):  # pragma: no cover
    """:func:`decoder_layers_kernel` on the calling thread (each GEMV claimed whole)."""
    config = LayerConfig(*config)
    schedule = DecodeSchedule(*schedule)
    bufs = _run_buffers(x, h, layers, kvs, config, schedule, isa)
    # np.int64, not a bare constant: Numba would pass a literal's own type and compile _layers_worker a second time
    # for the parallel kernel's call (~30 s)
    _layers_worker(x, h, layers, kvs, config, positions, cos, sin, slots, schedule, isa, bufs, _syncs(len(layers)),
                   np.int64(1))


@njit(parallel=True, fastmath=FASTMATH, cache=True, error_model="numpy")
def _parallel_layers(x, h, layers, kvs, config, positions, cos, sin, slots, schedule, isa,
                     n_workers):  # pragma: no cover - compiled
    """:func:`decoder_layers_kernel` as ``n_workers`` workers in one parallel region for all the layers."""
    # Built by calls to the record classes here: a named tuple entering a parallel region must come from such a call
    # (or be an argument), where Numba's parfor lowering finds its class. The layers' weights enter inside the typed
    # lists: a parallel region cannot take tuples of arrays from outside, but a list is one value.
    config = LayerConfig(*config)
    schedule = DecodeSchedule(*schedule)
    bufs = _run_buffers(x, h, layers, kvs, config, schedule, isa)
    syncs = _syncs(len(layers))
    n_claims = np.int64(n_workers * CLAIMS_PER_WORKER)  # see _serial_layers
    for _ in prange(n_workers):
        _layers_worker(x, h, layers, kvs, config, positions, cos, sin, slots, schedule, isa, bufs, syncs, n_claims)


#: ``kv_quant`` of a cache in the model's dtype: no scales, and top / unit unused
FLOAT_PAGES = (NO_SCALES, NO_SCALES, np.float32(0.0), np.float32(1.0))


def layer_list(layers: list[tuple[LayerWeights, LayerNorms]]) -> List:
    """``[(weights, norms), ...]`` as the typed list :func:`decoder_layers_kernel` takes (plain tuples inside: see
    :mod:`~tessera.backends.cpu.kernel_args`). Every item must have the same Numba type and array shapes."""
    out = List()
    for weights, norms in layers:
        out.append((tuple(weights), tuple(norms)))
    return out


def kv_list(kvs: list[tuple[np.ndarray, np.ndarray, tuple]]) -> List:
    """``[(k_rows, v_rows, kv_quant), ...]`` per layer as the typed list :func:`decoder_layers_kernel` takes."""
    out = List()
    for item in kvs:
        out.append(tuple(item))
    return out


def decoder_layers_kernel(
    x: np.ndarray, h: np.ndarray, layers: List, kvs: List, config: LayerConfig, positions: np.ndarray,
    cos: np.ndarray, sin: np.ndarray, slots: np.ndarray, schedule: DecodeSchedule, isa: object, n_workers: int,
) -> None:
    """Run consecutive layers for ``T`` new tokens (one or more per sequence) and update ``x`` and ``h`` in place.

    One call for a run of layers, not one per layer: at batch 1 on SmolLM2 (30 layers) a call cost ~5 us of
    dispatch (typing and unboxing ~25 arguments) plus a thread-pool wake-up, where the layer itself takes ~80 us.

    Parameters
    ----------
    x : storage ``[T, H]``, the residual stream before the first layer; after: the stream after the last.
    h : storage ``[T, H]``, the first layer's normed input; after: the normed input of the layer after the run
        (each layer's ``norms.next_norm_w``).
    layers : :func:`layer_list` of the run's ``(weights, norms)``: each layer's projections and biases
        (:class:`~tessera.backends.cpu.kernel_args.LayerWeights`) and norm weights
        (:class:`~tessera.backends.cpu.kernel_args.LayerNorms`), all with one Numba type and the same shapes.
    kvs : :func:`kv_list` of each layer's ``(k_rows, v_rows, kv_quant)``: its cache as storage rows
        ``[rows, Hkv, D]`` (the model's dtype, or the codes of a quantized cache: int8, or e4m3 as uint8 bits) and
        ``(k_scales, v_scales, top, unit)``: for codes, their float16 scale bits (int16 ``[rows, Hkv]``), the format's
        largest code (float32; the new rows are quantized as ``tessera.kv.quantized.quantize_kv`` does, bit for bit)
        and ``decode_kernel.code_unit``; for float pages :data:`FLOAT_PAGES`.
    config : the scalars (:class:`~tessera.backends.cpu.kernel_args.LayerConfig`, built by ``LayerConfig.of``).
    positions : int64 ``[T]``; cos, sin : float32 ``[P, rotary_dim / 2]``, the run's RoPE tables.
    slots : int64 ``[T]``, where the new K/V go.
    schedule : :attr:`tessera.backends.cpu.decode.DecodePlan.schedule` of a plan over every sequence of the step
        (the run's layers share it), whose queries are consecutive token rows in sequence order (``seq_q_start``
        the running sum of ``seq_q_len``); split or not: the workers claim its items, then merge each sequence's parts.
    isa : the ISA token of the int8-activation ``qgemv`` variant that runs the packed projections, or None for the
        portable int4 kernel. It is an argument of its own, not part of the weight tuples: see ``_int8_simd``'s
        ``_typeof_token`` for what a token inside a tuple costs at every call.
    n_workers : 1 runs the layers on the calling thread; more runs them in one parallel region of that many workers.

    Two compiled kernels behind one entry point: a model that only ever runs serial steps never compiles the
    parallel region (~53 s cold on a 2-core Zen 3, 44 s of it its own; ``benchmarks/compile_times.py``).
    """
    config, schedule = tuple(config), tuple(schedule)  # see kernel_args: plain tuples type in C
    if n_workers <= 1:
        _serial_layers(x, h, layers, kvs, config, positions, cos, sin, slots, schedule, isa)
    else:
        _parallel_layers(x, h, layers, kvs, config, positions, cos, sin, slots, schedule, isa, n_workers)


def decoder_layer_kernel(
    x: np.ndarray, h: np.ndarray, weights: LayerWeights, norms: LayerNorms, config: LayerConfig,
    positions: np.ndarray, cos: np.ndarray, sin: np.ndarray, k_rows: np.ndarray, v_rows: np.ndarray,
    kv_quant: tuple, slots: np.ndarray, schedule: DecodeSchedule, isa: object, n_workers: int,
) -> None:
    """One layer through :func:`decoder_layers_kernel` (the same compiled kernels), for callers that time or tune a
    single layer; building its two one-item lists costs ~10 us a call, so decoding runs whole runs of layers."""
    decoder_layers_kernel(x, h, layer_list([(weights, norms)]), kv_list([(k_rows, v_rows, kv_quant)]), config,
                          positions, cos, sin, slots, schedule, isa, n_workers)
