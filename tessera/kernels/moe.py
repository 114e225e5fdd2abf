"""Mixture-of-experts ops: routing, grouping tokens by expert, the grouped expert GEMM, the weighted combine, and
the whole SwiGLU expert MLP (with Qwen2-MoE's gated shared expert), matching Hugging Face transformers' Mixtral and
Qwen2-MoE / Qwen3-MoE sparse blocks. ``docs/kernels/moe.md`` gives the formulas.

The pipeline of one MoE layer on ``T`` tokens, ``E`` experts, ``k`` experts per token::

    weights, ids = route(router_logits, k)                        # [T, k] float32, [T, k] int64
    xs, offsets, inverse = permute(x, ids, E)                     # [T*k, H] grouped by expert, [E+1], [T, k]
    ys = grouped_matmul(xs, w, offsets)                           # row r of expert e: xs[r] @ w[e].T
    y = combine(ys, weights, inverse)                             # [T, H]: sum_j weights[t, j] * ys[inverse[t, j]]

:func:`moe_mlp` runs it with the SwiGLU expert (two grouped GEMMs around ``silu(gate) * up``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch

from tessera.dtypes import FLOAT_DTYPES
from tessera.kernels import registry

ROUTING_MODES = ("softmax_topk", "topk_softmax")


@dataclass(slots=True)
class SharedExpert:
    """Qwen2-MoE's shared expert: a dense SwiGLU MLP every token goes through, scaled by a sigmoid gate.

    ``shared(x) = sigmoid(x @ gate) * (silu(x @ Wg.T) * (x @ Wu.T)) @ down.T`` with ``[Wg; Wu] = gate_up``
    (``Qwen2MoeSparseMoeBlock``: ``F.sigmoid(shared_expert_gate(x)) * shared_expert(x)``). ``gate=None`` drops the
    sigmoid factor (an ungated shared expert, as DeepSeek-MoE has).

    Fields
    ------
    gate_up : ``[2 * I_s, H]``, x's dtype: ``cat([gate_proj.weight, up_proj.weight])``
    down : ``[H, I_s]``, x's dtype: ``down_proj.weight``
    gate : ``[H]`` any float dtype (used in float32), or None: ``shared_expert_gate.weight[0]``
    """

    gate_up: torch.Tensor
    down: torch.Tensor
    gate: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.gate_up.dim() != 2 or self.gate_up.shape[0] % 2:
            raise ValueError(f"SharedExpert.gate_up must be [2*I_s, H], got {tuple(self.gate_up.shape)}")
        inter, hidden = self.gate_up.shape[0] // 2, self.gate_up.shape[1]
        if tuple(self.down.shape) != (hidden, inter):
            raise ValueError(f"SharedExpert.down must be [H, I_s] = {(hidden, inter)} to match gate_up "
                             f"{tuple(self.gate_up.shape)}, got {tuple(self.down.shape)}")
        if self.gate is not None and tuple(self.gate.shape) != (hidden,):
            raise ValueError(f"SharedExpert.gate must be [H] = [{hidden}] (shared_expert_gate.weight[0]), "
                             f"got {tuple(self.gate.shape)}")


def route(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    mode: str = "softmax_topk",
    renormalize: bool = False,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick each token's ``top_k`` experts and their mixing weights from the router logits.

    Experts are ranked by logit (softmax is monotone, so this is also the order of probabilities), ties to the
    lowest expert id; ids come out in rank order. Weights, computed in float32:

    - ``"softmax_topk"`` (Qwen2-MoE / Qwen3-MoE): ``p = softmax(logits)`` over all E experts, ``w = p[ids]``, and
      with ``renormalize=True`` (HF's ``norm_topk_prob``) ``w / sum(w)``.
    - ``"topk_softmax"`` (Mixtral): softmax over the k selected logits; equal to ``softmax_topk`` with
      ``renormalize=True`` (``renormalize`` changes nothing here).

    Parameters
    ----------
    router_logits : torch.Tensor ``[T, E]``, float32 / bfloat16 / float16
    top_k : int, ``1 <= top_k <= E``
    mode : "softmax_topk" or "topk_softmax"
    renormalize : bool, divide the top-k probabilities by their sum (``softmax_topk`` only)
    backend : "auto", "reference", "cpu" or "triton"

    Returns
    -------
    weights : ``[T, top_k]`` float32
    expert_ids : ``[T, top_k]`` int64, distinct per row

    Examples
    --------
    >>> w, ids = route(x @ router_w.T, 2, mode="topk_softmax")              # Mixtral
    >>> w, ids = route(logits, 8, mode="softmax_topk", renormalize=True)    # Qwen3-MoE
    """
    _check_float("route", "router_logits", router_logits, dims=2)
    num_experts = router_logits.shape[1]
    top_k = _check_top_k(top_k, num_experts)
    if mode not in ROUTING_MODES:
        raise ValueError(f"route: mode must be one of {ROUTING_MODES}, got {mode!r} (Mixtral: 'topk_softmax'; "
                         f"Qwen-MoE: 'softmax_topk' with renormalize=norm_topk_prob)")
    return registry.resolve("moe_route", backend, router_logits.device)(router_logits, top_k, mode, bool(renormalize))


def permute(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    num_experts: int,
    *,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Copy each token once per chosen expert, grouped contiguously by expert (expert 0's rows first).

    Inside a group rows keep token order (a stable sort of the flattened ``expert_ids``), so
    ``x_sorted[offsets[e]:offsets[e + 1]]`` are expert e's tokens in ascending token index.

    Parameters
    ----------
    x : torch.Tensor ``[T, H]``, float32 / bfloat16 / float16
    expert_ids : torch.Tensor ``[T, k]``, int64 (or int32), values in ``[0, num_experts)``
    num_experts : int, E >= 1
    backend : "auto", "reference", "cpu" or "triton"

    Returns
    -------
    x_sorted : ``[T * k, H]`` in x's dtype
    expert_offsets : ``[E + 1]`` int64; expert e owns rows ``offsets[e]:offsets[e + 1]`` (``offsets[0] = 0``,
        ``offsets[E] = T * k``; equal neighbours mean the expert got no token)
    inverse : ``[T, k]`` int64; ``x_sorted[inverse[t, j]]`` is token t's copy for ``expert_ids[t, j]``

    Examples
    --------
    >>> xs, offsets, inverse = permute(x, ids, num_experts=8)
    """
    _check_float("permute", "x", x, dims=2)
    ids = _check_ids("permute", expert_ids, x.shape[0], num_experts)
    return registry.resolve("moe_permute", backend, x.device)(x, ids, int(num_experts))


def grouped_matmul(
    x_sorted: torch.Tensor,
    weights: torch.Tensor | Sequence,
    expert_offsets: torch.Tensor,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Each expert's rows times its weight: ``out[r] = x_sorted[r] @ weights[e].T`` for rows r of expert e.

    Expert e owns rows ``offsets[e] <= r < offsets[e + 1]``.

    Parameters
    ----------
    x_sorted : torch.Tensor ``[R, K]``, float32 / bfloat16 / float16, rows grouped by expert (see :func:`permute`)
    weights : torch.Tensor ``[E, N, K]`` in x's dtype (``nn.Linear`` layout per expert), or a list of E
        ``tessera.kernels.quant.QuantizedWeight`` (each ``[N, K]``; run through ``quant.qmatmul`` per group)
    expert_offsets : torch.Tensor ``[E + 1]`` int64, non-decreasing, from 0 to R
    backend : "auto", "reference", "cpu" or "triton" (quantized weights: any backend ``qmatmul`` has)

    Returns
    -------
    ``[R, N]`` in x's dtype (float32 accumulation)

    Examples
    --------
    >>> h = grouped_matmul(xs, experts_gate_up, offsets)        # [T*k, 2I]
    """
    _check_float("grouped_matmul", "x_sorted", x_sorted, dims=2)
    if isinstance(weights, (list, tuple)):
        return _grouped_qmatmul(x_sorted, weights, expert_offsets, backend)
    _check_float("grouped_matmul", "weights", weights, dims=3)
    _check_same_dtype("grouped_matmul", "weights", weights, x_sorted)
    if weights.shape[2] != x_sorted.shape[1]:
        raise ValueError(f"grouped_matmul: weights must be [E, N, K] with K = x_sorted.shape[1] = "
                         f"{x_sorted.shape[1]}, got {tuple(weights.shape)} (nn.Linear layout: out x in)")
    _check_offsets("grouped_matmul", expert_offsets, weights.shape[0], x_sorted.shape[0])
    return registry.resolve("moe_grouped_matmul", backend, x_sorted.device)(x_sorted, weights, expert_offsets)


def combine(
    y_sorted: torch.Tensor,
    weights: torch.Tensor,
    inverse: torch.Tensor,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Weighted sum of each token's expert outputs, back in token order: ``out[t] = sum_j w[t, j] * y[inverse[t, j]]``.

    Parameters
    ----------
    y_sorted : torch.Tensor ``[T * k, H]``, float32 / bfloat16 / float16
    weights : torch.Tensor ``[T, k]``, any float dtype (used in float32)
    inverse : torch.Tensor ``[T, k]`` int64, from :func:`permute`
    backend : "auto", "reference", "cpu" or "triton"

    Returns
    -------
    ``[T, H]`` in y's dtype, accumulated in float32 and rounded once.

    Examples
    --------
    >>> y = combine(ys, w, inverse)
    """
    _check_float("combine", "y_sorted", y_sorted, dims=2)
    if weights.dim() != 2 or not weights.is_floating_point():
        raise ValueError(f"combine: weights must be a float [T, k] tensor, got {weights.dtype} "
                         f"{tuple(weights.shape)}")
    num_tokens, top_k = weights.shape
    if y_sorted.shape[0] != num_tokens * top_k:
        raise ValueError(f"combine: y_sorted has {y_sorted.shape[0]} rows but weights is [T, k] = "
                         f"{(num_tokens, top_k)}, so T*k = {num_tokens * top_k} rows were expected")
    if inverse.dtype != torch.int64 or tuple(inverse.shape) != (num_tokens, top_k):
        raise ValueError(f"combine: inverse must be int64 [T, k] = {(num_tokens, top_k)} (permute's third output), "
                         f"got {inverse.dtype} {tuple(inverse.shape)}")
    _check_range("combine", "inverse", inverse, num_tokens * top_k)
    if weights.device != y_sorted.device or inverse.device != y_sorted.device:
        raise ValueError("combine: y_sorted, weights and inverse must be on one device")
    return registry.resolve("moe_combine", backend, y_sorted.device)(y_sorted, weights, inverse)


def moe_mlp(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    router_logits: torch.Tensor,
    top_k: int,
    mode: str = "softmax_topk",
    renormalize: bool = False,
    *,
    shared: SharedExpert | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """A whole sparse MoE block: route, then ``sum_j w[t, j] * expert_{ids[t, j]}(x[t])`` (+ the shared expert).

    ``expert_e(x) = (silu(x @ G_e.T) * (x @ U_e.T)) @ down[e].T`` with ``[G_e; U_e] = gate_up[e]`` (HF's merged
    ``gate_up_proj``: first half gate, second half up), as ``MixtralSparseMoeBlock`` / ``Qwen2MoeSparseMoeBlock``
    compute it; ``shared`` adds ``sigmoid(x @ gate) * shared_mlp(x)`` (see :class:`SharedExpert`). Matmuls
    accumulate in float32; the two expert GEMM outputs are rounded to x's dtype (as HF's bf16 linears are).

    Parameters
    ----------
    x : torch.Tensor ``[T, H]``, float32 / bfloat16 / float16
    gate_up : ``[E, 2I, H]`` in x's dtype
    down : ``[E, H, I]`` in x's dtype
    router_logits : ``[T, E]``, any float dtype in {float32, bfloat16, float16}
    top_k, mode, renormalize : as :func:`route`
    shared : SharedExpert or None, its tensors in x's dtype (gate: any float)
    backend : "auto", "reference", "cpu" or "triton"

    Returns
    -------
    ``[T, H]`` in x's dtype

    Examples
    --------
    >>> y = moe_mlp(h, gate_up, down, h @ router_w.T, 2, "topk_softmax")                     # Mixtral
    >>> y = moe_mlp(h, gate_up, down, logits, 4, "softmax_topk", False, shared=shared)       # Qwen2-MoE
    """
    _check_float("moe_mlp", "x", x, dims=2)
    _check_float("moe_mlp", "gate_up", gate_up, dims=3)
    _check_float("moe_mlp", "down", down, dims=3)
    _check_same_dtype("moe_mlp", "gate_up", gate_up, x)
    _check_same_dtype("moe_mlp", "down", down, x)
    num_experts, two_inter, hidden = gate_up.shape
    if two_inter % 2 or hidden != x.shape[1]:
        raise ValueError(f"moe_mlp: gate_up must be [E, 2I, H] with H = x.shape[1] = {x.shape[1]}, got "
                         f"{tuple(gate_up.shape)} (HF's merged gate_up_proj: gate rows first, then up)")
    if tuple(down.shape) != (num_experts, hidden, two_inter // 2):
        raise ValueError(f"moe_mlp: down must be [E, H, I] = {(num_experts, hidden, two_inter // 2)}, got "
                         f"{tuple(down.shape)}")
    _check_float("moe_mlp", "router_logits", router_logits, dims=2)
    if tuple(router_logits.shape) != (x.shape[0], num_experts):
        raise ValueError(f"moe_mlp: router_logits must be [T, E] = {(x.shape[0], num_experts)}, got "
                         f"{tuple(router_logits.shape)}")
    top_k = _check_top_k(top_k, num_experts)
    if mode not in ROUTING_MODES:
        raise ValueError(f"moe_mlp: mode must be one of {ROUTING_MODES}, got {mode!r}")
    if shared is not None:
        if shared.gate_up.shape[1] != hidden:
            raise ValueError(f"moe_mlp: shared.gate_up must be [2*I_s, H={hidden}], got {tuple(shared.gate_up.shape)}")
        _check_same_dtype("moe_mlp", "shared.gate_up", shared.gate_up, x)
        _check_same_dtype("moe_mlp", "shared.down", shared.down, x)
    fn = registry.resolve("moe_mlp", backend, x.device)
    return fn(x, gate_up, down, router_logits, top_k, mode, bool(renormalize), shared)


# ---------------------------------------------------------------------------------------------- quantized experts

def _grouped_qmatmul(x_sorted: torch.Tensor, weights: Sequence, offsets: torch.Tensor, backend: str) -> torch.Tensor:
    """Grouped GEMM over per-expert quantized weights: one ``quant.qmatmul`` call per non-empty group."""
    try:
        from tessera.kernels import quant
    except ImportError as exc:  # the quant family is optional
        raise ValueError("grouped_matmul: a list of weights needs tessera.kernels.quant (QuantizedWeight), "
                         "which is not available; pass a [E, N, K] float tensor instead") from exc
    if not weights or not all(isinstance(w, quant.QuantizedWeight) for w in weights):
        raise ValueError("grouped_matmul: a list of weights must hold one tessera.kernels.quant.QuantizedWeight "
                         "per expert")
    if len({w.shape for w in weights}) != 1:
        raise ValueError(f"grouped_matmul: every expert's QuantizedWeight must have one shape [N, K], got "
                         f"{sorted({w.shape for w in weights})}")
    _check_offsets("grouped_matmul", offsets, len(weights), x_sorted.shape[0])
    bounds = offsets.tolist()
    outs = [quant.qmatmul(x_sorted[bounds[e]:bounds[e + 1]], w, backend=backend) for e, w in enumerate(weights)]
    return torch.cat(outs, dim=0)


# ---------------------------------------------------------------------------------------------- validation

def _check_float(op: str, name: str, t: torch.Tensor, dims: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{op}: {name} must be float32, bfloat16 or float16, got {t.dtype}; cast it with .to()")
    if t.dim() != dims:
        raise ValueError(f"{op}: {name} must have {dims} dims, got shape {tuple(t.shape)}")


def _check_same_dtype(op: str, name: str, t: torch.Tensor, x: torch.Tensor) -> None:
    if t.dtype != x.dtype:
        raise ValueError(f"{op}: {name} must have x's dtype {x.dtype}, got {t.dtype}; cast it once at load time")
    if t.device != x.device:
        raise ValueError(f"{op}: {name} is on {t.device} but x is on {x.device}")


def _check_top_k(top_k: int, num_experts: int) -> int:
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be an int in [1, E={num_experts}], got {top_k!r}")
    return top_k


def _check_range(op: str, name: str, t: torch.Tensor, upper: int) -> None:
    """Values in ``[0, upper)``; one host sync, cheaper than an out-of-bounds gather on a GPU."""
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= upper):
        raise ValueError(f"{op}: {name} values must lie in [0, {upper}), got [{int(t.min())}, {int(t.max())}]")


def _check_ids(op: str, ids: torch.Tensor, num_tokens: int, num_experts: int) -> torch.Tensor:
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"{op}: num_experts must be a positive int, got {num_experts!r}")
    if ids.dtype not in (torch.int64, torch.int32) or ids.dim() != 2 or ids.shape[0] != num_tokens:
        raise ValueError(f"{op}: expert_ids must be an int64 [T={num_tokens}, k] tensor (route's second output), "
                         f"got {ids.dtype} {tuple(ids.shape)}")
    _check_range(op, "expert_ids", ids, num_experts)
    return ids.long()


def _check_offsets(op: str, offsets: torch.Tensor, num_experts: int, rows: int) -> None:
    if offsets.dtype != torch.int64 or tuple(offsets.shape) != (num_experts + 1,):
        raise ValueError(f"{op}: expert_offsets must be int64 [E+1] = [{num_experts + 1}] (permute's second output), "
                         f"got {offsets.dtype} {tuple(offsets.shape)}")
    bounds = offsets.tolist()
    if bounds[0] != 0 or bounds[-1] != rows or any(a > b for a, b in pairwise(bounds)):
        raise ValueError(f"{op}: expert_offsets must rise from 0 to the row count {rows} without decreasing, "
                         f"got {bounds}")
