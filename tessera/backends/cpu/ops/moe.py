"""Mixture-of-experts ops on the CPU: torch ops throughout, no loop over tokens.

Routing is a stable sort over the E logits of each token (E is small; ``torch.topk`` does not promise which of
two equal logits wins, a stable sort does: the lowest id). Grouping is a stable sort of the T*k expert ids plus one
row gather. The grouped GEMM loops over experts and hands each contiguous group to one BLAS call writing straight
into its slice of the output. The combine is one batched ``[1, k] @ [k, H]`` product per token in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.backends.reference.ops.moe import permute_indices, route_in_dtype


def route(logits: torch.Tensor, top_k: int, mode: str, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return route_in_dtype(logits.float(), top_k, mode, renormalize)


def permute(x: torch.Tensor, expert_ids: torch.Tensor, num_experts: int):
    order, offsets, inverse = permute_indices(expert_ids, num_experts)
    return x.index_select(0, order // max(expert_ids.shape[1], 1)), offsets, inverse


def grouped_matmul(x_sorted: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x_sorted.shape[0], weights.shape[1], dtype=x_sorted.dtype, device=x_sorted.device)
    bounds = offsets.tolist()
    for e in range(weights.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            torch.mm(x_sorted[lo:hi], weights[e].T, out=out[lo:hi])
    return out


def combine(y_sorted: torch.Tensor, weights: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    num_tokens, top_k = inverse.shape
    gathered = y_sorted.index_select(0, inverse.reshape(-1)).view(num_tokens, top_k, y_sorted.shape[1]).float()
    out = torch.bmm(weights.float().unsqueeze(1), gathered).squeeze(1)
    return out.to(y_sorted.dtype)


def _swiglu_rows(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, out: torch.Tensor) -> None:
    """``out = (silu(x @ G.T) * (x @ U.T)) @ down.T``; GEMM outputs rounded to x's dtype, the product in float32."""
    inter = down.shape[1]
    h = torch.mm(x, gate_up.T)
    act = (F.silu(h[:, :inter].float()) * h[:, inter:].float()).to(x.dtype)
    torch.mm(act, down.T, out=out)


def shared_expert(x: torch.Tensor, shared) -> torch.Tensor:
    """Qwen2-MoE's gated shared expert, float32 ``[T, H]``."""
    out = torch.empty_like(x)
    _swiglu_rows(x, shared.gate_up, shared.down, out)
    if shared.gate is None:
        return out.float()
    return torch.sigmoid(x.float() @ shared.gate.float()).unsqueeze(-1) * out.float()


def moe_mlp(x, gate_up, down, router_logits, top_k, mode, renormalize, shared=None) -> torch.Tensor:
    weights, ids = route(router_logits, top_k, mode, renormalize)
    x_sorted, offsets, inverse = permute(x, ids, gate_up.shape[0])
    y_sorted = torch.empty_like(x_sorted)
    bounds = offsets.tolist()
    for e in range(gate_up.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            _swiglu_rows(x_sorted[lo:hi], gate_up[e], down[e], y_sorted[lo:hi])
    if shared is None:
        return combine(y_sorted, weights, inverse)
    num_tokens = x.shape[0]
    gathered = y_sorted.index_select(0, inverse.reshape(-1)).view(num_tokens, top_k, y_sorted.shape[1]).float()
    routed = torch.bmm(weights.unsqueeze(1), gathered).squeeze(1)
    return (routed + shared_expert(x, shared)).to(x.dtype)


OPS = {"moe_route": route, "moe_permute": permute, "moe_grouped_matmul": grouped_matmul, "moe_combine": combine,
       "moe_mlp": moe_mlp}
