"""Host-side planning for the Triton kernels: work items, block-sparse kv tile lists and split-KV.

A *launch* is one call of ``attention_kernel`` with one block shape. Sequences with at most ``DECODE_MAX_Q`` queries
(decode and multi-token verification) go to the decode launch, whose items may be split over kv tiles and merged;
the rest go to the prefill launch. Everything here depends on lengths, the page table and the mask, never on tensor
values, so one plan serves every layer of a step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from tessera.attention.masks import FULL, PARTIAL
from tessera.attention.spec import AttentionSpec
from tessera.attention.tiles import classify_tiles, tile_bounds
from tessera.backends.base import KVLayout, RaggedBatch
from tessera.backends.triton.configs import Configs, LaunchConfig
from tessera.backends.triton.kernels import FULL_CNT, ITEM_FIELDS, MERGE_FIELDS, PART_CNT

DECODE_MAX_Q = 8


@dataclass
class Launch:
    """The work of one kernel launch (host arrays; the backend uploads them once per device)."""

    config: LaunchConfig
    heads: int  # query heads per tile (HEADS): min(group size, block_m)
    items: np.ndarray  # int32 [num_items, ITEM_FIELDS]
    tiles: np.ndarray  # int32 [num_tile_entries]: kv start positions
    merges: np.ndarray  # int32 [num_merges, MERGE_FIELDS]
    num_slots: int  # partial-result slots of split items

    @property
    def num_items(self) -> int:
        return int(self.items.shape[0])


@dataclass
class TritonPlan:
    spec: AttentionSpec
    batch: RaggedBatch
    row_base: np.ndarray  # int32 [num_seqs, max_blocks]
    block_size: int
    launches: list[Launch]
    variant: object  # codegen.Variant
    device_state: dict = field(default_factory=dict)  # per-device uploads, filled by the backend


def plan_launches(spec: AttentionSpec, batch: RaggedBatch, configs: Configs) -> list[Launch]:
    """Split the batch into a decode and a prefill launch and build each one's items."""
    decode = [s for s in range(batch.num_seqs) if 0 < batch.q_lens[s] <= DECODE_MAX_Q]
    prefill = [s for s in range(batch.num_seqs) if batch.q_lens[s] > DECODE_MAX_Q]
    launches = []
    if decode:
        rows = max(batch.q_lens[s] for s in decode) * spec.group_size
        block_m = min(max(configs.decode.block_m, _next_pow2(rows)), 64)
        cfg = LaunchConfig(block_m, configs.decode.block_n, configs.decode.num_warps, configs.decode.num_stages)
        launches.append(_build(spec, batch, decode, cfg, configs, split=True))
    if prefill:
        launches.append(_build(spec, batch, prefill, configs.prefill, configs, split=False))
    return launches


def _build(spec: AttentionSpec, batch: RaggedBatch, seqs: list[int], cfg: LaunchConfig, configs: Configs,
           split: bool) -> Launch:
    group = spec.group_size
    heads = min(group, cfg.block_m)
    subtiles = math.ceil(group / heads)
    tokens_per_tile = cfg.block_m // heads

    # 1. Per (sequence, q tile): its non-empty kv tiles in order and which of them need the mask.
    units = []  # (seq, t0, n_tok, kv tile starts, partial flags)
    for s in seqs:
        q_len, kv_len = batch.q_lens[s], batch.kv_lens[s]
        first_pos = kv_len - q_len
        q_lo, q_hi = tile_bounds(first_pos, kv_len, tokens_per_tile)
        kv_lo, kv_hi = tile_bounds(0, kv_len, cfg.block_n)
        classes = classify_tiles(spec.mask, s, q_lo, q_hi, kv_lo, kv_hi).copy()
        if kv_len % cfg.block_n:  # the last tile runs past kv_len: its keys need the range check
            classes[:, -1] = np.minimum(classes[:, -1], PARTIAL)
        for i in range(len(q_lo)):
            keep = classes[i] != 0
            units.append((s, int(q_lo[i] - first_pos), int(q_hi[i] - q_lo[i]), kv_lo[keep], classes[i][keep] != FULL))

    # 2. Split-KV: enough programs to fill the GPU, never splits shorter than min_tiles_per_split.
    base_programs = len(units) * spec.num_kv_heads * subtiles
    want = math.ceil(configs.target_programs / max(base_programs, 1)) if split else 1

    items, tiles, merges = [], [], []
    slot = 0
    for s, t0, n_tok, starts, partial in units:
        n_splits = max(1, min(want, len(starts) // configs.min_tiles_per_split)) if split else 1
        bounds = np.linspace(0, len(starts), n_splits + 1).round().astype(int)
        ranges = []
        for j in range(n_splits):
            part_starts, part_flags = starts[bounds[j]:bounds[j + 1]], partial[bounds[j]:bounds[j + 1]]
            full_off = len(tiles)
            tiles.extend(part_starts[~part_flags].tolist())
            part_off = len(tiles)
            tiles.extend(part_starts[part_flags].tolist())
            ranges.append((full_off, part_off - full_off, part_off, len(tiles) - part_off))
        q_row, q_pos, kv_len = batch.q_starts[s] + t0, batch.kv_lens[s] - batch.q_lens[s] + t0, batch.kv_lens[s]
        for kvh in range(spec.num_kv_heads):
            for sub in range(subtiles):
                h0 = kvh * group + sub * heads
                n_heads = min(heads, (kvh + 1) * group - h0)
                for full_off, full_cnt, part_off, part_cnt in ranges:
                    items.append((s, q_row, q_pos, n_tok, h0, n_heads, kvh, full_off, full_cnt, part_off, part_cnt,
                                  kv_len, slot if n_splits > 1 else -1))
                    slot += n_splits > 1
                if n_splits > 1:
                    merges.append((q_row, n_tok, h0, n_heads, slot - n_splits, n_splits))

    items_arr = np.asarray(items, dtype=np.int32).reshape(-1, ITEM_FIELDS)
    # Longest first: programs with the most kv tiles start early, the short ones fill the tail of the wave.
    work = items_arr[:, FULL_CNT] + items_arr[:, PART_CNT]
    items_arr = np.ascontiguousarray(items_arr[np.argsort(-work, kind="stable")])
    return Launch(cfg, heads, items_arr, np.asarray(tiles if tiles else [0], dtype=np.int32),
                  np.asarray(merges, dtype=np.int32).reshape(-1, MERGE_FIELDS), slot)


def row_table(layout: KVLayout) -> np.ndarray:
    """The layout's row bases as int32 (the kernels add 64-bit strides after the lookup)."""
    base = np.maximum(np.ascontiguousarray(layout.row_base), 0)  # entries past a sequence's pages may be -1: unread
    if base.size and base.max() > np.iinfo(np.int32).max:
        raise ValueError(f"triton backend: kv row indices must lie below 2**31, got up to {int(base.max())}; "
                         "use fewer or smaller pages per cache tensor")
    return base.astype(np.int32) if base.size else np.zeros((1, 1), np.int32)


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()
