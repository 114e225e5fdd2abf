"""How a :class:`tessera.kernels.quant.QuantizedWeight` becomes the operands of a ``tessera.qmatmul``.

A packed projection ``l{i}_{part}`` is captured as function arguments named after it:

=====================  ========================================  ==========================================
argument               type                                      tensor passed at run time
=====================  ========================================  ==========================================
``l{i}_{part}``        ``i8 [N, K]`` (int8), ``i8 [N, K/2]``     ``qw.data`` (uint8 bytes passed as int8)
``..._scales``         ``[N, K/G]`` f32 or f16                   ``qw.scales``
``..._zeros``          ``i8 [N, K/G]`` (int4 only)               ``qw.zeros`` (0..15)
``..._mins``           ``[N, K/G]``, the scales' type (int4_min)  ``qw.mins``
=====================  ========================================  ==========================================

GGUF's Q8_0, Q4_0 and Q4_1 arrive from :func:`tessera.kernels.quant.from_gguf` already split into int8, int4 (zero
point 8) and int4_min with f16 scales, group 32, so they take the same path. ggml's whole-block formats (Q5_0, Q5_1,
K-quants), fp8_e4m3 and row-stacked weights have no ``qmatmul`` format and are declined with the reason.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from xdsl.dialects.builtin import Float16Type, Float32Type, IntegerType, TensorType
from xdsl.ir import Attribute

from tessera.mlir import dialect as td

_SCALE_TYPES: dict[torch.dtype, Attribute] = {torch.float32: Float32Type(), torch.float16: Float16Type()}
#: the offsets argument's suffix per qmatmul format
OFFSET_SUFFIX = {"int8": None, "int4": "zeros", "int4_min": "mins"}


def is_packed(weight: object) -> bool:
    """Whether ``weight`` is a packed (quantized) weight rather than a float tensor."""
    from tessera.kernels.quant import QuantizedWeight, StackedWeight

    return isinstance(weight, (QuantizedWeight, StackedWeight))


def qmatmul_format(weight: object, what: str) -> str:
    """The ``tessera.qmatmul`` format of packed weight ``weight`` (named ``what`` in errors).

    Raises
    ------
    NotImplementedError
        A packing no ``qmatmul`` format expresses, with what to do instead.
    """
    from tessera.kernels.quant import QuantizedWeight

    if not isinstance(weight, QuantizedWeight):
        raise NotImplementedError(f"capture: {what} is a {type(weight).__name__} (row blocks in several packed "
                                  "formats); tessera.qmatmul takes one QuantizedWeight; requantize the model "
                                  "(tessera.models.requantize.requantize_model) to int8, int4 or int4_min")
    if weight.fmt not in OFFSET_SUFFIX:
        raise NotImplementedError(
            f"capture: {what} is packed as {weight.fmt!r}; tessera.qmatmul lowers {list(OFFSET_SUFFIX)} (GGUF Q8_0, "
            "Q4_0 and Q4_1 load as those); requantize the model to one of them or pass float weights")
    return weight.fmt


def operand_types(weight: object, what: str, shape: tuple[int, int]) -> list[tuple[str, TensorType]]:
    """``(argument suffix, type)`` of ``weight``'s qmatmul operands: ``""`` (the codes), ``"_scales"``, and
    ``"_zeros"`` or ``"_mins"``; ``shape`` is the ``[N, K]`` the config expects for it."""
    fmt = qmatmul_format(weight, what)
    got = tuple(weight.shape)  # type: ignore[attr-defined]
    if got != tuple(shape):
        raise ValueError(f"capture: {what} is a packed [N, K] = {got} weight, but the config expects "
                         f"{tuple(shape)}; the weights belong to another model")
    n, k = shape
    group = weight.group_size  # type: ignore[attr-defined]
    scale_el = _SCALE_TYPES[weight.scales.dtype]  # type: ignore[attr-defined]
    i8 = IntegerType(8)
    out = [("", td.tensor([n, k if fmt == "int8" else k // 2], i8)), ("_scales", td.tensor([n, k // group], scale_el))]
    if fmt == "int4":
        out.append(("_zeros", td.tensor([n, k // group], i8)))
    elif fmt == "int4_min":
        out.append(("_mins", td.tensor([n, k // group], scale_el)))
    return out


def operand_tensors(weight: object) -> dict[str, torch.Tensor]:
    """``weight``'s run-time tensors by argument suffix (see :func:`operand_types`), bytes as int8 views."""
    fmt = qmatmul_format(weight, "the weight")
    out = {"": weight.data.view(torch.int8), "_scales": weight.scales}  # type: ignore[attr-defined]
    if fmt == "int4":
        out["_zeros"] = weight.zeros.view(torch.int8)  # type: ignore[attr-defined]
    elif fmt == "int4_min":
        out["_mins"] = weight.mins  # type: ignore[attr-defined]
    return out


def layer_inputs(arg_names: tuple[str, ...], weights: Mapping[str, object], layer: int) -> dict[str, torch.Tensor]:
    """The weight inputs of a captured layer's function by argument name, from a model's weights
    (``l{layer}_qkv`` -> ``layers.{layer}.qkv.weight``, packed ones split into codes, scales and zeros or mins)."""
    prefix = f"l{layer}_"
    out: dict[str, torch.Tensor] = {}
    for name in arg_names:
        if not name.startswith(prefix):
            continue
        part = name[len(prefix):]
        for suffix in ("_scales", "_zeros", "_mins", ""):
            if suffix and part.endswith(suffix):
                base = part[: -len(suffix)]
                break
        else:
            base = part
        weight = weights[f"layers.{layer}.{base}.weight"]
        out[name] = operand_tensors(weight)[suffix] if is_packed(weight) else weight  # type: ignore[assignment]
    return out
