"""Logits of whole windows computed through a paged KV cache, so a KV cache format's effect on quality is measured
(``tessera.eval.perplexity`` with ``kv_cache_dtype``).

``Model.logits`` attends over K/V it keeps in the model's dtype. Here each window is one sequence of a prefill
step over a fresh :class:`~tessera.kv.cache.PagedKVCache`: every layer writes the window's K/V into its pages (int8
or e4m3 codes for a quantized cache, quantized as written) and attention reads them back from the pages, as the
engine's prefill does. A window's own keys go through the cache too, so every score of every position uses the
format's K/V.
"""

from __future__ import annotations

import math

import torch

from tessera.models.model import Model
from tessera.models.paged import StepBatch, forward_step, new_cache


class CacheLogits:
    """``window_logits(windows)`` through a paged cache in ``kv_cache_dtype`` (None: the model's dtype).

    Parameters
    ----------
    model : Model
    kv_cache_dtype : None, "int8" or "fp8_e4m3"
    page_size : tokens per page.

    The cache is sized on the first call (for the batch of windows it gets) and reused: each call overwrites the
    same pages, so nothing of one batch is visible to the next.
    """

    def __init__(self, model: Model, kv_cache_dtype: str | None = None, page_size: int = 16) -> None:
        self.model, self.kv_cache_dtype, self.page_size = model, kv_cache_dtype, page_size
        self._cache = None

    @torch.no_grad()
    def __call__(self, windows: torch.Tensor) -> torch.Tensor:
        """``windows`` int64 ``[b, ctx]`` -> float32 logits ``[b, ctx, vocab]``."""
        if windows.dim() != 2 or windows.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"CacheLogits: windows must be int [b, ctx], got {windows.dtype} {list(windows.shape)}")
        b, ctx = windows.shape
        pages = math.ceil(ctx / self.page_size)
        if self._cache is None or self._cache.num_pages < b * pages:
            self._cache = new_cache(self.model, b * pages, self.page_size, self.kv_cache_dtype)
        table = torch.arange(b * pages, dtype=torch.int32).view(b, pages)
        pos = torch.arange(ctx)
        slots = (table[:, pos // self.page_size].long() * self.page_size + pos % self.page_size).reshape(-1)
        device = self.model.device
        step = StepBatch(windows.reshape(-1).to(device, torch.int64), [ctx] * b, [ctx] * b, table, slots.to(device))
        return forward_step(self.model, self._cache, step, all_logits=True).view(b, ctx, -1)
