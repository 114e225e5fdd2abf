"""Block-sparse schedules: which kv tiles each q tile of one sequence visits, from the mask's analytic classification.

A :class:`TileSchedule` is what the ``block-sparse-schedule`` pass (:mod:`tessera.mlir.passes`) attaches to a
``tessera.attention`` op and what the planner (:mod:`tessera.backends.mlir.planner`) turns into work items. Both
get it from :func:`tile_schedule`, which asks :func:`~tessera.attention.tiles.classify_tiles` (the classification
the cpu and triton backends plan with) and keeps every tile that is not EMPTY. The kept tiles are stored in CSR form:
q tile ``i`` visits the kv tiles starting at keys ``kv_starts[row_ptr[i] : row_ptr[i + 1]]``.

Query ``t`` of ``q_len`` sits at position ``kv_len - q_len + t`` (the queries are the last ``q_len`` of the
``kv_len`` keys), and q tiles are aligned to absolute positions, as the planner's work items are.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tessera.attention.masks import EMPTY, Mask
from tessera.attention.tiles import classify_tiles, tile_bounds


@dataclass(frozen=True, eq=False)
class TileSchedule:
    """The kv tiles each q tile of one sequence visits.

    Attributes
    ----------
    q_len, kv_len : int
        Queries and keys of the sequence (queries are its last ``q_len`` positions).
    q_tile, kv_tile : int
        Query positions per q tile and keys per kv tile.
    row_ptr : int64 ``[num_q_tiles + 1]``
        Offsets into ``kv_starts``: q tile ``i`` keeps ``kv_starts[row_ptr[i]:row_ptr[i + 1]]``.
    kv_starts : int64 ``[row_ptr[-1]]``
        First key of each kept kv tile, ascending within a q tile.
    """

    q_len: int
    kv_len: int
    q_tile: int
    kv_tile: int
    row_ptr: np.ndarray
    kv_starts: np.ndarray

    def __post_init__(self) -> None:
        q_lo, _ = self.q_bounds()
        ptr, starts = np.asarray(self.row_ptr, np.int64), np.asarray(self.kv_starts, np.int64)
        object.__setattr__(self, "row_ptr", ptr)
        object.__setattr__(self, "kv_starts", starts)
        if ptr.ndim != 1 or len(ptr) != len(q_lo) + 1 or (len(ptr) and ptr[0] != 0) or np.any(np.diff(ptr) < 0):
            raise ValueError(f"TileSchedule: row_ptr must be {len(q_lo) + 1} non-decreasing offsets starting at 0 "
                             f"(one per q tile of {self.q_tile} over {self.q_len} queries, plus one), got "
                             f"{ptr.tolist()}")
        if starts.ndim != 1 or len(starts) != ptr[-1]:
            raise ValueError(f"TileSchedule: kv_starts must hold row_ptr[-1] = {int(ptr[-1])} tile starts, got "
                             f"{len(starts)}")
        bad = starts[(starts % self.kv_tile != 0) | (starts < 0) | (starts >= max(self.kv_len, 1))]
        if len(bad):
            raise ValueError(f"TileSchedule: kv tile starts must be multiples of kv_tile={self.kv_tile} in "
                             f"[0, kv_len={self.kv_len}), got {bad.tolist()}")

    def q_bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """Absolute query positions of each q tile, half-open ``(lo, hi)``."""
        if self.q_tile < 1 or self.kv_tile < 1:
            raise ValueError(f"TileSchedule: q_tile and kv_tile must be >= 1, got {self.q_tile} and {self.kv_tile}")
        if not 0 <= self.q_len <= self.kv_len:
            raise ValueError(f"TileSchedule: need 0 <= q_len <= kv_len (queries are the last keys), got q_len="
                             f"{self.q_len}, kv_len={self.kv_len}")
        return tile_bounds(self.kv_len - self.q_len, self.kv_len, self.q_tile)

    def kept(self, i: int) -> np.ndarray:
        """First key of each kv tile q tile ``i`` visits."""
        return self.kv_starts[self.row_ptr[i]:self.row_ptr[i + 1]]

    def visited(self) -> int:
        """Kept (q tile, kv tile) pairs."""
        return int(self.row_ptr[-1])


def tile_schedule(mask: Mask | None, seq_index: int, q_len: int, kv_len: int, q_tile: int, kv_tile: int
                  ) -> TileSchedule:
    """The schedule of sequence ``seq_index`` under ``mask``: every (q tile, kv tile) pair the mask's analytic
    classification does not call EMPTY (custom masks answer PARTIAL everywhere, so they keep every tile)."""
    probe = TileSchedule(q_len, kv_len, q_tile, kv_tile, np.zeros(-(-q_len // q_tile) + 1, np.int64),
                         np.zeros(0, np.int64))  # validates the sizes before classifying
    q_lo, q_hi = probe.q_bounds()
    kv_lo, kv_hi = tile_bounds(0, kv_len, kv_tile)
    keep = classify_tiles(mask, seq_index, q_lo, q_hi, kv_lo, kv_hi) != EMPTY
    row_ptr = np.concatenate([[0], np.cumsum(keep.sum(axis=1))]).astype(np.int64)
    kv_starts = np.broadcast_to(kv_lo, keep.shape)[keep].astype(np.int64)
    return TileSchedule(q_len, kv_len, q_tile, kv_tile, row_ptr, kv_starts)


def dense_schedule(q_len: int, kv_len: int, q_tile: int, kv_tile: int) -> TileSchedule:
    """Every q tile visits every kv tile (masks whose values are only known at run time)."""
    return tile_schedule(None, 0, q_len, kv_len, q_tile, kv_tile)


__all__ = ["TileSchedule", "dense_schedule", "tile_schedule"]
