"""Normalization ops: RMSNorm (Llama and Gemma forms, with the fused residual add), LayerNorm, per-head QK-norm.

All of them compute in float32 whatever the storage dtype and return the input's dtype, matching Hugging Face
transformers' ``LlamaRMSNorm`` / ``GemmaRMSNorm`` / ``nn.LayerNorm``. ``docs/kernels/norms.md`` gives the formulas.
"""

from __future__ import annotations

import torch

from tessera.dtypes import FLOAT_DTYPES
from tessera.kernels import registry


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    residual: torch.Tensor | None = None,
    gemma: bool = False,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Root-mean-square normalization over the last dimension, optionally fused with the residual add.

    ``y = x / sqrt(mean(x^2) + eps) * w`` (Llama), or ``* (1 + w)`` with ``gemma=True`` (Gemma stores ``w - 1``),
    computed in float32 and rounded once to x's dtype. With ``residual``, first ``r = x + residual`` rounded to x's
    dtype (as a model adding the residual in its own dtype does), then ``y = rms_norm(r)``; both are returned.

    Parameters
    ----------
    x : torch.Tensor ``[..., H]``, float32 / bfloat16 / float16
    weight : torch.Tensor ``[H]``, any float dtype (used in float32), same device as x
    eps : float, > 0
    residual : torch.Tensor ``[..., H]``, optional; same shape, dtype and device as x
    gemma : bool, multiply by ``1 + w`` instead of ``w``
    backend : "auto", "reference", "cpu" or "triton"

    Returns
    -------
    y : ``[..., H]`` in x's dtype; or ``(y, r)`` when ``residual`` is given, ``r`` the new residual stream.

    Examples
    --------
    >>> h = torch.randn(64, 4096, dtype=torch.bfloat16)
    >>> y, h = rms_norm(attn_out, w, 1e-6, residual=h)     # fused: h += attn_out; y = RMSNorm(h)
    """
    _check_norm_input("rms_norm", x, weight, eps)
    if residual is not None:
        _check_same("rms_norm", "residual", residual, x)
    if torch.compiler.is_compiling():  # the Numba kernels are opaque to Dynamo: trace the custom op instead
        from tessera.integrations import kernel_ops

        return kernel_ops.rms_norm(x, weight, eps, residual=residual, gemma=gemma, backend=backend)
    return registry.resolve("rms_norm", backend, x.device)(x, weight, float(eps), residual, bool(gemma))


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """LayerNorm over the last dimension (GPT-2): ``(x - mean) / sqrt(var + eps) * w + b``, biased variance.

    Parameters
    ----------
    x : torch.Tensor ``[..., H]``, float32 / bfloat16 / float16
    weight : torch.Tensor ``[H]``; bias : torch.Tensor ``[H]`` or None (any float dtypes, used in float32)
    eps : float, > 0
    backend : "auto", "reference", "cpu" or "triton"

    Returns
    -------
    ``[..., H]`` in x's dtype (statistics and arithmetic in float32, as ``torch.nn.LayerNorm`` does).

    Examples
    --------
    >>> y = layer_norm(h, ln_f.weight, ln_f.bias, 1e-5)
    """
    _check_norm_input("layer_norm", x, weight, eps)
    if bias is not None:
        _check_vector("layer_norm", "bias", bias, x)
    return registry.resolve("layer_norm", backend, x.device)(x, weight, bias, float(eps))


def qk_norm(
    q: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    gemma: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """Per-head RMSNorm of queries or keys over ``head_dim`` (Qwen3 ``q_norm``/``k_norm``; Gemma 3 with ``gemma``).

    Parameters
    ----------
    q : torch.Tensor ``[tokens, heads, head_dim]``, float32 / bfloat16 / float16 (keys work the same way)
    weight : torch.Tensor ``[head_dim]``, shared by all heads
    eps, gemma, backend : as in :func:`rms_norm`

    Returns
    -------
    ``[tokens, heads, head_dim]`` in q's dtype.

    Examples
    --------
    >>> q = qk_norm(q.view(tokens, num_q_heads, head_dim), q_norm.weight, 1e-6)
    """
    if q.dim() != 3:
        raise ValueError(f"qk_norm: q must be [tokens, heads, head_dim], got shape {tuple(q.shape)}; "
                         "view the projection as (tokens, heads, head_dim) first")
    _check_norm_input("qk_norm", q, weight, eps)
    return registry.resolve("qk_norm", backend, q.device)(q, weight, float(eps), bool(gemma))


def _check_norm_input(op: str, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype not in FLOAT_DTYPES:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{op}: x must be a float32, bfloat16 or float16 tensor, got {got}")
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"{op}: x must be [..., H] with H >= 1, got shape {tuple(x.shape)}")
    _check_vector(op, "weight", weight, x)
    if not eps > 0:
        raise ValueError(f"{op}: eps must be > 0, got {eps}")


def _check_vector(op: str, name: str, v: torch.Tensor, x: torch.Tensor) -> None:
    if not isinstance(v, torch.Tensor) or not v.dtype.is_floating_point:
        raise TypeError(f"{op}: {name} must be a float tensor, got {getattr(v, 'dtype', type(v).__name__)}")
    if v.shape != (x.shape[-1],):
        raise ValueError(f"{op}: {name} must be [H] = [{x.shape[-1]}] (x's last dim), got {tuple(v.shape)}")
    if v.device != x.device:
        raise ValueError(f"{op}: {name} is on {v.device} but x is on {x.device}; move it with .to(x.device)")


def _check_same(op: str, name: str, t: torch.Tensor, x: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor) or t.shape != x.shape or t.dtype != x.dtype or t.device != x.device:
        got = (tuple(t.shape), t.dtype, t.device) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{op}: {name} must match x (shape {tuple(x.shape)}, {x.dtype}, {x.device}), got {got}; "
                         f"cast it with .to(x.dtype) or fix the shapes")
