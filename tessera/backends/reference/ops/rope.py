"""Float64 rotary embeddings: the oracle of the rope tests and the ``reference`` backend of ``apply_rope``.

Angles are recomputed in float64 from ``rope.inv_freq`` (not read from the float32 tables), so the oracle is
independent of the tables the fast backends use.
"""

from __future__ import annotations

import torch

from tessera.kernels.rope import RotaryEmbedding


def _rotate_f64(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int,
                interleaved: bool) -> torch.Tensor:
    """``x`` float64 ``[tokens, heads, head_dim]``, ``cos``/``sin`` float64 ``[tokens, 1, rotary_dim // 2]``."""
    out = x.clone()
    if interleaved:
        a, b = x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2]
        out[..., 0:rotary_dim:2] = a * cos - b * sin
        out[..., 1:rotary_dim:2] = b * cos + a * sin
    else:
        half = rotary_dim // 2
        a, b = x[..., :half], x[..., half:rotary_dim]
        out[..., :half] = a * cos - b * sin
        out[..., half:rotary_dim] = b * cos + a * sin
    return out


def apply_rope_f64(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                   interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of ``q`` and ``k`` in float64 (inputs untouched); same semantics as ``apply_rope``.

    Returns
    -------
    (torch.Tensor float64 ``[tokens, num_q_heads, head_dim]``, torch.Tensor float64 ``[tokens, num_kv_heads, head_dim]``)
    """
    angles = positions.to("cpu", torch.float64)[:, None] * rope.inv_freq[None, :]
    cos = (torch.cos(angles) * rope.attention_scaling)[:, None, :]
    sin = (torch.sin(angles) * rope.attention_scaling)[:, None, :]
    q64, k64 = q.detach().to("cpu", torch.float64), k.detach().to("cpu", torch.float64)
    return (_rotate_f64(q64, cos, sin, rope.rotary_dim, interleaved),
            _rotate_f64(k64, cos, sin, rope.rotary_dim, interleaved))


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
               interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 rotation, rounded back into ``q`` and ``k`` in place."""
    q64, k64 = apply_rope_f64(q, k, positions, rope, interleaved)
    q.copy_(q64)
    k.copy_(k64)
    return q, k


OPS = {"apply_rope": apply_rope}
