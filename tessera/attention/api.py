"""The public entry points: dense and ragged attention, validated at the boundary, dispatched to a backend."""

from __future__ import annotations

import torch

from tessera.attention.execute import execute
from tessera.attention.lengths import ragged_batch
from tessera.attention.plan_cache import PlanCache
from tessera.attention.spec import AttentionSpec
from tessera.backends.base import AttentionRequest, KVLayout, RaggedBatch
from tessera.backends.registry import select
from tessera.dtypes import FLOAT_DTYPES


#: Plans of the dense / ragged entry points (see PlanCache for why they are reused).
PLANS = PlanCache()


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spec: AttentionSpec,
    *,
    backend: str = "auto",
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over a dense batch.

    Parameters
    ----------
    q : torch.Tensor ``[B, Sq, Hq, D]``
    k, v : torch.Tensor ``[B, Skv, Hkv, D]``, same dtype and device as q; ``Sq <= Skv``
        Queries are the last ``Sq`` positions of the kv: query ``i`` sits at absolute position ``Skv - Sq + i``.
    spec : AttentionSpec
    backend : "auto", "reference", "cpu", "triton", ...
    return_lse : also return the log-sum-exp ``[B, Sq, Hq]`` float32.

    Returns
    -------
    ``[B, Sq, Hq, D]`` in q's dtype (and lse when asked).

    Notes
    -----
    Under ``torch.compile`` this traces as one ``tessera::attention`` op (no graph break); when q, k, v or the sinks
    require a gradient it is differentiable (the backward recomputes in float64). docs/integrations.md has both.

    Examples
    --------
    >>> spec = AttentionSpec(32, 8, 128, mask=causal())
    >>> out = attention(q, k, v, spec)
    """
    _check_tensors(q, k, v, spec, ndim=4)
    bsz, sq, skv = q.shape[0], q.shape[1], k.shape[1]
    if k.shape[0] != bsz:
        raise ValueError(f"attention: q has batch {bsz} but k/v have batch {k.shape[0]}; they must match")
    if sq > skv:
        raise ValueError(
            f"attention: Sq ({sq}) > Skv ({skv}). Queries are the last Sq positions of the kv, so the kv must "
            "include them: append the new tokens' k/v before attending"
        )
    if _torch_op_needed(q, k, v, spec):
        return _torch_ops().dense_attention(q, k, v, spec, backend, return_lse)
    batch = RaggedBatch((sq,) * bsz, (skv,) * bsz)
    if spec.mask is not None:
        spec.mask.check_lengths(bsz, list(batch.kv_lens), dense=True)
    out, lse = _run(q.reshape(bsz * sq, *q.shape[2:]), k.reshape(bsz * skv, *k.shape[2:]),
                    v.reshape(bsz * skv, *v.shape[2:]), batch, spec, backend)
    out = out.view(bsz, sq, *q.shape[2:])
    return (out, lse.view(bsz, sq, spec.num_q_heads)) if return_lse else out


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_lens: list[int] | torch.Tensor,
    kv_lens: list[int] | torch.Tensor,
    spec: AttentionSpec,
    *,
    backend: str = "auto",
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over a ragged batch packed along the token dimension.

    Parameters
    ----------
    q : torch.Tensor ``[sum(q_lens), Hq, D]``
    k, v : torch.Tensor ``[sum(kv_lens), Hkv, D]``
    q_lens, kv_lens : list of int or 1-D int tensor ``[num_seqs]``, ``q_lens[s] <= kv_lens[s]``
        Sequence ``s``'s queries sit at its last ``q_lens[s]`` kv positions.
    spec, backend, return_lse : as in :func:`attention`.

    Returns
    -------
    ``[sum(q_lens), Hq, D]`` in q's dtype (and lse ``[sum(q_lens), Hq]`` float32 when asked).

    Notes
    -----
    Traceable by ``torch.compile`` (``tessera::varlen_attention``; pass the lengths as int tensors so new lengths
    do not recompile) and differentiable, as :func:`attention`.
    """
    _check_tensors(q, k, v, spec, ndim=3)
    if _torch_op_needed(q, k, v, spec):
        return _torch_ops().ragged_attention(q, k, v, q_lens, kv_lens, spec, backend, return_lse)
    batch = ragged_batch(q_lens, kv_lens, spec, "varlen_attention")
    if batch.total_q != q.shape[0] or batch.total_kv != k.shape[0]:
        raise ValueError(
            f"varlen_attention: sum(q_lens) = {batch.total_q} and sum(kv_lens) = {batch.total_kv} must equal the "
            f"token counts of q ({q.shape[0]}) and k/v ({k.shape[0]})"
        )
    out, lse = _run(q, k, v, batch, spec, backend)
    return (out, lse) if return_lse else out


def _torch_op_needed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec) -> bool:
    """While ``torch.compile`` traces, or when an input wants a gradient, attention runs as the ``tessera::attention``
    custom op (tessera/integrations/attention_ops.py): the kernels below are opaque to Dynamo and have no autograd."""
    if torch.compiler.is_compiling():
        return True
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or (
        spec.sinks is not None and spec.sinks.requires_grad))


def _torch_ops():
    # Imported on first use: the custom ops import this module, and plain inference never needs them.
    from tessera.integrations import attention_ops

    return attention_ops


def _run(q, k, v, batch: RaggedBatch, spec: AttentionSpec, backend: str):
    # Tensors that require a gradient reach here only under no_grad (else the op above runs); kernels read NumPy
    # views, which torch refuses on such tensors.
    q, k, v = q.detach(), k.detach(), v.detach()
    chosen = select(AttentionRequest(spec, q.dtype, q.device), backend)
    if batch.total_q == 0:
        empty = q.new_empty(q.shape)
        return empty, torch.empty(q.shape[0], spec.num_q_heads, dtype=torch.float32, device=q.device)
    state = _plan(chosen, spec, batch)
    return execute(chosen, state, spec, q, k, v, batch.total_q)


def _plan(chosen, spec: AttentionSpec, batch: RaggedBatch):
    """``chosen.plan`` for a contiguous batch, reused for specs of the same structure and the same lengths."""
    return PLANS.get(chosen.name, spec, batch, lambda: chosen.plan(spec, batch, KVLayout.contiguous(batch)))


def _check_tensors(q, k, v, spec: AttentionSpec, ndim: int) -> None:
    layout = "[B, S, H, D]" if ndim == 4 else "[tokens, H, D]"
    if not isinstance(spec, AttentionSpec):
        raise TypeError(f"spec must be an AttentionSpec, got {type(spec).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != ndim:
            raise ValueError(f"{name} must be {layout} ({ndim} dims), got shape {tuple(t.shape)}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; supported storage dtypes are float32, bfloat16, float16")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}; cast them first")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[-2] != spec.num_q_heads or k.shape[-2] != spec.num_kv_heads:
        raise ValueError(
            f"head counts differ from the spec: q has {q.shape[-2]} heads (spec.num_q_heads={spec.num_q_heads}), "
            f"k/v have {k.shape[-2]} (spec.num_kv_heads={spec.num_kv_heads}); layout is {layout}"
        )
    if q.shape[-1] != spec.head_dim or k.shape[-1] != spec.head_dim:
        raise ValueError(
            f"head_dim differs: spec says {spec.head_dim}, q has {q.shape[-1]}, k/v have {k.shape[-1]}"
        )
