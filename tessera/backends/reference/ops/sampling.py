"""Float64 reference of the vocabulary ops and the sampler: the tests' oracle, written for clarity, not speed.

The sampler's filters are written as whole-batch torch ops over a stable descending sort, so that ties are broken
by the lowest index everywhere; :func:`filter_logits` is parametrized by the compute dtype so the triton backend can
reuse it in float32 on GPUs (see ``tessera/backends/triton/ops/sampling.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tessera.kernels.sampling import SamplingBatch

F64 = torch.float64


def _scaled(logits: torch.Tensor, temperature: torch.Tensor | None, dtype: torch.dtype = F64) -> torch.Tensor:
    x = logits.to(dtype)
    if temperature is not None:
        x = x / temperature.to(x.device, dtype)[:, None]
    return x


def softmax_f64(logits: torch.Tensor, temperature: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax(logits / temperature)`` in float64 ``[B, V]``; ``temperature`` float ``[B]`` or None."""
    return torch.softmax(_scaled(logits, temperature), dim=-1)


def log_softmax_f64(logits: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)`` in float64 ``[B, V]``."""
    return torch.log_softmax(logits.to(F64), dim=-1)


def softmax(logits: torch.Tensor, temperature: torch.Tensor | None) -> torch.Tensor:
    return softmax_f64(logits, temperature).float()


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    return log_softmax_f64(logits).float()


def argmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.argmax(logits.to(F64), dim=-1)


def topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, ids = torch.sort(logits.to(F64), dim=-1, descending=True, stable=True)
    return values[:, :k].float(), ids[:, :k]


def apply_penalties(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """HF repetition penalty, then OpenAI presence / frequency penalties, on the seen tokens of each row (in place)."""
    if batch.seen_ids.numel() == 0:
        return x
    dev = x.device
    rows = torch.repeat_interleave(torch.arange(x.shape[0]), batch.seen_ptr.diff()).to(dev)
    ids, counts = batch.seen_ids.to(dev), batch.seen_counts.to(dev, x.dtype)
    rep, pres, freq = (t.to(dev, x.dtype)[rows] for t in (batch.repetition, batch.presence, batch.frequency))
    vals = x[rows, ids]
    vals = torch.where(vals > 0, vals / rep, vals * rep)
    x[rows, ids] = vals - pres - freq * counts
    return x


def filter_logits(logits: torch.Tensor, batch: SamplingBatch, dtype: torch.dtype = F64) -> torch.Tensor:
    """The final filtered logits ``[B, V]`` (``dtype``): -inf for dropped tokens; greedy rows keep only the argmax.

    The distribution a row samples from is ``softmax`` of its row.
    """
    dev = logits.device
    x = apply_penalties(logits.to(dtype).clone(), batch)
    temp = batch.temperature.to(dev, dtype)
    greedy = temp == 0
    best = torch.argmax(x, dim=-1)
    x = x / torch.where(greedy, 1.0, temp)[:, None]
    neg_inf = torch.tensor(float("-inf"), dtype=dtype, device=dev)
    top_k, top_p = batch.top_k.to(dev), batch.top_p.to(dev, dtype)
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        x = _top_k_top_p(x, top_k, top_p, neg_inf)
    min_p = batch.min_p.to(dev, dtype)
    if bool((min_p > 0).any()):
        floor = x.max(dim=-1, keepdim=True).values + torch.log(min_p)[:, None]  # log(0) = -inf keeps everything
        x = torch.where(x < floor, neg_inf, x)
    point = torch.full_like(x, float("-inf")).scatter_(1, best[:, None], 0.0)
    return torch.where(greedy[:, None], point, x)


def _top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, neg_inf: torch.Tensor) -> torch.Tensor:
    """Top-k (ties of the k-th kept), then top-p on the renormalized survivors (a prefix in the stable sort)."""
    vals, order = torch.sort(x, dim=-1, descending=True, stable=True)
    kth = vals.gather(1, (top_k - 1).clamp(min=0)[:, None])
    vals = torch.where((top_k[:, None] > 0) & (vals < kth), neg_inf, vals)
    probs = torch.softmax(vals, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # mass ranked strictly before each token
    keep = (vals > neg_inf) & ((top_p[:, None] >= 1) | (before < top_p[:, None]))
    keep[:, 0] = True  # the top token always survives (rounding must not empty a row)
    mask = torch.zeros_like(keep).scatter_(1, order, keep)
    return torch.where(mask, x, neg_inf)


def draw(filtered: torch.Tensor, uniform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF draw in vocabulary order: the first token whose cumulative probability exceeds ``u``."""
    logp = torch.log_softmax(filtered, dim=-1)
    cdf = torch.cumsum(logp.exp(), dim=-1)
    target = uniform.to(cdf.device, cdf.dtype)[:, None] * cdf[:, -1:]
    ids = torch.searchsorted(cdf.contiguous(), target, right=True).clamp(max=filtered.shape[1] - 1)
    # Rounding can land past the last kept token only when u*total ~ total: step back to the last kept one.
    dropped = logp.gather(1, ids) == float("-inf")
    if bool(dropped.any()):
        last = filtered.shape[1] - 1 - torch.argmax(torch.flip(logp > float("-inf"), [1]).to(torch.int8), dim=-1)
        ids = torch.where(dropped, last[:, None], ids)
    return ids[:, 0], logp.gather(1, ids)[:, 0]


def filtered_probs_f64(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The distribution each row samples from, float64 ``[B, V]`` (the statistical tests' oracle)."""
    return torch.softmax(filter_logits(logits, batch), dim=-1)


def sample_f64(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids int64 [B], logprobs float64 [B])`` drawn with ``batch.uniform``."""
    return draw(filter_logits(logits, batch), batch.uniform)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    ids, logprobs = sample_f64(logits, batch)
    return ids, logprobs.float()


def filtered_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    return filtered_probs_f64(logits, batch).float()


OPS = {"softmax": softmax, "log_softmax": log_softmax, "argmax": argmax, "topk": topk, "sample": sample,
       "filtered_probs": filtered_probs}
