"""Host-side planning for the MLIR attention kernel: work items and the kv tiles each one visits.

A work item is ``rows`` query rows of one kv head's GQA group (rows are ``(token, head)`` pairs, token-major),
within one q tile of :data:`Q_TILE` tokens. Each sequence's :class:`~tessera.mlir.schedule.TileSchedule` (the mask's
classification of every (q tile, kv tile) pair, :func:`~tessera.mlir.schedule.tile_schedule`, or one a
``block-sparse-schedule`` pass attached to the IR) lists the kv tiles of ``kv_tile`` keys each q tile keeps; an item
visits only those. Everything depends on lengths, the page table and the mask, never on tensor values.

``rows``, ``kv_tile`` and the key-layout threshold are the tunables ``mlir_attention_rows``,
``mlir_attention_kv_tile`` and ``mlir_tokens_max_q`` (:mod:`tessera.backends.mlir.tunables`), read once per plan;
the plan records the first two so the backend lowers the kernel that matches it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tessera.attention.spec import AttentionSpec
from tessera.backends.base import KVLayout, RaggedBatch
from tessera.mlir.attention_kernel import KV_TILE, KV_TILE_CHOICES, ROW_CHOICES, ROWS, F, ITEM_FIELDS
from tessera.mlir.schedule import TileSchedule, tile_schedule
from tessera.tuning import tuned

#: query tokens per classification tile (items never straddle one)
Q_TILE = 16
#: batches whose sequences all have at most this many queries read keys in place ("tokens" layout); others pack them
TOKENS_MAX_Q = 8


@dataclass
class MlirPlan:
    """One step's host state: the kernel's items and tiles, and how to pack the keys and values."""

    spec: AttentionSpec
    batch: RaggedBatch
    items: np.ndarray  # int32 [num_items, len(ITEM_FIELDS)], longest first
    tiles: np.ndarray  # int32 [num_tile_entries]: kv start positions within the sequence
    key_layout: str  # "tiles" (packed by the host) or "tokens" (read in place), see attention_kernel._KeyReader
    kv_gather: np.ndarray | None  # tiles: int64 [packed rows], the k_rows row each packed row copies (-1: zeros)
    kv_map: np.ndarray  # tokens: int32 [2 + num_seqs * max_blocks] = block, max_blocks, row bases; else [0, 0]
    rows: int = ROWS  # query rows per item: the kernel must be lowered with the same value
    kv_tile: int = KV_TILE  # keys per kv tile: likewise


def build_plan(spec: AttentionSpec, batch: RaggedBatch, layout: KVLayout, key_layout: str | None = None,
               schedules: Sequence[TileSchedule] | None = None, rows: int | None = None,
               kv_tile: int | None = None) -> MlirPlan:
    """Items and tiles of one step (see the module docstring).

    ``key_layout`` None chooses: "tokens" (keys and values read in place through the page table, no copy) when every
    sequence has at most ``mlir_tokens_max_q`` queries (:data:`TOKENS_MAX_Q` untuned), as in decode, where packing
    would copy the whole cache per step for a few rows of work; "tiles" (packed, transposed keys: outer-product
    scores) otherwise.

    ``schedules`` (one per sequence, e.g. from a ``block-sparse-schedule`` annotation) replace the classification;
    their kv tile size becomes the plan's. ``rows`` and ``kv_tile`` None read the tunables.
    """
    from tessera.backends.mlir import tunables  # noqa: F401  (registers the tunables read here; cached after once)

    if key_layout is None:
        key_layout = "tokens" if max(batch.q_lens, default=0) <= tuned("mlir_tokens_max_q", None, TOKENS_MAX_Q) \
            else "tiles"
    if key_layout not in ("tiles", "tokens"):
        raise ValueError(f"key_layout must be 'tiles' or 'tokens', got {key_layout!r}")
    rows = tuned("mlir_attention_rows", None, ROWS) if rows is None else rows
    if schedules is not None:
        schedules = list(schedules)
        if len(schedules) != batch.num_seqs:
            raise ValueError(f"schedules: expected one TileSchedule per sequence ({batch.num_seqs}), got "
                             f"{len(schedules)}")
        for s, sched in enumerate(schedules):
            if (sched.q_len, sched.kv_len) != (batch.q_lens[s], batch.kv_lens[s]):
                raise ValueError(f"schedules[{s}] is for q_len={sched.q_len}, kv_len={sched.kv_len} but sequence {s} "
                                 f"has q_len={batch.q_lens[s]}, kv_len={batch.kv_lens[s]}")
        tile_sizes = {sched.kv_tile for sched in schedules}
        if len(tile_sizes) > 1 or (kv_tile is not None and tile_sizes and tile_sizes != {kv_tile}):
            raise ValueError("schedules: every schedule must use one kv tile size"
                             + ("" if kv_tile is None else f" (the plan's, {kv_tile})") + f"; got {sorted(tile_sizes)}")
        kv_tile = kv_tile if not tile_sizes else tile_sizes.pop()
    kv_tile = tuned("mlir_attention_kv_tile", None, KV_TILE) if kv_tile is None else kv_tile
    if rows not in ROW_CHOICES or kv_tile not in KV_TILE_CHOICES:
        raise ValueError(f"mlir plan: rows must be one of {ROW_CHOICES} and kv_tile one of {KV_TILE_CHOICES} (the "
                         f"mlir_attention_rows / mlir_attention_kv_tile tunables), got rows={rows!r}, "
                         f"kv_tile={kv_tile!r}")
    group = spec.group_size
    if key_layout == "tiles":
        gather, kv_row0 = _packing(batch, layout, kv_tile)
        kv_map = np.zeros(2, np.int32)
    else:
        gather, kv_row0, kv_map = None, [0] * batch.num_seqs, _kv_map(layout)
    items: list[np.ndarray] = []
    tiles: list[np.ndarray] = []
    tile_count = 0
    heads = np.arange(spec.num_kv_heads, dtype=np.int64)
    for s in range(batch.num_seqs):
        q_len, kv_len = batch.q_lens[s], batch.kv_lens[s]
        if q_len == 0:
            continue
        first_pos = kv_len - q_len
        sched = schedules[s] if schedules is not None else tile_schedule(spec.mask, s, q_len, kv_len, Q_TILE, kv_tile)
        q_lo, q_hi = sched.q_bounds()
        for i in range(len(q_lo)):
            kept = sched.kept(i)
            row_lo, row_hi = (q_lo[i] - first_pos) * group, (q_hi[i] - first_pos) * group
            starts = np.arange(row_lo, row_hi, rows, dtype=np.int64)
            block = np.empty((len(heads), len(starts), len(ITEM_FIELDS)), dtype=np.int64)
            block[..., F["seq"]] = s
            block[..., F["row0"]] = starts
            block[..., F["num_rows"]] = np.minimum(row_hi - starts, rows)
            block[..., F["q_row0"]] = batch.q_starts[s]
            block[..., F["q_pos0"]] = first_pos
            block[..., F["kv_row0"]] = kv_row0[s]
            block[..., F["kv_len"]] = kv_len
            block[..., F["kv_head"]] = heads[:, None]
            block[..., F["tile_off"]] = tile_count
            block[..., F["tile_count"]] = len(kept)
            items.append(block.reshape(-1, len(ITEM_FIELDS)))
            tiles.append(kept)
            tile_count += len(kept)
    item_arr = np.concatenate(items) if items else np.zeros((0, len(ITEM_FIELDS)), np.int64)
    # Longest first: items with the most tiles start early, the short ones fill the tail.
    item_arr = item_arr[np.argsort(-item_arr[:, F["tile_count"]], kind="stable")]
    tile_arr = np.concatenate(tiles) if tiles and tile_count else np.zeros(1, np.int64)
    for name, arr in (("items", item_arr), ("tiles", tile_arr)):
        if arr.size and (arr.max() > np.iinfo(np.int32).max):
            raise ValueError(f"mlir backend: {name} exceed int32 (got {int(arr.max())}); split the batch")
    return MlirPlan(spec, batch, np.ascontiguousarray(item_arr, dtype=np.int32),
                    np.ascontiguousarray(tile_arr, dtype=np.int32), key_layout, gather, kv_map, rows, kv_tile)


def _kv_map(layout: KVLayout) -> np.ndarray:
    """``[block, max_blocks, row_base...]`` int32: how the "tokens" kernel finds key ``j`` of sequence ``s``."""
    base = np.maximum(np.asarray(layout.row_base, dtype=np.int64), 0)  # -1 entries (no page) are never read
    if base.size and base.max() > np.iinfo(np.int32).max:
        raise ValueError(f"mlir backend: kv row indices must lie below 2**31, got up to {int(base.max())}; use fewer "
                         "or smaller pages per cache tensor")
    return np.concatenate([[layout.block, base.shape[1]], base.reshape(-1)]).astype(np.int32)


def _packing(batch: RaggedBatch, layout: KVLayout, kv_tile: int) -> tuple[np.ndarray, list[int]]:
    """Which row of ``k_rows``/``v_rows`` each packed row copies, and where each sequence starts in the packing.

    Every sequence's keys become consecutive (a paged cache is gathered) and start at a multiple of
    ``kv_tile`` (a multiple of 16), so a kv tile is whole blocks of the packed layout. Rows past a sequence's end copy
    row ``len(k_rows)``: the zero row the backend appends, so a tile never reads a page that may hold uninitialized
    values (NaN times a zero probability would still be NaN).
    """
    parts, starts, pos = [], [], 0
    for s in range(batch.num_seqs):
        n = batch.kv_lens[s]
        rows = layout.rows(s, n)
        rows = np.arange(rows.start, rows.stop, dtype=np.int64) if isinstance(rows, slice) else rows
        padded = -(-n // kv_tile) * kv_tile
        parts.append(np.concatenate([rows, np.full(padded - n, -1, dtype=np.int64)]))
        starts.append(pos)
        pos += padded
    return (np.concatenate(parts) if parts else np.zeros(0, np.int64)), starts
