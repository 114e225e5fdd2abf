"""``apply_rope`` in Triton: one kernel rotates q and k in place, one program per token.

Each program loads its token's cos/sin row once, then sweeps the q heads and the k heads in blocks of
``BLOCK_H`` rows of ``BLOCK_I`` pairs; the math runs in float32 and is stored back in the input dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tessera.kernels.rope import RotaryEmbedding


@triton.jit
def _rotate_heads(base, stride_h, num_heads, c, s, i, i_mask, half,
                  INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr):
    """Rotate the first ``2 * half`` dims of heads ``0 .. num_heads - 1`` of one token (``base`` -> head 0)."""
    if INTERLEAVED:
        ia, ib = 2 * i, 2 * i + 1
    else:
        ia, ib = i, i + half
    for h0 in range(0, num_heads, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        mask = (h < num_heads)[:, None] & i_mask[None, :]
        rows = base + h[:, None].to(tl.int64) * stride_h
        a = tl.load(rows + ia[None, :], mask=mask, other=0.0).to(tl.float32)
        b = tl.load(rows + ib[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(rows + ia[None, :], (a * c - b * s).to(base.dtype.element_ty), mask=mask)
        tl.store(rows + ib[None, :], (b * c + a * s).to(base.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_cos,
                 num_q_heads, num_kv_heads, half,
                 INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_I: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    p = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, BLOCK_I)
    i_mask = i < half
    c = tl.load(cos_ptr + p * stride_cos + i, mask=i_mask, other=0.0)[None, :]
    s = tl.load(sin_ptr + p * stride_cos + i, mask=i_mask, other=0.0)[None, :]
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, num_q_heads, c, s, i, i_mask, half, INTERLEAVED, BLOCK_H)
    _rotate_heads(k_ptr + t * stride_kt, stride_kh, num_kv_heads, c, s, i, i_mask, half, INTERLEAVED, BLOCK_H)


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
               interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`tessera.kernels.rope.apply_rope` (arguments already validated)."""
    cos, sin = rope.tables(q.device)
    half = rope.rotary_dim // 2
    block_i = triton.next_power_of_2(half)
    # ~4K elements per block: enough loads in flight per warp without spilling at head_dim 256
    block_h = max(1, min(triton.next_power_of_2(max(q.shape[1], k.shape[1])), 4096 // block_i))
    _rope_kernel[(q.shape[0],)](q, k, positions, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                                cos.stride(0), q.shape[1], k.shape[1], half,
                                INTERLEAVED=bool(interleaved), BLOCK_H=block_h, BLOCK_I=block_i)
    return q, k


OPS = {"apply_rope": apply_rope}
