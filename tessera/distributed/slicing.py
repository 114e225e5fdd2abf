"""Row and column slices of a weight in any form a model holds: float tensor, packed, or stacked packed blocks.

A row slice (output features: column-parallel q/k/v, gate/up, vocabulary ranges) can cut anywhere, because every
format quantizes along the input dimension only. A column slice (input features: row-parallel o and down) must
fall on quantization-group boundaries, so that every group keeps its own scale; anything else raises. An expert
slice takes whole experts, so it never cuts a packed weight.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from tessera.kernels.ggml_blocks import BLOCKS, row_bytes
from tessera.kernels.quant import QuantizedWeight, StackedWeight

AnyWeight = torch.Tensor | QuantizedWeight | StackedWeight


def take_rows(w: AnyWeight, index: list[int], name: str) -> AnyWeight:
    """Rows ``index`` (ascending) of ``w [N, K]``, in the same form (packed stays packed).

    Parameters
    ----------
    w : float tensor ``[N, ...]`` (a bias ``[N]`` too), :class:`QuantizedWeight` or :class:`StackedWeight`.
    index : row numbers in ``[0, N)``, ascending (a stacked weight's parts keep their order).
    name : the weight's canonical name, for error messages.
    """
    if any(b <= a for a, b in zip(index, index[1:])):
        raise ValueError(f"take_rows({name}): row indices must be strictly ascending")
    if isinstance(w, StackedWeight):
        parts, start = [], 0
        for part in w.parts:
            n = part.shape[0]
            local = [r - start for r in index if start <= r < start + n]
            if local:
                parts.append(take_rows(part, local, name))
            start += n
        return parts[0] if len(parts) == 1 else StackedWeight(tuple(parts))
    idx = torch.tensor(index, dtype=torch.int64, device=w.device)
    if isinstance(w, QuantizedWeight):
        return w.rows(idx)
    return w.index_select(0, idx).contiguous()


def take_cols(w: AnyWeight, start: int, stop: int, name: str) -> AnyWeight:
    """Input columns ``[start, stop)`` of ``w [N, K]``; for a packed weight both ends must be group boundaries.

    Raises
    ------
    ValueError
        When ``start`` or ``stop`` falls inside a quantization group (the message names the group size and the
        nearest boundaries), or the weight has one scale per row (per-channel int8 / fp8: no column split keeps it).
    """
    if isinstance(w, StackedWeight):
        return StackedWeight(tuple(take_cols(p, start, stop, name) for p in w.parts))
    if not isinstance(w, QuantizedWeight):
        return w[:, start:stop].contiguous()
    k, g = w.shape[1], w.group_size
    if g == k:
        raise ValueError(f"{name}: {w.fmt} with one scale per row (group {g} = the whole input dimension) cannot be "
                         "split along its input dimension across ranks; quantize it with groups (32/64/128) or run "
                         "tensor_parallel_size=1")
    for at in (start, stop):
        if at % g:
            raise ValueError(f"{name}: a row-parallel split at input column {at} falls inside a {w.fmt} group of {g} "
                             f"values (nearest boundaries {at - at % g} and {at - at % g + g}); this model cannot be "
                             "split across this many ranks with its packed weights kept whole: load it with "
                             "keep_quantized=False or pick another tensor_parallel_size")
    g0, g1 = start // g, stop // g
    if w.fmt in BLOCKS:
        per = row_bytes(w.fmt, g)
        return dataclasses.replace(w, shape=(w.shape[0], stop - start), data=w.data[:, g0 * per:g1 * per].contiguous())
    # int8 / fp8 keep one code per value; int4 formats pack a group's values into g / 2 bytes, group after group
    per_value = 2 if w.fmt.startswith("int4") else 1
    data = w.data[:, start // per_value:stop // per_value].contiguous()
    cut = (lambda t: None if t is None else t[:, g0:g1].contiguous())  # noqa: E731
    return dataclasses.replace(w, shape=(w.shape[0], stop - start), data=data, scales=cut(w.scales),
                               zeros=cut(w.zeros), mins=cut(w.mins))


def take_experts(w: torch.Tensor | Sequence, start: int, stop: int, name: str) -> torch.Tensor | list:
    """Experts ``[start, stop)`` of a stacked expert weight, whole and in the same form.

    Parameters
    ----------
    w : float tensor ``[E, N, K]`` (``experts.gate_up`` / ``experts.down``), or a sequence of E per-expert weights
        (packed ones stay packed: nothing inside an expert is cut).
    start, stop : global expert ids, ``0 <= start <= stop <= E``.
    name : the weight's canonical name, for error messages.

    Returns
    -------
    A tensor ``[stop - start, N, K]`` with storage of its own (so a rank's copy holds only its experts, not a view
    of every expert), or a list of ``stop - start`` weights.
    """
    if isinstance(w, torch.Tensor) and w.dim() == 3:
        num = int(w.shape[0])
    elif isinstance(w, Sequence) and not isinstance(w, torch.Tensor):
        num = len(w)
    else:
        raise TypeError(f"take_experts({name}): expected a [E, N, K] tensor or a sequence of per-expert weights, got "
                        f"{type(w).__name__} {tuple(getattr(w, 'shape', ()))}")
    if not 0 <= start <= stop <= num:
        raise ValueError(f"take_experts({name}): experts [{start}, {stop}) do not lie in the weight's {num} experts")
    if isinstance(w, torch.Tensor):
        return w[start:stop].clone(memory_format=torch.contiguous_format)
    return list(w[start:stop])


def group_size(w: AnyWeight) -> int:
    """The input-dimension granularity a column split of ``w`` must respect (1 for a float weight)."""
    if isinstance(w, StackedWeight):
        sizes = {p.group_size for p in w.parts}
        return max(sizes)  # every size in use is 32 or 256; the larger is a multiple of the smaller
    return w.group_size if isinstance(w, QuantizedWeight) else 1
