"""Constrained decoding at run time: each constrained sequence's grammar state, and the batch's token masks.

Before a step's forward, :meth:`StructuredDecoder.begin` starts computing the allowed-token bitmask of every
constrained sequence that will sample, on a worker thread (llguidance releases the GIL while it computes), so the
masks are ready by the time the logits are. :meth:`StructuredDecoder.apply` then sets every disallowed token's logit
to -inf in those rows only, and :meth:`StructuredDecoder.advance` moves each grammar past its sampled token.
A step without a constrained sequence does none of this: ``begin`` returns None after one scan of the batch.
``StructuredDecoder.overlap = False`` fills the masks on the step's own thread after the forward instead (the
benchmark compares both; docs/structured.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

#: the finish reason of a sequence whose grammar allows no token at all (a grammar too complex for the parser's
#: limits, say); the sequence ends with an EOS token and no further text, never with text outside the grammar
DEAD_END = "grammar"


_LANES = np.arange(32)


def _bit_positions(words: np.ndarray, value: int) -> np.ndarray:
    """The positions of the bits equal to ``value`` (0 or 1) in a bitmask of int32 words (bit ``i % 32`` of word
    ``i // 32``), unpacking only the words that are not uniformly the other value."""
    at = np.flatnonzero(words != (0 if value else -1))
    bits = np.unpackbits(words[at].view(np.uint8).reshape(-1, 4), axis=1, bitorder="little")
    return (at[:, None] * 32 + _LANES)[bits == value]


def _mask_row(row: np.ndarray, words: np.ndarray) -> None:
    """Set ``row``'s logits whose bit is clear to -inf. Costs what the smaller side does: a JSON structure step
    allows a few tokens (keep those, fill the rest), a string's content allows nearly all (ban the few)."""
    if np.count_nonzero(words == 0) > np.count_nonzero(words == -1):
        allowed = _bit_positions(words, 1)
        allowed = allowed[allowed < row.shape[0]]
        keep = row[allowed]
        row.fill(-np.inf)
        row[allowed] = keep
    else:
        banned = _bit_positions(words, 0)
        row[banned[banned < row.shape[0]]] = -np.inf


class GrammarState:
    """Where one sequence stands in its grammar (an llguidance matcher) and how it must end.

    Attributes
    ----------
    matcher : llguidance.LLMatcher
    eos_ids : the model's EOS tokens: the grammar allows them where the text may end.
    dead_end : True once the grammar allowed no token (the runner then forces an EOS; see :data:`DEAD_END`).
    """

    __slots__ = ("dead_end", "eos_ids", "matcher")

    def __init__(self, matcher: Any, eos_ids: tuple[int, ...]) -> None:
        self.matcher, self.eos_ids, self.dead_end = matcher, eos_ids, False

    @property
    def finished(self) -> bool:
        """The text is complete: the grammar accepts nothing more than an EOS."""
        return self.dead_end or self.matcher.is_stopped()

    @property
    def error(self) -> str:
        """llguidance's reason for a dead end ("" when there is none)."""
        return self.matcher.get_error()

    def advance(self, token: int) -> None:
        """Move past ``token`` (one the mask allowed; a refused token marks a dead end)."""
        if not self.dead_end and not self.matcher.consume_token(token):
            self.dead_end = True


@dataclass(slots=True)
class PendingMasks:
    """Masks being computed for one step: ``rows`` index the step's sampled rows, ``states`` their grammars."""

    rows: list[int]
    states: list[GrammarState]
    bitmask: torch.Tensor
    future: Future[float] | None  # the fill running on the worker (overlapped), or
    fill: Callable[[], float] | None  # the fill to run after the forward (not overlapped)


class StructuredDecoder:
    """The batch side of constrained decoding for one model: grammar states, mask computation, mask application.

    Parameters
    ----------
    tokenizer : the model's ``tokenizers.Tokenizer`` (None: constrained requests are refused at validation).
    vocab_size : the width of the model's logits.
    eos_token_ids : the model's EOS tokens.

    Attributes
    ----------
    overlap : fill the bitmasks on a worker while the forward runs (default), or after it on the step's thread.
    timers : seconds spent in ``mask_s`` (computing bitmasks, on the worker), ``wait_s`` (the step waiting for
        them after its forward; the whole fill when not overlapped), ``apply_s`` (logits set to -inf) and ``advance_s`` (grammars moved past sampled
        tokens), plus ``steps`` and ``rows`` counts; :meth:`reset_timers` zeroes them.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, tuple(eos_token_ids)
        self._ll_tokenizer: Any = None
        self._executor: Any = None
        self._pool: ThreadPoolExecutor | None = None
        self.overlap = True
        self.timers: dict[str, float] = {}
        self.reset_timers()

    def reset_timers(self) -> None:
        self.timers = {"mask_s": 0.0, "wait_s": 0.0, "apply_s": 0.0, "advance_s": 0.0, "steps": 0, "rows": 0}

    # ------------------------------------------------------------------------------------------- states
    def state_for(self, seq: Any) -> GrammarState:
        """``seq``'s grammar state, created on its first sampled token."""
        if seq.constraint is None:
            import llguidance

            from tessera.engine.structured.compiler import ll_tokenizer

            if self._ll_tokenizer is None:
                self._ll_tokenizer = ll_tokenizer(self.tokenizer, self.vocab_size, self.eos_token_ids)
            matcher = llguidance.LLMatcher(self._ll_tokenizer, seq.params.grammar_source, log_level=0)
            seq.constraint = GrammarState(matcher, self.eos_token_ids)
        return seq.constraint

    # -------------------------------------------------------------------------------------------- masks
    def begin(self, seqs: list[Any]) -> PendingMasks | None:
        """Start computing the masks of the constrained sequences among ``seqs`` (one per sampled row, in row
        order); None, at the cost of one scan, when there are none."""
        rows = [i for i, s in enumerate(seqs) if s.params.grammar_source is not None]
        if not rows:
            return None
        import llguidance
        import llguidance.torch as llt

        states = [self.state_for(seqs[i]) for i in rows]
        bitmask = torch.full((len(rows), (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        live = [(s.matcher, k) for k, s in enumerate(states) if not s.dead_end]
        if not self.overlap:
            def fill() -> float:
                start = time.perf_counter()
                for matcher, k in live:
                    llt.fill_next_token_bitmask(matcher, bitmask, k)
                return time.perf_counter() - start

            return PendingMasks(rows, states, bitmask, None, fill)
        if self._pool is None:
            self._executor = llguidance.LLExecutor(num_threads=1)
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="tessera-grammar")

        def fill_all() -> float:
            start = time.perf_counter()
            if live:
                llt.fill_next_token_bitmask_par(self._executor, live, bitmask)
            return time.perf_counter() - start

        return PendingMasks(rows, states, bitmask, self._pool.submit(fill_all), None)

    def apply(self, pending: PendingMasks, logits: torch.Tensor) -> None:
        """Wait for the masks and set the disallowed logits of their rows to -inf (``logits``: the sampled rows,
        modified in place). A row whose grammar allows nothing gets only its first EOS token, and is marked a dead
        end."""
        start = time.perf_counter()
        self.timers["mask_s"] += pending.future.result() if pending.future is not None else pending.fill()
        waited = time.perf_counter()
        words = pending.bitmask.numpy()
        for k, state in enumerate(pending.states):
            if state.dead_end or not words[k].any():
                state.dead_end = True
                words[k] = 0
                eos = self.eos_token_ids[0]
                words[k, eos // 32] = np.int32(np.uint32(1 << (eos % 32)).view(np.int32))
        if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float16):
            # NumPy, touching only the words that are neither all allowed nor all banned: a torch op over the
            # whole [rows, vocab] block wakes torch's thread pool, which costs milliseconds on a busy machine
            view = logits.numpy()
            for k, row in enumerate(pending.rows):
                _mask_row(view[row], words[k])
        else:
            bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :logits.shape[1]]
            banned = torch.from_numpy(bits == 0).to(logits.device)
            rows = torch.tensor(pending.rows, dtype=torch.int64, device=logits.device)
            logits[rows] = logits[rows].masked_fill(banned, float("-inf"))
        self.timers["wait_s"] += waited - start
        self.timers["apply_s"] += time.perf_counter() - waited
        self.timers["steps"] += 1
        self.timers["rows"] += len(pending.rows)

    def advance(self, pending: PendingMasks, tokens: list[int]) -> None:
        """Move each constrained row's grammar past its sampled token (``tokens``: every sampled row's)."""
        start = time.perf_counter()
        for row, state in zip(pending.rows, pending.states):
            state.advance(tokens[row])
        self.timers["advance_s"] += time.perf_counter() - start

    def close(self) -> None:
        """Stop the worker thread (it is a daemon-like pool thread; closing is optional)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
