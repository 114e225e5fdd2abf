"""Float64 oracle of the normalization ops: the formulas of ``docs/kernels/norms.md``, written literally.

``*_f64`` functions return float64 (the tests' oracle); the registered functions round once to x's dtype. The fused
residual sum is rounded to x's dtype before normalizing, as the API specifies, so the oracle charges the kernel only
for its own arithmetic.
"""

from __future__ import annotations

import torch


def rms_norm_f64(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                 gemma: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``y = r / sqrt(mean(r^2) + eps) * w`` (or ``* (1 + w)``) in float64, ``r = x`` or ``(x + residual)`` rounded
    to x's dtype; returns ``y`` or ``(y, r)``, both float64."""
    r = x if residual is None else (x.double() + residual.double()).to(x.dtype)
    r64 = r.double()
    w = weight.detach().double() + 1.0 if gemma else weight.detach().double()
    y = r64 * torch.rsqrt(r64.pow(2).mean(-1, keepdim=True) + eps) * w
    return y if residual is None else (y, r64)


def layer_norm_f64(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps) * w + b`` in float64 (biased variance, as ``torch.nn.LayerNorm``)."""
    x64 = x.double()
    centered = x64 - x64.mean(-1, keepdim=True)
    y = centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + eps) * weight.detach().double()
    return y if bias is None else y + bias.detach().double()


def qk_norm_f64(q: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False) -> torch.Tensor:
    """RMSNorm of every ``q[t, h, :]`` with the shared ``weight [head_dim]``, float64."""
    return rms_norm_f64(q, weight, eps, None, gemma)


def rms_norm(x, weight, eps, residual, gemma):
    out = rms_norm_f64(x, weight, eps, residual, gemma)
    if residual is None:
        return out.to(x.dtype)
    return out[0].to(x.dtype), out[1].to(x.dtype)


def layer_norm(x, weight, bias, eps):
    return layer_norm_f64(x, weight, bias, eps).to(x.dtype)


def qk_norm(q, weight, eps, gemma):
    return qk_norm_f64(q, weight, eps, gemma).to(q.dtype)


OPS = {"rms_norm": rms_norm, "layer_norm": layer_norm, "qk_norm": qk_norm}
