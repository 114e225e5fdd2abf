"""The cpu decode planner's shortcut for plain decode steps builds exactly the schedule of its general path."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tessera.attention import AttentionSpec, causal, sliding_window
from tessera.backends.base import KVLayout, RaggedBatch
from tessera.backends.cpu import decode
from tests.attention.strategies import PROPERTY_SETTINGS


def _both(m: pytest.MonkeyPatch, batch: RaggedBatch, seqs: list[int], spec: AttentionSpec, layout: KVLayout):
    fast = decode.DecodePlan.build(batch, seqs, spec, layout)
    m.setattr(decode, "_sees_every_key", lambda mask: False)  # the general path: classify every tile
    general = decode.DecodePlan.build(batch, seqs, spec, layout)
    return fast, general


def _assert_same(fast: decode.DecodePlan, general: decode.DecodePlan) -> None:
    for name, a, b in zip(fast.schedule._fields, fast.schedule, general.schedule):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and np.array_equal(a, b), name
    assert (fast.num_items, fast.rows_per_item, fast.head_dim, fast.serial, fast.direct) == \
        (general.num_items, general.rows_per_item, general.head_dim, general.serial, general.direct)


@PROPERTY_SETTINGS
@given(kv_lens=st.lists(st.integers(1, 3000), min_size=1, max_size=6), page_size=st.sampled_from([1, 4, 16]),
       masked=st.booleans(), split=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_plain_decode_schedule_equals_the_general_one(kv_lens, page_size, masked, split, seed) -> None:
    """One query per sequence over shuffled pages (partial last pages included), causal or no mask, serial or
    split over the threads: every schedule array and every plan field equal the general planner's."""
    rng = np.random.default_rng(seed)
    batch = RaggedBatch(tuple([1] * len(kv_lens)), tuple(kv_lens))
    pages = max(-(-kl // page_size) for kl in kv_lens)
    table = rng.permutation(len(kv_lens) * pages).reshape(len(kv_lens), pages)
    spec = AttentionSpec(6, 2, 32, mask=causal() if masked else None)
    with pytest.MonkeyPatch.context() as m:  # not the fixture: hypothesis runs many examples per test call
        # split: every step goes over the threads; else every step runs serially
        m.setattr(decode, "SERIAL_MAX_BYTES", 0 if split else 1 << 62)
        m.setattr(decode, "tuned", lambda name, shape, default: default)
        seqs = sorted(rng.choice(len(kv_lens), size=rng.integers(1, len(kv_lens) + 1), replace=False).tolist())
        fast, general = _both(m, batch, seqs, spec, KVLayout.paged(table, page_size))
    _assert_same(fast, general)


@pytest.mark.parametrize("spec", [AttentionSpec(4, 2, 16, mask=sliding_window(100)),
                                  AttentionSpec(4, 2, 16, mask=causal() & sliding_window(100))],
                         ids=["window", "causal-and-window"])
def test_masks_that_hide_keys_take_the_general_path(spec) -> None:
    """A window (alone or composed with causal) hides early keys: the shortcut does not apply, and its tiles are
    dropped exactly as before."""
    assert not decode._sees_every_key(spec.mask)
    batch = RaggedBatch((1,), (700,))
    plan = decode.DecodePlan.build(batch, [0], spec, KVLayout.contiguous(batch))
    assert plan.schedule.seg_start[0] > 0  # the first tiles are outside the window


@PROPERTY_SETTINGS
@given(seg_counts=st.lists(st.integers(0, 5), min_size=1, max_size=6))
def test_unsplit_items_equal_the_splitting_loop_that_never_cuts(seg_counts) -> None:
    """``_split_items(split=False)`` (one item per sequence, built directly) equals its splitting loop run with a
    part size no sequence reaches."""
    segs, ranges = decode._Segments(), []
    for count in seg_counts:
        lo = len(segs.start)
        for j in range(count):
            segs.add(256 * j, 256 * j + 200)
        ranges.append((lo, len(segs.start)))
    direct = decode._split_items(segs, ranges, split=False)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(decode, "MIN_PART_KEYS", 1 << 62)
        looped = decode._split_items(segs, ranges, split=True)
    for a, b in zip(direct, looped):
        assert a.dtype == b.dtype and np.array_equal(a, b)


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_one_item_goes_to_the_first_worker(workers) -> None:
    order, start = decode._schedule(np.array([700], dtype=np.int64), workers)
    assert order.tolist() == [0] and start.tolist() == [0] + [1] * workers
    order, start = decode._schedule(np.array([700, 300], dtype=np.int64), workers)  # the LPT loop
    assert sorted(order.tolist()) == [0, 1] and start[-1] == 2
