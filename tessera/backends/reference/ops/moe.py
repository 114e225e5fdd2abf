"""Float64 oracles of the mixture-of-experts ops (``tessera.kernels.moe``), written from the definitions.

``moe_mlp_f64`` does not go through ``permute``/``combine``: it sums each token's experts directly, so the tests'
end-to-end oracle is independent of the grouping machinery it checks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route_f64(logits: torch.Tensor, top_k: int, mode: str, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float64 ``[T, k]``, ids int64 ``[T, k]``); ranks by logit, ties to the lowest expert id."""
    return route_in_dtype(logits.double(), top_k, mode, renormalize)


def route_in_dtype(lg: torch.Tensor, top_k: int, mode: str, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`route_f64`'s arithmetic in ``lg``'s own dtype (the cpu backend routes in float32)."""
    # A stable descending sort keeps equal logits in index order: the lowest id wins a tie.
    ids = torch.sort(lg, dim=-1, descending=True, stable=True).indices[:, :top_k]
    if mode == "topk_softmax":
        return torch.softmax(lg.gather(1, ids), dim=-1), ids
    weights = torch.softmax(lg, dim=-1).gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def permute_indices(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order ``[T*k]``: flat (t, j) index of each sorted row, offsets ``[E+1]``, inverse ``[T, k]``)."""
    flat = expert_ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    offsets[1:] = torch.cumsum(torch.bincount(flat, minlength=num_experts), 0)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=flat.device)
    return order, offsets, inverse.view(expert_ids.shape)


def permute_f64(x: torch.Tensor, expert_ids: torch.Tensor, num_experts: int):
    order, offsets, inverse = permute_indices(expert_ids, num_experts)
    return x.double()[order // max(expert_ids.shape[1], 1)], offsets, inverse


def grouped_matmul_f64(x_sorted: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    bounds = offsets.tolist()
    out = torch.zeros(x_sorted.shape[0], weights.shape[1], dtype=torch.float64, device=x_sorted.device)
    for e in range(weights.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        out[lo:hi] = x_sorted[lo:hi].double() @ weights[e].double().T
    return out


def combine_f64(y_sorted: torch.Tensor, weights: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    gathered = y_sorted.double()[inverse]  # [T, k, H]
    return (gathered * weights.double().unsqueeze(-1)).sum(dim=1)


def swiglu_f64(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """``(silu(x @ G.T) * (x @ U.T)) @ down.T`` with ``[G; U] = gate_up``, all in float64."""
    gate, up = (x.double() @ gate_up.double().T).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ down.double().T


def shared_f64(x: torch.Tensor, shared) -> torch.Tensor:
    out = swiglu_f64(x, shared.gate_up, shared.down)
    if shared.gate is not None:
        out = torch.sigmoid(x.double() @ shared.gate.double()).unsqueeze(-1) * out
    return out


def moe_mlp_f64(x, gate_up, down, router_logits, top_k, mode, renormalize, shared=None) -> torch.Tensor:
    weights, ids = route_f64(router_logits, top_k, mode, renormalize)
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for e in range(gate_up.shape[0]):
        tokens, slot = torch.nonzero(ids == e, as_tuple=True)
        if tokens.numel():
            y = swiglu_f64(x[tokens], gate_up[e], down[e])
            out.index_add_(0, tokens, y * weights[tokens, slot].unsqueeze(-1))
    if shared is not None:
        out += shared_f64(x, shared)
    return out


def route(logits, top_k, mode, renormalize):
    weights, ids = route_f64(logits, top_k, mode, renormalize)
    return weights.float(), ids


def permute(x, expert_ids, num_experts):
    x_sorted, offsets, inverse = permute_f64(x, expert_ids, num_experts)
    return x_sorted.to(x.dtype), offsets, inverse


def grouped_matmul(x_sorted, weights, offsets):
    return grouped_matmul_f64(x_sorted, weights, offsets).to(x_sorted.dtype)


def combine(y_sorted, weights, inverse):
    return combine_f64(y_sorted, weights, inverse).to(y_sorted.dtype)


def moe_mlp(x, gate_up, down, router_logits, top_k, mode, renormalize, shared=None):
    return moe_mlp_f64(x, gate_up, down, router_logits, top_k, mode, renormalize, shared).to(x.dtype)


OPS = {"moe_route": route, "moe_permute": permute, "moe_grouped_matmul": grouped_matmul, "moe_combine": combine,
       "moe_mlp": moe_mlp}
