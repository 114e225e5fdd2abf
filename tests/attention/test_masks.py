"""Masks: ``classify`` must agree with ``evaluate`` (kernels skip EMPTY tiles and skip masking FULL ones)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tessera.attention import (
    EMPTY,
    FULL,
    PARTIAL,
    Mask,
    ScoreMod,
    causal,
    chunked,
    custom,
    custom_mask,
    document,
    prefix_lm,
    sliding_window,
)
from tests.attention import strategies as S

NUM_SEQS, LENGTH, HEADS = 3, 200, 4


def _exact_classes(mask: Mask, b: int, q_lo, q_hi, kv_lo, kv_hi) -> np.ndarray:
    """Class of each rectangle by evaluating every pair of it, over all heads."""
    out = np.empty(len(q_lo), dtype=np.int8)
    h = torch.arange(HEADS).view(-1, 1, 1)
    for i in range(len(q_lo)):
        q_pos = torch.arange(q_lo[i], q_hi[i]).view(1, -1, 1)
        kv_pos = torch.arange(kv_lo[i], kv_hi[i]).view(1, 1, -1)
        shape = (HEADS, q_hi[i] - q_lo[i], kv_hi[i] - kv_lo[i])
        keep = torch.broadcast_to(mask.evaluate(torch.tensor(b), h, q_pos, kv_pos), shape)
        out[i] = FULL if bool(keep.all()) else EMPTY if not bool(keep.any()) else PARTIAL
    return out


@st.composite
def rectangles(draw, n: int = 12) -> tuple[np.ndarray, ...]:
    """``n`` random non-empty half-open rectangles of positions inside ``[0, LENGTH)``."""
    def interval():
        return st.tuples(st.integers(0, LENGTH - 1), st.integers(1, 80)).map(lambda t: (t[0], min(t[0] + t[1], LENGTH)))
    pairs = draw(st.lists(st.tuples(interval(), interval()), min_size=n, max_size=n))
    return tuple(np.array(x, dtype=np.int64) for x in zip(*[(q[0], q[1], k[0], k[1]) for q, k in pairs]))


def _assert_sound(mask: Mask, b: int, rects, exact: bool = False) -> None:
    q_lo, q_hi, kv_lo, kv_hi = rects
    claimed = np.broadcast_to(mask.classify(b, q_lo, q_hi, kv_lo, kv_hi), q_lo.shape)
    truth = _exact_classes(mask, b, q_lo, q_hi, kv_lo, kv_hi)
    wrong = (claimed != PARTIAL) & (claimed != truth)
    assert not wrong.any(), f"{mask!r} b={b}: claims {claimed[wrong]} but is {truth[wrong]} at {np.flatnonzero(wrong)}"
    if exact:
        np.testing.assert_array_equal(claimed, truth, err_msg=f"{mask!r} is not classified exactly")


@S.PROPERTY_SETTINGS
@given(mask=S.masks(NUM_SEQS, LENGTH), b=st.integers(0, NUM_SEQS - 1), rects=rectangles())
def test_classify_is_sound(mask: Mask | None, b: int, rects) -> None:
    """FULL means every pair is kept and EMPTY means none is, for built-ins, custom masks and compositions."""
    if mask is not None:
        _assert_sound(mask, b, rects)


BUILT_INS = [
    causal(), sliding_window(1), sliding_window(7), sliding_window(500), chunked(1), chunked(16), chunked(64),
    prefix_lm(0), prefix_lm(30), prefix_lm(500),
]


@pytest.mark.parametrize("mask", BUILT_INS, ids=repr)
@S.PROPERTY_SETTINGS
@given(rects=rectangles())
def test_built_in_masks_classify_exactly(mask: Mask, rects) -> None:
    """The analytic built-ins never fall back to PARTIAL: a kernel would needlessly evaluate those tiles."""
    _assert_sound(mask, 0, rects, exact=True)


@S.PROPERTY_SETTINGS
@given(seed=S.seeds, b=st.integers(0, NUM_SEQS - 1), rects=rectangles())
def test_sorted_documents_classify_exactly(seed: int, b: int, rects) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.cumsum((torch.rand(NUM_SEQS, LENGTH, generator=g) < 0.05).long(), dim=-1)
    _assert_sound(document(ids), b, rects, exact=True)
    _assert_sound(document(ids[b]), b, rects, exact=True)


def test_classify_broadcasts_tile_grids() -> None:
    """Kernels pass column and row vectors of tile bounds and expect a ``[q_tiles, kv_tiles]`` grid back."""
    q_lo, q_hi = np.array([[0], [64], [128]]), np.array([[64], [128], [150]])
    kv_lo, kv_hi = np.array([[0, 100]]), np.array([[100, 150]])
    masks = [causal(), sliding_window(30), chunked(50), prefix_lm(20), document(torch.arange(150) // 40),
             custom_mask(lambda b, h, q, k: k <= q) & causal(), ~causal() | chunked(8)]
    for mask in masks:
        classes = np.broadcast_to(mask.classify(0, q_lo, q_hi, kv_lo, kv_hi), (3, 2))
        for i in range(3):
            for j in range(2):
                truth = _exact_classes(mask, 0, q_lo[i], q_hi[i], kv_lo[0, j:j + 1], kv_hi[0, j:j + 1])[0]
                assert classes[i, j] in (PARTIAL, truth), f"{mask!r} tile ({i}, {j})"


def test_evaluate_semantics() -> None:
    q = torch.arange(12).view(-1, 1)
    k = torch.arange(12).view(1, -1)
    b, h = torch.tensor(0), torch.tensor(0)
    ev = lambda m: m.evaluate(b, h, q, k)  # noqa: E731
    assert torch.equal(ev(causal()), k <= q)
    assert torch.equal(ev(sliding_window(3)), (k <= q) & (k > q - 3))
    assert torch.equal(ev(chunked(4)), q // 4 == k // 4)
    assert torch.equal(ev(prefix_lm(5)), (k < 5) | (k <= q))
    ids = torch.tensor([0, 0, 1, 1, 1, 2, 0, 0, 3, 3, 3, 3])
    assert torch.equal(ev(document(ids)), ids[q] == ids[k])
    assert torch.equal(ev(~causal()), k > q)
    assert torch.equal(ev(causal() & chunked(4)), (k <= q) & (q // 4 == k // 4))
    assert torch.equal(ev(sliding_window(2) | prefix_lm(3)), ((k <= q) & (k > q - 2)) | (k < 3) | (k <= q))
    two_rows = document(torch.stack([ids, ids.flip(0)]))
    assert torch.equal(two_rows.evaluate(torch.tensor(1), h, q, k), ids.flip(0)[q] == ids.flip(0)[k])


def test_custom_dispatches_on_arity() -> None:
    assert isinstance(custom(lambda b, h, q, k: k <= q), Mask)
    assert isinstance(custom(lambda s, b, h, q, k: s), ScoreMod)

    def with_default(b, h, q, k, extra=None):  # 5 positional parameters: a score function by signature
        return k <= q

    assert isinstance(custom(with_default), ScoreMod)


def test_head_dependence_propagates() -> None:
    assert not causal().head_dependent
    assert custom_mask(lambda b, h, q, k: k <= q).head_dependent
    assert (causal() & custom_mask(lambda b, h, q, k: k <= q)).head_dependent
    assert (~(causal() | custom_mask(lambda b, h, q, k: k <= q))).head_dependent
    assert not (~(causal() | sliding_window(3))).head_dependent
