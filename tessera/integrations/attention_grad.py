"""The backward of attention: gradients of q, k, v and sinks, recomputed in float64 from the spec.

The forward runs the planned fused kernels of the chosen backend; the backward does not have kernels of its own
yet. It recomputes each sequence's attention in float64 with the spec's semantics (score function, then mask,
then softmax with the sinks in the denominator; the same order as the float64 oracle) as a differentiable function
of ``(q, k, v, sinks)`` and pulls the incoming gradients back through it with ``torch.func.vjp``. ``torch.func``
rather than ``torch.autograd.grad`` because this code also runs inside a torch custom op's implementation, where
the autograd dispatch keys are switched off and only functorch's transforms still differentiate.

Cost: it materializes the ``[Hq, q_len, kv_len]`` scores of one sequence at a time in float64 (a few copies of
them), so memory grows with ``q_len * kv_len``: fine for fine-tuning at short and medium lengths, not a long-context
training kernel.
"""

from __future__ import annotations

import torch

from tessera.attention.spec import AttentionSpec


def sequence_forward_f64(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None, spec: AttentionSpec,
    seq_index: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable float64 attention of one sequence.

    Parameters
    ----------
    q : float64 ``[q_len, Hq, D]``; k, v : float64 ``[kv_len, Hkv, D]``
    sinks : float64 ``[Hq]`` or None (``spec.sinks`` is ignored: the sinks to differentiate come in here)
    spec : AttentionSpec (mask, score function, scale, heads)
    seq_index : the batch index ``b`` masks and score functions see

    Returns
    -------
    out float64 ``[q_len, Hq, D]`` and lse float64 ``[q_len, Hq]`` (sinks included; ``-inf`` for a fully masked row
    without sinks, whose output is 0).
    """
    q_len, kv_len = q.shape[0], k.shape[0]
    dev = q.device
    kh = k.repeat_interleave(spec.group_size, dim=1).permute(1, 0, 2)  # [Hq, kv_len, D]
    vh = v.repeat_interleave(spec.group_size, dim=1).permute(1, 0, 2)
    s = torch.matmul(q.permute(1, 0, 2), kh.transpose(1, 2)) * spec.softmax_scale  # [Hq, q_len, kv_len]
    b = torch.tensor(seq_index, device=dev)
    h = torch.arange(spec.num_q_heads, device=dev).view(-1, 1, 1)
    q_pos = torch.arange(kv_len - q_len, kv_len, device=dev).view(1, -1, 1)
    kv_pos = torch.arange(kv_len, device=dev).view(1, 1, -1)
    if spec.score is not None:
        s = spec.score.apply(s, b, h, q_pos, kv_pos).to(torch.float64)
    keep = None
    if spec.mask is not None:
        keep = torch.broadcast_to(spec.mask.evaluate(b, h, q_pos, kv_pos), s.shape)
        # where, not masked_fill on a product: masked entries get exactly zero gradient, never 0 * inf
        s = torch.where(keep, s, float("-inf"))
    # The row maximum only stabilizes the exponentials; lse and out do not depend on it, so it is detached and the
    # gradient stays exact.
    m = s.detach().amax(dim=-1) if kv_len else torch.full(s.shape[:-1], float("-inf"), dtype=s.dtype, device=dev)
    if sinks is not None:
        m = torch.maximum(m, sinks.detach().view(-1, 1))
    m = torch.where(torch.isfinite(m), m, 0.0)
    e = torch.exp(s - m.unsqueeze(-1))
    if keep is not None:
        e = torch.where(keep, e, 0.0)
    denom = e.sum(dim=-1)
    if sinks is not None:
        denom = denom + torch.exp(sinks.view(-1, 1) - m)
    alive = denom > 0
    safe = torch.where(alive, denom, 1.0)
    lse = torch.where(alive, m + torch.log(safe), float("-inf"))
    out = torch.matmul(e / safe.unsqueeze(-1), vh)  # [Hq, q_len, D]
    return out.permute(1, 0, 2), lse.permute(1, 0)


def attention_grads(
    grad_out: torch.Tensor | None,
    grad_lse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor | None,
    spec: AttentionSpec,
    q_lens: tuple[int, ...],
    kv_lens: tuple[int, ...],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gradients of a ragged batch's attention, in float64 then cast to the inputs' dtypes.

    Parameters
    ----------
    grad_out : ``[total_q, Hq, D]`` (any float dtype) or None (no gradient reached the output)
    grad_lse : ``[total_q, Hq]`` or None (no gradient reached the log-sum-exp)
    q : ``[total_q, Hq, D]``; k, v : ``[total_kv, Hkv, D]``, packed along tokens as in ``varlen_attention``
    sinks : ``[Hq]`` float or None
    spec : AttentionSpec (its own ``sinks`` are ignored; ``sinks`` above are the ones differentiated)
    q_lens, kv_lens : per-sequence lengths, ``q_lens[s] <= kv_lens[s]``

    Returns
    -------
    dq ``[total_q, Hq, D]`` in q's dtype, dk and dv ``[total_kv, Hkv, D]`` in k's / v's dtype, and dsinks ``[Hq]``
    in the sinks' dtype (None without sinks).
    """
    f64 = torch.float64
    dq = torch.zeros(q.shape, dtype=f64, device=q.device)
    dk = torch.zeros(k.shape, dtype=f64, device=k.device)
    dv = torch.zeros(v.shape, dtype=f64, device=v.device)
    ds = None if sinks is None else torch.zeros(sinks.shape, dtype=f64, device=sinks.device)
    sinks64 = None if sinks is None else sinks.detach().to(f64)
    q_start = kv_start = 0
    for s, (ql, kl) in enumerate(zip(q_lens, kv_lens)):
        qs, ks = slice(q_start, q_start + ql), slice(kv_start, kv_start + kl)
        q_start, kv_start = q_start + ql, kv_start + kl
        if ql == 0:
            continue
        go = _cotangent(grad_out, qs, (ql, spec.num_q_heads, spec.head_dim), q.device)
        gl = _cotangent(grad_lse, qs, (ql, spec.num_q_heads), q.device)
        primals = [q[qs].detach().to(f64), k[ks].detach().to(f64), v[ks].detach().to(f64)]
        if sinks64 is not None:
            primals.append(sinks64)

        def fn(*xs: torch.Tensor, _s: int = s) -> tuple[torch.Tensor, torch.Tensor]:
            return sequence_forward_f64(xs[0], xs[1], xs[2], xs[3] if len(xs) > 3 else None, spec, _s)

        (_, lse), pullback = torch.func.vjp(fn, *primals)
        # A row with lse = -inf (fully masked, no sinks) has no gradient path; a finite cotangent on it would
        # multiply an infinite derivative.
        gl = torch.where(torch.isfinite(lse), gl, 0.0)
        grads = pullback((go, gl))
        dq[qs] += grads[0]
        dk[ks] += grads[1]
        dv[ks] += grads[2]
        if ds is not None:
            ds += grads[3]
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None if ds is None else ds.to(sinks.dtype))


def _cotangent(grad: torch.Tensor | None, rows: slice, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    if grad is None:
        return torch.zeros(shape, dtype=torch.float64, device=device)
    return grad[rows].to(torch.float64)
