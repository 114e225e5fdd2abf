"""Score functions: transforms applied to ``s = (q . k) * scale`` before the mask and the softmax.

Each takes and returns float32 scores and may use the batch index, the query head and the absolute positions
(FlexAttention's ``score_mod(score, b, h, q_idx, kv_idx)`` convention).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

ScoreFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class ScoreMod:
    """Base class of all score functions."""

    def apply(
        self, score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_pos: torch.Tensor, kv_pos: torch.Tensor
    ) -> torch.Tensor:
        raise NotImplementedError

    def check_heads(self, num_q_heads: int) -> None:
        """Raise ValueError when per-head parameters do not match ``num_q_heads``."""

    def structure_key(self) -> tuple | None:
        """A hashable description that fixes this score function (see ``Mask.structure_key``), or None when it holds
        tensors or user functions."""
        return None


class Softcap(ScoreMod):
    """``cap * tanh(score / cap)`` (Gemma 2, Grok)."""

    def __init__(self, cap: float) -> None:
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not math.isfinite(cap) or cap <= 0:
            raise ValueError(f"softcap(cap) expects a finite float > 0, got {cap!r}")
        self.cap = float(cap)

    def apply(self, score, b, h, q_pos, kv_pos):
        return torch.tanh(score / self.cap) * self.cap

    def structure_key(self) -> tuple:
        return ("softcap", self.cap)

    def __repr__(self) -> str:
        return f"softcap({self.cap})"


class Alibi(ScoreMod):
    """Adds ``slopes[h] * (kv_pos - q_pos)``: a linear penalty with distance (BLOOM, MPT)."""

    def __init__(self, slopes: torch.Tensor) -> None:
        if not isinstance(slopes, torch.Tensor) or not slopes.dtype.is_floating_point or slopes.dim() != 1:
            raise TypeError(
                f"alibi(slopes) expects a 1-D float tensor [num_q_heads], got "
                f"{getattr(slopes, 'dtype', type(slopes).__name__)} {tuple(getattr(slopes, 'shape', ()))}"
            )
        if not torch.isfinite(slopes).all():
            raise ValueError("alibi(slopes): slopes must be finite")
        self.slopes = slopes.detach().to("cpu", torch.float32).contiguous()

    def check_heads(self, num_q_heads: int) -> None:
        if self.slopes.numel() != num_q_heads:
            raise ValueError(
                f"alibi(slopes): expected one slope per query head ({num_q_heads}), got {self.slopes.numel()}"
            )

    def apply(self, score, b, h, q_pos, kv_pos):
        slopes = self.slopes.to(score.device)[h]
        return score + slopes * (kv_pos - q_pos).to(score.dtype)

    def __repr__(self) -> str:
        return f"alibi(<{self.slopes.numel()} slopes>)"


class CustomScore(ScoreMod):
    """A user score function ``fn(score, b, h, q_pos, kv_pos) -> score`` built from vectorized torch ops."""

    def __init__(self, fn: ScoreFn) -> None:
        if not callable(fn):
            raise TypeError(f"custom_score(fn) expects a callable fn(score, b, h, q_pos, kv_pos), got {type(fn).__name__}")
        self.fn = fn

    def apply(self, score, b, h, q_pos, kv_pos):
        out = self.fn(score, b, h, q_pos, kv_pos)
        if not isinstance(out, torch.Tensor) or not out.dtype.is_floating_point:
            raise TypeError(
                f"custom score function {getattr(self.fn, '__name__', self.fn)!r} must return a float tensor, got "
                f"{getattr(out, 'dtype', type(out).__name__)}"
            )
        return out

    def __repr__(self) -> str:
        return f"custom_score({getattr(self.fn, '__name__', 'fn')})"


def softcap(cap: float) -> ScoreMod:
    """Soft-cap scores to ``(-cap, cap)`` with ``cap * tanh(score / cap)``."""
    return Softcap(cap)


def alibi(slopes: torch.Tensor) -> ScoreMod:
    """ALiBi: add ``slopes[h] * (kv_pos - q_pos)``; ``slopes`` is float ``[num_q_heads]``."""
    return Alibi(slopes)


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """The geometric slopes of the ALiBi paper for ``num_heads`` heads (float32 ``[num_heads]``)."""
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"alibi_slopes(num_heads) expects an int >= 1, got {num_heads!r}")
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2.0 ** (-8.0 / closest)
    slopes = [base ** (i + 1) for i in range(closest)]
    if closest < num_heads:
        extra = 2.0 ** (-4.0 / closest)
        slopes += [extra ** (2 * i + 1) for i in range(num_heads - closest)]
    return torch.tensor(slopes, dtype=torch.float32)


def custom_score(fn: ScoreFn) -> ScoreMod:
    """Wrap ``fn(score, b, h, q_pos, kv_pos) -> score`` (vectorized torch ops, FlexAttention's score_mod)."""
    return CustomScore(fn)
