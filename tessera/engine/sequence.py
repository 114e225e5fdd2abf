"""One request's state through the engine: its tokens, how many have KV in the cache, its sampler and its text."""

from __future__ import annotations

import enum
import time
from typing import Any

from tessera.engine.detokenizer import Detokenizer, find_stop
from tessera.engine.params import CompletionOutput, RequestOutput, SamplingParams
from tessera.engine.structured.decoding import DEAD_END


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """A request: prompt, generated tokens, progress through the KV cache, and finish state.

    ``num_computed`` counts the leading tokens of :attr:`token_ids` whose KV is in the cache. A preempted sequence
    drops to 0 and, on readmission, recomputes prompt *and* generated tokens as one prompt, so it continues exactly
    where it stopped. The torch generator of a seeded request lives here, so its draws never depend on the batch.

    Parameters
    ----------
    seq_id : int, unique in the engine (the request's index in its ``generate`` call).
    prompt_ids : the prompt's token ids (non-empty).
    params : the request's :class:`SamplingParams`.
    eos_token_ids : ids that end generation unless ``params.ignore_eos``.
    max_len : the context length; generation stops ("length") when the sequence reaches it.
    tokenizer : for the text; None leaves ``text`` empty.
    generator : the request's own torch.Generator (seeded requests), or None for torch's default stream.
    request_id : what :class:`RequestOutput` reports (the prompt's index in its call); defaults to ``seq_id``.
    sample_index : which of the request's ``n`` samples this is (0 for the first, which runs the prompt).

    Parallel sampling (``n > 1``): sample 0 carries the other samples in :attr:`pending_children` until its prompt is
    computed; then the scheduler forks them (they share its pages) and each gets its own first token from the same
    logits. :attr:`group` lists all ``n`` samples in order.
    """

    def __init__(self, seq_id: int, prompt_ids: list[int], params: SamplingParams, eos_token_ids: tuple[int, ...],
                 max_len: int, tokenizer: Any = None, generator: Any = None, request_id: int | None = None,
                 sample_index: int = 0) -> None:
        self.seq_id = seq_id
        self.sample_index = sample_index
        self.group: list[Sequence] = [self]
        self.pending_children: list[Sequence] = []
        self.request_id = seq_id if request_id is None else request_id
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []
        self.status = Status.WAITING
        self.num_computed = 0
        self.num_cached_tokens: int | None = None  # prefix hits at the first admission
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.text = ""
        self.generator = generator
        self.draft: Any = None  # speculative decoding: the Draft proposed for this step's decode, if any
        # structured output: the grammar state (engine/structured/decoding.GrammarState), made by the runner at the
        # first sampled token and moved past each token before append_token sees it
        self.constraint: Any = None
        self._stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        # the longest stop string minus one: how much of the text's end could still grow into a stop string
        self._stop_hold = max((len(s) for s in params.stop), default=1) - 1
        self._max_len = max_len
        self._detok = Detokenizer(tokenizer, self.prompt_ids)
        self.arrival_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

    @property
    def token_ids(self) -> list[int]:
        """Prompt then generated tokens: what the KV cache must hold."""
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return self.num_tokens - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def group_finished(self) -> bool:
        """Every sample of the request has finished (the same as :attr:`is_finished` when ``n = 1``)."""
        return all(s.is_finished for s in self.group)

    def shown_text_end(self, sent: int) -> int:
        """How much of ``text`` a stream may show, given that ``sent`` characters already went out: all of it once
        finished; before that, text that could still turn out to be the start of a stop string is held back until
        it cannot (stop strings never show)."""
        if self.is_finished:
            return len(self.text)
        return max(sent, len(self.text) - self._stop_hold)

    def append_token(self, token_id: int, logprob: float, top: list[tuple[int, float]] | None = None) -> None:
        """Record a sampled token, extend the text, and decide whether the request is done."""
        now = time.perf_counter()
        self.first_token_time = self.first_token_time or now
        self.output_ids.append(token_id)
        if self.params.logprobs:
            self.logprobs.append(logprob)
        if self.params.top_logprobs:
            self.top_logprobs.append(top or [])
        grammar = self.constraint
        if token_id in self._stop_ids or (grammar is not None and (grammar.dead_end or token_id in grammar.eos_ids)):
            self._finish(DEAD_END if grammar is not None and grammar.dead_end else "stop", now)
            return
        delta = self._detok.step(token_id)
        self.text += delta
        at = find_stop(self.text, self.params.stop, len(delta)) if delta and self.params.stop else None
        if at is not None:
            self.text = self.text[:at]
            self._finish("stop", now)
        elif grammar is not None and grammar.finished:  # the text is complete: nothing but EOS could follow
            self._finish("stop", now)
        elif len(self.output_ids) >= self.params.max_tokens or self.num_tokens >= self._max_len:
            self._finish("length", now)

    def clear_draft(self) -> None:
        """Drop the speculative draft, if any: a draft is proposed for one step's decode and must not outlive it
        (a preempted sequence recomputes its KV, and each step proposes afresh)."""
        self.draft = None

    def abort(self) -> None:
        """Finish now with reason ``"abort"`` (the scheduler frees the pages)."""
        self._finish("abort", time.perf_counter())

    def _finish(self, reason: str, now: float) -> None:
        self.finish_reason, self.status, self.finish_time = reason, Status.FINISHED, now

    def completion(self) -> CompletionOutput:
        """This sample's part of the output."""
        return CompletionOutput(self.sample_index, list(self.output_ids), self.text, self.finish_reason,
                                list(self.logprobs) if self.params.logprobs else None,
                                list(self.top_logprobs) if self.params.top_logprobs else None)

    def output(self) -> RequestOutput:
        """A snapshot of the request (all its samples when called on sample 0) as a :class:`RequestOutput`."""
        first = [s.first_token_time for s in self.group if s.first_token_time is not None]
        ttft = min(first) - self.arrival_time if first else None
        ends = [s.finish_time for s in self.group]
        latency = max(ends) - self.arrival_time if all(e is not None for e in ends) else None
        return RequestOutput(
            request_id=self.request_id, prompt_tokens=list(self.prompt_ids), token_ids=list(self.output_ids),
            text=self.text, finish_reason=self.finish_reason,
            logprobs=list(self.logprobs) if self.params.logprobs else None,
            top_logprobs=list(self.top_logprobs) if self.params.top_logprobs else None,
            num_cached_tokens=self.num_cached_tokens or 0, num_preemptions=sum(s.num_preemptions for s in self.group),
            time_to_first_token=ttft, latency=latency, outputs=[s.completion() for s in self.group],
        )
