"""Attention as torch custom ops: ``tessera::attention`` (dense), ``tessera::varlen_attention`` (ragged, by
``cu_seqlens``) and their backward ``tessera::attention_backward``.

Each op has a fake implementation (output shapes and dtypes from the inputs alone), so ``torch.compile`` traces
through it without a graph break and ``torch.export`` keeps it as one node, and an autograd formula whose backward is
itself an op (so a compiled backward graph holds one opaque node too, not a trace of the float64 recomputation).

The spec reaches the op as ``spec_handle: int`` (:mod:`tessera.integrations.spec_handles`); sinks travel as a tensor
argument, so they can be a learned parameter with a gradient.

Two callers:

* ``tessera.attention.attention`` / ``varlen_attention`` call :func:`dense_attention` / :func:`ragged_attention`
  while ``torch.compile`` traces them or when an input requires a gradient;
* anyone may call ``torch.ops.tessera.attention(q, k, v, sinks, register_spec(spec), "auto")`` directly.

In eager mode with gradients the same forward and backward run through a ``torch.autograd.Function`` that keeps the
spec object on its context instead of registering it, so a training loop that builds a spec with a custom mask per
step does not grow the process-wide table.
"""

from __future__ import annotations

import dataclasses

import torch

from tessera.attention.api import attention, varlen_attention
from tessera.attention.lengths import ragged_batch
from tessera.attention.spec import AttentionSpec
from tessera.integrations.attention_grad import attention_grads
from tessera.integrations.spec_handles import lookup_spec, spec_handle, without_sinks


# ---- forward ops ---------------------------------------------------------------------------------------------

@torch.library.custom_op("tessera::attention", mutates_args=())
def attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None, spec_handle: int, backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention, ``tessera.attention.attention``'s semantics.

    Parameters
    ----------
    q : ``[B, Sq, Hq, D]``; k, v : ``[B, Skv, Hkv, D]`` (float32 / bfloat16 / float16, one dtype and device)
    sinks : float ``[Hq]`` or None
    spec_handle : int from ``spec_handles.register_spec``
    backend : "auto" or a backend name

    Returns
    -------
    out ``[B, Sq, Hq, D]`` in q's dtype, lse ``[B, Sq, Hq]`` float32 (sinks included).
    """
    spec = lookup_spec(spec_handle, None if sinks is None else sinks.detach())
    return attention(q.detach(), k.detach(), v.detach(), spec, backend=backend, return_lse=True)


@attention_op.register_fake
def _attention_fake(q, k, v, sinks, spec_handle, backend):
    _check_fake(q, k, lookup_spec(spec_handle), ndim=4)
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device),
            torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device))


@torch.library.custom_op("tessera::varlen_attention", mutates_args=())
def varlen_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_kv: torch.Tensor,
    sinks: torch.Tensor | None, spec_handle: int, backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged attention, ``tessera.attention.varlen_attention``'s semantics.

    Parameters
    ----------
    q : ``[total_q, Hq, D]``; k, v : ``[total_kv, Hkv, D]``
    cu_seqlens_q, cu_seqlens_kv : int32/int64 ``[num_seqs + 1]``, cumulative lengths starting at 0 (FlashAttention's
        convention): sequence ``s`` owns q rows ``cu_seqlens_q[s] : cu_seqlens_q[s + 1]``.
    sinks, spec_handle, backend : as in ``tessera::attention``.

    Returns
    -------
    out ``[total_q, Hq, D]`` in q's dtype, lse ``[total_q, Hq]`` float32.
    """
    spec = lookup_spec(spec_handle, None if sinks is None else sinks.detach())
    q_lens, kv_lens = lengths_of(cu_seqlens_q, "cu_seqlens_q"), lengths_of(cu_seqlens_kv, "cu_seqlens_kv")
    return varlen_attention(q.detach(), k.detach(), v.detach(), list(q_lens), list(kv_lens), spec, backend=backend,
                            return_lse=True)


@varlen_attention_op.register_fake
def _varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_kv, sinks, spec_handle, backend):
    _check_fake(q, k, lookup_spec(spec_handle), ndim=3)
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device),
            torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device))


# ---- backward op ---------------------------------------------------------------------------------------------

@torch.library.custom_op("tessera::attention_backward", mutates_args=())
def attention_backward_op(
    grad_out: torch.Tensor, grad_lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    sinks: torch.Tensor | None, cu_seqlens_q: torch.Tensor, cu_seqlens_kv: torch.Tensor, spec_handle: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ragged attention (``attention_grad.attention_grads``: float64 recomputation).

    Parameters
    ----------
    grad_out : ``[total_q, Hq, D]``; grad_lse : ``[total_q, Hq]``
    q, k, v, sinks, cu_seqlens_q, cu_seqlens_kv, spec_handle : the forward's inputs (ragged form)

    Returns
    -------
    dq, dk, dv in the inputs' shapes and dtypes, and dsinks ``[Hq]`` (``[0]`` when there are no sinks: an op
    cannot return None).
    """
    spec = lookup_spec(spec_handle)
    q_lens, kv_lens = lengths_of(cu_seqlens_q, "cu_seqlens_q"), lengths_of(cu_seqlens_kv, "cu_seqlens_kv")
    dq, dk, dv, ds = attention_grads(grad_out, grad_lse, q, k, v, sinks, spec, q_lens, kv_lens)
    return dq, dk, dv, (q.new_zeros(0, dtype=torch.float32) if ds is None else ds)


@attention_backward_op.register_fake
def _backward_fake(grad_out, grad_lse, q, k, v, sinks, cu_seqlens_q, cu_seqlens_kv, spec_handle):
    # contiguous, as attention_grads returns them (empty_like would copy a permuted input's strides)
    ds = torch.empty(0, dtype=torch.float32, device=q.device) if sinks is None else \
        torch.empty(sinks.shape, dtype=sinks.dtype, device=sinks.device)
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v)) + (ds,)


def _setup_dense(ctx, inputs, output) -> None:
    q, k, v, sinks, handle, _backend = inputs
    ctx.save_for_backward(q, k, v, sinks)
    ctx.handle = handle


def _backward_dense(ctx, grad_out, grad_lse):
    q, k, v, sinks = ctx.saved_tensors
    bsz, sq, skv = q.shape[0], q.shape[1], k.shape[1]
    go = torch.zeros_like(q) if grad_out is None else grad_out
    gl = q.new_zeros(q.shape[:-1], dtype=torch.float32) if grad_lse is None else grad_lse
    steps = torch.arange(bsz + 1, device=q.device, dtype=torch.int64)
    dq, dk, dv, ds = torch.ops.tessera.attention_backward(
        go.reshape(bsz * sq, *q.shape[2:]), gl.reshape(bsz * sq, q.shape[2]), q.reshape(bsz * sq, *q.shape[2:]),
        k.reshape(bsz * skv, *k.shape[2:]), v.reshape(bsz * skv, *v.shape[2:]), sinks, steps * sq, steps * skv,
        ctx.handle)
    return (dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape), None if sinks is None else ds, None,
            None)


def _setup_varlen(ctx, inputs, output) -> None:
    q, k, v, cu_q, cu_kv, sinks, handle, _backend = inputs
    ctx.save_for_backward(q, k, v, cu_q, cu_kv, sinks)
    ctx.handle = handle


def _backward_varlen(ctx, grad_out, grad_lse):
    q, k, v, cu_q, cu_kv, sinks = ctx.saved_tensors
    go = torch.zeros_like(q) if grad_out is None else grad_out
    gl = q.new_zeros(q.shape[:-1], dtype=torch.float32) if grad_lse is None else grad_lse
    dq, dk, dv, ds = torch.ops.tessera.attention_backward(go, gl, q, k, v, sinks, cu_q, cu_kv, ctx.handle)
    return dq, dk, dv, None, None, None if sinks is None else ds, None, None


attention_op.register_autograd(_backward_dense, setup_context=_setup_dense)
varlen_attention_op.register_autograd(_backward_varlen, setup_context=_setup_varlen)


# ---- eager autograd (no table entry) -------------------------------------------------------------------------

class _EagerAttention(torch.autograd.Function):
    """Ragged attention with the spec object on the context (eager calls that need a gradient)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, spec, q_lens, kv_lens, backend):
        full = spec if sinks is None else _with_sinks(spec, sinks.detach())
        out, lse = varlen_attention(q.detach(), k.detach(), v.detach(), list(q_lens), list(kv_lens), full,
                                    backend=backend, return_lse=True)
        ctx.save_for_backward(q, k, v, sinks)
        ctx.spec, ctx.lens = spec, (q_lens, kv_lens)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, sinks = ctx.saved_tensors
        dq, dk, dv, ds = attention_grads(grad_out, grad_lse, q, k, v, sinks, ctx.spec, *ctx.lens)
        return dq, dk, dv, ds, None, None, None, None


def _with_sinks(spec: AttentionSpec, sinks: torch.Tensor) -> AttentionSpec:
    return dataclasses.replace(spec, sinks=sinks)


# ---- what tessera.attention's entry points call --------------------------------------------------------------

def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec, backend: str,
                    return_lse: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``tessera.attention.attention`` (arguments already validated) as a differentiable, traceable op.

    Under ``torch.compile`` tracing it emits ``tessera::attention`` with the spec's handle; in eager mode it runs the
    eager autograd function. Shapes as in ``tessera.attention.attention``.
    """
    if torch.compiler.is_compiling():
        out, lse = torch.ops.tessera.attention(q, k, v, spec.sinks, spec_handle(spec), backend)
    else:
        bsz, sq, skv = q.shape[0], q.shape[1], k.shape[1]
        if spec.mask is not None:  # the dense API's length rule (document ids: exactly Skv), before going ragged
            spec.mask.check_lengths(bsz, [skv] * bsz, dense=True)
        out, lse = _EagerAttention.apply(
            q.reshape(bsz * sq, *q.shape[2:]), k.reshape(bsz * skv, *k.shape[2:]),
            v.reshape(bsz * skv, *v.shape[2:]), spec.sinks, without_sinks(spec), (sq,) * bsz, (skv,) * bsz, backend)
        out, lse = out.view(q.shape), lse.view(q.shape[:-1])
    return (out, lse) if return_lse else out


def ragged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_lens, kv_lens, spec: AttentionSpec,
                     backend: str, return_lse: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``tessera.attention.varlen_attention`` (tensors validated) as a differentiable, traceable op.

    ``q_lens`` / ``kv_lens``: lists of ints or 1-D int tensors. Under ``torch.compile``, int tensors keep the lengths
    out of the graph's guards (a list's values are constants of the compiled graph: new values recompile).
    """
    if torch.compiler.is_compiling():
        cu_q, cu_kv = cu_seqlens(q_lens, q.device), cu_seqlens(kv_lens, q.device)
        out, lse = torch.ops.tessera.varlen_attention(q, k, v, cu_q, cu_kv, spec.sinks, spec_handle(spec), backend)
    else:
        batch = ragged_batch(q_lens, kv_lens, spec, "varlen_attention")
        if batch.total_q != q.shape[0] or batch.total_kv != k.shape[0]:
            raise ValueError(
                f"varlen_attention: sum(q_lens) = {batch.total_q} and sum(kv_lens) = {batch.total_kv} must equal the "
                f"token counts of q ({q.shape[0]}) and k/v ({k.shape[0]})")
        out, lse = _EagerAttention.apply(q, k, v, spec.sinks, without_sinks(spec), batch.q_lens, batch.kv_lens,
                                         backend)
    return (out, lse) if return_lse else out


# ---- helpers -------------------------------------------------------------------------------------------------

def cu_seqlens(lens, device: torch.device) -> torch.Tensor:
    """int64 ``[n + 1]`` cumulative lengths (0 first) of a list of ints or a 1-D int tensor."""
    t = lens if isinstance(lens, torch.Tensor) else torch.tensor(list(lens), dtype=torch.int64)
    t = t.to(device=device, dtype=torch.int64)
    return torch.cat([t.new_zeros(1), torch.cumsum(t, dim=0)])


def lengths_of(cu: torch.Tensor, name: str) -> tuple[int, ...]:
    """Per-sequence lengths from cumulative ``cu`` ``[n + 1]`` (validated: 1-D integer, starts at 0,
    non-decreasing)."""
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype.is_floating_point or cu.dtype == torch.bool \
            or cu.numel() < 1:
        raise TypeError(f"{name} must be a 1-D integer tensor [num_seqs + 1] of cumulative lengths starting at 0, "
                        f"got {getattr(cu, 'dtype', type(cu).__name__)} {tuple(getattr(cu, 'shape', ()))}")
    values = cu.tolist()
    if values[0] != 0 or any(b < a for a, b in zip(values, values[1:])):
        raise ValueError(f"{name} must start at 0 and never decrease (cumulative lengths), got {values}")
    return tuple(b - a for a, b in zip(values, values[1:]))


def _check_fake(q: torch.Tensor, k: torch.Tensor, spec: AttentionSpec, ndim: int) -> None:
    """Shape checks that need no values, so a traced graph fails at trace time, as eager would."""
    layout = "[B, S, H, D]" if ndim == 4 else "[tokens, H, D]"
    if q.dim() != ndim or k.dim() != ndim:
        raise ValueError(f"tessera attention op: q and k must be {layout}, got {tuple(q.shape)} and {tuple(k.shape)}")
    if q.shape[-2] != spec.num_q_heads or k.shape[-2] != spec.num_kv_heads or q.shape[-1] != spec.head_dim:
        raise ValueError(f"tessera attention op: q {tuple(q.shape)} / k {tuple(k.shape)} do not match {spec!r} "
                         f"(heads and head_dim); layout is {layout}")
