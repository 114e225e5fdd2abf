"""Plan once per step, run per layer: batched attention over a paged KV cache.

``plan`` does the host-side work of a step once (validation, routing of each sequence to a kernel, block-sparse tile
lists, masks of partial tiles, split-KV work items); ``AttentionPlan.run`` then runs one layer. Plans depend on
lengths and the page table, never on tensor values, so every layer with the same spec reuses one plan.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from tessera.attention.lengths import ragged_batch
from tessera.attention.execute import execute
from tessera.attention.spec import AttentionSpec
from tessera.backends.base import DEFAULT_PLAN_OPTIONS, AttentionRequest, KVLayout, PlanOptions, RaggedBatch
from tessera.backends.registry import select
from tessera.dtypes import FLOAT_DTYPES
from tessera.kv.quantized import QuantizedPages


class AttentionPlan:
    """A planned step; call :meth:`run` once per layer. Build it with :func:`plan`."""

    def __init__(self, spec: AttentionSpec, batch: RaggedBatch, page_table: np.ndarray, page_size: int,
                 backend_name: str, options: PlanOptions = DEFAULT_PLAN_OPTIONS) -> None:
        self.spec, self.batch, self.page_size, self.options = spec, batch, page_size, options
        self._layout = KVLayout.paged(page_table, page_size)
        self._page_table = page_table
        self._used: torch.Tensor | None = None  # pages read, for de-quantizing only those (see run)
        used = [page_table[s, : math.ceil(kl / page_size)] for s, kl in enumerate(batch.kv_lens)]
        self._max_page = max((int(u.max()) for u in used if u.size), default=-1)
        self._backend_name = backend_name
        self._backend = None
        self._state = None

    def run(
        self, q: torch.Tensor, k_pages: torch.Tensor | QuantizedPages, v_pages: torch.Tensor | QuantizedPages,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attention of every planned sequence against its pages.

        Parameters
        ----------
        q : torch.Tensor ``[sum(q_lens), Hq, D]``
        k_pages, v_pages : ``[num_pages, page_size, Hkv, D]``: tensors in q's dtype and device, or both
            :class:`~tessera.kv.quantized.QuantizedPages` of one format (a quantized ``PagedKVCache``). A backend
            whose plan reads quantized rows itself (``reads_quantized_kv``) gets them as they are; for any other,
            the pages the plan reads are de-quantized to q's dtype first.
        return_lse : also return the log-sum-exp ``[sum(q_lens), Hq]`` float32 (sinks included).

        Returns
        -------
        ``[sum(q_lens), Hq, D]`` in q's dtype (and lse when asked).
        """
        self._check(q, k_pages, v_pages)
        self.backend_state(q.dtype, q.device)
        if isinstance(k_pages, QuantizedPages):
            reads = getattr(self._backend, "reads_quantized_kv", None)
            if reads is None or not reads(self._state, k_pages.fmt):
                used = self._used_pages(k_pages.device)
                k_pages, v_pages = k_pages.dequantize(q.dtype, used), v_pages.dequantize(q.dtype, used)
        rows_shape = (-1, self.spec.num_kv_heads, self.spec.head_dim)
        out, lse = execute(self._backend, self._state, self.spec, q, k_pages.reshape(rows_shape),
                           v_pages.reshape(rows_shape), self.batch.total_q)
        return (out, lse) if return_lse else out

    def _used_pages(self, device: torch.device) -> torch.Tensor:
        """int64 ids of the pages this plan reads (computed once)."""
        if self._used is None or self._used.device != device:
            table, size = self._page_table, self.page_size
            ids = [np.asarray(table[s, : math.ceil(kl / size)]) for s, kl in enumerate(self.batch.kv_lens)]
            flat = np.unique(np.concatenate(ids)) if ids else np.zeros(0, dtype=np.int64)
            self._used = torch.from_numpy(flat.astype(np.int64)).to(device)
        return self._used

    def backend_state(self, dtype: torch.dtype, device: torch.device) -> tuple[object, object]:
        """``(backend, its plan)`` for tensors of ``dtype`` on ``device``: chosen and planned on the first call.

        For callers that fuse attention into a larger kernel of the same backend (``tessera.backends.cpu.ops.fused_decode``).
        """
        if self._backend is None:
            self._backend = select(AttentionRequest(self.spec, dtype, device, layout="paged"), self._backend_name)
            self._state = self._backend.plan(self.spec, self.batch, self._layout, self.options)
        return self._backend, self._state

    def _check(self, q: torch.Tensor, k_pages, v_pages) -> None:
        spec, where = self.spec, "AttentionPlan.run"
        quantized = isinstance(k_pages, QuantizedPages)
        if quantized or isinstance(v_pages, QuantizedPages):
            if not (quantized and isinstance(v_pages, QuantizedPages)) or k_pages.fmt != v_pages.fmt:
                raise TypeError(f"{where}: k_pages and v_pages must both be QuantizedPages of one format or both "
                                f"tensors, got {_describe(k_pages)} and {_describe(v_pages)}")
            if not isinstance(q, torch.Tensor) or q.dtype not in FLOAT_DTYPES:
                raise TypeError(f"{where}: q must be a float32/bfloat16/float16 tensor, got {_describe(q)}")
        else:
            for name, t in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
                if not isinstance(t, torch.Tensor) or t.dtype not in FLOAT_DTYPES:
                    raise TypeError(f"{where}: {name} must be a float32/bfloat16/float16 tensor, got "
                                    f"{getattr(t, 'dtype', type(t))}")
            if q.dtype != k_pages.dtype or k_pages.dtype != v_pages.dtype:
                raise TypeError(f"{where}: q, k_pages, v_pages must share one dtype, got {q.dtype}, "
                                f"{k_pages.dtype}, {v_pages.dtype}")
        if tuple(q.shape) != (self.batch.total_q, spec.num_q_heads, spec.head_dim):
            raise ValueError(f"{where}: q must be [sum(q_lens), Hq, D] = "
                             f"{[self.batch.total_q, spec.num_q_heads, spec.head_dim]}, got {list(q.shape)}")
        want = (self.page_size, spec.num_kv_heads, spec.head_dim)
        if k_pages.dim() != 4 or tuple(k_pages.shape[1:]) != want or k_pages.shape != v_pages.shape:
            raise ValueError(f"{where}: k_pages and v_pages must both be [num_pages, {', '.join(map(str, want))}] "
                             f"(page_size, Hkv, D), got {list(k_pages.shape)} and {list(v_pages.shape)}")
        if self._max_page >= k_pages.shape[0]:
            raise ValueError(f"{where}: the page table uses page {self._max_page} but the cache has only "
                             f"{k_pages.shape[0]} pages")


def _describe(t) -> str:
    if isinstance(t, QuantizedPages):
        return f"QuantizedPages({t.fmt})"
    return str(getattr(t, "dtype", type(t).__name__))


def plan(
    spec: AttentionSpec,
    q_lens: list[int] | torch.Tensor,
    kv_lens: list[int] | torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    *,
    backend: str = "auto",
    shared_prefix: bool = True,
) -> AttentionPlan:
    """Plan one step of batched attention over a paged KV cache.

    Parameters
    ----------
    spec : AttentionSpec
    q_lens, kv_lens : list of int or int tensor ``[batch]``; ``q_lens[s] <= kv_lens[s]``
        Sequence ``s`` has ``kv_lens[s]`` tokens in the cache, the last ``q_lens[s]`` of which are its queries (prefill
        of a new prompt: q = kv; after a cached prefix or in chunked prefill: q < kv; decode: q = 1; verification: 2-8).
    page_table : int32 tensor ``[batch, max_pages]``
        Row ``s`` lists sequence ``s``'s pages in order; entries past ``ceil(kv_lens[s] / page_size)`` are ignored.
    page_size : tokens per page.
    backend : "auto" or a backend name.
    shared_prefix : bool
        Let the backend attend to pages that several sequences share (the same page ids at the start of their tables)
        once for all of them, as a cascade (see :class:`~tessera.backends.base.PlanOptions`); False reads every
        sequence's cache on its own. Results agree to float32 rounding either way.

    Examples
    --------
    >>> p = plan(spec, q_lens=[5, 1], kv_lens=[5, 300], page_table=table, page_size=16)
    >>> for layer in range(num_layers):
    ...     out = p.run(q[layer], cache.k_pages[layer], cache.v_pages[layer])
    """
    if not isinstance(spec, AttentionSpec):
        raise TypeError(f"plan: spec must be an AttentionSpec, got {type(spec).__name__}")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"plan: page_size must be an int >= 1, got {page_size!r}")
    batch = ragged_batch(q_lens, kv_lens, spec, "plan")
    table = _check_page_table(page_table, batch.kv_lens, page_size)
    if not isinstance(shared_prefix, bool):
        raise TypeError(f"plan: shared_prefix must be a bool, got {shared_prefix!r}")
    return AttentionPlan(spec, batch, table, page_size, backend, PlanOptions(shared_prefix=shared_prefix))


def _check_page_table(page_table: torch.Tensor, kv_lens: tuple[int, ...], page_size: int) -> np.ndarray:
    if not isinstance(page_table, torch.Tensor) or page_table.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"plan: page_table must be an int32 tensor [batch, max_pages], got "
                        f"{getattr(page_table, 'dtype', type(page_table).__name__)}")
    if page_table.dim() != 2 or page_table.shape[0] != len(kv_lens):
        raise ValueError(f"plan: page_table must be [batch, max_pages] with batch = {len(kv_lens)}, got "
                         f"{list(page_table.shape)}")
    table = page_table.detach().cpu().numpy().astype(np.int64)
    for s, kl in enumerate(kv_lens):
        need = math.ceil(kl / page_size)
        if need > table.shape[1]:
            raise ValueError(f"plan: sequence {s} needs {need} pages for {kl} tokens at page_size {page_size}, but "
                             f"page_table has {table.shape[1]} columns")
        if need and table[s, :need].min() < 0:
            raise ValueError(f"plan: sequence {s} has a negative page id among its first {need} pages")
    return table
