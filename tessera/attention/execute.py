"""The one place a planned step turns into results: allocate, run the backend, fold in sinks, cast.

Dense, ragged and paged attention all end here, so every backend implements only ``plan`` and ``run``.
"""

from __future__ import annotations

import math

import torch

from tessera.attention.merge import add_sinks
from tessera.attention.spec import AttentionSpec


def execute(backend, state, spec: AttentionSpec, q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor,
            total_q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``backend.run(state, ...)`` on token rows and finish the result.

    Parameters
    ----------
    q : ``[total_q, Hq, D]``; k_rows, v_rows : ``[rows, Hkv, D]`` addressed by the plan's layout.

    Returns
    -------
    out ``[total_q, Hq, D]`` in q's dtype and lse ``[total_q, Hq]`` float32 (natural log, sinks included).
    """
    if getattr(backend, "fused_epilogue", False):
        # The backend writes every row in the output dtype and folds sinks itself (GPU kernels: no extra passes).
        out = torch.empty(total_q, spec.num_q_heads, spec.head_dim, dtype=q.dtype, device=q.device)
        lse = torch.empty(total_q, spec.num_q_heads, dtype=torch.float32, device=q.device)
        backend.run(state, q.contiguous(), k_rows.contiguous(), v_rows.contiguous(), out, lse)
        return out, lse
    out = torch.zeros(total_q, spec.num_q_heads, spec.head_dim, dtype=torch.float32, device=q.device)
    lse = torch.full((total_q, spec.num_q_heads), -math.inf, dtype=torch.float32, device=q.device)
    backend.run(state, q.contiguous(), k_rows.contiguous(), v_rows.contiguous(), out, lse)
    if spec.sinks is not None:
        out, lse = add_sinks(out, lse, spec.sinks)
    return out.to(q.dtype), lse
