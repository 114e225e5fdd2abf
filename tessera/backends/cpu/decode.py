"""Decode-shaped attention on the CPU: host-side planning of kv segments, then one Numba kernel call per batch.

A sequence is decode-shaped when it has few queries (``q_len <= DECODE_MAX_Q``): its work is reading K/V once, not
GEMM throughput. The plan walks each sequence's kv in tiles of ``SEGMENT_TILE`` keys, drops EMPTY tiles, keeps every
other tile as one segment (so split-KV can cut between any two), and evaluates the mask only on PARTIAL tiles (stored
as uint8 for the kernel).
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
import torch

from tessera.attention.scores import Alibi, Softcap
from tessera.attention.spec import AttentionSpec
from tessera.attention.tiles import (
    EMPTY,
    FULL,
    classify_tiles,
    resolve_partial_tile,
    tile_bounds,
)
from tessera.backends.base import KVLayout, RaggedBatch
from tessera.backends.cpu.decode_kernel import (
    NO_SCALES,
    code_unit,
    decode_attention_kernel,
    decode_attention_serial,
    merge_parts_kernel,
    merge_parts_serial,
)
from tessera.backends.cpu.decode_qk8 import decode_q8_kernel, decode_q8_serial, qk_token, quantize_queries
from tessera.backends.cpu.decode_pv8 import pv_token
from tessera.backends.cpu.kernel_args import DecodeSchedule
from tessera.backends.cpu.ops._narrow import storage_view
from tessera.kv.quantized import QuantizedPages
from tessera.tuning import tuned

DECODE_MAX_Q = 8
SEGMENT_TILE = 256
#: split-KV: aim for this many work items per thread, but never parts shorter than MIN_PART_KEYS keys
ITEMS_PER_THREAD = 4
MIN_PART_KEYS = 512
#: below this many K+V bytes (counted as float32) a step runs on the calling thread, unsplit: waking Numba's pool
#: costs ~60 us per kernel here, more than reading 1 MiB (a 50-token context of SmolLM2 is 75 KiB per layer)
SERIAL_MAX_BYTES = 1 << 20


def kernel_supports(spec: AttentionSpec) -> bool:
    """The Numba kernel runs built-in score functions only; a custom score function goes through the BLAS path."""
    return spec.score is None or isinstance(spec.score, (Softcap, Alibi))


class _Segments:
    """Growing arrays of kv segments (one per visited tile) plus the uint8 mask bytes of partial ones."""

    def __init__(self) -> None:
        self.start: list[int] = []
        self.end: list[int] = []
        self.mask_off: list[int] = []
        self.hstride: list[int] = []
        self.masks: list[np.ndarray] = []
        self.mask_size = 0

    def add(self, start: int, end: int, keep: np.ndarray | None = None) -> None:
        self.start.append(start)
        self.end.append(end)
        if keep is None:
            self.mask_off.append(-1)
            self.hstride.append(0)
        else:
            self.mask_off.append(self.mask_size)
            self.hstride.append(1 if keep.shape[0] > 1 else 0)
            self.masks.append(keep.reshape(-1))
            self.mask_size += keep.size

    def add_full(self, starts: np.ndarray, ends: np.ndarray) -> None:
        """Append unmasked segments in bulk (the common case: every visited tile of a causal decode is FULL)."""
        n = len(starts)
        self.start.extend(starts.tolist())
        self.end.extend(ends.tolist())
        self.mask_off.extend([-1] * n)
        self.hstride.extend([0] * n)

    def repeat(self, lo: int, hi: int) -> None:
        """Append copies of segments ``lo .. hi - 1`` (their mask bytes are shared: the kernel only reads them)."""
        for lst in (self.start, self.end, self.mask_off, self.hstride):
            lst.extend(lst[lo:hi])

    def arrays(self) -> tuple[np.ndarray, ...]:
        i64 = lambda x: np.asarray(x, dtype=np.int64)  # noqa: E731
        buf = np.concatenate(self.masks) if self.masks else np.zeros(1, dtype=np.uint8)
        return i64(self.start), i64(self.end), i64(self.mask_off), i64(self.hstride), buf


def _sees_every_key(mask) -> bool:
    """True when one query at the end of a sequence attends to every key before it: no mask, or the plain causal
    mask (by its structure key, which a composition or a custom mask does not share)."""
    return mask is None or mask.structure_key() == ("causal",)


def _plan_sequence(
    segs: _Segments, spec: AttentionSpec, seq_index: int, q_len: int, kv_len: int, kv_begin: int = 0
) -> None:
    """Append the segments of one sequence (queries at the last ``q_len`` of ``kv_len`` positions), visiting keys
    from ``kv_begin`` on (a cascade handles the shared prefix before it)."""
    kv_lo, kv_hi = tile_bounds(kv_begin, kv_len, SEGMENT_TILE)
    q_lo, q_hi = np.array([kv_len - q_len]), np.array([kv_len])
    classes = classify_tiles(spec.mask, seq_index, q_lo, q_hi, kv_lo, kv_hi)[0]
    visited = classes != EMPTY
    if (classes[visited] == FULL).all():  # no mask to evaluate: one bulk append (~10x less host time per step)
        segs.add_full(kv_lo[visited], kv_hi[visited])
        return
    b = torch.tensor(seq_index)
    heads = torch.arange(spec.num_q_heads).view(-1, 1, 1)
    q_pos = torch.arange(kv_len - q_len, kv_len).view(1, -1, 1)
    for t in np.flatnonzero(classes != EMPTY):
        c, f = int(kv_lo[t]), int(kv_hi[t])
        if classes[t] == FULL:
            segs.add(c, f)
            continue
        kind, keep = resolve_partial_tile(spec.mask, b, heads, q_pos, c, f)
        if kind == EMPTY:
            continue
        if kind == FULL:
            segs.add(c, f)
            continue
        keep = torch.broadcast_to(keep, (spec.num_q_heads, q_len, f - c))
        if keep.stride(0) == 0:
            keep = keep[:1]  # the mask ignores the head: store one copy
        segs.add(c, f, keep.to(torch.uint8).contiguous().numpy())


def _split_items(
    segs: _Segments, seq_seg_ranges: list[tuple[int, int]], split: bool
) -> tuple[np.ndarray, ...]:
    """Cut each sequence's segments into parts of about equal key counts so every core gets work (split-KV); with
    ``split=False`` each sequence is one item.

    Returns int64 arrays: per item its sequence, segment range; per sequence its item range.
    """
    if not split:  # one item per sequence
        n = len(seq_seg_ranges)
        bounds = np.asarray(seq_seg_ranges, dtype=np.int64).reshape(n, 2)
        return (np.arange(n, dtype=np.int64), bounds[:, 0].copy(), bounds[:, 1].copy(), np.arange(n, dtype=np.int64),
                np.arange(1, n + 1, dtype=np.int64))
    lengths = np.asarray(segs.end, dtype=np.int64) - np.asarray(segs.start, dtype=np.int64)
    total = int(lengths.sum())
    target = max(total // (ITEMS_PER_THREAD * numba.get_num_threads()), MIN_PART_KEYS)
    item_seq, item_lo, item_hi, seq_lo, seq_hi = [], [], [], [], []
    for s, (lo, hi) in enumerate(seq_seg_ranges):
        seq_lo.append(len(item_seq))
        part_start, keys = lo, 0
        for seg in range(lo, hi):
            keys += int(lengths[seg])
            if keys >= target and seg + 1 < hi:
                item_seq.append(s), item_lo.append(part_start), item_hi.append(seg + 1)
                part_start, keys = seg + 1, 0
        item_seq.append(s), item_lo.append(part_start), item_hi.append(hi)
        seq_hi.append(len(item_seq))
    return tuple(np.asarray(a, dtype=np.int64) for a in (item_seq, item_lo, item_hi, seq_lo, seq_hi))


def _schedule(item_keys: np.ndarray, workers: int) -> tuple[np.ndarray, np.ndarray]:
    """Assign items to workers, longest first to the least loaded (LPT), so every core reads about as many keys.

    Numba's ``prange`` splits its iterations into one contiguous block per thread (``parallel_chunksize`` did not
    change that here, measured), so a batch of mixed lengths split into parts in sequence order left one core with
    most of the long parts: batch 8 at 1k-16k keys ran 13.0 ms, against 9.9 ms for the same keys in equal lengths.

    Returns ``item_order`` (int64, the items worker by worker) and ``worker_start`` (int64 ``[workers + 1]``).
    """
    if len(item_keys) == 1:  # what the loop below gives one item, without its NumPy calls
        start = np.ones(workers + 1, dtype=np.int64)
        start[0] = 0
        return np.zeros(1, dtype=np.int64), start
    loads = [0] * workers
    lists: list[list[int]] = [[] for _ in range(workers)]
    for item in np.argsort(-item_keys, kind="stable").tolist():
        w = loads.index(min(loads))
        lists[w].append(item)
        loads[w] += int(item_keys[item])
    order = np.fromiter((i for lst in lists for i in lst), dtype=np.int64, count=len(item_keys))
    start = np.zeros(workers + 1, dtype=np.int64)
    start[1:] = np.cumsum([len(lst) for lst in lists])
    return order, start


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """Everything the decode kernel needs that depends on lengths and the mask, never on tensor values.

    Built once per step (mask evaluation of partial tiles included) and reused by every layer with the same spec.
    """

    schedule: DecodeSchedule  # what the kernels read (decode_attention_kernel, the fused decoder layer)
    num_items: int
    rows_per_item: int
    head_dim: int
    serial: bool  # run on the calling thread (small steps), see SERIAL_MAX_BYTES
    direct: bool  # items are the first output rows, one query each: write out / lse without a merge

    @staticmethod
    def build(
        batch: RaggedBatch, seqs: list[int], spec: AttentionSpec, layout: KVLayout, kv_begin: dict[int, int] | None = None
    ) -> DecodePlan:
        """``kv_begin[s]``: first key sequence ``s`` visits (default 0)."""
        segs = _Segments()
        ranges = []
        if not kv_begin and _sees_every_key(spec.mask) and all(batch.q_lens[s] == 1 for s in seqs):
            # The plain decode step (one query at the end of each sequence, causal or no mask): every tile is FULL,
            # so the segments are the tile bounds, without classifying tiles (~20 us a step for one sequence; the
            # planning runs between the LM head and the next token's layers, with cold caches).
            for s in seqs:
                lo, kv_len = len(segs.start), batch.kv_lens[s]
                segs.start.extend(range(0, kv_len, SEGMENT_TILE))
                segs.end.extend(min(c + SEGMENT_TILE, kv_len) for c in range(0, kv_len, SEGMENT_TILE))
                ranges.append((lo, len(segs.start)))
            segs.mask_off.extend([-1] * len(segs.start))
            segs.hstride.extend([0] * len(segs.start))
        else:
            # A mask that ignores the sequence index gives every sequence of the same lengths the same segments.
            planned: dict[tuple[int, int, int], tuple[int, int]] = {}
            reuse = spec.mask is None or not spec.mask.batch_dependent
            for s in seqs:
                lo = len(segs.start)
                key = (batch.q_lens[s], batch.kv_lens[s], (kv_begin or {}).get(s, 0))
                if reuse and key in planned:
                    segs.repeat(*planned[key])
                else:
                    _plan_sequence(segs, spec, s, *key)
                    planned[key] = (lo, len(segs.start))
                ranges.append((lo, len(segs.start)))
        keys = sum(segs.end) - sum(segs.start)
        max_bytes = tuned("decode_serial_max_bytes", None, SERIAL_MAX_BYTES)  # tessera tune measures the crossover
        serial = keys * spec.num_kv_heads * spec.head_dim * 8 < max_bytes or numba.get_num_threads() == 1
        item_seq, item_lo, item_hi, seq_item_lo, seq_item_hi = _split_items(segs, ranges, split=not serial)
        q_start = np.array([batch.q_starts[s] for s in seqs], dtype=np.int64)
        q_len = np.array([batch.q_lens[s] for s in seqs], dtype=np.int64)
        kv_len = np.array([batch.kv_lens[s] for s in seqs], dtype=np.int64)
        softcap = spec.score.cap if isinstance(spec.score, Softcap) else 0.0
        slopes = spec.score.slopes.numpy() if isinstance(spec.score, Alibi) else np.zeros(0, dtype=np.float32)
        seg_arrays = segs.arrays()
        seg_keys = np.concatenate([[0], np.cumsum(seg_arrays[1] - seg_arrays[0])])
        item_keys = seg_keys[item_hi] - seg_keys[item_lo]
        item_order, worker_start = _schedule(item_keys, numba.get_num_threads())
        seg_start, seg_end, seg_mask_off, seg_mask_hstride, mask_buf = seg_arrays
        schedule = DecodeSchedule(
            item_seq=item_seq, item_seg_lo=item_lo, item_seg_hi=item_hi, seq_q_start=q_start, seq_q_len=q_len,
            seq_kv_len=kv_len, row_base=np.ascontiguousarray(layout.row_base[seqs]), block=np.int64(layout.block),
            seg_start=seg_start, seg_end=seg_end, seg_mask_off=seg_mask_off, seg_mask_hstride=seg_mask_hstride,
            mask_buf=mask_buf, scale=np.float32(spec.softmax_scale), softcap=np.float32(softcap), slopes=slopes,
            item_order=item_order, worker_start=worker_start, seq_item_lo=seq_item_lo, seq_item_hi=seq_item_hi,
        )
        # One query per sequence, one item per sequence, in token order: the kernel's per-item rows are exactly the
        # output rows, so it writes ``out`` / ``lse`` directly and no merge pass runs (batch-1 decode).
        in_order = bool((q_start == np.arange(len(seqs))).all())
        direct = len(item_seq) == len(seqs) and bool((q_len == 1).all()) and in_order
        return DecodePlan(schedule, len(item_seq), spec.num_q_heads * int(q_len.max()), spec.head_dim, serial, direct)

    @property
    def q_start(self) -> np.ndarray:
        """int64 ``[seqs]``: each planned sequence's first query token."""
        return self.schedule.seq_q_start

    def run(self, q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Write the planned sequences' rows of ``out`` / ``lse`` (float32, contiguous, without sinks).

        q : ``[total_q, Hq, D]``; k_rows, v_rows : ``[rows, Hkv, D]`` contiguous, float32 / bfloat16 / float16, or
        both :class:`~tessera.kv.quantized.QuantizedPages` rows (their codes read in place).
        """
        qn = q.numpy() if q.dtype == torch.float32 else q.to(torch.float32).numpy()
        if self.direct:  # the kernel's item rows are the output rows
            part_out, part_lse = out.numpy()[: self.num_items], lse.numpy()[: self.num_items]
        else:
            part_out = np.empty((self.num_items, self.rows_per_item, self.head_dim), dtype=np.float32)
            part_lse = np.empty((self.num_items, self.rows_per_item), dtype=np.float32)
        # The plan assigned items to workers (``_schedule``): one prange iteration per worker.
        if isinstance(k_rows, QuantizedPages):  # codes and their scales, read as stored
            k, v = k_rows.code_bits().numpy(), v_rows.code_bits().numpy()
            ks, vs = storage_view(k_rows.scales), storage_view(v_rows.scales)
        else:
            k, v, ks, vs = storage_view(k_rows), storage_view(v_rows), NO_SCALES, NO_SCALES
        token = qk_token(k, self.head_dim)  # int8 codes on a CPU with VNNI: Q.K in int8 dot products (kv_qk)
        if token is not None:
            sch = self.schedule
            qcodes, qscale, qcorr = quantize_queries(qn, sch.scale, sch.seq_q_start, sch.seq_q_len)
            kernel = decode_q8_serial if self.serial else decode_q8_kernel
            pv, pv8_rows = pv_token(token, self.head_dim)  # P.V in int8 dot products too (kv_pv), for big groups
            kernel(qcodes, qscale, qcorr, k, ks, v, vs, code_unit(k), part_out, part_lse, tuple(sch), token, pv,
                   pv8_rows)
        else:
            kernel = decode_attention_serial if self.serial else decode_attention_kernel
            kernel(qn, k, ks, v, vs, code_unit(k), part_out, part_lse, tuple(self.schedule))
        if self.direct:
            return
        sch = self.schedule
        merge = merge_parts_serial if self.serial else merge_parts_kernel
        merge(part_out, part_lse, sch.seq_item_lo, sch.seq_item_hi, sch.seq_q_start, sch.seq_q_len, out.numpy(),
              lse.numpy())
