"""Quantizers for ggml's K-quant block formats (Q4_K, Q5_K, Q6_K), in NumPy: float rows in, the file's bytes out.

gguf-py quantizes the 32-value formats (Q4_0 ... Q8_0) but not the K-quants, so these are Tessera's own. They
write the layouts of :mod:`tessera.kernels.ggml_blocks` (which de-quantizes them, and so does gguf-py: the tests
check the two agree on these bytes). The rounding rule is the plain one, not llama.cpp's search:

* Q4_K / Q5_K: each 32-value sub-block gets the range ``[min(x, 0), max(x)]`` split into 15 (31) steps; the eight
  steps and eight offsets of a 256-value block are then stored as 6-bit multiples of two f16 block scales, and the
  values are rounded against the scales as stored, so what is de-quantized is what was rounded to.
* Q6_K: each 16-value sub-block gets a symmetric step ``max|x| / 31``, stored as an int8 multiple of one f16 block
  scale; values are rounded against it to -32..31.

llama.cpp's quantizers (``make_qkx2_quants``) search each sub-block's step and offset for the least squared error,
which lowers it by roughly a tenth to a third; what that costs in perplexity is measured by the accuracy benchmarks,
not assumed here. Inputs: float32 ``[N, K]`` with K a multiple of 256.

>>> blocks = quantize_rows(w.numpy(), "q4_k")         # uint8 [N, K // 256 * 144]
"""

from __future__ import annotations

import numpy as np

from tessera.kernels.ggml_blocks import BLOCKS

QUANTIZABLE = ("q4_k", "q5_k", "q6_k")


def quantize_rows(x: np.ndarray, fmt: str) -> np.ndarray:
    """uint8 ``[N, row_bytes]`` blocks of float ``x [N, K]`` in ``fmt`` (one of :data:`QUANTIZABLE`)."""
    if fmt not in QUANTIZABLE:
        raise ValueError(f"quantize_rows: format {fmt!r} has no quantizer here; supported: {list(QUANTIZABLE)}")
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] % 256:
        raise ValueError(f"quantize_rows({fmt}): need a 2-D array whose rows are whole 256-value blocks, got shape "
                         f"{x.shape}")
    if not np.isfinite(x).all():
        raise ValueError(f"quantize_rows({fmt}): the input has NaN or infinite values")
    n, k = x.shape
    blocks = x.reshape(-1, 256)
    out = _q6_k(blocks) if fmt == "q6_k" else _q45_k(blocks, bits=4 if fmt == "q4_k" else 5)
    return out.reshape(n, k // 256 * BLOCKS[fmt][2])


def _f16(v: np.ndarray) -> np.ndarray:
    """``v`` rounded to float16 and back: the value a reader of the stored half sees."""
    return v.astype(np.float16).astype(np.float32)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros(np.broadcast_shapes(a.shape, b.shape), np.float32), where=b != 0)


def _q45_k(blocks: np.ndarray, bits: int) -> np.ndarray:
    top = (1 << bits) - 1
    sub = blocks.reshape(-1, 8, 32)
    offset = np.maximum(-sub.min(axis=2), 0.0)  # value = step * q - offset, offset >= 0
    step = (sub.max(axis=2) + offset) / top
    d = _f16(step.max(axis=1) / 63)
    dmin = _f16(offset.max(axis=1) / 63)
    sc = np.clip(np.rint(_safe_div(step, d[:, None])), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(_safe_div(offset, dmin[:, None])), 0, 63).astype(np.uint8)
    eff_step = d[:, None] * sc
    eff_off = dmin[:, None] * mn
    q = np.clip(np.rint(_safe_div(sub + eff_off[:, :, None], eff_step[:, :, None])), 0, top).astype(np.uint8)

    nb = blocks.shape[0]
    size = BLOCKS["q4_k" if bits == 4 else "q5_k"][2]
    out = np.zeros((nb, size), np.uint8)
    out[:, 0:2] = d.astype(np.float16).view(np.uint8).reshape(nb, 2)
    out[:, 2:4] = dmin.astype(np.float16).view(np.uint8).reshape(nb, 2)
    scales = out[:, 4:16]
    scales[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    # qs: chunk c holds sub-block 2c in the low nibbles and 2c+1 in the high ones, 32 bytes
    low = q & 15
    qs = (low[:, 0::2] | (low[:, 1::2] << 4)).reshape(nb, 128)
    if bits == 4:
        out[:, 16:144] = qs
        return out
    # Q5_K: the fifth bit of sub-block s's value l is bit s of qh[l]
    high = (q >> 4).astype(np.uint8)  # [nb, 8, 32]
    qh = np.zeros((nb, 32), np.uint8)
    for s in range(8):
        qh |= high[:, s] << s
    out[:, 16:48] = qh
    out[:, 48:176] = qs
    return out


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    sub = blocks.reshape(-1, 16, 16)
    step = np.abs(sub).max(axis=2) / 31
    d = _f16(step.max(axis=1) / 127)
    sc = np.clip(np.rint(_safe_div(step, d[:, None])), -128, 127).astype(np.int8)
    eff = d[:, None] * sc
    q = (np.clip(np.rint(_safe_div(sub, eff[:, :, None].astype(np.float32))), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(-1, 2, 4, 32)  # half, part (32 values), value
    nb = blocks.shape[0]
    out = np.zeros((nb, 210), np.uint8)
    low, high = q & 15, q >> 4
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2)
    out[:, 0:128] = ql.reshape(nb, 128)
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    out[:, 128:192] = qh.reshape(nb, 64)
    out[:, 192:208] = sc.view(np.uint8)
    out[:, 208:210] = d.astype(np.float16).view(np.uint8).reshape(nb, 2)
    return out
