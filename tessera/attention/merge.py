"""Merging partial attention results by their log-sum-exp (split-KV, cascades, sinks)."""

from __future__ import annotations

import torch


def merge_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over two disjoint KV sets into attention over their union.

    Parameters
    ----------
    out_a, out_b : torch.Tensor ``[..., H, D]``, float32 / bfloat16 / float16, same shape and dtype
        Each normalized over its own KV set.
    lse_a, lse_b : torch.Tensor ``[..., H]``, float32
        Natural-log sum of exp scores of each set; ``-inf`` for an empty set.

    Returns
    -------
    out : ``[..., H, D]`` in out_a's dtype, and lse : ``[..., H]`` float32. Rows empty in both inputs give 0 / -inf.

    Examples
    --------
    >>> out, lse = merge_states(out_prefix, lse_prefix, out_suffix, lse_suffix)
    """
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape:
        raise ValueError(
            f"merge_states: shapes differ: out {tuple(out_a.shape)} vs {tuple(out_b.shape)}, "
            f"lse {tuple(lse_a.shape)} vs {tuple(lse_b.shape)}"
        )
    if out_a.shape[:-1] != lse_a.shape:
        raise ValueError(
            f"merge_states: lse must be out's shape without the last dim: out {tuple(out_a.shape)}, "
            f"lse {tuple(lse_a.shape)}"
        )
    la, lb = lse_a.float(), lse_b.float()
    lse = torch.logaddexp(la, lb)
    ref = torch.where(torch.isfinite(lse), lse, 0.0)
    wa = torch.exp(la - ref).unsqueeze(-1)  # exp(-inf) = 0 for an empty side
    wb = torch.exp(lb - ref).unsqueeze(-1)
    out = out_a.float() * wa + out_b.float() * wb
    return out.to(out_a.dtype), lse


def add_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold per-head sink logits into finished attention: a merge with a zero-valued state whose lse is the sink.

    Parameters
    ----------
    out : float32 ``[tokens, H, D]``; lse : float32 ``[tokens, H]``; sinks : float ``[H]``.

    Returns
    -------
    out rescaled by ``exp(lse - lse')`` and ``lse' = logaddexp(lse, sinks)`` (a fully masked row: 0 and the sink).
    """
    new_lse = torch.logaddexp(lse, sinks.to(lse.device, torch.float32).unsqueeze(0))
    scale = torch.exp(lse - new_lse)  # 0 where lse is -inf
    return out * scale.unsqueeze(-1), new_lse
