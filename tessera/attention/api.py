"""The public entry points: dense and ragged attention, validated at the boundary, dispatched to a backend."""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from tessera.attention import masks
from tessera.attention.execute import execute
from tessera.attention.scores import Softcap
from tessera.attention.spec import AttentionSpec
from tessera.backends.base import AttentionRequest, KVLayout, RaggedBatch, select
from tessera.dtypes import FLOAT_DTYPES


#: Recent cpu plans of the dense / ragged entry points, keyed by (spec object, lengths): a model calls attention
#: layer after layer with one spec and the same lengths, and planning costs ~0.15-0.35 ms per call on this machine
#: (4% of a B=8, L=4096 decode). Only specs whose plan depends on nothing a caller could change in place qualify.
_PLANS: OrderedDict = OrderedDict()
_PLAN_CACHE_SIZE = 8
_PLANS_LOCK = threading.Lock()  # the server may call attention from several threads
_PURE_MASKS = (masks._Causal, masks._SlidingWindow, masks._Chunked, masks._PrefixLM)


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
    """
    _check_tensors(q, k, v, spec, ndim=3)
    q_lens_t, kv_lens_t = as_lengths(q_lens, "q_lens"), as_lengths(kv_lens, "kv_lens")
    if len(q_lens_t) != len(kv_lens_t):
        raise ValueError(f"varlen_attention: {len(q_lens_t)} q_lens but {len(kv_lens_t)} kv_lens; give one of each per sequence")
    for s, (ql, kl) in enumerate(zip(q_lens_t, kv_lens_t)):
        if ql > kl:
            raise ValueError(f"varlen_attention: sequence {s} has q_len {ql} > kv_len {kl}; the kv must include the queries")
    if sum(q_lens_t) != q.shape[0] or sum(kv_lens_t) != k.shape[0]:
        raise ValueError(
            f"varlen_attention: sum(q_lens) = {sum(q_lens_t)} and sum(kv_lens) = {sum(kv_lens_t)} must equal the "
            f"token counts of q ({q.shape[0]}) and k/v ({k.shape[0]})"
        )
    batch = RaggedBatch(q_lens_t, kv_lens_t)
    if spec.mask is not None:
        spec.mask.check_lengths(batch.num_seqs, list(kv_lens_t), dense=False)
    out, lse = _run(q, k, v, batch, spec, backend)
    return (out, lse) if return_lse else out


def _run(q, k, v, batch: RaggedBatch, spec: AttentionSpec, backend: str):
    chosen = select(AttentionRequest(spec, q.dtype, q.device), backend)
    if batch.total_q == 0:
        empty = q.new_empty(q.shape)
        return empty, torch.empty(q.shape[0], spec.num_q_heads, dtype=torch.float32, device=q.device)
    state = _plan(chosen, spec, batch)
    return execute(chosen, state, spec, q, k, v, batch.total_q)


def _pure(mask) -> bool:
    """True when the mask is built only from position rules (no tensors, no user functions)."""
    if mask is None or isinstance(mask, _PURE_MASKS):
        return True
    if isinstance(mask, masks._And):  # also _Or
        return _pure(mask.a) and _pure(mask.b)
    return isinstance(mask, masks._Not) and _pure(mask.inner)


def _plan(chosen, spec: AttentionSpec, batch: RaggedBatch):
    """``chosen.plan`` for a contiguous batch, reused for the same spec object and lengths (cpu backend only)."""
    if chosen.name != "cpu" or not _pure(spec.mask) or not (spec.score is None or isinstance(spec.score, Softcap)):
        return chosen.plan(spec, batch, KVLayout.contiguous(batch))
    key = (id(spec), batch.q_lens, batch.kv_lens)
    with _PLANS_LOCK:
        hit = _PLANS.get(key)
        if hit is not None and hit[0] is spec:  # the entry holds the spec, so its id cannot have been reused
            _PLANS.move_to_end(key)
            return hit[1]
    state = chosen.plan(spec, batch, KVLayout.contiguous(batch))
    with _PLANS_LOCK:
        _PLANS[key] = (spec, state)
        while len(_PLANS) > _PLAN_CACHE_SIZE:
            _PLANS.popitem(last=False)
    return state


def as_lengths(lens, name: str, where: str = "varlen_attention") -> tuple[int, ...]:
    if isinstance(lens, torch.Tensor):
        if lens.dim() != 1 or lens.dtype.is_floating_point or lens.dtype == torch.bool:
            raise TypeError(f"{where}: {name} must be a 1-D integer tensor or a list of ints, got {lens.dtype} {tuple(lens.shape)}")
        lens = lens.tolist()
    try:
        out = tuple(int(x) for x in lens)
    except (TypeError, ValueError):
        raise TypeError(f"{where}: {name} must be a list of ints or a 1-D int tensor, got {lens!r}") from None
    if any(x < 0 for x in out):
        raise ValueError(f"{where}: {name} must be >= 0, got {list(out)}")
    return out


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
