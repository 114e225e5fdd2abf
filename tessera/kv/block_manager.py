"""BlockManager: the KV-cache pages of every sequence, with refcounts, prefix caching, copy-on-write and eviction.

Plain Python, no torch: the scheduler asks it capacity questions and the tests run it without tensors. It decides
page ids and which tokens they hold; the caller owns the device tensors and performs the page copies it is told to.

Every page is in exactly one of three pools:

- *free*: refcount 0, holding nothing; handed out first.
- *cached*: refcount 0, holding a full page registered in the prefix cache. A later prompt with the same prefix
  takes it back into use; when no free page is left, the least recently released cached page is evicted.
- *used*: refcount >= 1, the number of sequences whose page table lists it.

A full page is registered under a chained hash, ``page_hash(hash of the previous page, its token ids)``, once the
caller reports its KV computed (:meth:`BlockManager.mark_computed`). A hash hit is only a hint: the page must also
hold the very same tokens *and* follow the very page matched just before it, so a collision never shares a page.
"""

from __future__ import annotations

import math
import operator
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

#: ``hash_fn(parent_hash, token_ids) -> int``; ``parent_hash`` is None for a sequence's first page.
HashFn = Callable[[int | None, tuple[int, ...]], int]

# Identity (page id, epoch) standing for "no previous page": the parent of every sequence's first page.
_ROOT: tuple[int, int] = (-1, -1)


def page_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Chained hash of one full page: its tokens and, through ``parent_hash``, every page before it.

    Python's hash of a tuple of ints is fast and the same in every process (only str/bytes hashes are salted). It
    need not be collision-free: :class:`BlockManager` checks tokens and the previous page on every hit.
    """
    # CPython never returns -1 from hash(), so -1 cannot be mistaken for a real parent hash.
    return hash((-1 if parent_hash is None else parent_hash, token_ids))


class OutOfPagesError(RuntimeError):
    """Not enough free (or evictable) pages; nothing was changed. The scheduler catches it to preempt.

    Attributes ``needed`` and ``available`` count pages.
    """

    def __init__(self, what: str, needed: int, available: int) -> None:
        self.needed = needed
        self.available = available
        super().__init__(
            f"{what} needs {needed} more KV page(s) but only {available} are free or evictable; free or preempt "
            f"sequences (BlockManager.free), ask can_allocate/can_append first, or give the cache more pages"
        )


@dataclass(frozen=True, slots=True)
class AllocationResult:
    """What :meth:`BlockManager.allocate` reserved for a prompt.

    Parameters
    ----------
    page_table : tuple[int, ...]
        Page ids ``[ceil(num_tokens / page_size)]``; token ``j`` lives in slot
        ``page_table[j // page_size] * page_size + j % page_size``.
    num_cached_tokens : int
        Leading tokens whose KV is already in cached pages (a multiple of ``page_size``, below the prompt length):
        the caller computes only tokens ``num_cached_tokens ..``.
    """

    page_table: tuple[int, ...]
    num_cached_tokens: int

    def __post_init__(self) -> None:
        if self.num_cached_tokens < 0:
            raise ValueError(f"AllocationResult.num_cached_tokens must be >= 0, got {self.num_cached_tokens}")


@dataclass(slots=True, eq=False)
class _Page:
    """One page's bookkeeping. ``hash`` is set exactly while the page is registered in the prefix table."""

    page_id: int
    ref_count: int = 0
    epoch: int = 0  # bumped each time the page is handed out anew, so stale references to it stop matching
    token_ids: list[int] = field(default_factory=list)
    hash: int | None = None
    parent_hash: int | None = None
    parent: tuple[int, int] = _ROOT  # (page id, epoch) of the page before it when it was registered


@dataclass(slots=True, eq=False)
class _Sequence:
    """One sequence's pages, its token count, how many tokens have KV computed, and its full pages' hashes."""

    page_table: list[int]
    num_tokens: int = 0
    num_computed: int = 0
    hashes: list[int] = field(default_factory=list)  # chained hash of page i, for leading full computed pages


def _as_token_ids(token_ids: Iterable[int], name: str) -> list[int]:
    """Token ids as a list of non-negative Python ints (NumPy and other integer scalars accepted)."""
    try:
        tokens = [operator.index(t) for t in token_ids]
    except TypeError:
        raise TypeError(
            f"{name} must be an iterable of integer token ids, got {type(token_ids).__name__}; pass e.g. [1, 2, 3]"
        ) from None
    if any(t < 0 for t in tokens):
        raise ValueError(f"{name} must be token ids >= 0, got a negative id ({min(tokens)})")
    return tokens


def _check_num_tokens(op: str, seq_id: int, seq: _Sequence, num_tokens: int, why: str = "") -> None:
    """Raise unless ``num_tokens`` is an int in ``[seq.num_computed, seq.num_tokens]``.

    Both :meth:`BlockManager.mark_computed` (computed tokens never go back) and :meth:`BlockManager.truncate` (only
    uncomputed tokens may go) accept exactly that range.

    Parameters
    ----------
    op : the method's name, which starts the error message.
    seq_id, seq : the sequence and its state.
    num_tokens : the caller's value.
    why : a clause put before "num_tokens must be ..." in the message ("" for none).
    """
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or not (
        seq.num_computed <= num_tokens <= seq.num_tokens
    ):
        raise ValueError(
            f"{op}: sequence {seq_id!r} has {seq.num_computed} computed of {seq.num_tokens} tokens; "
            f"{why}num_tokens must be an int in [{seq.num_computed}, {seq.num_tokens}], got {num_tokens!r}"
        )


class BlockManager:
    """Pages of ``page_size`` tokens out of ``num_pages``, for many sequences.

    Parameters
    ----------
    num_pages : int
        Pages in the KV cache (``k_pages.shape[0]``); page ids are ``0 .. num_pages - 1``.
    page_size : int
        Tokens per page (``k_pages.shape[1]``).
    enable_prefix_caching : bool
        Share computed full pages between prompts with a common prefix and keep them after their sequences end.
    hash_fn : callable, optional
        ``hash_fn(parent_hash, token_ids) -> int``; defaults to :func:`page_hash`. Collisions are harmless.

    Notes
    -----
    Per step the engine calls :meth:`allocate` (new prompts) or :meth:`append` (new tokens), performs the returned
    page copies *in order, before* the forward pass writes KV, then calls :meth:`mark_computed` with the number of
    tokens whose KV is now written. Only then do full pages join the prefix cache, so a chunked prefill never lets
    another prompt read pages whose KV is not there yet.

    Examples
    --------
    >>> bm = BlockManager(num_pages=8, page_size=4)
    >>> bm.allocate(0, [1, 2, 3, 4, 5, 6]).page_table
    (0, 1)
    >>> bm.mark_computed(0, 6)
    >>> result = bm.allocate(1, [1, 2, 3, 4, 9])   # shares page 0, the full page of the common prefix
    >>> result.page_table, result.num_cached_tokens
    ((0, 2), 4)
    >>> bm.slot_mapping(1, 4, 5)
    [8]
    """

    def __init__(
        self, num_pages: int, page_size: int, enable_prefix_caching: bool = True, hash_fn: HashFn | None = None
    ) -> None:
        for name, value in (("num_pages", num_pages), ("page_size", page_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"BlockManager.{name} must be an int >= 1, got {value!r}")
        if hash_fn is not None and not callable(hash_fn):
            raise TypeError(f"BlockManager.hash_fn must be callable(parent_hash, token_ids) -> int, got {hash_fn!r}")
        self._page_size = page_size
        self._prefix_caching = bool(enable_prefix_caching)
        self._hash_fn: HashFn = hash_fn if hash_fn is not None else page_hash
        self._pages = [_Page(i) for i in range(num_pages)]
        self._free: deque[int] = deque(range(num_pages))
        self._cached: OrderedDict[int, None] = OrderedDict()  # refcount-0 registered pages, least recent first
        self._table: dict[int, int] = {}  # chained hash -> registered page id
        self._seqs: dict[int, _Sequence] = {}

    # ----------------------------------------------------------------------------------------------- queries
    @property
    def num_pages(self) -> int:
        """Pages in the cache."""
        return len(self._pages)

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return self._page_size

    @property
    def num_free_pages(self) -> int:
        """Pages that can be handed out now: free ones plus cached ones no sequence uses (evicted on demand)."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached_pages(self) -> int:
        """Unused pages kept for prefix hits (a part of :attr:`num_free_pages`)."""
        return len(self._cached)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def __repr__(self) -> str:
        return (
            f"BlockManager({self.num_pages} pages x {self._page_size} tokens: {len(self._free)} free, "
            f"{len(self._cached)} cached, {self.num_pages - self.num_free_pages} used; {len(self._seqs)} sequences)"
        )

    def num_tokens(self, seq_id: int) -> int:
        """Tokens with a reserved slot in ``seq_id``'s pages."""
        return self._seq(seq_id).num_tokens

    def num_computed_tokens(self, seq_id: int) -> int:
        """Leading tokens of ``seq_id`` whose KV is written (cache hits plus :meth:`mark_computed`)."""
        return self._seq(seq_id).num_computed

    def page_table(self, seq_id: int) -> list[int]:
        """Page ids of ``seq_id`` in token order, ``[ceil(num_tokens / page_size)]`` (a copy)."""
        return list(self._seq(seq_id).page_table)

    def token_ids(self, seq_id: int) -> list[int]:
        """The token ids ``seq_id``'s pages hold, in order."""
        return [t for page_id in self._seq(seq_id).page_table for t in self._pages[page_id].token_ids]

    def page_tokens(self, page_id: int) -> tuple[int, ...]:
        """Token ids page ``page_id`` holds (empty for a free page)."""
        return tuple(self._pages[page_id].token_ids)

    def ref_count(self, page_id: int) -> int:
        """How many sequences use page ``page_id``."""
        return self._pages[page_id].ref_count

    def cached_page_ids(self) -> tuple[int, ...]:
        """Cached unused pages in eviction order (the next one evicted first)."""
        return tuple(self._cached)

    def slot_mapping(self, seq_id: int, start: int = 0, end: int | None = None) -> list[int]:
        """Cache slots of tokens ``start .. end - 1`` of ``seq_id``: ``page * page_size + offset`` each."""
        seq = self._seq(seq_id)
        end = seq.num_tokens if end is None else end
        if not 0 <= start <= end <= seq.num_tokens:
            raise ValueError(
                f"slot_mapping: need 0 <= start <= end <= num_tokens ({seq.num_tokens}) of sequence {seq_id!r}, "
                f"got start={start}, end={end}"
            )
        ps, table = self._page_size, seq.page_table
        return [table[pos // ps] * ps + pos % ps for pos in range(start, end)]

    def can_allocate(self, prompt: int | Sequence[int]) -> bool:
        """Whether :meth:`allocate` would succeed now.

        Given token ids the answer counts prefix-cache hits; given only a length it assumes none (conservative).
        """
        if isinstance(prompt, int) and not isinstance(prompt, bool):
            if prompt < 1:
                raise ValueError(f"can_allocate: a prompt has at least 1 token, got a length of {prompt}")
            return math.ceil(prompt / self._page_size) <= self.num_free_pages
        tokens = _as_token_ids(prompt, "can_allocate(prompt)")
        hits, _ = self._match_prefix(tokens)
        return self._fresh_pages_for(tokens, hits) <= self._available(hits)

    def can_append(self, seq_id: int, num_new_tokens: int = 1) -> bool:
        """Whether :meth:`append` of ``num_new_tokens`` tokens to ``seq_id`` would succeed now."""
        return self._pages_to_append(self._seq(seq_id), num_new_tokens) <= self.num_free_pages

    # -------------------------------------------------------------------------------------------- operations
    def allocate(self, seq_id: int, token_ids: Sequence[int]) -> AllocationResult:
        """Reserve pages for a new sequence's prompt, reusing cached pages of its longest computed full-page prefix.

        At most ``(len(token_ids) - 1) // page_size`` pages come from the cache, so at least one token is left to
        compute (its logits are needed) and the last, possibly partial, page is always private.

        Raises
        ------
        ValueError
            ``seq_id`` is already allocated, or the prompt is empty.
        OutOfPagesError
            Too few free or evictable pages; nothing is reserved.
        """
        if seq_id in self._seqs:
            raise ValueError(f"allocate: sequence {seq_id!r} is already allocated; free it first or use a new id")
        tokens = _as_token_ids(token_ids, "allocate(token_ids)")
        if not tokens:
            raise ValueError(f"allocate: sequence {seq_id!r} has an empty prompt; a prompt needs at least 1 token")
        hits, hashes = self._match_prefix(tokens)
        needed, available = self._fresh_pages_for(tokens, hits), self._available(hits)
        if needed > available:
            raise OutOfPagesError(f"allocating sequence {seq_id!r} ({len(tokens)} tokens)", needed, available)
        for page_id in hits:
            self._acquire(page_id)
        num_cached = len(hits) * self._page_size
        seq = _Sequence(page_table=list(hits), num_tokens=num_cached, num_computed=num_cached, hashes=hashes)
        self._seqs[seq_id] = seq
        self._write(seq, tokens[num_cached:])
        return AllocationResult(tuple(seq.page_table), num_cached)

    def append(self, seq_id: int, new_token_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Reserve slots for tokens added to ``seq_id``, allocating pages as needed.

        If the last page is partial and shared (after :meth:`fork`), the sequence first gets a private copy.

        Returns
        -------
        list[tuple[int, int]]
            ``(src, dst)`` page pairs to copy on the device (all layers, K and V) before writing this step's KV.

        Raises
        ------
        OutOfPagesError
            Too few free or evictable pages; nothing is changed.
        """
        seq = self._seq(seq_id)
        tokens = _as_token_ids(new_token_ids, "append(new_token_ids)")
        needed, available = self._pages_to_append(seq, len(tokens)), self.num_free_pages
        if needed > available:
            raise OutOfPagesError(f"appending {len(tokens)} token(s) to sequence {seq_id!r}", needed, available)
        copies: list[tuple[int, int]] = []
        if tokens and seq.num_tokens % self._page_size and self._pages[seq.page_table[-1]].ref_count > 1:
            copies.append(self._copy_on_write(seq))
        self._write(seq, tokens)
        return copies

    def mark_computed(self, seq_id: int, num_tokens: int) -> None:
        """Record that the KV of ``seq_id``'s first ``num_tokens`` tokens is written; full pages join the prefix cache.

        ``num_tokens`` never decreases and cannot exceed :meth:`num_tokens`.
        """
        seq = self._seq(seq_id)
        _check_num_tokens("mark_computed", seq_id, seq, num_tokens)
        seq.num_computed = num_tokens
        if self._prefix_caching:
            self._register_full_pages(seq)

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Drop ``seq_id``'s tokens past the first ``num_tokens``, releasing pages that no longer hold any.

        Speculative decoding appends drafted tokens and, after verification, cuts the rejected ones. Only tokens
        whose KV is not marked computed may go (``num_tokens >= num_computed_tokens``): those pages are never in the
        prefix cache, so nothing stale can be served. The last page kept is private (``append`` copied it if it
        was shared), so trimming its token list changes no other sequence.
        """
        seq = self._seq(seq_id)
        _check_num_tokens("truncate", seq_id, seq, num_tokens, "only uncomputed tokens can be dropped, so ")
        if num_tokens == seq.num_tokens:
            return
        ps = self._page_size
        keep_pages = math.ceil(num_tokens / ps)
        if keep_pages and num_tokens % ps and self._pages[seq.page_table[keep_pages - 1]].ref_count > 1:
            raise ValueError(f"truncate: sequence {seq_id!r} shares page {seq.page_table[keep_pages - 1]}, which "
                             f"would be cut at token {num_tokens}; only tokens appended since the last fork can go")
        for page_id in reversed(seq.page_table[keep_pages:]):
            self._release(page_id)
        del seq.page_table[keep_pages:]
        if keep_pages:
            del self._pages[seq.page_table[-1]].token_ids[num_tokens - (keep_pages - 1) * ps:]
        seq.num_tokens = num_tokens

    def fork(self, parent_id: int, child_id: int) -> None:
        """Make ``child_id`` share every page of ``parent_id`` (parallel sampling, beam search). Takes no page."""
        parent = self._seq(parent_id)
        if child_id in self._seqs:
            raise ValueError(f"fork: child sequence {child_id!r} is already allocated; pick a new id")
        for page_id in parent.page_table:
            self._acquire(page_id)
        self._seqs[child_id] = _Sequence(
            list(parent.page_table), parent.num_tokens, parent.num_computed, list(parent.hashes)
        )

    def free(self, seq_id: int) -> None:
        """Release ``seq_id``'s pages (finished or preempted); registered pages stay cached for later prompts."""
        seq = self._seq(seq_id)
        del self._seqs[seq_id]
        # Release the tail first: it then sits ahead of the head in eviction order, and evicting a prefix's head
        # would strand the rest of it (a walk from the first page can no longer reach it).
        for page_id in reversed(seq.page_table):
            self._release(page_id)

    # ------------------------------------------------------------------------------------------------ helpers
    def _seq(self, seq_id: int) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"sequence {seq_id!r} is not allocated (allocate it first, or it was freed)") from None

    def _match_prefix(self, tokens: list[int]) -> tuple[list[int], list[int]]:
        """Registered pages (and their hashes) holding the longest run of leading full pages, leaving >= 1 token."""
        pages: list[int] = []
        hashes: list[int] = []
        if not self._prefix_caching:
            return pages, hashes
        ps, parent_hash, parent = self._page_size, None, _ROOT
        for i in range((len(tokens) - 1) // ps):
            chunk = tokens[i * ps : (i + 1) * ps]
            h = self._hash_fn(parent_hash, tuple(chunk))
            page_id = self._table.get(h)
            if page_id is None:
                break
            page = self._pages[page_id]
            # A hash hit is a hint: the page must hold these tokens right after the page matched before it.
            if page.parent != parent or page.token_ids != chunk:
                break
            pages.append(page_id)
            hashes.append(h)
            parent_hash, parent = h, (page_id, page.epoch)
        return pages, hashes

    def _fresh_pages_for(self, tokens: list[int], hits: list[int]) -> int:
        return math.ceil(len(tokens) / self._page_size) - len(hits)

    def _available(self, hits: list[int]) -> int:
        """Pages obtainable once ``hits`` are taken: cached hits leave the evictable pool."""
        return self.num_free_pages - sum(1 for page_id in hits if self._pages[page_id].ref_count == 0)

    def _pages_to_append(self, seq: _Sequence, num_new_tokens: int) -> int:
        if isinstance(num_new_tokens, bool) or not isinstance(num_new_tokens, int) or num_new_tokens < 0:
            raise ValueError(f"the number of new tokens must be an int >= 0, got {num_new_tokens!r}")
        if num_new_tokens == 0:
            return 0
        ps = self._page_size
        room = -seq.num_tokens % ps  # empty slots in the last page
        new_pages = math.ceil(max(0, num_new_tokens - room) / ps)
        copy = 1 if room and self._pages[seq.page_table[-1]].ref_count > 1 else 0
        return new_pages + copy

    def _acquire(self, page_id: int) -> None:
        page = self._pages[page_id]
        if page.ref_count == 0:
            del self._cached[page_id]
        page.ref_count += 1

    def _release(self, page_id: int) -> None:
        page = self._pages[page_id]
        page.ref_count -= 1
        if page.ref_count:
            return
        if page.hash is not None:
            self._cached[page_id] = None  # most recently released: evicted last
        else:
            page.token_ids.clear()
            self._free.append(page_id)

    def _take_fresh_page(self) -> int:
        """A page with refcount 1 and no content: a free one, else the least recently released cached one."""
        if self._free:
            page = self._pages[self._free.popleft()]
        else:
            page = self._pages[self._cached.popitem(last=False)[0]]
            del self._table[page.hash]
            page.hash, page.parent_hash, page.parent = None, None, _ROOT
            page.token_ids.clear()
        page.epoch += 1
        page.ref_count = 1
        return page.page_id

    def _copy_on_write(self, seq: _Sequence) -> tuple[int, int]:
        src = seq.page_table[-1]
        dst = self._take_fresh_page()
        self._pages[dst].token_ids.extend(self._pages[src].token_ids)
        self._release(src)  # still used by the sequences it was shared with
        seq.page_table[-1] = dst
        return src, dst

    def _write(self, seq: _Sequence, tokens: list[int]) -> None:
        """Put ``tokens`` after the sequence's last token, in its (private or new) last page and fresh ones."""
        ps, pos = self._page_size, 0
        while pos < len(tokens):
            if seq.num_tokens % ps == 0:
                seq.page_table.append(self._take_fresh_page())
            page = self._pages[seq.page_table[-1]]
            take = min(ps - len(page.token_ids), len(tokens) - pos)
            page.token_ids.extend(tokens[pos : pos + take])
            seq.num_tokens += take
            pos += take

    def _register_full_pages(self, seq: _Sequence) -> None:
        """Hash the sequence's newly computed full pages; register those whose hash is not taken yet."""
        for i in range(len(seq.hashes), seq.num_computed // self._page_size):
            page = self._pages[seq.page_table[i]]
            parent_hash = seq.hashes[i - 1] if i else None
            h = self._hash_fn(parent_hash, tuple(page.token_ids))
            seq.hashes.append(h)
            # A taken hash (a duplicate computed concurrently, or a collision) leaves this page private: correct,
            # merely not shareable.
            if page.hash is None and h not in self._table:
                previous = self._pages[seq.page_table[i - 1]] if i else None
                page.hash, page.parent_hash = h, parent_hash
                page.parent = (previous.page_id, previous.epoch) if previous else _ROOT
                self._table[h] = page.page_id

    # ------------------------------------------------------------------------------------------------ checking
    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (a test and debugging aid; O(pages + tokens)).

        Checked: refcounts equal the number of sequences listing each page; free, cached and used pages partition
        all pages; the prefix table maps each hash to a full page holding tokens with exactly that hash; each
        sequence's pages hold exactly its token count, page by page.
        """
        refs = [0] * self.num_pages
        for seq_id, seq in self._seqs.items():
            _expect(len(set(seq.page_table)) == len(seq.page_table), f"sequence {seq_id!r} lists a page twice")
            for page_id in seq.page_table:
                refs[page_id] += 1
            self._check_sequence(seq_id, seq)
        free = set(self._free)
        _expect(len(free) == len(self._free), "a page is on the free list twice")
        for page in self._pages:
            self._check_page(page, refs[page.page_id], page.page_id in free)
        for h, page_id in self._table.items():
            page = self._pages[page_id]
            _expect(page.hash == h, f"prefix table maps hash {h} to page {page_id}, which has hash {page.hash}")
            _expect(len(page.token_ids) == self._page_size, f"registered page {page_id} is not full")
            _expect(self._hash_fn(page.parent_hash, tuple(page.token_ids)) == h, f"page {page_id} tokens != hash")

    def _check_page(self, page: _Page, refs: int, in_free: bool) -> None:
        pid = page.page_id
        _expect(page.ref_count == refs, f"page {pid} has refcount {page.ref_count} but {refs} sequences use it")
        in_cached = pid in self._cached
        _expect(in_free + in_cached + (refs > 0) == 1, f"page {pid} is in {in_free + in_cached + (refs > 0)} pools")
        if in_free:
            _expect(page.hash is None and not page.token_ids, f"free page {pid} still holds tokens or a hash")
        if in_cached:
            _expect(page.hash is not None, f"cached page {pid} is not registered in the prefix table")
        if page.hash is not None:
            _expect(self._table.get(page.hash) == pid, f"page {pid} has hash {page.hash} missing from the table")

    def _check_sequence(self, seq_id: int, seq: _Sequence) -> None:
        ps = self._page_size
        _expect(len(seq.page_table) == math.ceil(seq.num_tokens / ps), f"sequence {seq_id!r}: wrong page count")
        _expect(0 <= seq.num_computed <= seq.num_tokens, f"sequence {seq_id!r}: computed count out of range")
        _expect(len(seq.hashes) <= seq.num_computed // ps, f"sequence {seq_id!r}: hashes beyond computed pages")
        for i, page_id in enumerate(seq.page_table):
            held, want = len(self._pages[page_id].token_ids), min(ps, seq.num_tokens - i * ps)
            _expect(held == want, f"sequence {seq_id!r}: page {page_id} holds {held} tokens, expected {want}")
        for i, h in enumerate(seq.hashes):
            page = self._pages[seq.page_table[i]]
            chained = self._hash_fn(seq.hashes[i - 1] if i else None, tuple(page.token_ids))
            _expect(h == chained and page.hash in (None, h), f"sequence {seq_id!r}: page {i} has a stale hash")


def _expect(condition: bool, message: str) -> None:
    """``assert`` that survives ``python -O``."""
    if not condition:
        raise AssertionError(f"BlockManager invariant broken: {message}")
