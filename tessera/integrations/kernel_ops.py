"""The kernel library's hot ops as torch custom ops, with fake implementations for ``torch.compile`` / ``torch.export``.

========================================  ====================================================================
op                                        wraps
========================================  ====================================================================
``tessera::rms_norm``                     ``tessera.kernels.rms_norm(x, w, eps, gemma=)``
``tessera::fused_add_rms_norm``           ``tessera.kernels.rms_norm(x, w, eps, residual=r, gemma=)`` -> (y, r)
``tessera::rope``                         ``tessera.kernels.apply_rope`` (mutates q and k in place)
``tessera::silu_and_mul``                 ``tessera.kernels.silu_and_mul``
``tessera::qmatmul``                      ``tessera.kernels.qmatmul`` (the packed weight as its tensors)
========================================  ====================================================================

A schema takes tensors and scalars only, so the Python objects of the kernel API travel as their tensors: a
:class:`~tessera.kernels.RotaryEmbedding` as its ``cos`` / ``sin`` tables and ``inv_freq`` (plus its
``attention_scaling``), a :class:`~tessera.kernels.QuantizedWeight` as ``data`` / ``scales`` / ``zeros`` / ``mins``
(plus ``fmt`` and ``group_size``). The tables and packed weights then become graph inputs or constants, and an
exported graph holds one node per op. The public functions in ``tessera.kernels`` route here while
``torch.compile`` traces them; the Python wrappers below (same arguments as the public functions) are the entry
points for direct use.

These ops have no autograd formula (the kernel library serves inference); calling one on tensors that require a
gradient raises torch's "does not have an autograd kernel" error.
"""

from __future__ import annotations

import torch

from tessera.kernels.quant import QuantizedWeight
from tessera.kernels.rope import RotaryEmbedding


def _fresh(out: torch.Tensor, *inputs: torch.Tensor | None) -> torch.Tensor:
    """``out``, cloned if a backend returned an input itself (a custom op's outputs must not alias its inputs)."""
    for t in inputs:
        if t is not None and t.numel() and out.numel() and out.untyped_storage().data_ptr() == \
                t.untyped_storage().data_ptr():
            return out.clone()
    return out


# ---- rms_norm ------------------------------------------------------------------------------------------------

@torch.library.custom_op("tessera::rms_norm", mutates_args=())
def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool, backend: str) -> torch.Tensor:
    """``tessera.kernels.rms_norm(x, weight, eps, gemma=gemma)``: ``[..., H]`` -> ``[..., H]`` in x's dtype."""
    from tessera.kernels.norms import rms_norm

    return _fresh(rms_norm(x, weight, eps, gemma=gemma, backend=backend), x)


@rms_norm_op.register_fake
def _rms_norm_fake(x, weight, eps, gemma, backend):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("tessera::fused_add_rms_norm", mutates_args=())
def fused_add_rms_norm_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool,
                          backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``r = x + residual`` (rounded to x's dtype), ``y = rms_norm(r)``; returns ``(y, r)``, both ``[..., H]``."""
    from tessera.kernels.norms import rms_norm

    y, r = rms_norm(x, weight, eps, residual=residual, gemma=gemma, backend=backend)
    return _fresh(y, x, residual), _fresh(r, x, residual)


@fused_add_rms_norm_op.register_fake
def _fused_add_rms_norm_fake(x, residual, weight, eps, gemma, backend):
    return (torch.empty(x.shape, dtype=x.dtype, device=x.device),
            torch.empty(x.shape, dtype=x.dtype, device=x.device))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, residual: torch.Tensor | None = None,
             gemma: bool = False, backend: str = "auto") -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``tessera.kernels.rms_norm`` through the custom ops (same arguments, shapes and results)."""
    if residual is None:
        return torch.ops.tessera.rms_norm(x, weight, float(eps), bool(gemma), backend)
    return torch.ops.tessera.fused_add_rms_norm(x, residual, weight, float(eps), bool(gemma), backend)


# ---- silu_and_mul --------------------------------------------------------------------------------------------

@torch.library.custom_op("tessera::silu_and_mul", mutates_args=())
def silu_and_mul_op(gate_up: torch.Tensor, backend: str) -> torch.Tensor:
    """``silu(gate_up[..., :I]) * gate_up[..., I:]``: ``[..., 2I]`` -> ``[..., I]`` in gate_up's dtype."""
    from tessera.kernels.activations import silu_and_mul

    return _fresh(silu_and_mul(gate_up, backend=backend), gate_up)


@silu_and_mul_op.register_fake
def _silu_and_mul_fake(gate_up, backend):
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2:
        raise ValueError(f"tessera::silu_and_mul: gate_up must be [..., 2*I], got {tuple(gate_up.shape)}")
    return torch.empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2), dtype=gate_up.dtype, device=gate_up.device)


def silu_and_mul(gate_up: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """``tessera.kernels.silu_and_mul`` through the custom op."""
    return torch.ops.tessera.silu_and_mul(gate_up, backend)


# ---- rope ----------------------------------------------------------------------------------------------------

@torch.library.custom_op("tessera::rope", mutates_args=("q", "k"))
def rope_op(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            inv_freq: torch.Tensor, attention_scaling: float, interleaved: bool, backend: str) -> None:
    """Rotate q ``[tokens, Hq, D]`` and k ``[tokens, Hkv, D]`` in place by ``positions`` ``[tokens]``.

    ``cos`` / ``sin``: float32 ``[max_position, rotary_dim // 2]`` (the RotaryEmbedding's tables on q's device);
    ``inv_freq``: float64 ``[rotary_dim // 2]`` (the float64 backend recomputes angles from it).
    """
    from tessera.kernels.rope import apply_rope

    apply_rope(q, k, positions, _rope_from_tables(q, cos, sin, inv_freq, attention_scaling),
               interleaved=interleaved, backend=backend)


@rope_op.register_fake
def _rope_fake(q, k, positions, cos, sin, inv_freq, attention_scaling, interleaved, backend):
    return None


def _rope_from_tables(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inv_freq: torch.Tensor,
                      attention_scaling: float) -> RotaryEmbedding:
    """A RotaryEmbedding around given tables; only the fields the ops read are meaningful (``base`` and ``params``
    matter only to ``for_length``, which callers apply before the op)."""
    rows, half = cos.shape
    on_device = {} if q.device.type == "cpu" else {q.device: (cos, sin)}
    return RotaryEmbedding(head_dim=q.shape[-1], rotary_dim=2 * half, max_position=rows,
                           max_position_embeddings=rows, base=0.0, params={"rope_type": "default"}, seq_len=None,
                           inv_freq=inv_freq.cpu(), attention_scaling=float(attention_scaling), cos=cos.cpu(),
                           sin=sin.cpu(), _on_device=on_device)


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, *,
               interleaved: bool = False, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``tessera.kernels.apply_rope`` through the custom op: rotates q and k in place and returns them."""
    if not isinstance(rope, RotaryEmbedding):
        raise TypeError(f"rope must be a RotaryEmbedding (RotaryEmbedding.build / .from_hf_config), got "
                        f"{type(rope).__name__}")
    cos, sin = rope.tables(q.device)
    torch.ops.tessera.rope(q, k, positions, cos, sin, rope.inv_freq, rope.attention_scaling, bool(interleaved),
                           backend)
    return q, k


# ---- qmatmul -------------------------------------------------------------------------------------------------

@torch.library.custom_op("tessera::qmatmul", mutates_args=())
def qmatmul_op(x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor | None, zeros: torch.Tensor | None,
               mins: torch.Tensor | None, fmt: str, group_size: int, backend: str) -> torch.Tensor:
    """``x [M, K] @ dequantize(w).T`` -> ``[M, N]`` in x's dtype; ``w`` given by its packed parts (see
    :class:`~tessera.kernels.QuantizedWeight`; ``N = data.shape[0]``, ``K = x.shape[1]``)."""
    from tessera.kernels.quant import qmatmul

    qw = QuantizedWeight(fmt, (data.shape[0], x.shape[1]), group_size, data, scales, zeros, mins)
    return _fresh(qmatmul(x, qw, backend=backend), x)


@qmatmul_op.register_fake
def _qmatmul_fake(x, data, scales, zeros, mins, fmt, group_size, backend):
    if x.dim() != 2:
        raise ValueError(f"tessera::qmatmul: x must be [M, K], got {tuple(x.shape)}")
    return torch.empty((x.shape[0], data.shape[0]), dtype=x.dtype, device=x.device)


def qmatmul(x: torch.Tensor, qw: QuantizedWeight, *, backend: str = "auto") -> torch.Tensor:
    """``tessera.kernels.qmatmul`` through the custom op."""
    if not isinstance(qw, QuantizedWeight):
        raise TypeError(f"qw must be a QuantizedWeight (from quantize or from_gguf), got {type(qw).__name__}")
    return torch.ops.tessera.qmatmul(x, qw.data, qw.scales, qw.zeros, qw.mins, qw.fmt, qw.group_size, backend)
