"""Prefill-shaped attention on the CPU: FlashAttention-style tiles through BLAS (NumPy's OpenBLAS sgemm).

Per query tile, the queries of one KV group are stacked into one matrix ``[Hkv, G * tq, D]`` so a single batched GEMM
per kv run serves every query head of a group without repeating K/V (GQA costs nothing extra). Tiles are classified
before any arithmetic: EMPTY tiles are skipped, FULL tiles skip mask evaluation, PARTIAL tiles evaluate the mask once
(a custom mask that turns out all-False or all-True over the tile is then treated as EMPTY or FULL).

Parallelism is coarse: every (sequence, query tile) is one task, tasks run on a thread pool largest-first, and torch
runs single-threaded inside them. Splitting each small op across threads instead costs a fork/join per op; measured
on this 2-core machine with another process busy, causal S=4096 took 18.4 s that way against 1.96 s with tasks
(SDPA: 1.63 s), because every op waits for its slowest thread.

The online softmax step is one fused Numba pass per tile (``softmax_kernel``), and K/V are widened to float32 once per sequence: widening per
tile would redo the conversion for every query tile.

bfloat16 storage on a CPU with bf16 dot products (the ``prefill_pv`` variant family: AMX or AVX512-BF16) runs the
P.V product in bf16: P is rounded to bf16, as FlashAttention does on GPUs, and torch's bf16 GEMM (oneDNN) multiplies
it with the stored V; the tile's product is accumulated in float32. Q.K stays float32, because torch's CPU bf16 GEMM
rounds its output to bf16 and the scores must not lose that much before the exponential. Measured on Zen 4
(2026-12-02, one core, ``[32, 256, 128] x [32, 128, 512]``): torch bf16 bmm 189 GFLOP/s, NumPy's OpenBLAS sgemm
~100-140, torch's fp32 bmm 67.
"""

from __future__ import annotations

import functools
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch
from threadpoolctl import ThreadpoolController

from tessera.attention.spec import AttentionSpec
from tessera.attention.tiles import EMPTY, FULL, classify_tiles, resolve_partial_tile, tile_bounds
from tessera.backends.base import KVLayout, RaggedBatch
from tessera.backends.cpu import variants
from tessera.backends.cpu.kv_gather import gather_heads
from tessera.backends.cpu.softmax_kernel import online_softmax_tile
from tessera.kv.quantized import QuantizedPages
from tessera.tuning import tuned

#: Query positions per tile (the default of the ``prefill_q_tile`` tunable); with G query heads per KV head the GEMM
#: has G * Q_TILE rows. 128 rather than 64: bigger GEMMs, fewer tasks. Zen 4 (2026-12-02, 2 threads, causal, best of
#: 3): 32/8 heads D=128 fp32 S=4096 1016 against 1133-1161 ms (SDPA 1161-1183), S=1024 113 vs 126 ms; bf16 S=4096
#: 933 vs 1023; SmolLM2's 9/3 D=64 at S=512 6 vs 11 ms. Not measured on Zen 3, where `tessera tune` decides.
Q_TILE = 128
#: Longest kv run per GEMM.
KV_TILE = 512
#: Tiles are classified at this finer kv granularity, then consecutive visited tiles merge into runs of up to KV_TILE
#: keys: big GEMMs where the mask is dense, tight bounds at a window's or document's edges.
KV_CLASSIFY_TILE = 64


@dataclass(slots=True)
class _Sequence:
    """One prefill-shaped sequence, prepared on the calling thread."""

    index: int  # b, as seen by masks and score functions
    q: torch.Tensor  # [q_len, Hq, D], storage dtype
    k: torch.Tensor  # [Hkv, kv_len, D] float32
    v: torch.Tensor  # [Hkv, kv_len, D] float32
    v_bf16: torch.Tensor | None  # [Hkv, kv_len, D] bfloat16 when P.V runs in bf16 (the prefill_pv variant)
    out_rows: int  # first row of this sequence in the batch output
    q_start: int  # absolute position of the first query
    q_lo: np.ndarray
    q_hi: np.ndarray
    kv_lo: np.ndarray
    kv_hi: np.ndarray
    classes: np.ndarray  # [num_q_tiles, num_kv_tiles] int8


class _State:
    """Running max ``m``, denominator ``l`` (both ``[Hkv * R]``) and unnormalized output ``acc [Hkv, R, D]``."""

    __slots__ = ("m", "l", "alpha", "acc")

    def __init__(self, rows: int) -> None:
        self.m = torch.full((rows,), -math.inf)
        self.l = torch.zeros(rows)
        self.alpha = torch.empty(rows)
        self.acc: torch.Tensor | None = None

    def update(self, p: torch.Tensor, v_tile: torch.Tensor, v_bf16: torch.Tensor | None = None) -> None:
        """Fold score tile ``p [Hkv, R, tk]`` (overwritten with probabilities) and ``v_tile [Hkv, tk, D]``; with
        ``v_bf16`` (the same tile in bf16) the product runs in bf16 with float32 accumulation across tiles."""
        online_softmax_tile(p.view(-1, p.shape[-1]).numpy(), self.m.numpy(), self.l.numpy(), self.alpha.numpy())
        if v_bf16 is not None:
            p_low = _scratch("p_bf16", *p.shape, dtype=torch.bfloat16)
            p_low.copy_(p)
            pv = torch.bmm(p_low, v_bf16)  # [Hkv, R, D] bf16
            if self.acc is None:
                self.acc = pv.to(torch.float32)
            else:
                self.acc.mul_(self.alpha.view(p.shape[0], p.shape[1], 1)).add_(pv)
            return
        if self.acc is None:
            self.acc = torch.from_numpy(np.matmul(p.numpy(), v_tile.numpy()))
            return
        pv = _scratch("pv", p.shape[0], p.shape[1], v_tile.shape[2])
        np.matmul(p.numpy(), v_tile.numpy(), out=pv.numpy())
        self.acc.mul_(self.alpha.view(p.shape[0], p.shape[1], 1)).add_(pv)


def prefill_attention(
    q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, batch: RaggedBatch, layout: KVLayout,
    seqs: list[int], spec: AttentionSpec, out: torch.Tensor, lse: torch.Tensor,
) -> None:
    """Attention of the listed sequences of ``batch`` through BLAS tiles, writing their rows of ``out`` / ``lse``.

    Parameters
    ----------
    q : ``[total_q, Hq, D]``; k_rows, v_rows : ``[rows, Hkv, D]`` token rows addressed by ``layout`` (a ragged batch
        or a paged cache); float32, bfloat16 or float16, or both quantized
        (:class:`~tessera.kv.quantized.QuantizedPages`, read as codes).
    seqs : indices of the sequences to run.
    out : float32 ``[total_q, Hq, D]`` and lse : float32 ``[total_q, Hq]`` (without sinks).
    """
    seqs = [s for s in seqs if batch.kv_lens[s] > 0]
    prepare = lambda s: _prepare(q, k_rows, v_rows, batch, layout, s, spec)  # noqa: E731
    run = lambda task: _run_q_tile(task[0], task[1], spec, out, lse)  # noqa: E731
    workers = torch.get_num_threads()
    if not seqs:
        return
    if workers <= 1:  # the caller asked for one thread: honour it for BLAS too
        with _blas_controller().limit(limits=1, user_api="blas"):
            for seq in map(prepare, seqs):
                for qi in range(len(seq.q_lo)):
                    run((seq, qi))
        return
    # Both phases run as tasks with torch single-threaded: letting torch's own OpenMP pool split each op instead
    # also collides with the Numba pool that may still be spinning after a decode kernel in the same step.
    with _torch_single_threaded():
        pool = _pool(workers)
        prepared = list(pool.map(prepare, seqs))
        tasks = [(seq, qi) for seq in prepared for qi in range(len(seq.q_lo))]
        tasks.sort(key=lambda t: -_visited_keys(t[0], t[1]))  # largest first: late causal tiles visit most keys
        list(pool.map(run, tasks))


def _prepare(q, k_rows, v_rows, batch: RaggedBatch, layout: KVLayout, s: int, spec: AttentionSpec) -> _Sequence:
    """Widen this sequence's K/V to float32 ``[Hkv, kv_len, D]`` once (one Numba gather pass per sequence, from pages
    or contiguous rows; ``kv_gather.py``), and classify its tiles."""
    qs, ql, kl = batch.q_starts[s], batch.q_lens[s], batch.kv_lens[s]
    rows = layout.rows(s, kl)
    q_lo, q_hi = tile_bounds(kl - ql, kl, tuned("prefill_q_tile", None, Q_TILE))
    kv_lo, kv_hi = tile_bounds(0, kl, KV_CLASSIFY_TILE)
    v = gather_heads(v_rows, rows)
    # Quantized rows arrive as codes (de-quantized in the gather): P.V follows q's dtype then, and v's one rounding
    # to bf16 is the value a bf16 de-quantization of the page holds. Float rows: exact, v was widened from bf16.
    storage = q.dtype if isinstance(v_rows, QuantizedPages) else v_rows.dtype
    return _Sequence(
        index=s, q=q[qs : qs + ql],
        k=gather_heads(k_rows, rows),
        v=v,
        v_bf16=v.to(torch.bfloat16) if _bf16_pv(storage) else None,
        out_rows=qs, q_start=kl - ql, q_lo=q_lo, q_hi=q_hi, kv_lo=kv_lo, kv_hi=kv_hi,
        classes=classify_tiles(spec.mask, s, q_lo, q_hi, kv_lo, kv_hi),
    )


def _bf16_pv(storage: torch.dtype) -> bool:
    """Whether P.V runs in bf16 for K/V stored as ``storage`` (only bf16, and only where the chosen ``prefill_pv``
    variant has bf16 dot products)."""
    return storage == torch.bfloat16 and variants.choose("prefill_pv").name != "fp32"


def _visited_keys(seq: _Sequence, qi: int) -> int:
    visited = seq.classes[qi] != EMPTY
    return int((seq.kv_hi[visited] - seq.kv_lo[visited]).sum())


def _run_q_tile(seq: _Sequence, qi: int, spec: AttentionSpec, out: torch.Tensor, lse: torch.Tensor) -> None:
    hkv, group, d, hq = spec.num_kv_heads, spec.group_size, spec.head_dim, spec.num_q_heads
    a, e = int(seq.q_lo[qi]), int(seq.q_hi[qi])
    n = e - a
    rows = slice(a - seq.q_start, e - seq.q_start)
    q_t = (seq.q[rows].to(torch.float32) * spec.softmax_scale).view(n, hkv, group, d)
    q_t = q_t.permute(1, 2, 0, 3).reshape(hkv, group * n, d)
    b = torch.tensor(seq.index)
    heads = torch.arange(hq).view(-1, 1, 1)
    q_pos = torch.arange(a, e).view(1, -1, 1)
    state = _State(hkv * group * n)
    for run in kv_runs(seq.classes[qi], seq.kv_lo, seq.kv_hi, KV_TILE):
        c, f = run.start, run.stop
        masks = _partial_masks(spec, b, heads, q_pos, run)
        if masks is None:
            continue  # every tile of the run turned out empty
        s = _scratch("scores", hkv, group * n, f - c)  # == [Hq, n, tk]
        np.matmul(q_t.numpy(), seq.k[:, c:f].numpy().transpose(0, 2, 1), out=s.numpy())
        if spec.score is not None:
            s = spec.score.apply(s.view(hq, n, f - c), b, heads, q_pos, torch.arange(c, f).view(1, 1, -1))
            s = s.to(torch.float32).reshape(hkv, group * n, f - c)
        for lo, hi, keep in masks:  # mask only the partial sub-ranges, not the whole run
            s.view(hq, n, f - c)[:, :, lo - c : hi - c].masked_fill_(~keep, -math.inf)
        state.update(s, seq.v[:, c:f], None if seq.v_bf16 is None else seq.v_bf16[:, c:f])
    if state.acc is not None:  # else every tile was empty: rows stay 0 / -inf
        _write_tile(state, out, lse, slice(seq.out_rows + rows.start, seq.out_rows + rows.stop), n, spec)


@dataclass(slots=True)
class _Run:
    """Consecutive visited kv tiles ``[start, stop)``, with the sub-ranges whose tiles need the mask."""

    start: int
    stop: int
    partial: list[tuple[int, int]]
    has_full: bool


def _partial_masks(
    spec: AttentionSpec, b: torch.Tensor, heads: torch.Tensor, q_pos: torch.Tensor, run: _Run
) -> list[tuple[int, int, torch.Tensor]] | None:
    """Evaluate the mask on a run's partial sub-ranges; drop all-True ones; None when the whole run is empty."""
    masks = []
    any_kept = run.has_full
    for lo, hi in run.partial:
        kind, keep = resolve_partial_tile(spec.mask, b, heads, q_pos, lo, hi)
        any_kept = any_kept or kind != EMPTY
        if kind != FULL:  # an all-False sub-range is still masked: the run's other tiles are kept
            masks.append((lo, hi, keep))
    return masks if any_kept else None


def kv_runs(classes: np.ndarray, kv_lo: np.ndarray, kv_hi: np.ndarray, max_len: int) -> list[_Run]:
    """Merge consecutive non-EMPTY kv tiles into runs of at most ``max_len`` keys (big GEMMs), remembering which
    sub-ranges are PARTIAL (adjacent partial tiles merge into one sub-range)."""
    runs: list[_Run] = []
    for t in np.flatnonzero(classes != EMPTY):
        c, f, full = int(kv_lo[t]), int(kv_hi[t]), bool(classes[t] == FULL)
        if not runs or runs[-1].stop != c or f - runs[-1].start > max_len:
            runs.append(_Run(c, c, [], False))
        run = runs[-1]
        run.stop = f
        if full:
            run.has_full = True
        elif run.partial and run.partial[-1][1] == c:
            run.partial[-1] = (run.partial[-1][0], f)
        else:
            run.partial.append((c, f))
    return runs


def _write_tile(state: _State, out: torch.Tensor, lse: torch.Tensor, rows: slice, n: int, spec: AttentionSpec) -> None:
    hkv, group, d = spec.num_kv_heads, spec.group_size, spec.head_dim
    l = state.l.view(hkv, group * n)
    safe_l = torch.where(l > 0, l, 1.0)
    o = (state.acc / safe_l.unsqueeze(-1)).view(hkv, group, n, d).permute(2, 0, 1, 3).reshape(n, spec.num_q_heads, d)
    row_lse = torch.where(l > 0, state.m.view(hkv, group * n) + torch.log(safe_l), -math.inf)
    out[rows] = o
    lse[rows] = row_lse.view(hkv, group, n).permute(2, 0, 1).reshape(n, spec.num_q_heads)


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()
_LOCAL = threading.local()


def _scratch(name: str, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A per-thread buffer (float32 unless ``dtype``). A fresh multi-MB tensor per tile is a fresh mmap whose pages
    fault in on first touch; reusing one buffer removed about 0.3 s of a 1.8 s single-thread causal S=4096 run."""
    need = math.prod(shape)
    buf = getattr(_LOCAL, name, None)
    if buf is None or buf.numel() < need:
        buf = torch.empty(need, dtype=dtype)
        setattr(_LOCAL, name, buf)
    return buf[:need].view(shape)


_THREADS_LOCK = threading.Lock()


def _pool(workers: int) -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL._max_workers != workers:  # noqa: SLF001  (resize when torch's thread count changes)
            if _POOL is not None:
                _POOL.shutdown(wait=False)
            _POOL = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tessera-cpu")
        return _POOL


@functools.cache
def _blas_controller() -> ThreadpoolController:
    """Found once: scanning the loaded libraries costs about a millisecond per call."""
    return ThreadpoolController()


@contextmanager
def _torch_single_threaded() -> Iterator[None]:
    """Run torch ops and BLAS calls single-threaded while our own tasks supply the parallelism; restore after."""
    with _THREADS_LOCK, _blas_controller().limit(limits=1, user_api="blas"):
        previous = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(previous)


__all__ = ["KV_TILE", "Q_TILE", "kv_runs", "prefill_attention"]
