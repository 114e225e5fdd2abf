"""Block-sparse tile classification: which (q tile, kv tile) pairs a kernel visits and which need the mask.

Backends call :func:`classify_tiles` once per sequence while planning. Built-in masks answer analytically (O(tiles),
no tensor work); custom masks answer PARTIAL here and are resolved by evaluation when a kernel first touches the tile,
so a custom mask that is all-False over a tile still skips its matmuls.
"""

from __future__ import annotations

import numpy as np
import torch

from tessera.attention.masks import EMPTY, FULL, PARTIAL, Mask


def tile_bounds(start: int, stop: int, tile: int) -> tuple[np.ndarray, np.ndarray]:
    """Half-open tile bounds covering ``[start, stop)`` in steps of ``tile``: ``(lo [n], hi [n])`` int64."""
    lo = np.arange(start, stop, tile, dtype=np.int64)
    return lo, np.minimum(lo + tile, stop)


def classify_tiles(
    mask: Mask | None, seq_index: int, q_lo: np.ndarray, q_hi: np.ndarray, kv_lo: np.ndarray, kv_hi: np.ndarray
) -> np.ndarray:
    """Classes ``[num_q_tiles, num_kv_tiles]`` int8 (EMPTY=0, PARTIAL=1, FULL=2) for one sequence.

    Parameters
    ----------
    mask : the spec's mask; None means every tile is FULL.
    seq_index : the batch index ``b`` seen by the mask.
    q_lo, q_hi : int64 ``[num_q_tiles]``, absolute query positions of each q tile (half-open).
    kv_lo, kv_hi : int64 ``[num_kv_tiles]``, absolute kv positions of each kv tile (half-open).
    """
    shape = (len(q_lo), len(kv_lo))
    if mask is None:
        return np.full(shape, FULL, dtype=np.int8)
    classes = mask.classify(seq_index, q_lo[:, None], q_hi[:, None], kv_lo[None, :], kv_hi[None, :])
    return np.broadcast_to(np.asarray(classes, dtype=np.int8), shape)


def resolve_partial_tile(
    mask: Mask, b: torch.Tensor, heads: torch.Tensor, q_pos: torch.Tensor, kv_lo: int, kv_hi: int
) -> tuple[int, torch.Tensor]:
    """Evaluate ``mask`` on a tile classified PARTIAL and say what it really is.

    This is how custom masks are classified "by evaluation": the kernel that is about to touch the tile evaluates
    it once, and the answer decides whether its matmuls run (EMPTY: skip) and whether masking is needed (FULL: no).

    Returns
    -------
    (EMPTY, PARTIAL or FULL, the bool keep tensor broadcastable to ``[Hq, q_len, kv_hi - kv_lo]``)
    """
    keep = mask.evaluate(b, heads, q_pos, torch.arange(kv_lo, kv_hi).view(1, 1, -1))
    if not bool(keep.any()):
        return int(EMPTY), keep
    return (int(FULL) if bool(keep.all()) else int(PARTIAL)), keep


__all__ = ["EMPTY", "FULL", "PARTIAL", "classify_tiles", "resolve_partial_tile", "tile_bounds"]
