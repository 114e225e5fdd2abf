"""Token embedding lookup and the tied output projection (LM head).

``embed`` gathers rows of the embedding table, optionally scaled (Gemma multiplies by ``sqrt(hidden)`` rounded to the
table dtype: pass ``scale=gemma_embed_scale(hidden, dtype)``). ``lm_head`` computes float32 logits against the same
table (tied weights), with Gemma 2's optional final-logit softcap. ``docs/kernels/embedding.md`` has details.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from tessera.dtypes import FLOAT_DTYPES
from tessera.kernels import registry

if TYPE_CHECKING:  # for annotations only: the functions import it where they use it, as before
    from tessera.kernels.quant import QuantizedWeight

ID_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)


def embed(ids: torch.Tensor, table: torch.Tensor | QuantizedWeight, *, scale: float | None = None, dtype: torch.dtype | None = None,
          backend: str = "auto") -> torch.Tensor:
    """Embedding lookup ``out[...] = table[ids[...]] * scale`` (scale applied in float32, rounded once).

    Parameters
    ----------
    ids : torch.Tensor ``[...]``, int64 / int32 / int16 / uint8, every id in ``[0, V)``
    table : torch.Tensor ``[V, H]``, float32 / bfloat16 / float16, same device as ids; or a packed
        :class:`tessera.kernels.quant.QuantizedWeight` ``[V, H]`` (a GGUF file's quantized token table, kept as
        llama.cpp keeps it): only the looked-up rows are de-quantized, to ``dtype``
    scale : float, optional. Gemma: ``gemma_embed_scale(H, table.dtype)`` (``sqrt(H)`` rounded to the table dtype,
        as Hugging Face's ``torch.tensor(H ** 0.5, dtype=dtype)``).
    dtype : torch.dtype, optional. The output dtype of a packed table (default float32); a float table's own dtype
        otherwise (passing another raises).
    backend : "auto", "reference", "cpu" or "triton"

    Returns
    -------
    ``[..., H]`` in the table's dtype (``dtype`` for a packed table).

    Raises
    ------
    IndexError when an id is negative or >= V (the message names it).

    Examples
    --------
    >>> h = embed(torch.tensor([[1, 2, 3]]), wte)                                  # [1, 3, H]
    >>> h = embed(ids, emb, scale=gemma_embed_scale(emb.shape[1], emb.dtype))     # Gemma
    """
    from tessera.kernels.quant import QuantizedWeight

    packed = isinstance(table, QuantizedWeight)
    if not packed:
        _check_table("embed", table)
        if dtype is not None and dtype != table.dtype:
            raise TypeError(f"embed: dtype {dtype} differs from the float table's {table.dtype}; cast the table")
    if not isinstance(ids, torch.Tensor) or ids.dtype not in ID_DTYPES:
        got = ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise TypeError(f"embed: ids must be an integer tensor (int64, int32, int16 or uint8), got {got}")
    if ids.device != table.device:
        raise ValueError(f"embed: ids are on {ids.device} but the table is on {table.device}; move them together")
    if scale is not None and not math.isfinite(scale):
        raise ValueError(f"embed: scale must be a finite float or None, got {scale}")
    _check_ids_in_range(ids, table.shape[0])
    if packed:
        return _embed_packed(ids, table, scale, dtype or torch.float32, backend)
    return registry.resolve("embed", backend, table.device)(ids, table, None if scale is None else float(scale))


def _embed_packed(ids: torch.Tensor, table: QuantizedWeight, scale: float | None, dtype: torch.dtype,
                  backend: str) -> torch.Tensor:
    """The rows of a packed table, de-quantized and rounded to ``dtype`` (the value a float table loaded in that
    dtype holds), then scaled in float32 and rounded once, as the float path does."""
    from tessera.kernels.quant import dequantize

    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"embed: dtype must be one of {FLOAT_DTYPES}, got {dtype}")
    index = ids.reshape(-1).to(torch.int64)
    # a backend's own row de-quantization where it has one (the same values; None for a format it does not take)
    direct = registry.resolve_optional("embed_packed", backend, table.device)
    rows = direct(index, table, dtype) if direct is not None else None
    if rows is None:
        rows = dequantize(table.rows(index), backend=backend).to(dtype)
    if scale is not None:
        rows = (rows.float() * float(scale)).to(dtype)
    return rows.reshape(*ids.shape, table.shape[1])


#: a packed table's rows go through ``qmatmul`` in chunks of this many when there are at most ROW_CHUNK_UP_TO
ROW_CHUNK = 16
ROW_CHUNK_UP_TO = 128
#: above ROW_CHUNK_UP_TO rows, a packed table is de-quantized to float32 this many bytes of rows at a time (a tile
#: that stays in cache; the whole float table is never held) for a float32 GEMM
FLOAT_TILE_BYTES = 8 << 20


def lm_head(hidden: torch.Tensor, table: torch.Tensor, *, softcap: float | None = None,
            backend: str = "auto") -> torch.Tensor:
    """Tied output projection ``logits = hidden @ table.T`` accumulated in float32, optionally soft-capped
    ``cap * tanh(logits / cap)`` (Gemma 2's ``final_logit_softcapping``).

    Parameters
    ----------
    hidden : torch.Tensor ``[..., H]``, float32 / bfloat16 / float16
    table : torch.Tensor ``[V, H]``, float32 / bfloat16 / float16 (the embedding table), same device; or a packed
        :class:`tessera.kernels.quant.QuantizedWeight` ``[V, H]`` (a GGUF file's Q8_0 / Q4_x output table kept
        packed), which runs :func:`tessera.kernels.quant.qmatmul`
    softcap : float > 0, optional
    backend : "auto", "reference", "cpu" or "triton"

    Returns
    -------
    ``[..., V]`` float32 logits.

    Examples
    --------
    >>> logits = lm_head(final_norm_out[-1:], wte)          # [1, V] float32
    """
    from tessera.kernels.quant import QuantizedWeight, qmatmul

    packed = isinstance(table, QuantizedWeight)
    if not packed:
        _check_table("lm_head", table)
    if not isinstance(hidden, torch.Tensor) or hidden.dtype not in FLOAT_DTYPES:
        got = hidden.dtype if isinstance(hidden, torch.Tensor) else type(hidden).__name__
        raise TypeError(f"lm_head: hidden must be a float32, bfloat16 or float16 tensor, got {got}")
    if hidden.dim() < 1 or hidden.shape[-1] != table.shape[1]:
        raise ValueError(f"lm_head: hidden must be [..., H] with H = {table.shape[1]} (the table's width), got "
                         f"shape {tuple(hidden.shape)}")
    if hidden.device != table.device:
        raise ValueError(f"lm_head: hidden is on {hidden.device} but the table on {table.device}; move them together")
    if softcap is not None and not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"lm_head: softcap must be a finite float > 0 or None, got {softcap}")
    cap = None if softcap is None else float(softcap)
    if packed:  # the read of a packed table is 4-8x smaller than the float one's; logits are float32 either way
        h = hidden.reshape(-1, table.shape[1])
        if ROW_CHUNK < h.shape[0] <= ROW_CHUNK_UP_TO:
            # A speculative verification step asks for up to 16 x 8 rows. A backend may change kernels with the row
            # count (the cpu one leaves its row-by-row GEMV above 16 to 64 rows, by format), and the other kernel
            # rounds differently, so a drafted token's logits would depend on the batch; chunks keep every row on
            # the small-M kernel, whose rows do not depend on each other (tests/engine/test_speculative.py).
            logits = torch.cat([qmatmul(h[r:r + ROW_CHUNK], table, backend=backend).float()
                                for r in range(0, h.shape[0], ROW_CHUNK)])
        elif h.shape[0] > ROW_CHUNK_UP_TO:
            logits = _float_tiles_logits(h, table, backend)
        else:
            logits = qmatmul(h, table, backend=backend).float()
        logits = logits if cap is None else cap * torch.tanh(logits / cap)
        return logits.view(*hidden.shape[:-1], table.shape[0])
    return registry.resolve("lm_head", backend, table.device)(hidden, table, cap)


def _float_tiles_logits(h: torch.Tensor, table: QuantizedWeight, backend: str) -> torch.Tensor:
    """Float32 logits ``h @ dequantize(table).T`` for many rows (a prompt's or a perplexity window's every position),
    through float32 tiles of the table.

    ``qmatmul`` would take the backend's many-row kernel, and the cpu one's bf16 variant (``qgemm=avx512_bf16``)
    rounds its outputs to bf16: harmless for a layer's activations, but a logit of 20 then lands on a grid of 1/8, an
    error that dominates the KL divergence of an otherwise exact model (SmolLM2's packed GGUF against its
    de-quantized weights: two thirds of what its bf16 prefill kernels cost; docs/quantization.md, Quant report). The
    tiles cost a float GEMM; only callers that want every position's logits pay it (generation asks for the last
    position's, speculative verification for at most ROW_CHUNK_UP_TO rows).
    """
    from tessera.kernels.quant import dequantize, matmul

    vocab, width = table.shape
    x = h.float().contiguous()
    logits = torch.empty(x.shape[0], vocab, dtype=torch.float32, device=x.device)
    rows = max(1, FLOAT_TILE_BYTES // (4 * width))
    for v0 in range(0, vocab, rows):
        v1 = min(vocab, v0 + rows)
        tile = dequantize(table.rows(torch.arange(v0, v1, device=table.device)), backend=backend)
        logits[:, v0:v1] = matmul(x, tile, backend=backend)
    return logits


def gemma_embed_scale(hidden_size: int, dtype: torch.dtype) -> float:
    """Gemma's embedding normalizer: ``sqrt(hidden_size)`` rounded to ``dtype`` (e.g. 48.0 for 2304 in bf16)."""
    return float(torch.tensor(hidden_size**0.5, dtype=dtype))


def _check_table(op: str, table: torch.Tensor) -> None:
    if not isinstance(table, torch.Tensor) or table.dtype not in FLOAT_DTYPES:
        got = table.dtype if isinstance(table, torch.Tensor) else type(table).__name__
        raise TypeError(f"{op}: table must be a float32, bfloat16 or float16 tensor, got {got}")
    if table.dim() != 2 or table.shape[0] == 0:
        raise ValueError(f"{op}: table must be [V, H] with V >= 1, got shape {tuple(table.shape)}")


def _check_ids_in_range(ids: torch.Tensor, vocab: int) -> None:
    if ids.numel() == 0:
        return
    lo, hi = torch.aminmax(ids)
    lo, hi = int(lo), int(hi)
    if lo < 0 or hi >= vocab:
        bad = lo if lo < 0 else hi
        where = tuple(int(i) for i in (ids == bad).nonzero()[0])
        raise IndexError(f"embed: token id {bad} at index {where} is out of range for a table of {vocab} rows "
                         f"(ids must lie in [0, {vocab})); check the tokenizer's vocab size against the model's")
