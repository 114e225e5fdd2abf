"""Prefill-shaped attention on the CPU: FlashAttention-style tiles through torch BLAS.

Per sequence and query tile, the queries of one KV group are stacked into one matrix ``[Hkv, G * tq, D]`` so a single
batched GEMM per kv tile serves every query head of a group without repeating K/V (GQA costs nothing extra). Tiles are
classified before any arithmetic: EMPTY tiles are skipped, FULL tiles skip mask evaluation, PARTIAL tiles evaluate the
mask once (a custom mask that turns out all-False or all-True over the tile is then treated as EMPTY or FULL).

The online softmax runs in place on the score tile (one allocation per tile), and K/V are widened to float32 once per
sequence: bf16 GEMM through torch runs about 10x slower than fp32 on AVX2 CPUs, and widening per tile would redo the
conversion for every query tile.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from tessera.attention.spec import AttentionSpec
from tessera.attention.tiles import EMPTY, FULL, classify_tiles, tile_bounds

#: Query positions per tile. With G query heads per KV head the GEMM has G * Q_TILE rows; measured on a 2-core Zen 3
#: (causal, S=4096, Hq=32, Hkv=8, D=128, fp32): (64, 512) 156 GFLOP/s, (128, 512) 150, (256, 512) 130, (512, 512) 104.
Q_TILE = 64
KV_TILE = 512


class _State:
    """Running max ``m``, denominator ``l`` (both ``[Hkv, R]``) and unnormalized output ``acc [Hkv, R, D]``."""

    __slots__ = ("m", "l", "acc")

    def __init__(self) -> None:
        self.m: torch.Tensor | None = None
        self.l: torch.Tensor | None = None
        self.acc: torch.Tensor | None = None

    def update(self, p: torch.Tensor, v_tile: torch.Tensor) -> None:
        """Fold score tile ``p [Hkv, R, tk]`` (overwritten with probabilities) and ``v_tile [Hkv, tk, D]``."""
        tile_max = p.amax(dim=-1)
        if self.m is None:
            m_new = tile_max
        else:
            m_new = torch.maximum(self.m, tile_max)
        # A row with no kept key so far has max -inf; shift by 0 there so exp gives 0, not NaN.
        shift = m_new.masked_fill(m_new == -math.inf, 0.0)
        p.sub_(shift.unsqueeze(-1)).exp_()
        if self.m is None:
            self.l = p.sum(dim=-1)
            self.acc = torch.bmm(p, v_tile)
        else:
            alpha = torch.exp(self.m - shift)
            self.l.mul_(alpha).add_(p.sum(dim=-1))
            self.acc.mul_(alpha.unsqueeze(-1)).baddbmm_(p, v_tile)
        self.m = m_new


def sequence_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec, seq_index: int,
    q_tile: int = Q_TILE, kv_tile: int = KV_TILE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one sequence through BLAS tiles.

    Parameters
    ----------
    q : ``[q_len, Hq, D]``; k, v : ``[kv_len, Hkv, D]``; float32, bfloat16 or float16.
    spec : the attention spec; seq_index : ``b`` as seen by masks and score functions.

    Returns
    -------
    out ``[q_len, Hq, D]`` float32 and lse ``[q_len, Hq]`` float32 (without sinks; the caller merges them).
    """
    q_len, kv_len = q.shape[0], k.shape[0]
    hkv, group, d = spec.num_kv_heads, spec.group_size, spec.head_dim
    out = torch.zeros(q_len, spec.num_q_heads, d, dtype=torch.float32)
    lse = torch.full((q_len, spec.num_q_heads), -math.inf, dtype=torch.float32)
    if kv_len == 0 or q_len == 0:
        return out, lse
    k_f = k.permute(1, 0, 2).to(torch.float32).contiguous()  # [Hkv, kv_len, D]
    v_f = v.permute(1, 0, 2).to(torch.float32).contiguous()
    q_start = kv_len - q_len
    q_lo, q_hi = tile_bounds(q_start, kv_len, q_tile)
    kv_lo, kv_hi = tile_bounds(0, kv_len, kv_tile)
    classes = classify_tiles(spec.mask, seq_index, q_lo, q_hi, kv_lo, kv_hi)
    b = torch.tensor(seq_index)
    heads = torch.arange(spec.num_q_heads).view(-1, 1, 1)
    for qi in range(len(q_lo)):
        a, e = int(q_lo[qi]), int(q_hi[qi])
        n = e - a
        rows = slice(a - q_start, e - q_start)
        q_t = (q[rows].to(torch.float32) * spec.softmax_scale).view(n, hkv, group, d)
        q_t = q_t.permute(1, 2, 0, 3).reshape(hkv, group * n, d)
        q_pos = torch.arange(a, e).view(1, -1, 1)
        state = _State()
        for ki in np.flatnonzero(classes[qi] != EMPTY):
            c, f = int(kv_lo[ki]), int(kv_hi[ki])
            kv_pos = torch.arange(c, f).view(1, 1, -1)
            keep = None
            if classes[qi, ki] != FULL:
                keep = spec.mask.evaluate(b, heads, q_pos, kv_pos)
                if not bool(keep.any()):
                    continue
                if bool(keep.all()):
                    keep = None
            s = torch.bmm(q_t, k_f[:, c:f].transpose(1, 2))  # [Hkv, G*n, tk] == [Hq, n, tk]
            if spec.score is not None:
                s = spec.score.apply(s.view(spec.num_q_heads, n, f - c), b, heads, q_pos, kv_pos)
                s = s.to(torch.float32).reshape(hkv, group * n, f - c)
            if keep is not None:
                s.view(spec.num_q_heads, n, f - c).masked_fill_(~keep, -math.inf)
            state.update(s, v_f[:, c:f])
        if state.m is None:
            continue  # every tile of this query block was empty: outputs stay 0, lse -inf
        _write_tile(state, out, lse, rows, n, spec)
    return out, lse


def _write_tile(state: _State, out: torch.Tensor, lse: torch.Tensor, rows: slice, n: int, spec: AttentionSpec) -> None:
    hkv, group, d = spec.num_kv_heads, spec.group_size, spec.head_dim
    l = state.l
    safe_l = torch.where(l > 0, l, 1.0)
    o = (state.acc / safe_l.unsqueeze(-1)).view(hkv, group, n, d).permute(2, 0, 1, 3).reshape(n, spec.num_q_heads, d)
    row_lse = torch.where(l > 0, state.m + torch.log(safe_l), -math.inf)
    out[rows] = o
    lse[rows] = row_lse.view(hkv, group, n).permute(2, 0, 1).reshape(n, spec.num_q_heads)
