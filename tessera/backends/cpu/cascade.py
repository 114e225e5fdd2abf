"""Shared-prefix (cascade) attention: many decodes that share prefix pages read the prefix once, as one GEMM.

When requests share their first pages (a common system prompt, parallel samples of one prompt), attending to that
prefix separately per request reads the same K/V once per request, and each read is a memory-bound GEMV. Stacking the
group's queries instead turns the prefix into one GEMM-shaped pass that reads the prefix once (the Numba kernel of
``prefix_kernel.py``, or BLAS query tiles for head dims off the SIMD width); each request then attends only to its
own suffix in the decode kernel, and the two partial results merge by log-sum-exp.

The plan uses a cascade only where it cannot change the result: the mask must keep every prefix key for every
query of the group (checked with the mask's tile classification) and the score function must not depend on positions
(none, or softcap).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from tessera.attention.merge import merge_states
from tessera.attention.scores import Softcap
from tessera.attention.spec import AttentionSpec
from tessera.attention.tiles import FULL, classify_tiles
from tessera.backends.base import KVLayout, RaggedBatch
from tessera.backends.cpu.kv_gather import dequantize_token_rows
from tessera.backends.cpu.ops._narrow import storage_view
from tessera.backends.cpu.prefill import prefill_attention
from tessera.backends.cpu.prefix_kernel import KEY_TILE, merge_prefix_parts, merge_prefix_parts_serial, shared_prefix_kernel
from tessera.backends.cpu.simd import LANES
from tessera.kv.quantized import QuantizedPages

#: A shared prefix shorter than this is not worth a separate pass.
MIN_PREFIX_KEYS = 256
#: Prefix merges of at most this many part elements run on the calling thread (waking the pool costs more).
SERIAL_MERGE_ELEMENTS = 1 << 20


@dataclass(frozen=True, slots=True)
class Cascade:
    """Requests ``members`` share their first ``prefix_len`` keys (the same pages)."""

    members: list[int]
    prefix_len: int
    q_rows: torch.Tensor  # int64 rows of q (and out) of all members' queries, in member order
    batch: RaggedBatch  # one pseudo-sequence: the stacked queries against the prefix
    layout: KVLayout  # the prefix's rows (the first member's page table)
    prefix_base: np.ndarray  # int64 row bases of the prefix's pages (for the Numba prefix kernel)
    block: int  # rows per page


def find_cascades(batch: RaggedBatch, seqs: list[int], spec: AttentionSpec, layout: KVLayout) -> list[Cascade]:
    """Groups of at least two of ``seqs`` whose leading pages are identical, with the longest safe shared prefix."""
    if layout.row_base.shape[1] < 2 or not (spec.score is None or isinstance(spec.score, Softcap)):
        return []  # contiguous batches share nothing; position-dependent scores differ per request
    groups: dict[int, list[int]] = {}
    for s in seqs:
        groups.setdefault(int(layout.row_base[s, 0]), []).append(s)
    cascades = []
    for members in groups.values():
        if len(members) < 2:
            continue
        prefix = _shared_prefix(batch, members, layout)
        if prefix >= MIN_PREFIX_KEYS and _mask_keeps_prefix(batch, members, spec, prefix):
            cascades.append(_make(batch, members, prefix, layout))
    return cascades


def _shared_prefix(batch: RaggedBatch, members: list[int], layout: KVLayout) -> int:
    """Keys in the longest run of identical whole pages that ends before every member's first query."""
    limit = min(batch.kv_lens[s] - batch.q_lens[s] for s in members) // layout.block
    bases = layout.row_base[members, :limit]
    same = np.all(bases == bases[0], axis=0)
    pages = int(np.argmin(same)) if not same.all() else limit
    return pages * layout.block


def _mask_keeps_prefix(batch: RaggedBatch, members: list[int], spec: AttentionSpec, prefix: int) -> bool:
    if spec.mask is None:
        return True
    for s in members:
        q_lo = np.array([batch.kv_lens[s] - batch.q_lens[s]])
        q_hi = np.array([batch.kv_lens[s]])
        if classify_tiles(spec.mask, s, q_lo, q_hi, np.array([0]), np.array([prefix]))[0, 0] != FULL:
            return False
    return True


def _make(batch: RaggedBatch, members: list[int], prefix: int, layout: KVLayout) -> Cascade:
    """Stack the members' queries; cut the prefix into page-aligned parts, one task each (split-KV), so that the
    prefix pass uses every core even though the stacked queries form a single query tile."""
    rows = [torch.arange(batch.q_starts[s], batch.q_starts[s] + batch.q_lens[s]) for s in members]
    q_rows = torch.cat(rows)
    pages = prefix // layout.block
    parts = max(1, min(torch.get_num_threads(), pages))
    bounds = np.linspace(0, pages, parts + 1).astype(int)
    base = layout.row_base[members[0]]
    width = int(np.max(np.diff(bounds)))
    part_base = np.zeros((parts, width), dtype=np.int64)
    for i in range(parts):
        part_base[i, : bounds[i + 1] - bounds[i]] = base[bounds[i] : bounds[i + 1]]
    part_lens = tuple(int(n) * layout.block for n in np.diff(bounds))
    return Cascade(members, prefix, q_rows, RaggedBatch((len(q_rows),) * parts, part_lens),
                   KVLayout(part_base, layout.block), np.ascontiguousarray(base[:pages], dtype=np.int64), layout.block)


def cascade_prefix(cascade: Cascade, spec: AttentionSpec, q: torch.Tensor, k_rows: torch.Tensor,
                   v_rows: torch.Tensor) -> tuple[np.ndarray | torch.Tensor, np.ndarray | torch.Tensor]:
    """Attend the members' stacked queries to the shared prefix: one partial result per key part, float32
    ``[parts, n, Hq, D]`` / ``[parts, n, Hq]`` (``[parts * n, ...]`` on the BLAS path), for :func:`merge_cascade`.

    Every prefix key is visible to every member (checked at plan time), so the prefix runs unmasked. Head dims that
    are a multiple of the SIMD width run the Numba prefix kernel (``prefix_kernel.py``: outer-product micro-kernels
    at GEMM speed with any BLAS); others run as BLAS query tiles (``prefill_attention``), one pseudo-sequence per part.

    The backend runs this before the members' suffix decode: the prefix pass is compute-bound and reads the prefix
    only once, so it gains most from finding the prefix still in L3 (where a plain step or the previous layer's
    tokens left it); the suffix decode streams from memory either way. Measured on the 32 x (4096 + 128) case right
    after a plain step: 7.8 ms this way round against 8.2 ms suffix first.
    """
    if spec.head_dim % LANES == 0:
        return _prefix_by_kernel(cascade, spec, q, k_rows, v_rows)
    return _prefix_by_blas(cascade, spec, q, k_rows, v_rows)


def merge_cascade(cascade: Cascade, parts: tuple[np.ndarray | torch.Tensor, np.ndarray | torch.Tensor],
                  out: torch.Tensor, lse: torch.Tensor) -> None:
    """Merge :func:`cascade_prefix`'s parts by log-sum-exp into the members' suffix results in ``out`` / ``lse``
    (float32, in place)."""
    part_out, part_lse = parts
    if isinstance(part_out, np.ndarray):
        # One Numba pass (the torch merge of [32, 32, 128] rows cost ~0.4 ms per step, 5% of the cascade), on the
        # calling thread when it is small
        merge = merge_prefix_parts if part_out.size > SERIAL_MERGE_ELEMENTS else merge_prefix_parts_serial
        merge(out.numpy(), lse.numpy(), cascade.q_rows.numpy(), part_out, part_lse)
        return
    n = len(cascade.q_rows)
    merged, merged_lse = out[cascade.q_rows], lse[cascade.q_rows]
    for i in range(part_out.shape[0] // n):
        rows = slice(i * n, (i + 1) * n)
        merged, merged_lse = merge_states(merged, merged_lse, part_out[rows], part_lse[rows])
    out[cascade.q_rows], lse[cascade.q_rows] = merged, merged_lse


def _prefix_by_kernel(cascade: Cascade, spec: AttentionSpec, q: torch.Tensor, k_rows: torch.Tensor,
                      v_rows: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Results float32 ``[parts, n, Hq, D]`` / ``[parts, n, Hq]`` of the prefix kernel. Work items are (kv head, key
    part): parts are added until there are at least two items per core, in whole key tiles."""
    n, workers = len(cascade.q_rows), torch.get_num_threads()
    tiles = -(-cascade.prefix_len // KEY_TILE)
    parts = max(1, min(tiles, -(-2 * workers // spec.num_kv_heads)))
    # integer arithmetic: np.linspace cost 0.09 ms per call, 1% of the step
    bounds = np.array([min(tiles * i // parts * KEY_TILE, cascade.prefix_len) for i in range(parts + 1)],
                      dtype=np.int64)
    out = np.empty((parts, n, spec.num_q_heads, spec.head_dim), dtype=np.float32)
    lse = np.empty((parts, n, spec.num_q_heads), dtype=np.float32)
    softcap = spec.score.cap if isinstance(spec.score, Softcap) else 0.0
    qf = q if q.dtype == torch.float32 else q.float()
    if isinstance(k_rows, QuantizedPages):
        # Codes: the prefix's pages de-quantized once, in one pass, into float32 token rows the kernel reads as a
        # contiguous prefix (the pass reads D + 2 bytes per key and head; the kernel's work is compute-bound)
        rows = (cascade.prefix_base[:, None] + np.arange(cascade.block, dtype=np.int64)).reshape(-1)
        k_src, v_src = dequantize_token_rows(k_rows, rows).numpy(), dequantize_token_rows(v_rows, rows).numpy()
        prefix_base = np.arange(len(cascade.prefix_base), dtype=np.int64) * cascade.block
    else:
        k_src, v_src, prefix_base = storage_view(k_rows), storage_view(v_rows), cascade.prefix_base
    shared_prefix_kernel(qf.numpy(), k_src, v_src, cascade.q_rows.numpy(), prefix_base, cascade.block, bounds,
                         np.float32(spec.softmax_scale), np.float32(softcap), out, lse)
    return out, lse


def _prefix_by_blas(cascade: Cascade, spec: AttentionSpec, q: torch.Tensor, k_rows: torch.Tensor,
                    v_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, parts = len(cascade.q_rows), cascade.batch.num_seqs
    part_out = torch.zeros(parts * n, spec.num_q_heads, spec.head_dim)
    part_lse = torch.full((parts * n, spec.num_q_heads), -float("inf"))
    unmasked = dataclasses.replace(spec, mask=None, sinks=None)
    q_parts = q[cascade.q_rows].repeat(parts, 1, 1)
    prefill_attention(q_parts, k_rows, v_rows, cascade.batch, cascade.layout, list(range(parts)), unmasked,
                      part_out, part_lse)
    return part_out, part_lse
