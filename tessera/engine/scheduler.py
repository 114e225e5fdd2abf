"""Continuous batching: which sequences run this step and how many of their tokens (plain Python, no torch)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any

from tessera.engine.sequence import Sequence, Status
from tessera.kv.block_manager import BlockManager


@dataclass(slots=True)
class ScheduledSeq:
    """``num_new`` tokens of ``seq`` starting at position ``start`` run this step.

    A speculative decode carries its ``draft``: the step's tokens are the last sampled token and the drafted ones
    (``num_new = 1 + len(draft.tokens)``), and every one of their logits rows is verified.
    """

    seq: Sequence
    start: int
    num_new: int
    draft: Any = None

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the sequence's end, so its last logits give the next token."""
        drafted = len(self.draft.tokens) if self.draft is not None else 0
        return self.start + self.num_new == self.seq.num_tokens + drafted


@dataclass(slots=True)
class SchedulerOutput:
    """One step's work: decodes first, then prompt chunks; page copies to do before the forward (in order)."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    page_copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.scheduled)


class Scheduler:
    """FCFS continuous batching with chunked prefill and preemption by recompute.

    Every step, within a budget of ``max_num_batched_tokens`` new tokens:

    1. each running sequence that has sampled a token gets one decode slot (oldest first). When the pages run out,
       the youngest running sequence is preempted: its pages are freed and it goes back to the front of the waiting
       queue, keeping its generated tokens, which are recomputed as part of its prompt on readmission;
    2. running sequences part-way through their prompt get their next chunk;
    3. waiting sequences are admitted in arrival order while pages, the budget and ``max_num_seqs`` allow (not in a
       step that preempted: the freed pages go to the running sequences first).

    Parameters
    ----------
    block_manager : the KV page allocator (the scheduler is its only user).
    max_num_seqs : running sequences at most.
    max_num_batched_tokens : new tokens per step at most (decode tokens count 1 each).

    Examples
    --------
    >>> sched = Scheduler(BlockManager(64, 16), max_num_seqs=8, max_num_batched_tokens=256)
    >>> sched.add(seq)
    >>> out = sched.schedule()          # run out.scheduled through the model ...
    >>> sched.update(out, {seq.seq_id: (token, logprob)})
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Scheduler: {name} must be an int >= 1, got {value!r}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the last one is the youngest
        self.num_preemptions = 0
        self.num_prompt_tokens = 0  # prompt tokens admitted for the first time
        self.num_cached_prompt_tokens = 0  # of those, served from the prefix cache
        #: called with the seq_id of every sequence that finishes or is aborted (speculative decoding frees its
        #: draft state there)
        self.on_release: Callable[[int], None] | None = None

    def add(self, seq: Sequence) -> None:
        """Queue a new request (FCFS)."""
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, seq: Sequence) -> None:
        """Drop a request wherever it is and free its pages; an unfinished one finishes with reason ``"abort"``.

        Aborting sample 0 of a parallel-sampling request aborts all its samples.
        """
        for other in seq.group[1:] if seq.sample_index == 0 else ():
            self.abort(other)
        seq.pending_children = []
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
            self.block_manager.free(seq.seq_id)
        if not seq.is_finished:
            seq.abort()
        if self.on_release is not None:
            self.on_release(seq.seq_id)

    # ---------------------------------------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        """Pick this step's work; reserves the pages it needs."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        budget = self._schedule_decodes(out, budget)
        budget = self._schedule_prefill_chunks(out, budget)
        if not out.preempted:
            self._admit(out, budget)
        return out

    def _schedule_decodes(self, out: SchedulerOutput, budget: int) -> int:
        bm = self.block_manager
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING or bm.num_tokens(seq.seq_id) == seq.num_tokens:
                continue  # preempted above, or still in its prompt (no sampled token waiting for a slot)
            draft = self._fit_draft(seq, budget)
            while seq.status is Status.RUNNING and not bm.can_append(seq.seq_id, 1):
                self._preempt(self.running[-1], out)
            if seq.status is not Status.RUNNING:
                break  # it was the youngest: everything after it is preempted too
            drafted = draft.tokens if draft is not None else []
            out.page_copies += bm.append(seq.seq_id, [seq.output_ids[-1], *drafted])
            out.scheduled.append(ScheduledSeq(seq, seq.num_computed, 1 + len(drafted), draft))
            budget -= 1 + len(drafted)
        return budget

    def _fit_draft(self, seq: Sequence, budget: int) -> Any:
        """The sequence's speculative draft cut to what the budget and the free pages allow (drafts never preempt
        anyone), or None."""
        draft = seq.draft
        seq.clear_draft()
        if draft is None:
            return None
        n = min(len(draft.tokens), budget - 1)
        while n > 0 and not self.block_manager.can_append(seq.seq_id, 1 + n):
            n -= 1
        return draft.truncated(n) if n > 0 else None

    def _schedule_prefill_chunks(self, out: SchedulerOutput, budget: int) -> int:
        decoding = {item.seq.seq_id for item in out.scheduled}
        for seq in self.running:
            if budget == 0:
                break
            # a sequence with a sampled token not yet given a slot (decode skipped: budget) is no prompt chunk
            in_prompt = self.block_manager.num_tokens(seq.seq_id) == seq.num_tokens
            if seq.seq_id not in decoding and in_prompt and seq.num_uncomputed > 0:
                n = min(seq.num_uncomputed, budget)
                out.scheduled.append(ScheduledSeq(seq, seq.num_computed, n))
                budget -= n
        return budget

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if len(self.running) + 1 + len(seq.pending_children) > self.max_num_seqs:
                break  # its samples fork into running sequences once the prompt is computed
            if not bm.can_allocate(seq.token_ids):
                break  # FCFS: a later, smaller request does not jump the queue
            self.waiting.popleft()
            result = bm.allocate(seq.seq_id, seq.token_ids)
            seq.num_computed = result.num_cached_tokens
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = result.num_cached_tokens
                self.num_prompt_tokens += len(seq.prompt_ids)
                self.num_cached_prompt_tokens += result.num_cached_tokens
            seq.status = Status.RUNNING
            self.running.append(seq)
            n = min(seq.num_uncomputed, budget)
            out.scheduled.append(ScheduledSeq(seq, seq.num_computed, n))
            budget -= n

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq.seq_id)
        seq.num_computed = 0
        seq.clear_draft()
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    # ------------------------------------------------------------------------------------------------ update
    def update(self, out: SchedulerOutput, sampled: dict[int, tuple[int, float]]) -> list[Sequence]:
        """Record the forward's results; returns the sequences that finished this step.

        Parameters
        ----------
        out : this step's :meth:`schedule` result, after the forward wrote the KV of every scheduled token.
        sampled : ``seq_id -> (token id, logprob[, top alternatives])`` for each scheduled sequence whose chunk
            reached its end; for a speculative decode, the list of such tuples it emits (accepted drafts, then the
            target's token).
        """
        finished = []
        for item in out.scheduled:
            seq = item.seq
            if item.draft is not None:
                self._record_verified(item, sampled[seq.seq_id], finished)
                continue
            seq.num_computed = item.start + item.num_new
            self.block_manager.mark_computed(seq.seq_id, seq.num_computed)
            if not item.samples:
                continue
            for child in seq.pending_children:  # parallel sampling: the prompt is computed, the other samples fork
                if child.is_finished:
                    continue  # aborted before its fork
                self.block_manager.fork(seq.seq_id, child.seq_id)
                child.num_computed = seq.num_computed
                child.num_cached_tokens = seq.num_cached_tokens
                child.status = Status.RUNNING
                self.running.append(child)
                self._record(child, sampled[child.seq_id], finished)
            seq.pending_children = []
            self._record(seq, sampled[seq.seq_id], finished)
        return finished

    def _record_verified(self, item: ScheduledSeq, tokens: list[tuple], finished: list[Sequence]) -> None:
        """A speculative decode: the KV of the last token and of the accepted drafts stays, the rejected drafts'
        slots are cut (their pages freed), then each emitted token is recorded until the sequence finishes."""
        seq = item.seq
        seq.num_computed = item.start + len(tokens)  # the last sampled token + the accepted drafts
        self.block_manager.mark_computed(seq.seq_id, seq.num_computed)
        self.block_manager.truncate(seq.seq_id, seq.num_computed)
        for token in tokens:
            self._record(seq, token, finished)
            if seq.is_finished:
                break

    def _record(self, seq: Sequence, token: tuple, finished: list[Sequence]) -> None:
        seq.append_token(*token)
        if seq.is_finished:
            self.running.remove(seq)
            self.block_manager.free(seq.seq_id)
            finished.append(seq)
            if self.on_release is not None:
                self.on_release(seq.seq_id)
