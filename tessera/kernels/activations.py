"""Activation ops: SiLU, GELU (exact and tanh), ReLU, and the fused gated forms of merged ``gate_up`` projections.

``silu_and_mul(gate_up)`` takes ONE concatenated projection ``[..., 2*I]`` (first half gate, second half up, the
layout of vLLM's and Hugging Face's merged ``gate_up_proj``) and returns ``silu(gate) * up`` ``[..., I]``. Math is
float32 whatever the storage dtype, rounded once to the input's dtype. ``docs/kernels/activations.md`` has details.
"""

from __future__ import annotations

import torch

from tessera.dtypes import FLOAT_DTYPES
from tessera.kernels import registry

APPROXIMATIONS = ("none", "tanh")


def silu(x: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """``x * sigmoid(x)`` elementwise; x any shape, float32 / bfloat16 / float16; returns x's shape and dtype.

    Examples
    --------
    >>> y = silu(torch.randn(4, 11008, dtype=torch.bfloat16))
    """
    _check("silu", x)
    return registry.resolve("silu", backend, x.device)(x)


def gelu(x: torch.Tensor, approximate: str = "none", *, backend: str = "auto") -> torch.Tensor:
    """GELU elementwise: ``x * Phi(x)`` (``approximate="none"``, erf form) or the tanh form
    ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` (``"tanh"``, GPT-2's ``gelu_new``, Gemma's
    ``gelu_pytorch_tanh``); same names as ``torch.nn.functional.gelu``. Returns x's shape and dtype.

    Examples
    --------
    >>> y = gelu(h, approximate="tanh")
    """
    _check("gelu", x)
    _check_approximate("gelu", approximate)
    return registry.resolve("gelu", backend, x.device)(x, approximate)


def relu(x: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """``max(x, 0)`` elementwise; returns x's shape and dtype.

    Examples
    --------
    >>> y = relu(h)
    """
    _check("relu", x)
    return registry.resolve("relu", backend, x.device)(x)


def silu_and_mul(gate_up: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """Fused SwiGLU: ``silu(gate_up[..., :I]) * gate_up[..., I:]`` in one pass (Llama, Mistral, Qwen MLPs).

    Parameters
    ----------
    gate_up : torch.Tensor ``[..., 2*I]``, float32 / bfloat16 / float16; gate first, up second
    backend : "auto", "reference", "cpu" or "triton"

    Returns
    -------
    ``[..., I]`` in gate_up's dtype.

    Examples
    --------
    >>> gate_up = x @ w_gate_up.T                 # [tokens, 2 * intermediate]
    >>> h = silu_and_mul(gate_up) @ w_down.T       # [tokens, hidden]
    """
    _check_gated("silu_and_mul", gate_up)
    if torch.compiler.is_compiling():  # the Numba kernels are opaque to Dynamo: trace the custom op instead
        from tessera.integrations import kernel_ops

        return kernel_ops.silu_and_mul(gate_up, backend=backend)
    return registry.resolve("silu_and_mul", backend, gate_up.device)(gate_up)


def gelu_and_mul(gate_up: torch.Tensor, approximate: str = "none", *, backend: str = "auto") -> torch.Tensor:
    """Fused GeGLU: ``gelu(gate_up[..., :I], approximate) * gate_up[..., I:]`` (Gemma uses ``approximate="tanh"``).

    Parameters
    ----------
    gate_up : torch.Tensor ``[..., 2*I]``, float32 / bfloat16 / float16; gate first, up second
    approximate : "none" (erf) or "tanh"
    backend : "auto", "reference", "cpu" or "triton"

    Returns
    -------
    ``[..., I]`` in gate_up's dtype.

    Examples
    --------
    >>> h = gelu_and_mul(gate_up, approximate="tanh")
    """
    _check_gated("gelu_and_mul", gate_up)
    _check_approximate("gelu_and_mul", approximate)
    return registry.resolve("gelu_and_mul", backend, gate_up.device)(gate_up, approximate)


def _check(op: str, x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype not in FLOAT_DTYPES:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{op}: expected a float32, bfloat16 or float16 tensor, got {got}")


def _check_gated(op: str, gate_up: torch.Tensor) -> None:
    _check(op, gate_up)
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2:
        raise ValueError(f"{op}: gate_up must be [..., 2*I] (gate and up concatenated on the last dim), got shape "
                         f"{tuple(gate_up.shape)}; pass torch.cat([gate, up], -1) or the merged gate_up projection")


def _check_approximate(op: str, approximate: str) -> None:
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"{op}: approximate must be 'none' (erf) or 'tanh', got {approximate!r}")
