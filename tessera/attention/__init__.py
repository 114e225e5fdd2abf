"""The Attention framework: one declarative spec, planned once, run as fused kernels on every backend.

Examples
--------
>>> import torch
>>> from tessera.attention import AttentionSpec, attention, causal, sliding_window, softcap
>>> spec = AttentionSpec(num_q_heads=8, num_kv_heads=2, head_dim=64, mask=causal() & sliding_window(256))
>>> q = torch.randn(1, 300, 8, 64); k = torch.randn(1, 300, 2, 64); v = torch.randn(1, 300, 2, 64)
>>> out = attention(q, k, v, spec)          # [1, 300, 8, 64]
"""

from __future__ import annotations

from typing import Callable

from tessera.attention.api import attention, varlen_attention
from tessera.attention.masks import (
    EMPTY,
    FULL,
    PARTIAL,
    Mask,
    causal,
    chunked,
    custom_mask,
    document,
    positional_arity,
    prefix_lm,
    sliding_window,
)
from tessera.attention.merge import add_sinks, merge_states
from tessera.attention.plan import AttentionPlan, plan
from tessera.attention.scores import ScoreMod, alibi, alibi_slopes, custom_score, softcap
from tessera.attention.spec import AttentionSpec


def custom(fn: Callable) -> Mask | ScoreMod:
    """Wrap a user callable as a mask or a score function, told apart by its signature.

    ``fn(b, h, q_pos, kv_pos) -> bool tensor`` (4 parameters) becomes a mask; ``fn(score, b, h, q_pos, kv_pos)``
    (5 parameters) becomes a score function. Use :func:`custom_mask` / :func:`custom_score` to be explicit.
    """
    arity = positional_arity(fn)
    if arity == 4:
        return custom_mask(fn)
    if arity == 5:
        return custom_score(fn)
    raise TypeError(
        f"custom(fn): cannot tell a mask from a score function by fn's signature ({arity} positional parameters); "
        "a mask takes (b, h, q_pos, kv_pos), a score function (score, b, h, q_pos, kv_pos). "
        "Use custom_mask(fn) or custom_score(fn) to say which"
    )


__all__ = [
    "EMPTY", "FULL", "PARTIAL", "AttentionPlan", "AttentionSpec", "add_sinks", "Mask", "ScoreMod", "alibi", "alibi_slopes", "attention", "causal",
    "chunked", "custom", "custom_mask", "custom_score", "document", "merge_states", "plan", "prefix_lm", "sliding_window",
    "softcap", "varlen_attention",
]
