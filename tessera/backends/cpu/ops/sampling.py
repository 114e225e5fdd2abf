"""Vocabulary ops and the sampler on the CPU: torch's fused row ops, and one Numba kernel for the whole sampler.

softmax / log_softmax are torch's own kernels, already vectorized and row-parallel (a fused Numba version was not
written: it could at best match them); argmax is a Numba scan for the few float32 rows of a greedy step, where
torch's reduction took over twice as long, and torch's beyond; top-k is ``torch.topk`` plus a fix-up that makes ties
deterministic.

The sampler runs each row in one Numba task: widen, penalize the seen tokens, scale, then find the kept set without
sorting the vocabulary. Every filter keeps a prefix of the row in (value descending, index ascending) order, so the
kept set is one threshold ``(value, index)``. A histogram of the scaled logits (count and probability mass per
bucket of ``x - max``) locates the bucket holding the k-th token or the top-p boundary; only that bucket's tokens
(and for top-k those above it) are sorted. Torch eager would sort all ``V`` logits per row for top-p.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import torch
from numba import njit, prange

from tessera.backends.cpu.numba_math import FASTMATH, fast_exp, row_max, widen
from tessera.backends.cpu.ops._narrow import storage_view

if TYPE_CHECKING:
    from tessera.kernels.sampling import SamplingBatch

#: Histogram buckets over ``x - max`` in ``[-SPAN, 0]``; everything lower (incl. -inf) shares bucket 0. Tokens more
#: than SPAN below the max carry under ``V * e^-SPAN`` of the mass, so top-p never needs to resolve them.
NUM_BUCKETS = 4096
SPAN = 40.0


def softmax(logits: torch.Tensor, temperature: torch.Tensor | None) -> torch.Tensor:
    if temperature is None:
        return torch.softmax(logits, dim=-1, dtype=torch.float32)
    return torch.softmax(logits.float() / temperature.to(logits.device, torch.float32)[:, None], dim=-1)


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, dim=-1, dtype=torch.float32)


@njit(nogil=True, fastmath=FASTMATH, cache=True)
def _argmax_rows(x, out):  # pragma: no cover - compiled
    """The first maximal index of each float32 row: a vectorized max, then a scan to its first occurrence."""
    part = np.empty(16, dtype=np.float32)
    rows, vocab = x.shape
    for r in range(rows):
        row = x[r]
        m = row_max(row, vocab, part)
        best = 0
        while best < vocab - 1 and row[best] != m:
            best += 1
        out[r] = best


#: float32 rows up to this many elements take the Numba scan (one thread); larger batches keep torch's
#: row-parallel kernel. One 49152-logit row: torch.argmax 27 us, the scan 11 us (2026-12-05, Zen 5, best of 5 x 2000)
ARGMAX_SCAN_MAX = 1 << 20


def argmax(logits: torch.Tensor) -> torch.Tensor:
    # documented: the first maximal index. Greedy decoding takes one row per sequence every step, where torch's
    # reduction costs more than the LM head's tail; the scan's max is the same comparison, so the same index.
    if logits.dtype == torch.float32 and logits.is_contiguous() and logits.numel() <= ARGMAX_SCAN_MAX:
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        _argmax_rows(logits.numpy(), out.numpy())
        return out
    return torch.argmax(logits, dim=-1)


def topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk``, then ties ordered by index and, where the k-th value ties with dropped tokens, the lowest
    indices chosen (torch leaves both unspecified)."""
    x = logits.float()
    vocab = x.shape[1]
    # One extra candidate tells whether the k-th value ties with a dropped token, without another pass over x.
    values, ids = torch.topk(x, min(k + 1, vocab), dim=-1, sorted=True)
    boundary_tie = values[:, k] == values[:, k - 1] if k < vocab else torch.zeros(len(x), dtype=torch.bool)
    values, ids = values[:, :k].contiguous(), ids[:, :k].contiguous()
    if bool(boundary_tie.any()):  # rare with real logits: redo those rows with a stable sort
        rows = torch.nonzero(boundary_tie).flatten()
        v, i = torch.sort(x[rows], dim=-1, descending=True, stable=True)
        values[rows], ids[rows] = v[:, :k], i[:, :k]
    # Within the top k, order equal values by index: sort by id, then stably by value.
    ids, by_id = torch.sort(ids, dim=-1)
    values = values.gather(1, by_id)
    values, by_value = torch.sort(values, dim=-1, descending=True, stable=True)
    return values, ids.gather(1, by_value)


@njit(nogil=True, fastmath=FASTMATH, cache=True)
def _buckets(x, m):  # pragma: no cover - compiled
    """Bucket of each ``d = x - max <= 0`` (int32 ``[V]``): monotone in d, so a lower bucket holds only strictly
    smaller values; written branch-free so the loop vectorizes (-inf lands in bucket 0 through the max)."""
    scale = np.float32(NUM_BUCKETS / SPAN)
    out = np.empty(x.shape[0], dtype=np.int32)
    for i in range(x.shape[0]):
        v = max((x[i] - m + np.float32(SPAN)) * scale, np.float32(0.0))
        out[i] = np.int32(min(v, np.float32(NUM_BUCKETS - 1)))
    return out


@njit(nogil=True, fastmath=FASTMATH, cache=True)
def _gather_sorted(x, bk, lo, hi, n):  # pragma: no cover - compiled
    """The ``n`` tokens in buckets ``lo..hi``, sorted by value descending, index ascending: (values, ids)."""
    vals = np.empty(n, dtype=np.float32)
    ids = np.empty(n, dtype=np.int64)
    j = 0
    for i in range(x.shape[0]):
        if lo <= bk[i] <= hi:
            vals[j] = x[i]
            ids[j] = i
            j += 1
    order = np.argsort(-vals, kind="mergesort")  # stable: equal values stay in index order
    return vals[order], ids[order]


@njit(nogil=True, fastmath=FASTMATH, cache=True)
def _top_p_walk(vals, ids, m, n, before, target, tv, ti):  # pragma: no cover - compiled
    """Extend the kept prefix over sorted ``vals[:n]`` while the mass ranked before a token is below ``target``."""
    for j in range(n):
        if not before < target or vals[j] == -np.inf:
            break
        tv, ti = vals[j], ids[j]
        before += fast_exp(vals[j] - m)
    return tv, ti


@njit(nogil=True, fastmath=FASTMATH, cache=True)
def _top_k_threshold(x, m, bk, k, p):  # pragma: no cover - compiled
    """Last kept token ``(value, index)`` of top-k (ties of the k-th kept, as HF and vLLM), then top-p."""
    counts = np.zeros(NUM_BUCKETS, dtype=np.int64)
    for i in range(x.shape[0]):
        counts[bk[i]] += 1
    seen, b = 0, NUM_BUCKETS - 1
    while seen + counts[b] < k:
        seen += counts[b]
        b -= 1
    vals, ids = _gather_sorted(x, bk, b, NUM_BUCKETS - 1, seen + counts[b])
    kth = vals[k - 1]
    n = k
    while n < vals.shape[0] and vals[n] >= kth:
        n += 1
    if p >= 1.0:
        return kth, x.shape[0]
    total = 0.0
    for j in range(n):
        total += fast_exp(vals[j] - m)
    return _top_p_walk(vals, ids, m, n, 0.0, p * total, kth, x.shape[0])


@njit(nogil=True, fastmath=FASTMATH, cache=True)
def _top_p_threshold(x, e, total, m, bk, p):  # pragma: no cover - compiled
    """Last kept token of top-p alone: the histogram's mass finds the boundary bucket; only that bucket is sorted."""
    counts = np.zeros(NUM_BUCKETS, dtype=np.int64)
    mass = np.zeros(NUM_BUCKETS, dtype=np.float64)
    for i in range(x.shape[0]):
        counts[bk[i]] += 1
        mass[bk[i]] += e[i]
    target = p * total
    above, boundary, boundary_above = 0.0, 0, 0.0
    for b in range(NUM_BUCKETS - 1, -1, -1):  # stops at the boundary bucket, else (rounding) the lowest non-empty
        if counts[b] == 0:
            continue
        boundary, boundary_above = b, above
        if above + mass[b] >= target:
            break
        above += mass[b]
    n = counts[boundary]
    vals, ids = _gather_sorted(x, bk, boundary, boundary, n)
    return _top_p_walk(vals, ids, m, n, boundary_above, target, np.float32(np.inf), x.shape[0])


@njit(nogil=True, fastmath=FASTMATH, cache=True)
def _draw(x, e, tv, ti, m, u):  # pragma: no cover - compiled
    """Inverse CDF over the kept tokens in index order: (id, log-probability under the kept distribution)."""
    vocab = x.shape[0]
    total = 0.0
    for i in range(vocab):
        keep = x[i] > tv or (x[i] == tv and i <= ti)
        total += e[i] if keep else np.float32(0.0)
    target = u * total
    cum, last = 0.0, 0
    for i in range(vocab):
        if (x[i] > tv or (x[i] == tv and i <= ti)) and e[i] > 0:
            cum += e[i]
            last = i
            if cum > target:
                break
    return last, (x[last] - m) - math.log(total)


@njit(nogil=True, fastmath=FASTMATH, cache=True)
def _penalize(x, ids, counts, rep, pres, freq):  # pragma: no cover - compiled
    for j in range(ids.shape[0]):
        v = x[ids[j]]
        v = v / rep if v > 0 else v * rep
        x[ids[j]] = v - pres - freq * counts[j]


@njit(nogil=True, fastmath=FASTMATH, cache=True)
def _sample_row(x, t, k, p, min_p, u):  # pragma: no cover - compiled
    """Scale one penalized row by 1 / temperature (in place), filter it, draw: (id, logprob)."""
    vocab = x.shape[0]
    for i in range(vocab):
        x[i] = x[i] / t
    m = row_max(x, vocab, np.empty(16, dtype=np.float32))
    e = np.empty(vocab, dtype=np.float32)
    total = 0.0
    for i in range(vocab):
        e[i] = fast_exp(x[i] - m)
        total += e[i]
    tv, ti = np.float32(-np.inf), vocab
    if k > 0:
        tv, ti = _top_k_threshold(x, m, _buckets(x, m), k, p)
    elif p < 1.0:
        tv, ti = _top_p_threshold(x, e, total, m, _buckets(x, m), p)
    if min_p > 0.0:  # p_i >= min_p * p_max  <=>  x_i >= max + log(min_p); a prefix too, so intersect
        floor = m + np.float32(math.log(min_p))
        if floor > tv:
            tv, ti = floor, vocab
    return _draw(x, e, tv, ti, m, u)


@njit(parallel=True, nogil=True, fastmath=FASTMATH, cache=True)
def _sample_kernel(logits, temp, top_k, top_p, min_p, rep, pres, freq, seen_ptr, seen_ids, seen_counts, uniform,
                   out_ids, out_logprobs):  # pragma: no cover - compiled
    batch, vocab = logits.shape
    for r in prange(batch):
        x = np.empty(vocab, dtype=np.float32)
        for i in range(vocab):
            x[i] = widen(logits[r, i])
        lo, hi = seen_ptr[r], seen_ptr[r + 1]
        _penalize(x, seen_ids[lo:hi], seen_counts[lo:hi], np.float32(rep[r]), np.float32(pres[r]),
                  np.float32(freq[r]))
        if temp[r] == 0.0:  # greedy: the first maximal index of the penalized logits
            m = row_max(x, vocab, np.empty(16, dtype=np.float32))
            best = 0
            while x[best] != m and best < vocab - 1:
                best += 1
            out_ids[r], out_logprobs[r] = best, 0.0
        else:
            out_ids[r], out_logprobs[r] = _sample_row(x, np.float32(temp[r]), top_k[r], top_p[r], min_p[r],
                                                      uniform[r])


def sample(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    rows = logits.shape[0]
    ids = torch.empty(rows, dtype=torch.int64)
    logprobs = torch.empty(rows, dtype=torch.float32)
    f64 = [t.numpy() for t in (batch.temperature, batch.top_p, batch.min_p, batch.repetition, batch.presence,
                               batch.frequency)]
    temp, top_p, min_p, rep, pres, freq = f64
    _sample_kernel(storage_view(logits.contiguous()), temp, batch.top_k.numpy(), top_p, min_p, rep, pres, freq,
                   batch.seen_ptr.numpy(), batch.seen_ids.numpy(), batch.seen_counts.numpy(),
                   batch.uniform.numpy(), ids.numpy(), logprobs.numpy())
    return ids, logprobs


def filtered_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The sampler's distribution per row in float32 torch ops (speculative verification needs few rows, so the
    reference's sort-based filters are fast enough and define the same kept sets)."""
    from tessera.backends.reference.ops.sampling import filter_logits

    return torch.softmax(filter_logits(logits, batch, torch.float32), dim=-1)


OPS = {"softmax": softmax, "log_softmax": log_softmax, "argmax": argmax, "topk": topk, "sample": sample,
       "filtered_probs": filtered_probs}
