"""AttentionSpec: the one declarative description of an attention variant."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from tessera.attention.masks import Mask
from tessera.attention.scores import ScoreMod


def _finite_scale(scale: object) -> float:
    """Accept Python, NumPy and 0-d torch reals; reject bools, non-finite values and anything else."""
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1 or not scale.dtype.is_floating_point:
            raise ValueError(f"AttentionSpec.scale must be a finite float, got a tensor of shape {tuple(scale.shape)}")
        scale = scale.item()
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.integer, np.floating)):
        raise ValueError(f"AttentionSpec.scale must be a finite float, got {scale!r}")
    if not math.isfinite(float(scale)):
        raise ValueError(f"AttentionSpec.scale must be a finite float, got {scale!r}")
    return float(scale)


@dataclass(frozen=True, slots=True, eq=False)
class AttentionSpec:
    """What to compute, independent of shapes, layouts and backends.

    Parameters
    ----------
    num_q_heads : int
        Query heads ``Hq``.
    num_kv_heads : int
        Key/value heads ``Hkv``; must divide ``Hq`` (MHA: equal, GQA: a divisor, MQA: 1). Query head ``h`` reads
        kv head ``h // (Hq // Hkv)``.
    head_dim : int
        ``D``, shared by q, k and v.
    mask : Mask, optional
        Which (q_pos, kv_pos) pairs attend; None means full bidirectional attention. Compose with ``& | ~``.
    score : ScoreMod, optional
        Transform of the scaled scores before the mask (softcap, ALiBi, custom).
    sinks : torch.Tensor, optional
        float ``[num_q_heads]``: learned logits that join the softmax denominator only (gpt-oss style).
    scale : float, optional
        Multiplies ``q . k``; defaults to ``1 / sqrt(head_dim)``.

    Examples
    --------
    >>> from tessera.attention import AttentionSpec, causal, sliding_window, softcap
    >>> spec = AttentionSpec(32, 8, 128, mask=sliding_window(4096), score=softcap(50.0))
    """

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    mask: Mask | None = None
    score: ScoreMod | None = None
    sinks: torch.Tensor | None = None
    scale: float | None = None

    def __post_init__(self) -> None:
        for name in ("num_q_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"AttentionSpec.{name} must be an int >= 1, got {value!r}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"AttentionSpec: num_q_heads ({self.num_q_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}); GQA groups query heads evenly over kv heads"
            )
        if self.mask is not None and not isinstance(self.mask, Mask):
            raise TypeError(
                f"AttentionSpec.mask must be a Mask (causal(), sliding_window(...), custom_mask(fn), ...), "
                f"got {type(self.mask).__name__}"
            )
        if self.score is not None and not isinstance(self.score, ScoreMod):
            raise TypeError(
                f"AttentionSpec.score must be a ScoreMod (softcap(...), alibi(...), custom_score(fn)), "
                f"got {type(self.score).__name__}"
            )
        if self.score is not None:
            self.score.check_heads(self.num_q_heads)
        self._check_sinks()
        if self.scale is not None:
            object.__setattr__(self, "scale", _finite_scale(self.scale))

    def _check_sinks(self) -> None:
        sinks = self.sinks
        if sinks is None:
            return
        if not isinstance(sinks, torch.Tensor) or not sinks.dtype.is_floating_point:
            raise TypeError(f"AttentionSpec.sinks must be a float tensor [num_q_heads], got {type(sinks).__name__}")
        if tuple(sinks.shape) != (self.num_q_heads,):
            raise ValueError(
                f"AttentionSpec.sinks must have shape [num_q_heads] = [{self.num_q_heads}], got {tuple(sinks.shape)}"
            )
        if not torch.isfinite(sinks).all():
            raise ValueError("AttentionSpec.sinks must be finite")

    @property
    def group_size(self) -> int:
        """Query heads per kv head (1 for MHA, ``Hq`` for MQA)."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def softmax_scale(self) -> float:
        """The scale actually applied: ``scale`` or ``1 / sqrt(head_dim)``."""
        return self.scale if self.scale is not None else 1.0 / math.sqrt(self.head_dim)

    def structure_key(self) -> tuple | None:
        """A hashable key equal for specs that compute the same thing, or None when the spec holds values a caller can
        change in place or that cannot be compared (sinks, ALiBi slopes, document ids, user functions).

        Plan caches key on it rather than on the spec object: a model that builds a fresh ``AttentionSpec`` per call
        still reuses one plan, and a key never outlives the meaning it was built from.
        """
        if self.sinks is not None:
            return None
        mask = None if self.mask is None else self.mask.structure_key()
        score = None if self.score is None else self.score.structure_key()
        if (self.mask is not None and mask is None) or (self.score is not None and score is None):
            return None
        return (self.num_q_heads, self.num_kv_heads, self.head_dim, self.softmax_scale, mask, score)

    def __repr__(self) -> str:
        parts = [f"{self.num_q_heads}q/{self.num_kv_heads}kv x {self.head_dim}"]
        if self.mask is not None:
            parts.append(f"mask={self.mask!r}")
        if self.score is not None:
            parts.append(f"score={self.score!r}")
        if self.sinks is not None:
            parts.append("sinks")
        if self.scale is not None:
            parts.append(f"scale={self.scale:g}")
        return f"AttentionSpec({', '.join(parts)})"
