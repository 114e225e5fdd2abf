"""MoE benchmarks: our cpu ops against torch eager's composition of the same ops, on Mixtral-like shapes scaled
down (E=8 experts, k=2, hidden 1024, intermediate 2816), at decode (T=1) and a 64-token prefill chunk.

The eager baseline of the whole block is the usual loop over the experts that got tokens: a mask of the
(token, slot) pairs, a gather, two linears around ``silu(gate) * up``, the routing weight, an ``index_add_``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.bench.kernel_cases import KernelCase
from tessera.bench.machine import host_backend
from tessera.kernels.moe import combine, grouped_matmul, moe_mlp, permute, route

E, K, H, INTER = 8, 2, 1024, 2816


def _eager_route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    top, ids = torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1)
    return top / top.sum(dim=-1, keepdim=True), ids


def _eager_moe(x, gate_up, down, logits, top_k) -> torch.Tensor:
    weights, ids = _eager_route(logits, top_k)
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        tokens, slot = torch.where(ids == e)
        gate, up = F.linear(x[tokens], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[e]) * weights[tokens, slot, None]
        out.index_add_(0, tokens, y.to(x.dtype))
    return out


def _eager_grouped(xs: torch.Tensor, w: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    return torch.cat([xs[bounds[e]:bounds[e + 1]] @ w[e].T for e in range(w.shape[0])])


def _block_cases(tokens: int, dtype: torch.dtype, gate_up, down) -> list[KernelCase]:
    ours = host_backend()  # the backend timed as ours, looked up once
    name = str(dtype).removeprefix("torch.")
    x = torch.randn(tokens, H).to(dtype)
    logits = torch.randn(tokens, E).to(dtype)
    weights, ids = route(logits, K, mode="topk_softmax")
    xs, offsets, inverse = permute(x, ids, E)
    bounds = offsets.tolist()
    hit = len(torch.unique(ids))
    size = x.element_size()
    weight_bytes = hit * 3 * INTER * H * size
    tag = f"T={tokens} E={E} k={K} H={H} I={INTER} {name}"
    ys = torch.randn(tokens * K, H).to(dtype)
    return [
        KernelCase("moe", f"moe_mlp {tag}", lambda: moe_mlp(x, gate_up, down, logits, K, "topk_softmax",
                                                            backend=ours),
                   lambda: _eager_moe(x, gate_up, down, logits, K),
                   bytes_moved=weight_bytes + 2 * x.numel() * size, flops=2 * tokens * K * 3 * INTER * H),
        KernelCase("moe", f"grouped_matmul gate_up {tag}", lambda: grouped_matmul(xs, gate_up, offsets, backend=ours),
                   lambda: _eager_grouped(xs, gate_up, bounds),
                   bytes_moved=hit * 2 * INTER * H * size + xs.numel() * size + tokens * K * 2 * INTER * size,
                   flops=2 * tokens * K * 2 * INTER * H),
        KernelCase("moe", f"route T={tokens} E={E} k={K} {name}", lambda: route(logits, K, mode="topk_softmax",
                                                                               backend=ours),
                   lambda: _eager_route(logits, K), bytes_moved=logits.numel() * size + tokens * K * 12),
        KernelCase("moe", f"permute T={tokens} H={H} {name}", lambda: permute(x, ids, E, backend=ours),
                   lambda: x[torch.sort(ids.reshape(-1), stable=True).indices // K],
                   bytes_moved=3 * x.numel() * K * size // 2),
        KernelCase("moe", f"combine T={tokens} H={H} {name}", lambda: combine(ys, weights, inverse, backend=ours),
                   lambda: (ys[inverse].float() * weights[..., None]).sum(1).to(dtype),
                   bytes_moved=ys.numel() * size + x.numel() * size),
    ]


def cases(quick: bool) -> list[KernelCase]:
    out = []
    for dtype in (torch.float32,) if quick else (torch.float32, torch.bfloat16):
        gate_up = (torch.randn(E, 2 * INTER, H) * H ** -0.5).to(dtype)
        down = (torch.randn(E, H, INTER) * INTER ** -0.5).to(dtype)
        for tokens in (1, 64):
            out += _block_cases(tokens, dtype, gate_up, down)
    return out
