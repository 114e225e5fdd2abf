"""A loaded model with its matrices re-quantized to one packed format: what a quantized self-draft runs
(:mod:`tessera.engine.speculative.draft_model`) and what ``tessera quant-report`` measures
(:mod:`tessera.eval.quant_formats`).

The layer projections (``qkv``, ``o``, ``gate_up``, ``down`` of every layer) are always re-quantized. The token
tables are re-quantized as asked:

``tables="output"``  only the output table: ``lm_head``, or for a tied model a packed copy of the token table as
                     ``lm_head`` while lookups keep the float table (the float table is shared with the source
                     model, so a draft costs no second float copy).
``tables="all"``     the token table too. A tied model then holds one packed table for both the lookup and the
                     logits, as a GGUF file stores it; an untied one holds both tables packed.

Norms, biases and everything else are shared with the source model, not copied. A packed source weight is
de-quantized first, so a Q8_0 file's projections re-quantize to int4 from their own values.
"""

from __future__ import annotations

import torch

from tessera.kernels.quant import QUANTIZABLE, QuantizedWeight, StackedWeight, dequantize, quantize
from tessera.kernels.quant_search import search_int8_scales
from tessera.models.model import Model

#: the per-layer weights that are re-quantized (names ``layers.{i}.{projection}.weight``)
PROJECTIONS = ("qkv", "o", "gate_up", "down")
#: what ``tables`` may be
TABLES = ("output", "all")


def is_projection(name: str) -> bool:
    """Whether ``name`` is one of :data:`PROJECTIONS` of a layer."""
    return name.startswith("layers.") and name.endswith(".weight") and name.rsplit(".", 2)[-2] in PROJECTIONS


def requantize_weight(w: torch.Tensor | QuantizedWeight | StackedWeight, fmt: str, group_size: int | None,
                      backend: str = "auto", *, what: str = "weight", search_scales: bool = False) -> QuantizedWeight:
    """``w`` quantized to ``fmt`` with ``group_size`` (None: per channel), de-quantized first when it is packed.

    Parameters
    ----------
    w : float tensor ``[N, K]``, QuantizedWeight or StackedWeight
    fmt : one of :data:`tessera.kernels.quant.QUANTIZABLE`
    group_size : 32, 64, 128 or None (per channel; the only choice for fp8_e4m3)
    backend : the kernels' backend
    what : how errors name the weight
    search_scales : int8 only: per-group scales from a least-squares search
        (:func:`tessera.kernels.quant_search.search_int8_scales`) instead of ``max|w| / 127``

    Raises
    ------
    ValueError
        ``K`` not a multiple of ``group_size`` (the message names the weight and its shape).
    """
    if isinstance(w, (QuantizedWeight, StackedWeight)):
        w = dequantize(w, backend=backend)
    if group_size is not None and w.shape[1] % group_size:
        raise ValueError(f"{what} of shape {tuple(w.shape)} has K={w.shape[1]}, not a multiple of the group size "
                         f"{group_size}")
    # quantize reads float32, bfloat16 or float16; float32 makes the scales from the exact values
    w = w if w.dtype == torch.float32 else w.float()
    if search_scales and fmt == "int8":
        return search_int8_scales(w, group_size, backend=backend)
    return quantize(w, fmt, group_size, backend=backend)


def requantize_model(model: Model, fmt: str, group_size: int | None, *, tables: str = "output",
                     skip_odd_tables: bool = False, search_scales: bool = False) -> Model:
    """``model`` with its projections and tables quantized to ``fmt`` (see the module docstring for ``tables``).

    Parameters
    ----------
    model : the source model (float or packed weights; left unchanged)
    fmt : one of :data:`tessera.kernels.quant.QUANTIZABLE`
    group_size : 32, 64, 128, or None for per channel (fp8_e4m3 is per channel only)
    tables : ``"output"`` or ``"all"``
    skip_odd_tables : keep a table whose width is not a multiple of ``group_size`` as it is (a self-draft still
        drafts with packed projections) instead of raising
    search_scales : for ``fmt="int8"``, searched per-group scales (:mod:`tessera.kernels.quant_search`: smaller
        error at the same bytes, a few seconds more per 100M weights); other formats ignore it

    Returns
    -------
    Model
        A new :class:`Model` on the same config, tokenizer and backend.

    Raises
    ------
    ValueError
        An unknown ``fmt`` or ``tables``, or a matrix whose K is not a multiple of ``group_size``.
    """
    if fmt not in QUANTIZABLE:
        raise ValueError(f"requantize: format must be one of {list(QUANTIZABLE)}, got {fmt!r}")
    if tables not in TABLES:
        raise ValueError(f"requantize: tables must be one of {list(TABLES)}, got {tables!r}")
    backend = model.backend
    weights = dict(model.weights)
    for name, w in model.weights.items():
        if is_projection(name):
            weights[name] = requantize_weight(w, fmt, group_size, backend, what=name, search_scales=search_scales)
    if tables == "output":  # tied: the logits read a packed copy of the token table, lookups keep the float one
        sources = {"lm_head": model.weights.get("lm_head", model.weights["embed"])}
    else:
        sources = {name: model.weights[name] for name in ("embed", "lm_head") if name in model.weights}
    for name, w in sources.items():
        if skip_odd_tables and group_size is not None and w.shape[1] % group_size:
            continue
        weights[name] = requantize_weight(w, fmt, group_size, backend, what=name, search_scales=search_scales)
    return Model(model.config, weights, model.tokenizer, model.chat_template, model.backend)
