"""BlockManager: allocation, refcounts, prefix caching, copy-on-write, eviction, errors, and a stateful property test.

The stateful test keeps a shadow model and a fake device: every slot holds the full token prefix up to and
including its position (what a real KV entry depends on). A page handed out while in use, a copy-on-write that is
missed, or a prefix hit on the wrong page therefore shows up as a slot holding the wrong prefix.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import tessera.kv.block_manager as block_manager
from tessera.kv import AllocationResult, BlockManager, OutOfPagesError


def computed(bm: BlockManager, seq_id: int, token_ids: list[int]) -> AllocationResult:
    """Allocate a prompt and mark all of it computed, as one unchunked prefill would."""
    result = bm.allocate(seq_id, token_ids)
    bm.mark_computed(seq_id, len(token_ids))
    bm.check_invariants()
    return result


# ----------------------------------------------------------------------------------------------- construction
def test_block_manager_module_imports_without_torch() -> None:
    # Loaded from its file alone: tessera/kv/__init__.py also exports the (torch) PagedKVCache.
    path = Path(block_manager.__file__)
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('bm', {str(path)!r})\n"
        "module = importlib.util.module_from_spec(spec); sys.modules['bm'] = module; spec.loader.exec_module(module)\n"
        "module.BlockManager(4, 2).allocate(0, [1, 2, 3])\n"
        "assert 'torch' not in sys.modules and 'numpy' not in sys.modules, sorted(sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("num_pages, page_size", [(0, 4), (4, 0), (-1, 4), (4, 2.0), (True, 4), (4, None)])
def test_rejects_bad_sizes(num_pages: object, page_size: object) -> None:
    with pytest.raises(ValueError, match="must be an int >= 1"):
        BlockManager(num_pages, page_size)  # type: ignore[arg-type]


def test_rejects_non_callable_hash() -> None:
    with pytest.raises(TypeError, match="hash_fn must be callable"):
        BlockManager(4, 4, hash_fn=3)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------- allocate and append
def test_allocate_partial_last_page_and_slots() -> None:
    bm = BlockManager(num_pages=8, page_size=4)
    result = bm.allocate(7, list(range(10)))
    assert result == AllocationResult((0, 1, 2), 0)
    assert bm.page_table(7) == [0, 1, 2] and bm.num_tokens(7) == 10 and bm.num_computed_tokens(7) == 0
    assert bm.slot_mapping(7) == list(range(10))
    assert bm.slot_mapping(7, 3, 6) == [3, 4, 5]
    assert bm.page_tokens(2) == (8, 9) and bm.token_ids(7) == list(range(10))
    assert bm.num_free_pages == 5 and 7 in bm and 8 not in bm
    bm.check_invariants()


def test_append_fills_last_page_before_taking_new_ones() -> None:
    bm = BlockManager(num_pages=8, page_size=4)
    bm.allocate(0, [1, 2, 3, 4, 5])
    assert bm.append(0, [6, 7]) == [] and bm.page_table(0) == [0, 1]
    assert bm.append(0, [8, 9, 10, 11, 12, 13]) == [] and bm.page_table(0) == [0, 1, 2, 3]
    assert bm.token_ids(0) == list(range(1, 14)) and bm.slot_mapping(0, 11, 13) == [11, 12]
    assert bm.append(0, []) == [] and bm.num_tokens(0) == 13
    bm.check_invariants()


def test_page_size_one() -> None:
    bm = BlockManager(num_pages=6, page_size=1)
    computed(bm, 0, [5, 6, 7])
    result = computed(bm, 1, [5, 6, 9])
    assert result.num_cached_tokens == 2 and result.page_table[:2] == (0, 1)
    assert bm.slot_mapping(1) == list(result.page_table)
    bm.append(1, [1])
    assert bm.num_free_pages == 1 and not bm.can_append(1, 2) and bm.can_append(1, 1)


def test_free_returns_every_page() -> None:
    bm = BlockManager(num_pages=4, page_size=2, enable_prefix_caching=False)
    bm.allocate(0, [1, 2, 3])
    bm.allocate(1, [4, 5, 6, 7])
    assert bm.num_free_pages == 0
    bm.free(0)
    bm.free(1)
    assert bm.num_free_pages == 4 and bm.num_cached_pages == 0 and all(bm.ref_count(p) == 0 for p in range(4))
    bm.check_invariants()


# ---------------------------------------------------------------------------------------------- prefix caching
def test_prefix_hit_shares_full_pages_only() -> None:
    bm = BlockManager(num_pages=16, page_size=4)
    a = computed(bm, 0, list(range(10)))
    b = bm.allocate(1, list(range(10)))
    assert b.num_cached_tokens == 8 and b.page_table[:2] == a.page_table[:2]
    assert b.page_table[2] != a.page_table[2]  # the partial last page is never shared from the cache
    assert [bm.ref_count(p) for p in b.page_table] == [2, 2, 1]
    c = bm.allocate(2, list(range(8)) + [99])
    assert c.num_cached_tokens == 8
    bm.check_invariants()


def test_fully_cached_prompt_still_computes_its_last_page() -> None:
    bm = BlockManager(num_pages=16, page_size=4)
    a = computed(bm, 0, list(range(8)))
    b = bm.allocate(1, list(range(8)))
    # The last token's logits are needed, so its page is computed anew rather than written while shared.
    assert b.num_cached_tokens == 4 and b.page_table[0] == a.page_table[0] and b.page_table[1] != a.page_table[1]


def test_prefix_hit_stops_at_first_differing_page() -> None:
    bm = BlockManager(num_pages=16, page_size=2)
    computed(bm, 0, [1, 2, 3, 4, 5, 6, 7])
    assert bm.allocate(1, [1, 2, 3, 9, 5, 6, 7]).num_cached_tokens == 2
    assert bm.allocate(2, [9, 2, 3, 4, 5, 6, 7]).num_cached_tokens == 0


def test_no_hit_before_the_pages_are_computed() -> None:
    bm = BlockManager(num_pages=16, page_size=2)
    bm.allocate(0, [1, 2, 3, 4, 5])
    assert bm.allocate(1, [1, 2, 3, 4, 5]).num_cached_tokens == 0
    bm.mark_computed(0, 3)  # chunked prefill: only the first page is written so far
    assert bm.allocate(2, [1, 2, 3, 4, 5]).num_cached_tokens == 2
    bm.mark_computed(0, 5)
    assert bm.allocate(3, [1, 2, 3, 4, 5]).num_cached_tokens == 4
    bm.check_invariants()


def test_decoded_pages_join_the_cache() -> None:
    bm = BlockManager(num_pages=16, page_size=2)
    computed(bm, 0, [1, 2, 3])
    bm.append(0, [4, 5])
    bm.mark_computed(0, 5)
    assert bm.allocate(1, [1, 2, 3, 4, 5]).num_cached_tokens == 4


def test_cached_pages_survive_free_and_are_reused() -> None:
    bm = BlockManager(num_pages=4, page_size=2)
    a = computed(bm, 0, [1, 2, 3, 4, 5])
    bm.free(0)
    assert bm.num_free_pages == 4 and bm.num_cached_pages == 2 and bm.page_tokens(a.page_table[2]) == ()
    b = bm.allocate(1, [1, 2, 3, 4, 6])
    assert b.num_cached_tokens == 4 and b.page_table[:2] == a.page_table[:2] and bm.num_cached_pages == 0
    bm.check_invariants()


def test_prefix_caching_disabled() -> None:
    bm = BlockManager(num_pages=8, page_size=2, enable_prefix_caching=False)
    computed(bm, 0, [1, 2, 3, 4, 5])
    assert bm.allocate(1, [1, 2, 3, 4, 5]).num_cached_tokens == 0
    bm.free(0)
    assert bm.num_cached_pages == 0


def test_duplicate_computation_is_kept_private() -> None:
    bm = BlockManager(num_pages=8, page_size=2)
    bm.allocate(0, [1, 2, 3])
    bm.allocate(1, [1, 2, 3])  # same prompt in the same step: no hit yet, computed twice
    bm.mark_computed(0, 3)
    bm.mark_computed(1, 3)
    bm.check_invariants()
    bm.free(1)  # its duplicate page is not registered, so it goes straight back to the free list
    assert bm.num_cached_pages == 0 and bm.allocate(2, [1, 2, 3]).page_table[0] == bm.page_table(0)[0]


# ------------------------------------------------------------------------------------------------ eviction (LRU)
def test_eviction_takes_free_pages_first_then_least_recently_released() -> None:
    bm = BlockManager(num_pages=6, page_size=2)
    pages = {}
    for seq_id, first in enumerate((10, 20, 30)):  # three cached one-page prefixes, each with a private tail page
        pages[first] = computed(bm, seq_id, [first, first + 1, 0]).page_table[0]
    for seq_id in (0, 1, 2):
        bm.free(seq_id)
    computed(bm, 3, [10, 11, 0])
    bm.free(3)  # the hit made prefix 10 the most recently released
    assert bm.cached_page_ids() == (pages[20], pages[30], pages[10])
    bm.allocate(4, [1] * 6)  # three pages: the three free ones, nothing evicted
    assert bm.num_cached_pages == 3
    bm.allocate(5, [2] * 4)  # two pages: evicts prefix 20, then prefix 30
    assert bm.cached_page_ids() == (pages[10],)
    bm.free(4)
    assert bm.allocate(6, [20, 21, 0]).num_cached_tokens == 0
    assert bm.allocate(7, [10, 11, 0]).num_cached_tokens == 2
    bm.check_invariants()


def test_freed_sequence_evicts_its_tail_before_its_head() -> None:
    bm = BlockManager(num_pages=4, page_size=1)
    table = bm.allocate(0, [1, 2, 3, 4]).page_table
    bm.mark_computed(0, 3)
    bm.free(0)
    assert bm.cached_page_ids() == (table[2], table[1], table[0])  # the uncomputed last page went free
    bm.allocate(1, [9, 9])  # the free page, then the tail of the old prompt
    bm.free(1)
    assert bm.allocate(2, [1, 2, 3, 7]).num_cached_tokens == 2
    bm.check_invariants()


# ------------------------------------------------------------------------------------------ fork, copy-on-write
def test_fork_then_copy_on_write_of_the_shared_partial_page() -> None:
    bm = BlockManager(num_pages=8, page_size=4)
    parent = computed(bm, 0, [1, 2, 3, 4, 5]).page_table
    bm.fork(0, 1)
    assert bm.page_table(1) == list(parent) and [bm.ref_count(p) for p in parent] == [2, 2]
    copies = bm.append(0, [6])
    new_last = bm.page_table(0)[1]
    assert copies == [(parent[1], new_last)] and new_last not in parent
    assert bm.token_ids(0) == [1, 2, 3, 4, 5, 6] and bm.token_ids(1) == [1, 2, 3, 4, 5]
    assert bm.ref_count(parent[0]) == 2 and bm.ref_count(parent[1]) == 1
    assert bm.append(1, [7]) == [] and bm.page_table(1) == list(parent)  # now private: written in place
    assert bm.num_computed_tokens(1) == 5
    bm.check_invariants()


def test_fork_with_a_full_last_page_needs_no_copy() -> None:
    bm = BlockManager(num_pages=8, page_size=2)
    computed(bm, 0, [1, 2, 3, 4])
    bm.fork(0, 1)
    assert bm.append(0, [5]) == [] and bm.append(1, [6]) == []
    assert bm.page_table(0)[:2] == bm.page_table(1)[:2] and bm.page_table(0)[2] != bm.page_table(1)[2]
    bm.check_invariants()


def test_child_keeps_pages_after_parent_is_freed() -> None:
    bm = BlockManager(num_pages=4, page_size=2, enable_prefix_caching=False)
    bm.allocate(0, [1, 2, 3])
    bm.fork(0, 1)
    bm.free(0)
    assert bm.token_ids(1) == [1, 2, 3] and bm.num_free_pages == 2
    assert bm.append(1, [4]) == []  # the sole owner again: no copy
    bm.check_invariants()


def test_capacity_counts_the_copy() -> None:
    bm = BlockManager(num_pages=2, page_size=4, enable_prefix_caching=False)
    bm.allocate(0, [1, 2])
    bm.fork(0, 1)
    assert bm.can_append(0, 2) and not bm.can_append(0, 3)  # one page for the copy, none left for the next page
    bm.allocate(2, [3])
    assert not bm.can_append(0, 1)
    with pytest.raises(OutOfPagesError) as info:
        bm.append(0, [5])
    assert (info.value.needed, info.value.available) == (1, 0)
    assert bm.token_ids(0) == [1, 2]


# ------------------------------------------------------------------------------------------ hash collisions
def test_colliding_hashes_never_share_wrong_pages() -> None:
    bm = BlockManager(num_pages=16, page_size=2, hash_fn=lambda parent, tokens: 0)
    computed(bm, 0, [1, 2, 3, 4, 5])  # the table holds one entry: its first page [1, 2]
    assert bm.allocate(1, [7, 8, 9]).num_cached_tokens == 0  # hash hit, other tokens
    # Page 2 of this prompt holds [1, 2] too, and hashes the same, but at another position: no share.
    result = bm.allocate(2, [1, 2, 1, 2, 9])
    assert result.num_cached_tokens == 2 and result.page_table[1] != result.page_table[0]
    bm.check_invariants()


def test_colliding_hashes_through_a_patched_module_function(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(block_manager, "page_hash", lambda parent, tokens: len(tokens))
    bm = BlockManager(num_pages=16, page_size=2)
    computed(bm, 0, [1, 2, 3, 4, 5])
    assert bm.allocate(1, [3, 4, 3, 4, 5]).num_cached_tokens == 0
    assert bm.allocate(2, [1, 2, 3, 4, 5]).num_cached_tokens == 2  # later pages collide with the first: no hit
    bm.check_invariants()


def test_a_reused_parent_page_does_not_revive_its_old_children() -> None:
    # Hash = first token, so chains collide. Page ids are reused: a cached child must not follow a parent page that
    # was freed and refilled, even when the refilled page hashes to what the walk expects.
    bm = BlockManager(num_pages=5, page_size=1, hash_fn=lambda parent, tokens: tokens[0])
    bm.allocate(0, [1, 9])
    b = bm.allocate(1, [1, 2, 3])  # computed twice: b's first page stays unregistered (key 1 is taken by a's)
    bm.mark_computed(0, 2)
    bm.mark_computed(1, 3)  # b's [2] is registered as the child of b's first page
    bm.free(1)  # b's first page goes to the free list; its child stays cached
    d = bm.allocate(2, [5, 0])  # refills b's first page with [5] ...
    assert d.page_table[0] == b.page_table[0]
    bm.mark_computed(2, 1)  # ... and registers it
    bm.free(0)
    result = bm.allocate(3, [5, 2, 0])
    assert result.page_table[0] == d.page_table[0] and result.num_cached_tokens == 1  # [2] computed anew
    bm.check_invariants()


# ------------------------------------------------------------------------------------------------------ errors
def test_errors_name_the_problem() -> None:
    bm = BlockManager(num_pages=2, page_size=2)
    bm.allocate(0, [1, 2, 3])
    for call in (lambda: bm.append(9, [1]), lambda: bm.free(9), lambda: bm.fork(9, 10), lambda: bm.page_table(9),
                 lambda: bm.slot_mapping(9), lambda: bm.mark_computed(9, 0), lambda: bm.can_append(9)):
        with pytest.raises(KeyError, match="sequence 9 is not allocated"):
            call()
    with pytest.raises(ValueError, match="already allocated"):
        bm.allocate(0, [1])
    with pytest.raises(ValueError, match="already allocated"):
        bm.fork(0, 0)
    with pytest.raises(ValueError, match="empty prompt"):
        bm.allocate(1, [])
    with pytest.raises(TypeError, match="integer token ids"):
        bm.allocate(1, [1.5])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=">= 0"):
        bm.append(0, [-1])
    with pytest.raises(ValueError, match=r"in \[0, 3\]"):
        bm.mark_computed(0, 4)
    bm.mark_computed(0, 2)
    with pytest.raises(ValueError, match=r"in \[2, 3\]"):
        bm.mark_computed(0, 1)
    with pytest.raises(ValueError, match="start <= end"):
        bm.slot_mapping(0, 2, 4)
    with pytest.raises(ValueError, match="at least 1 token"):
        bm.can_allocate(0)
    with pytest.raises(ValueError, match="new tokens"):
        bm.can_append(0, -1)
    bm.check_invariants()


def test_out_of_pages_changes_nothing() -> None:
    bm = BlockManager(num_pages=3, page_size=2)
    computed(bm, 0, [1, 2, 3, 4])
    assert not bm.can_allocate(3) and not bm.can_allocate([5, 6, 7])
    assert bm.can_allocate([1, 2, 3])  # the shared first page counts: one fresh page is enough
    with pytest.raises(OutOfPagesError, match="needs 2 more KV page"):
        bm.allocate(1, [5, 6, 7])
    assert 1 not in bm and bm.num_free_pages == 1
    with pytest.raises(OutOfPagesError):
        bm.append(0, [5, 6, 7])
    assert bm.token_ids(0) == [1, 2, 3, 4]
    bm.check_invariants()


def test_a_cached_hit_leaves_the_evictable_pool() -> None:
    bm = BlockManager(num_pages=2, page_size=2)
    computed(bm, 0, [1, 2, 3])
    bm.free(0)  # one cached page, one free page
    assert bm.num_free_pages == 2 and bm.can_allocate([1, 2, 3])
    # One hit plus two fresh pages: the hit page cannot also be evicted for one of them.
    assert not bm.can_allocate([1, 2, 3, 4, 5]) and bm.can_allocate(4)
    with pytest.raises(OutOfPagesError, match="needs 2 more KV page"):
        bm.allocate(1, [1, 2, 3, 4, 5])
    assert bm.num_cached_pages == 1
    bm.check_invariants()


def test_truncate_drops_uncomputed_tokens_and_frees_their_pages() -> None:
    bm = BlockManager(num_pages=8, page_size=4)
    bm.allocate(0, [1, 2, 3, 4, 5, 6])
    bm.mark_computed(0, 6)
    bm.append(0, [7, 8, 9, 10, 11])  # a decode token and four drafted ones: pages 1 and 2
    assert bm.num_free_pages == 5
    bm.truncate(0, 7)  # keep one drafted token
    assert bm.token_ids(0) == [1, 2, 3, 4, 5, 6, 7] and bm.page_table(0) == [0, 1] and bm.num_free_pages == 6
    bm.check_invariants()
    with pytest.raises(ValueError, match=r"only uncomputed tokens can be dropped.*\[6, 7\]"):
        bm.truncate(0, 5)
    with pytest.raises(ValueError, match=r"\[6, 7\]"):
        bm.truncate(0, 8)


def test_truncate_refuses_to_cut_a_shared_page() -> None:
    bm = BlockManager(num_pages=8, page_size=4)
    bm.allocate(0, [1, 2, 3, 4, 5, 6])
    bm.fork(0, 1)
    with pytest.raises(ValueError, match="shares page 1"):
        bm.truncate(1, 5)
    bm.truncate(1, 6)  # nothing to cut: fine
    bm.append(1, [7, 8])  # copy-on-write makes the last page private
    bm.truncate(1, 6)
    assert bm.token_ids(1) == [1, 2, 3, 4, 5, 6] and bm.token_ids(0) == [1, 2, 3, 4, 5, 6]
    bm.check_invariants()


def test_check_invariants_catches_corruption() -> None:
    bm = BlockManager(num_pages=4, page_size=2)
    computed(bm, 0, [1, 2, 3])
    bm._pages[0].ref_count += 1
    with pytest.raises(AssertionError, match="refcount"):
        bm.check_invariants()


# ------------------------------------------------------------------------------------------- stateful property
BASES = ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 9, 9, 9, 9, 9, 9], [5, 5, 5, 5, 5, 5, 5, 5])
HASHES = {
    "default": None,
    "constant": lambda parent, tokens: 0,
    "first token": lambda parent, tokens: tokens[0],
    "few buckets": lambda parent, tokens: block_manager.page_hash(parent, tokens) % 3,
}
SEQ_INDEX = st.integers(0, 1_000)
SMALL_TOKENS = st.lists(st.integers(0, 3), min_size=1, max_size=5)


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / compute / append / fork / free in a small cache, against a shadow model and a fake device."""

    @initialize(
        num_pages=st.integers(1, 24), page_size=st.integers(1, 4), caching=st.booleans(),
        hash_name=st.sampled_from(sorted(HASHES)),
    )
    def setup(self, num_pages: int, page_size: int, caching: bool, hash_name: str) -> None:
        self.bm = BlockManager(num_pages, page_size, enable_prefix_caching=caching, hash_fn=HASHES[hash_name])
        self.device: list[tuple[int, ...] | None] = [None] * (num_pages * page_size)
        self.tokens: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        self.next_id = 0

    def pick(self, index: int) -> int | None:
        # Rules do nothing without a live sequence rather than use preconditions: with every sequence freed, a
        # precondition would disable most rules and Hypothesis would give up on the example.
        return sorted(self.tokens)[index % len(self.tokens)] if self.tokens else None

    def write_kv(self, seq_id: int, end: int) -> None:
        """Compute tokens ``computed .. end - 1``: each slot gets the prefix its KV depends on."""
        tokens, start = self.tokens[seq_id], self.computed[seq_id]
        for pos, slot in enumerate(self.bm.slot_mapping(seq_id, start, end), start):
            self.device[slot] = tuple(tokens[: pos + 1])
        self.bm.mark_computed(seq_id, end)
        self.computed[seq_id] = end

    def expect_out_of_pages(self, predicted: bool, action: Callable[[], object]) -> object:
        """Run ``action``; it must fail with OutOfPagesError exactly when the capacity query said no."""
        before = self.bm.num_free_pages
        try:
            result = action()
        except OutOfPagesError:
            assert not predicted and self.bm.num_free_pages == before
            return None
        assert predicted
        return result

    @rule(
        base=st.integers(0, len(BASES) - 1), cut=st.integers(0, 12), extra=st.lists(st.integers(0, 3), max_size=4),
        prefill=st.booleans(),
    )
    def allocate(self, base: int, cut: int, extra: list[int], prefill: bool) -> None:
        prompt = BASES[base][:cut] + extra or [0]
        predicted = self.bm.can_allocate(prompt)
        assert predicted or not self.bm.can_allocate(len(prompt))  # the length-only answer is conservative
        seq_id = self.next_id
        result = self.expect_out_of_pages(predicted, lambda: self.bm.allocate(seq_id, prompt))
        if result is None:
            return
        self.next_id += 1
        ps = self.bm.page_size
        assert result.num_cached_tokens % ps == 0 and result.num_cached_tokens < len(prompt)
        self.tokens[seq_id], self.computed[seq_id] = list(prompt), result.num_cached_tokens
        # A prefix hit must hand over pages whose KV was computed for exactly this prefix.
        for pos, slot in enumerate(self.bm.slot_mapping(seq_id, 0, result.num_cached_tokens)):
            assert self.device[slot] == tuple(prompt[: pos + 1])
        if prefill:
            self.write_kv(seq_id, len(prompt))

    @rule(index=SEQ_INDEX, amount=st.integers(1, 8))
    def compute(self, index: int, amount: int) -> None:
        seq_id = self.pick(index)
        if seq_id is not None:
            self.write_kv(seq_id, min(self.bm.num_tokens(seq_id), self.computed[seq_id] + amount))

    @rule(index=SEQ_INDEX, new=SMALL_TOKENS)
    def append(self, index: int, new: list[int]) -> None:
        seq_id = self.pick(index)
        if seq_id is None:
            return
        predicted = self.bm.can_append(seq_id, len(new))
        copies = self.expect_out_of_pages(predicted, lambda: self.bm.append(seq_id, new))
        if copies is None:
            return
        ps = self.bm.page_size
        for src, dst in copies:
            self.device[dst * ps : (dst + 1) * ps] = self.device[src * ps : (src + 1) * ps]
        self.tokens[seq_id] += new

    @rule(index=SEQ_INDEX, drop=st.integers(0, 8))
    def truncate(self, index: int, drop: int) -> None:
        """Speculative decoding's rollback: cut uncomputed tokens; their pages (none shared, none cached) return."""
        seq_id = self.pick(index)
        if seq_id is None:
            return
        ps, keep = self.bm.page_size, max(self.computed[seq_id], len(self.tokens[seq_id]) - drop)
        table = self.bm.page_table(seq_id)
        cut_page = table[keep // ps] if keep % ps and keep < len(self.tokens[seq_id]) else None
        if cut_page is not None and self.bm.ref_count(cut_page) > 1:
            with pytest.raises(ValueError, match="shares page"):
                self.bm.truncate(seq_id, keep)
            return
        released = [p for p in table[-(-keep // ps):] if self.bm.ref_count(p) == 1]
        free_before = self.bm.num_free_pages
        self.bm.truncate(seq_id, keep)
        self.tokens[seq_id] = self.tokens[seq_id][:keep]
        assert self.bm.page_table(seq_id) == table[: -(-keep // ps)]
        assert self.bm.num_free_pages == free_before + len(released)

    @rule(index=SEQ_INDEX)
    def fork(self, index: int) -> None:
        parent, child = self.pick(index), self.next_id
        if parent is None:
            return
        self.next_id += 1
        free_before = self.bm.num_free_pages
        self.bm.fork(parent, child)
        assert self.bm.num_free_pages == free_before
        self.tokens[child], self.computed[child] = list(self.tokens[parent]), self.computed[parent]

    @rule(index=SEQ_INDEX)
    def free(self, index: int) -> None:
        seq_id = self.pick(index)
        if seq_id is None:
            return
        self.bm.free(seq_id)
        del self.tokens[seq_id], self.computed[seq_id]

    @invariant()
    def consistent(self) -> None:
        self.bm.check_invariants()
        in_use = set()
        for seq_id, tokens in self.tokens.items():
            assert self.bm.token_ids(seq_id) == tokens and self.bm.num_computed_tokens(seq_id) == self.computed[seq_id]
            in_use.update(self.bm.page_table(seq_id))
            for pos, slot in enumerate(self.bm.slot_mapping(seq_id, 0, self.computed[seq_id])):
                assert self.device[slot] == tuple(tokens[: pos + 1]), "a computed KV slot was overwritten"
        assert self.bm.num_free_pages == self.bm.num_pages - len(in_use)


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None, derandomize=True, database=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBlockManagerMachine = BlockManagerMachine.TestCase
