"""Host side of the int8-activation quantized GEMV (:mod:`._qdot_kernels`): which weights it takes, which ISA token
the chosen ``qgemv`` variant runs, and the call itself."""

from __future__ import annotations

import numpy as np
import torch

from tessera.backends.cpu import variants
from tessera.backends.cpu.ops import _qdot_kernels as kernels
from tessera.backends.cpu.ops._int8_simd import AVX2, VNNI, IsaToken
from tessera.kernels.quant import QuantizedWeight

#: ``qgemv`` variant -> the ISA token its kernels compile for (None: the float-activation kernels)
_TOKENS: dict[str, IsaToken | None] = {"vnni": VNNI, "vnni512": VNNI, "avx2": AVX2, "portable": None}


def chosen_token() -> IsaToken | None:
    """The ISA token of the ``qgemv`` variant chosen here, or None when the portable variant runs."""
    return _TOKENS[variants.choose("qgemv").name]


def unsupported(qw: QuantizedWeight) -> str | None:
    """Why the int8-activation kernels cannot take ``qw`` (None when they can)."""
    if qw.fmt not in ("int4", "int4_min", "int8"):
        return f"format {qw.fmt} (the int8 dot products take int4, int4_min and int8)"
    if qw.shape[1] % kernels.BLOCK:
        return f"K={qw.shape[1]} is not a multiple of the activation block {kernels.BLOCK}"
    if qw.group_size % kernels.BLOCK and qw.group_size != qw.shape[1]:
        return f"group size {qw.group_size} is not a multiple of {kernels.BLOCK}"
    return None


def weight_arrays(qw: QuantizedWeight) -> tuple:
    """The kernels' weight arguments after the activation ones, as NumPy views."""
    if qw.fmt == "int8":
        return (qw.data.numpy(), qw.scales.numpy(), qw.group_size)
    offsets = qw.mins if qw.fmt == "int4_min" else qw.zeros
    return (qw.data.numpy(), qw.scales.numpy(), offsets.numpy(), qw.fmt == "int4_min", qw.group_size)


def qmatmul(x: torch.Tensor, qw: QuantizedWeight, isa: IsaToken, serial: bool) -> torch.Tensor:
    """float32 ``x_deq @ W.T`` for contiguous float32 ``x [M, K]``: x quantized to int8 per block of 32, then the
    integer kernels of ``isa`` on the calling thread (``serial``) or over all threads."""
    m = x.shape[0]
    out = torch.empty(m, qw.shape[0], dtype=torch.float32)
    xq, xd, xs = kernels.quantize_activations(x.numpy())
    on = out.numpy()
    if qw.fmt == "int8":
        q, scales, group = weight_arrays(qw)
        (kernels.gemv_int8_serial if serial else kernels.gemv_int8)(isa, xq, xd, q, scales, group, on)
    else:
        packed, scales, offsets, has_min, group = weight_arrays(qw)
        (kernels.gemv_int4_serial if serial else kernels.gemv_int4)(isa, xq, xd, xs, packed, scales, offsets,
                                                                    has_min, group, on)
    return out


def quantized_activation(x: torch.Tensor) -> torch.Tensor:
    """``x_deq``: float32 ``[M, K]`` as the int8-activation kernels see it (codes times block scales); the oracle
    input for testing them."""
    xq, xd, _ = kernels.quantize_activations(np.ascontiguousarray(x.detach().float().numpy()))
    return torch.from_numpy(xq).float() * torch.from_numpy(xd).repeat_interleave(kernels.BLOCK, dim=1)
