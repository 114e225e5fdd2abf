"""Embedding ops on the triton backend: a row gather (one program per (token, column block)) and the LM head as a
tiled GEMM with float32 accumulation and the softcap fused into its epilogue."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tessera.backends.triton.configs import interpreting
from tessera.backends.triton.ops._rounding import manual_rne, to_storage

EMBED_BLOCK = 1024


@triton.jit
def _embed_kernel(IDS, TABLE, OUT, h, scale, HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr,
                  MANUAL_RNE: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < h
    row = tl.load(IDS + tok).to(tl.int64)  # ids were range-checked at the API boundary
    v = tl.load(TABLE + row * h + cols, mask=ok, other=0.0)
    if HAS_SCALE:
        tl.store(OUT + tok * h + cols, to_storage(v.to(tl.float32) * scale, OUT.dtype.element_ty, MANUAL_RNE),
                 mask=ok)
    else:
        tl.store(OUT + tok * h + cols, v, mask=ok)


@triton.jit
def _lm_head_kernel(H, T, OUT, m, vocab, width, softcap, HAS_CAP: tl.constexpr, UPCAST: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``OUT[m, n] = sum_k H[m, k] T[n, k]`` for one ``BLOCK_M x BLOCK_N`` tile; ``UPCAST`` widens bf16 operands
    (Triton 3.9's interpreter multiplies bf16 bit patterns in ``tl.dot``)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, width, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(H + rows[:, None] * width + ks[None, :], mask=(rows[:, None] < m) & (ks[None, :] < width),
                    other=0.0)
        b = tl.load(T + cols[None, :] * width + ks[:, None], mask=(cols[None, :] < vocab) & (ks[:, None] < width),
                    other=0.0)
        if UPCAST:
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    if HAS_CAP:  # cap * tanh(x / cap), tanh through exp(-2|z|) so no intermediate overflows
        z = acc / softcap
        e = tl.exp(-2.0 * tl.abs(z))
        t = (1.0 - e) / (1.0 + e)
        acc = softcap * tl.where(z < 0, -t, t)
    tl.store(OUT + rows[:, None] * vocab + cols[None, :], acc, mask=(rows[:, None] < m) & (cols[None, :] < vocab))


def embed(ids, table, scale):
    h = table.shape[1]
    flat = ids.reshape(-1).contiguous()
    out = torch.empty(flat.numel(), h, dtype=table.dtype, device=table.device)
    if flat.numel():
        grid = (flat.numel(), triton.cdiv(h, EMBED_BLOCK))
        _embed_kernel[grid](flat, table.contiguous(), out, h, 1.0 if scale is None else scale,
                            HAS_SCALE=scale is not None, BLOCK=EMBED_BLOCK, MANUAL_RNE=manual_rne(table.dtype))
    return out.view(*ids.shape, h)


def lm_head(hidden, table, softcap):
    vocab, width = table.shape
    h = hidden.reshape(-1, width).contiguous()
    m = h.shape[0]
    # fp32 stays fp32 ("ieee", not tf32); mixed dtypes meet in fp32; the interpreter's bf16 dot needs widening
    upcast = interpreting() or table.dtype == torch.float32 or hidden.dtype != table.dtype
    out = torch.empty(m, vocab, dtype=torch.float32, device=table.device)
    if m:
        block_m = 16 if m <= 16 else 64
        grid = (triton.cdiv(m, block_m), triton.cdiv(vocab, 64))
        _lm_head_kernel[grid](h, table.contiguous(), out, m, vocab, width, 1.0 if softcap is None else softcap,
                              HAS_CAP=softcap is not None, UPCAST=upcast,
                              BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=32)
    return out.view(*hidden.shape[:-1], vocab)


OPS = {"embed": embed, "lm_head": lm_head}
