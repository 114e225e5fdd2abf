"""One whole decoder layer for a small decode step, as a single serial Numba call.

At batch 1 a SmolLM2-135M token spends ~12 ms streaming weights through four GEMVs per layer, and, before this
kernel, another ~8 ms in the Python around them: about fifteen op calls per layer, each a few layers of Python,
tensor allocations and checks, all running with caches just flushed by the weight stream. This kernel runs the
same ops, in the same order, with the same inline Numba helpers as the per-op cpu kernels (GEMV rows, RMSNorm rows,
RoPE rows, gated activation chunks, the paged decode item), so its results equal the per-op path's bit for bit; only
the Python between them is gone. Intermediates are rounded to the model's storage dtype exactly where the per-op path
stores a tensor (a GEMV result, a bias add, a norm, RoPE, the attention output).

It runs on the calling thread, so :mod:`tessera.models.fused_decode` uses it only when every GEMV of the step is
below the cpu GEMV's serial threshold and the attention plan is a serial, direct decode plan (short contexts, few
sequences): exactly when the per-op path would run every kernel serially too.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.core.extending import overload

from tessera.backends.cpu.decode_kernel import decode_item
from tessera.backends.cpu.numba_math import FASTMATH, widen
from tessera.backends.cpu.ops._gemv import _rows as _gemv_rows
from tessera.backends.cpu.ops._int8_simd import IsaTokenType
from tessera.backends.cpu.ops._qdot_kernels import int4_rows, int8_rows, quantize_rows
from tessera.backends.cpu.ops._quant_kernels import _int4_rows
from tessera.backends.cpu.ops._narrow import narrow
from tessera.backends.cpu.ops.activations import CHUNK as ACT_CHUNK
from tessera.backends.cpu.ops.activations import _act_and_mul_item
from tessera.backends.cpu.ops.norms import _rms_norm_row
from tessera.backends.cpu.ops.rope import _rotate_item


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _widened(x):  # pragma: no cover - compiled
    """float32 copy of a 2-D storage array (what ``x.float()`` gives the GEMV)."""
    out = np.empty(x.shape, dtype=np.float32)
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            out[i, j] = widen(x[i, j])
    return out


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _finish(acc, b, like):  # pragma: no cover - compiled
    """A GEMV's float32 result rounded to ``like``'s storage type, then the bias added and rounded again (torch's
    ``out + bias`` in the model dtype)."""
    out = np.empty(acc.shape, dtype=like.dtype)
    has_bias = b.shape[0] > 0
    for i in range(acc.shape[0]):
        for j in range(acc.shape[1]):
            v = narrow(acc[i, j], like)
            if has_bias:
                v = narrow(widen(v) + widen(b[j]), like)
            out[i, j] = v
    return out


def _project(x, w, b, like):  # pragma: no cover - replaced by the overload inside jitted code
    raise NotImplementedError


@overload(_project)
def _project_overload(x, w, b, like):
    """``x @ w.T (+ b)`` for storage ``x [T, K]``: ``w`` is a float storage array ``[N, K]`` (the float GEMV's rows),
    or an int4 weight as the tuple ``(packed uint8 [N, K/2], scales f32 [N, K/g], offsets [N, K/g], g, has_min)``
    (the int4 GEMV's rows, with x split into low/high-nibble halves and group sums exactly as the host side does),
    or, for the int8-activation ``qgemv`` variants, a tuple led by the variant's ISA token:
    ``(isa, packed, scales, offsets, has_min, g)`` (int4 / int4_min) or ``(isa, q int8 [N, K], scales, g)`` (int8),
    run by the same row kernels as the per-op path (:mod:`.ops._qdot_kernels`)."""
    if isinstance(w, types.Array):
        def float_weight(x, w, b, like):
            xf = _widened(x)
            acc = np.empty((x.shape[0], w.shape[0]), dtype=np.float32)
            _gemv_rows(xf, w, acc, 0, w.shape[0])
            return _finish(acc, b, like)
        return float_weight
    if isinstance(w, types.BaseTuple) and isinstance(w.types[0], IsaTokenType):
        if len(w.types) == 6:
            def int4_int8_activation(x, w, b, like):
                isa, packed, scales, offsets, has_min, group = w
                xq, xd, xs = quantize_rows(x)
                acc = np.empty((x.shape[0], packed.shape[0]), dtype=np.float32)
                int4_rows(isa, xq, xd, xs, packed, scales, offsets, has_min, group, acc, 0, packed.shape[0])
                return _finish(acc, b, like)
            return int4_int8_activation

        def int8_int8_activation(x, w, b, like):
            isa, q, scales, group = w
            xq, xd, _ = quantize_rows(x)
            acc = np.empty((x.shape[0], q.shape[0]), dtype=np.float32)
            int8_rows(isa, xq, xd, q, scales, group, acc, 0, q.shape[0])
            return _finish(acc, b, like)
        return int8_int8_activation
    if isinstance(w, types.BaseTuple):
        def int4_weight(x, w, b, like):
            packed, scales, offsets, group, has_min = w
            t_count, k = x.shape
            half = group // 2
            xlo = np.empty((t_count, k // 2), dtype=np.float32)
            xhi = np.empty((t_count, k // 2), dtype=np.float32)
            xsum = np.zeros((t_count, k // group), dtype=np.float32)
            for m in range(t_count):
                for g in range(k // group):
                    for j in range(half):
                        lo_v = widen(x[m, g * group + j])
                        hi_v = widen(x[m, g * group + half + j])
                        xlo[m, g * half + j] = lo_v
                        xhi[m, g * half + j] = hi_v
                    total = np.float32(0.0)
                    for j in range(group):
                        total += widen(x[m, g * group + j])
                    xsum[m, g] = total
            acc = np.empty((t_count, packed.shape[0]), dtype=np.float32)
            wlo = np.empty(k // 2, dtype=np.float32)
            whi = np.empty(k // 2, dtype=np.float32)
            _int4_rows(xlo, xhi, xsum, packed, scales, offsets, has_min, group, acc, 0, packed.shape[0], wlo, whi)
            return _finish(acc, b, like)
        return int4_weight
    return None


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _norm_rows(x, w, w_offset, eps):  # pragma: no cover - compiled
    """RMSNorm of every row of 2-D storage ``x`` into a new array (no residual)."""
    y = np.empty_like(x)
    for i in range(x.shape[0]):
        _rms_norm_row(x, x, w, w_offset, eps, y, x, i, False)
    return y


@njit(fastmath=FASTMATH, cache=True, error_model="numpy")
def decoder_layer_kernel(
    x, h,
    qkv_w, qkv_b, o_w, o_b, gate_up_w, gate_up_b, down_w, down_b,
    q_norm_w, k_norm_w, post_attn_w, mlp_norm_w, post_mlp_w, next_norm_w,
    w_offset, eps, act_kind, num_q_heads,
    positions, cos, sin,
    k_rows, v_rows, slots,
    item_seq, item_seg_lo, item_seg_hi, seq_q_start, seq_q_len, seq_kv_len, row_base, block,
    seg_start, seg_end, seg_mask_off, seg_mask_hstride, mask_buf, scale, softcap, slopes, item_order, worker_start,
):  # pragma: no cover - compiled
    """Run one layer for ``T`` new tokens (one per sequence) and update ``x`` and ``h`` in place.

    x : storage ``[T, H]``, the residual stream before the layer; after: the stream after it.
    h : storage ``[T, H]``, this layer's normed input; after: the next layer's normed input (``next_norm_w``).
    *_w, *_b : storage weights ``[N, K]`` (or int4 weight tuples for the four projections, see ``_project``) /
    biases ``[N]``; an empty array means absent (no bias, no q/k norm, no post norm). w_offset : 1.0 for Gemma's ``(1 + w)`` norms, else 0.0. act_kind : 0 SiLU, 1 GELU, 2 GELU (tanh).
    positions : int64 ``[T]``; cos, sin : float32 ``[P, rotary_dim / 2]``.
    k_rows, v_rows : the layer's cache as storage rows ``[rows, Hkv, D]``; slots : int64 ``[T]``, where the new
    K/V go. The rest is a direct, serial :class:`tessera.backends.cpu.decode.DecodePlan`'s arrays.
    """
    t_count = x.shape[0]
    hkv = k_rows.shape[1]
    d = k_rows.shape[2]
    hq = num_q_heads
    w_offset = np.float32(w_offset)
    eps = np.float32(eps)
    # --- attention: qkv projection, split, q/k norm, RoPE, cache write
    qkv = _project(h, qkv_w, qkv_b, x)
    q = np.empty((t_count, hq, d), dtype=x.dtype)
    k = np.empty((t_count, hkv, d), dtype=x.dtype)
    for t in range(t_count):
        for a in range(hq):
            for e in range(d):
                q[t, a, e] = qkv[t, a * d + e]
        for a in range(hkv):
            for e in range(d):
                k[t, a, e] = qkv[t, (hq + a) * d + e]
                v_rows[slots[t], a, e] = qkv[t, (hq + hkv + a) * d + e]
    if q_norm_w.shape[0] > 0:
        q = _norm_rows(q.reshape(t_count * hq, d), q_norm_w, w_offset, eps).reshape(t_count, hq, d)
        k = _norm_rows(k.reshape(t_count * hkv, d), k_norm_w, w_offset, eps).reshape(t_count, hkv, d)
    for r in range(t_count * hq):
        _rotate_item(q, positions, cos, sin, r, False)
    for r in range(t_count * hkv):
        _rotate_item(k, positions, cos, sin, r, False)
    for t in range(t_count):
        for a in range(hkv):
            for e in range(d):
                k_rows[slots[t], a, e] = k[t, a, e]
    # --- attention over the paged cache: one item per sequence, written straight to the output rows
    qf = np.empty((t_count, hq, d), dtype=np.float32)
    for t in range(t_count):
        for a in range(hq):
            for e in range(d):
                qf[t, a, e] = widen(q[t, a, e])
    att = np.empty((t_count, hq, d), dtype=np.float32)
    lse = np.empty((t_count, hq), dtype=np.float32)
    for item in range(item_seq.shape[0]):
        decode_item(item, qf, k_rows, v_rows, att, lse, item_seq, item_seg_lo, item_seg_hi, seq_q_start, seq_q_len,
                     seq_kv_len, row_base, block, seg_start, seg_end, seg_mask_off, seg_mask_hstride, mask_buf,
                     scale, softcap, slopes, item + 1 if item + 1 < item_seq.shape[0] else -1)
    att_s = np.empty((t_count, hq * d), dtype=x.dtype)
    for t in range(t_count):
        for a in range(hq):
            for e in range(d):
                att_s[t, a * d + e] = narrow(att[t, a, e], x)
    a_out = _project(att_s, o_w, o_b, x)
    if post_attn_w.shape[0] > 0:
        a_out = _norm_rows(a_out, post_attn_w, w_offset, eps)
    # --- residual + MLP norm, gated MLP, residual + the next layer's norm
    h2 = np.empty_like(x)
    for i in range(t_count):
        _rms_norm_row(a_out, x, mlp_norm_w, w_offset, eps, h2, x, i, True)
    gu = _project(h2, gate_up_w, gate_up_b, x)
    inter = gu.shape[1] // 2
    act = np.empty((t_count, inter), dtype=x.dtype)
    chunks = (inter + ACT_CHUNK - 1) // ACT_CHUNK
    for item in range(t_count * chunks):
        _act_and_mul_item(gu, act, act_kind, item, chunks)
    m = _project(act, down_w, down_b, x)
    if post_mlp_w.shape[0] > 0:
        m = _norm_rows(m, post_mlp_w, w_offset, eps)
    for i in range(t_count):
        _rms_norm_row(m, x, next_norm_w, w_offset, eps, h, x, i, True)
