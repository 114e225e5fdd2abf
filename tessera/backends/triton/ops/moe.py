"""Mixture-of-experts ops in Triton: a routing kernel, a grouped GEMM kernel (with a fused SwiGLU epilogue for the
gate/up projection), a combine kernel, and torch glue for the grouping sort.

- ``route``: one program per block of tokens holds the ``[BLOCK_T, E]`` logits in registers, takes the maximum k
  times (ties to the lowest id by a min over the tied columns), and writes weights and ids.
- ``permute``: torch glue (a stable sort of the T*k ids, a bincount, one row gather); a GPU radix sort beats
  anything worth hand-writing here.
- ``grouped_matmul``: the host cuts each expert's rows into BLOCK_M tiles (one sync to read the E+1 offsets) and
  launches one program per (row tile, N tile); every tile belongs to one expert, so a program streams one weight
  matrix. With SWIGLU the program keeps two accumulators, gate columns n and up columns I + n, and writes
  ``silu(gate) * up``: the ``[R, 2I]`` intermediate never reaches memory.
- ``combine``: one program per (token, H tile) gathers the token's k rows and sums them in float32, optionally
  adding a float32 ``[T, H]`` term (the gated shared expert) before the single rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tessera.backends.reference.ops.moe import permute_indices
from tessera.backends.triton.configs import interpreting


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """``a @ b`` in float32; DOT_UPCAST widens bfloat16 first (Triton 3.9's interpreter multiplies bf16 bits)."""
    if DOT_UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _narrow(x, DTYPE: tl.constexpr, RTNE_BF16: tl.constexpr):
    """float32 -> storage dtype. RTNE_BF16 rounds to nearest even by hand: Triton 3.9's interpreter truncates
    float32 -> bfloat16 (a bias of half an ulp that the bf16 tests see), so the interpreter writes the bits itself."""
    if RTNE_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(DTYPE)


@triton.jit
def _route_kernel(L, W, IDS, T, E, K, stride_l, stride_w, stride_ids,
                  BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                  TOPK_SOFTMAX: tl.constexpr, RENORMALIZE: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    kcols = tl.arange(0, BLOCK_K)
    row_ok = rows < T
    # rows past T read as zeros (not -inf) so no NaN arises in lanes whose results are never stored
    avail = tl.broadcast_to((cols < E)[None, :], (BLOCK_T, BLOCK_E))
    lg = tl.load(L + rows[:, None].to(tl.int64) * stride_l + cols[None, :], mask=row_ok[:, None] & avail,
                 other=0.0).to(tl.float32)
    lg = tl.where(avail, lg, -float("inf"))
    m = tl.max(lg, axis=1)
    denom = tl.sum(tl.where(avail, tl.exp(lg - m[:, None]), 0.0), axis=1)
    sel = tl.full([BLOCK_T, BLOCK_K], -float("inf"), tl.float32)
    ids = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int64)
    for j in range(K):
        cand = tl.where(avail, lg, -float("inf"))
        best = tl.max(cand, axis=1)
        # the lowest id among the columns holding the maximum (comparing with -inf too, so -inf logits get picked)
        idx = tl.min(tl.where(avail & (cand == best[:, None]), cols[None, :], BLOCK_E), axis=1)
        sel = tl.where(kcols[None, :] == j, best[:, None], sel)
        ids = tl.where(kcols[None, :] == j, idx[:, None].to(tl.int64), ids)
        avail = avail & (cols[None, :] != idx[:, None])
    k_ok = (kcols < K)[None, :]
    if TOPK_SOFTMAX:
        ms = tl.max(tl.where(k_ok, sel, -float("inf")), axis=1)
        p = tl.where(k_ok, tl.exp(sel - ms[:, None]), 0.0)
        w = p / tl.sum(p, axis=1)[:, None]
    else:
        w = tl.where(k_ok, tl.exp(sel - m[:, None]) / denom[:, None], 0.0)
        if RENORMALIZE:
            w = w / tl.sum(w, axis=1)[:, None]
    out_ok = row_ok[:, None] & k_ok
    tl.store(W + rows[:, None].to(tl.int64) * stride_w + kcols[None, :], w, mask=out_ok)
    tl.store(IDS + rows[:, None].to(tl.int64) * stride_ids + kcols[None, :], ids, mask=out_ok)


@triton.jit
def _grouped_mm_kernel(X, Wt, OUT, TILE_E, TILE_LO, TILE_HI, N_OUT, K,
                       stride_xr, stride_xk, stride_we, stride_wn, stride_wk, stride_or,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       SWIGLU: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
                       RTNE_BF16: tl.constexpr):
    tile = tl.program_id(0)
    e = tl.load(TILE_E + tile)
    lo = tl.load(TILE_LO + tile)
    hi = tl.load(TILE_HI + tile)
    rows = lo + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < hi
    col_ok = cols < N_OUT
    x_ptrs = X + rows[:, None] * stride_xr + ks[None, :] * stride_xk
    # [BLOCK_K, BLOCK_N] view of the expert's [N, K] weight: the transpose costs nothing but strides
    w_ptrs = Wt + e * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None] * stride_wk
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc += _dot(a, b, DOT_PRECISION, DOT_UPCAST)
        if SWIGLU:  # the up rows sit N_OUT (= I) rows below the gate rows
            bu = tl.load(w_ptrs + N_OUT * stride_wn, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc_up += _dot(a, bu, DOT_PRECISION, DOT_UPCAST)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    if SWIGLU:
        # round gate and up to the storage dtype first, as the two-GEMM composition (and HF) does
        g = _narrow(acc, OUT.dtype.element_ty, RTNE_BF16).to(tl.float32)
        u = _narrow(acc_up, OUT.dtype.element_ty, RTNE_BF16).to(tl.float32)
        acc = g * tl.sigmoid(g) * u
    tl.store(OUT + rows[:, None] * stride_or + cols[None, :], _narrow(acc, OUT.dtype.element_ty, RTNE_BF16),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _combine_kernel(Y, W, INV, EXTRA, OUT, H, K, stride_y, stride_w, stride_inv, stride_x, stride_o,
                    BLOCK_H: tl.constexpr, HAS_EXTRA: tl.constexpr, RTNE_BF16: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in range(K):
        r = tl.load(INV + t * stride_inv + j)
        wj = tl.load(W + t * stride_w + j).to(tl.float32)
        acc += wj * tl.load(Y + r * stride_y + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_EXTRA:
        acc += tl.load(EXTRA + t * stride_x + cols, mask=ok, other=0.0)
    tl.store(OUT + t * stride_o + cols, _narrow(acc, OUT.dtype.element_ty, RTNE_BF16), mask=ok)


def _rtne_fix(dtype: torch.dtype) -> bool:
    return interpreting() and dtype == torch.bfloat16


def _gemm_config(rows_per_expert: float) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps). The interpreter gets small tiles so tests cover partial tiles."""
    if interpreting():
        return 16, 32, 32, 4
    # decode-sized groups waste most of a tall tile; tl.dot needs at least 16 rows
    return (16, 64, 64, 4) if rows_per_expert <= 16 else (64, 64, 32, 4)


def _tiles(offsets: torch.Tensor, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(expert, first row, end row) of every BLOCK_M row tile, as int64 tensors on offsets' device."""
    bounds = offsets.tolist()
    expert, lo, hi = [], [], []
    for e in range(len(bounds) - 1):
        for start in range(bounds[e], bounds[e + 1], block_m):
            expert.append(e)
            lo.append(start)
            hi.append(bounds[e + 1])
    return tuple(torch.tensor(v, dtype=torch.int64, device=offsets.device) for v in (expert, lo, hi))


def _launch_grouped(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, swiglu: bool) -> torch.Tensor:
    rows, k = x.shape
    n_out = w.shape[1] // 2 if swiglu else w.shape[1]
    out = torch.empty(rows, n_out, dtype=x.dtype, device=x.device)
    block_m, block_n, block_k, warps = _gemm_config(rows / max(w.shape[0], 1))
    tile_e, tile_lo, tile_hi = _tiles(offsets, block_m)
    if rows == 0 or n_out == 0 or tile_e.numel() == 0:
        return out
    grid = (tile_e.numel(), triton.cdiv(n_out, block_n))
    _grouped_mm_kernel[grid](
        x, w, out, tile_e, tile_lo, tile_hi, n_out, k,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SWIGLU=swiglu,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        DOT_UPCAST=interpreting() and x.dtype == torch.bfloat16, RTNE_BF16=_rtne_fix(x.dtype), num_warps=warps,
    )
    return out


def route(logits: torch.Tensor, top_k: int, mode: str, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_experts = logits.shape
    logits = logits.contiguous()
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits.device)
    if num_tokens == 0:
        return weights, ids
    block_t = 16
    _route_kernel[(triton.cdiv(num_tokens, block_t),)](
        logits, weights, ids, num_tokens, num_experts, top_k, logits.stride(0), weights.stride(0), ids.stride(0),
        BLOCK_T=block_t, BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_K=triton.next_power_of_2(top_k),
        TOPK_SOFTMAX=mode == "topk_softmax", RENORMALIZE=renormalize,
    )
    return weights, ids


def permute(x: torch.Tensor, expert_ids: torch.Tensor, num_experts: int):
    order, offsets, inverse = permute_indices(expert_ids, num_experts)
    return x.index_select(0, order // max(expert_ids.shape[1], 1)), offsets, inverse


def grouped_matmul(x_sorted: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return _launch_grouped(x_sorted, weights, offsets, swiglu=False)


def _combine(y_sorted, weights, inverse, extra, out_dtype) -> torch.Tensor:
    num_tokens, top_k = inverse.shape
    hidden = y_sorted.shape[1]
    out = torch.empty(num_tokens, hidden, dtype=out_dtype, device=y_sorted.device)
    if num_tokens == 0 or hidden == 0:
        return out
    y_sorted = y_sorted.contiguous()
    block_h = min(triton.next_power_of_2(hidden), 128 if interpreting() else 1024)
    _combine_kernel[(num_tokens, triton.cdiv(hidden, block_h))](
        y_sorted, weights, inverse, extra if extra is not None else out, out, hidden, top_k,
        y_sorted.stride(0), weights.stride(0), inverse.stride(0),
        extra.stride(0) if extra is not None else 0, out.stride(0),
        BLOCK_H=block_h, HAS_EXTRA=extra is not None, RTNE_BF16=_rtne_fix(out_dtype),
    )
    return out


def combine(y_sorted: torch.Tensor, weights: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    return _combine(y_sorted, weights.contiguous(), inverse.contiguous(), None, y_sorted.dtype)


def _shared(x: torch.Tensor, shared) -> torch.Tensor:
    """The gated shared expert as float32 ``[T, H]``: two one-expert grouped GEMMs, the sigmoid gate in torch."""
    one = torch.tensor([0, x.shape[0]], dtype=torch.int64, device=x.device)
    act = _launch_grouped(x, shared.gate_up.unsqueeze(0), one, swiglu=True)
    out = _launch_grouped(act, shared.down.unsqueeze(0), one, swiglu=False).float()
    if shared.gate is None:
        return out
    return torch.sigmoid(x.float() @ shared.gate.float()).unsqueeze(-1) * out


def moe_mlp(x, gate_up, down, router_logits, top_k, mode, renormalize, shared=None) -> torch.Tensor:
    weights, ids = route(router_logits, top_k, mode, renormalize)
    x_sorted, offsets, inverse = permute(x, ids, gate_up.shape[0])
    act = _launch_grouped(x_sorted, gate_up, offsets, swiglu=True)
    y_sorted = _launch_grouped(act, down, offsets, swiglu=False)
    extra = _shared(x, shared).contiguous() if shared is not None else None
    return _combine(y_sorted, weights, inverse, extra, x.dtype)


OPS = {"moe_route": route, "moe_permute": permute, "moe_grouped_matmul": grouped_matmul, "moe_combine": combine,
       "moe_mlp": moe_mlp}
