"""Paged attention (``plan(...).run``) as a torch custom op: ``tessera::paged_attention``.

An :class:`~tessera.attention.plan.AttentionPlan` is host state built from one step's lengths and page table, so a
compiled graph cannot hold a plan: every step has a new one. The op therefore takes the step's lengths and page
table as tensors, with the spec as a handle (:mod:`tessera.integrations.spec_handles`), and plans inside. Lengths
and the table are graph inputs, not constants, so one compiled graph serves every step: a new batch composition
does not recompile.

Pages are float tensors in q's dtype (a quantized cache's :class:`~tessera.kv.quantized.QuantizedPages` is not a
tensor and is not accepted here; call ``plan(...).run`` eagerly for those). Forward only: the paged path serves
inference, where no gradient flows into the cache.
"""

from __future__ import annotations

import torch

from tessera.attention.plan import plan
from tessera.attention.spec import AttentionSpec
from tessera.integrations.spec_handles import lookup_spec, spec_handle


@torch.library.custom_op("tessera::paged_attention", mutates_args=())
def paged_attention_op(
    q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, q_lens: torch.Tensor, kv_lens: torch.Tensor,
    page_table: torch.Tensor, sinks: torch.Tensor | None, spec_handle: int, page_size: int, backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``plan(spec, q_lens, kv_lens, page_table, page_size).run(q, k_pages, v_pages, return_lse=True)``.

    Parameters
    ----------
    q : ``[sum(q_lens), Hq, D]``
    k_pages, v_pages : ``[num_pages, page_size, Hkv, D]``, q's dtype and device
    q_lens, kv_lens : integer ``[num_seqs]`` (any device; read on the host)
    page_table : int32 ``[num_seqs, max_pages]`` (read on the host)
    sinks : float ``[Hq]`` or None; spec_handle : from ``register_spec``; page_size : tokens per page;
    backend : "auto" or a backend name

    Returns
    -------
    out ``[sum(q_lens), Hq, D]`` in q's dtype, lse ``[sum(q_lens), Hq]`` float32.
    """
    spec = lookup_spec(spec_handle, None if sinks is None else sinks.detach())
    p = plan(spec, _lengths(q_lens, "q_lens"), _lengths(kv_lens, "kv_lens"), page_table.cpu(), page_size,
             backend=backend)
    return p.run(q.detach(), k_pages.detach(), v_pages.detach(), return_lse=True)


@paged_attention_op.register_fake
def _paged_fake(q, k_pages, v_pages, q_lens, kv_lens, page_table, sinks, spec_handle, page_size, backend):
    spec = lookup_spec(spec_handle)
    if q.dim() != 3 or q.shape[1] != spec.num_q_heads or q.shape[2] != spec.head_dim:
        raise ValueError(f"tessera::paged_attention: q must be [tokens, {spec.num_q_heads}, {spec.head_dim}], got "
                         f"{tuple(q.shape)}")
    want = (page_size, spec.num_kv_heads, spec.head_dim)
    if k_pages.dim() != 4 or tuple(k_pages.shape[1:]) != want or k_pages.shape != v_pages.shape:
        raise ValueError(f"tessera::paged_attention: k_pages and v_pages must be [num_pages, {want[0]}, {want[1]}, "
                         f"{want[2]}], got {tuple(k_pages.shape)} and {tuple(v_pages.shape)}")
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device),
            torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device))


def paged_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, q_lens: torch.Tensor,
                    kv_lens: torch.Tensor, page_table: torch.Tensor, spec: AttentionSpec, page_size: int,
                    backend: str = "auto", return_lse: bool = False):
    """Paged attention through ``tessera::paged_attention``: what to call inside ``torch.compile``d code.

    Same arguments as ``plan`` + ``run``, with the lengths as integer tensors. Build ``spec`` outside the compiled
    code (see docs/integrations.md).
    """
    if not isinstance(spec, AttentionSpec):
        raise TypeError(f"paged_attention: spec must be an AttentionSpec, got {type(spec).__name__}")
    out, lse = torch.ops.tessera.paged_attention(q, k_pages, v_pages, q_lens, kv_lens, page_table, spec.sinks,
                                                 spec_handle(spec), int(page_size), backend)
    return (out, lse) if return_lse else out


def _lengths(t: torch.Tensor, name: str) -> list[int]:
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype.is_floating_point or t.dtype == torch.bool:
        raise TypeError(f"tessera::paged_attention: {name} must be a 1-D integer tensor [num_seqs], got "
                        f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    return [int(x) for x in t.tolist()]
