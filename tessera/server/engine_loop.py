"""The engine loop: one thread owns the :class:`~tessera.engine.LLM`; HTTP handlers talk to it through a queue.

The engine is not thread-safe, so every call into it (``add_request``, ``step``, ``abort``, ``stats``, even the
tokenizer through ``add_request``) happens on the loop thread. Handlers ``submit`` a prompt with one
:class:`SamplingParams` per choice and a ``sink``; the loop answers through the sink with :class:`Admitted` or
:class:`Failed`, then :class:`Delta` events (new text, token ids, logprobs) until every choice has finished. The sink
is called on the loop thread and must only hand the event over (the server's sink does
``loop.call_soon_threadsafe(queue.put_nowait, event)``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tessera.engine import LLM, SamplingParams
from tessera.engine.sequence import Sequence
from tessera.server.metrics import ServerMetrics

log = logging.getLogger("tessera.server")
Prompt = str | list[int]


class QueueFull(Exception):
    """``submit`` found ``max_queue`` or more requests waiting."""


class ShuttingDown(Exception):
    """The loop is stopping (or stopped): no new work is accepted and queued work is dropped."""


@dataclass(slots=True)
class Admitted:
    """All choices of a submission were validated and queued; ``prompt_tokens`` is the prompt's token count."""

    prompt_tokens: int


@dataclass(slots=True)
class Failed:
    """The submission failed: ValueError / TypeError for a bad request, :class:`ShuttingDown`, or an engine error."""

    error: Exception


@dataclass(slots=True)
class Delta:
    """What choice ``index`` gained since its previous delta.

    ``text`` holds whole characters only; text that could still become a stop string is held back until it cannot.
    ``token_ids`` are the newly sampled ids (they may run ahead of ``text``), ``logprobs`` / ``tokens`` their
    log-probabilities and decoded strings when the request asked for logprobs (else empty). ``finish_reason`` is
    set on the choice's last delta ("stop", "length" or "abort").
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    tokens: list[str] = field(default_factory=list)
    top: list[list[tuple[str, float]]] = field(default_factory=list)  # per token: most likely (text, logprob) first
    finish_reason: str | None = None


Event = Admitted | Failed | Delta
Sink = Callable[[Event], None]


@dataclass(eq=False)
class Submission:
    """One HTTP request's work: a prompt run once per params (choice). Fields after ``sink`` belong to the loop.

    ``fit_max_tokens`` asks the loop to lower each ``max_tokens`` to what the context and KV cache leave after the
    prompt (chat without a token limit: "as long as it fits"), which only the loop can know since it tokenizes.
    """

    prompt: Prompt
    params: list[SamplingParams]
    sink: Sink
    fit_max_tokens: bool = False
    cancelled: bool = False
    seqs: list[Sequence] = field(default_factory=list)


class _Live:
    """Loop-side progress of one choice: what was already sent, for deltas and inter-token latency."""

    __slots__ = ("index", "last_token_time", "sent_chars", "sent_tokens", "seq", "sub")

    def __init__(self, sub: Submission, index: int, seq: Sequence) -> None:
        self.sub, self.index, self.seq = sub, index, seq
        self.sent_chars = self.sent_tokens = 0
        self.last_token_time: float | None = None


def _one_group(params: list[SamplingParams]) -> bool:
    """Whether ``params`` are the ``n`` samples of one request: equal but for seeds ``seed + i`` (or no seeds), which
    is exactly what the engine's ``SamplingParams.n`` runs (sample ``i`` draws with ``seed + i``)."""
    if len(params) < 2 or any(p.n != 1 for p in params):
        return False
    first = params[0]
    base = dataclasses.replace(first, seed=None)
    seeds_ok = all(p.seed is None for p in params) if first.seed is None else all(
        p.seed == first.seed + i for i, p in enumerate(params))
    return seeds_ok and all(dataclasses.replace(p, seed=None) == base for p in params)


class EngineLoop:
    """Owns an :class:`LLM` on a background thread and serves submissions from any thread.

    Parameters
    ----------
    llm : the engine; after :meth:`start` no other thread may touch it.
    metrics : where token counts and latencies go (a fresh :class:`ServerMetrics` when None).
    max_queue : :meth:`submit` raises :class:`QueueFull` when this many requests (choices) already wait.

    Examples
    --------
    >>> loop = EngineLoop(LLM(), max_queue=64); loop.start()
    >>> sub = loop.submit("Hello", [SamplingParams(max_tokens=4)], print)  # Admitted(...), then Delta(...)s
    >>> loop.shutdown()
    """

    def __init__(self, llm: LLM, metrics: ServerMetrics | None = None, max_queue: int = 256) -> None:
        if max_queue < 1:
            raise ValueError(f"EngineLoop: max_queue must be >= 1, got {max_queue}")
        self.llm = llm
        self.metrics = metrics or ServerMetrics()
        self.max_queue = max_queue
        self._cond = threading.Condition()
        self._inbox: list[Submission] = []
        self._cancels: list[Submission] = []
        self._in_transit = 0  # choices submitted but not yet in the engine's waiting queue (or rejected)
        self._engine_waiting = 0
        self._paused = False
        self._stopping = False
        self._live: dict[int, _Live] = {}  # seq_id -> progress; loop thread only
        self._stats: dict[str, float] = dict(llm.stats())
        self._thread = threading.Thread(target=self._run, name="tessera-engine-loop", daemon=True)

    # ------------------------------------------------------------------------------ any thread
    def start(self) -> None:
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, prompt: Prompt, params: list[SamplingParams], sink: Sink,
               fit_max_tokens: bool = False) -> Submission:
        """Queue ``prompt`` once per entry of ``params``; the loop reports through ``sink``.

        Raises
        ------
        QueueFull
            ``max_queue`` or more requests are already waiting (the caller answers 503).
        ShuttingDown
            :meth:`shutdown` was called.
        """
        sub = Submission(prompt, list(params), sink, fit_max_tokens)
        with self._cond:
            if self._stopping:
                raise ShuttingDown("the server is shutting down")
            waiting = self._in_transit + self._engine_waiting
            if waiting >= self.max_queue:
                self.metrics.inc("requests_rejected_total", len(params), reason="queue_full")
                raise QueueFull(f"{waiting} requests are waiting and the queue holds {self.max_queue}; retry later")
            self._in_transit += len(params)
            self._inbox.append(sub)
            self._cond.notify()
        return sub

    def cancel(self, sub: Submission) -> None:
        """Abort every unfinished choice of ``sub`` (a client went away); their KV pages are freed."""
        with self._cond:
            sub.cancelled = True
            self._cancels.append(sub)
            self._cond.notify()

    def pause(self) -> None:
        """Stop stepping (submissions are still admitted and cancels applied); for tests and maintenance."""
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify()

    def stats(self) -> dict[str, float]:
        """The engine's gauges as of its last step (``LLM.stats()`` keys) plus ``queue_length``."""
        with self._cond:
            return {**self._stats, "queue_length": self._in_transit + self._engine_waiting}

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop accepting work, abort what is queued or running (each choice ends with finish reason "abort";
        submissions not yet admitted get :class:`Failed` with :class:`ShuttingDown`) and join the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("engine loop did not stop within %s s (a step is still running)", timeout)

    # ------------------------------------------------------------------------------ loop thread
    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._inbox or self._cancels or self._stopping
                           or (not self._paused and self.llm.has_unfinished())):
                    self._cond.wait()
                inbox, self._inbox = self._inbox, []
                cancels, self._cancels = self._cancels, []
                stopping, paused = self._stopping, self._paused
            if stopping:
                self._stop(inbox)
                return
            try:
                self._iterate(inbox, cancels, paused)
            except Exception as err:  # a bug here must fail requests, not kill the thread and hang every client
                log.exception("engine loop iteration failed; failing the requests in flight")
                self._fail_all(err)
                for sub in inbox:
                    if not sub.seqs:  # never admitted: its handler still waits for Admitted / Failed
                        sub.sink(Failed(err))
            self._publish_stats(admitted=sum(len(s.params) for s in inbox))

    def _iterate(self, inbox: list[Submission], cancels: list[Submission], paused: bool) -> None:
        for sub in inbox:
            self._admit(sub)
        for sub in cancels:
            self._cancel(sub)
        if not paused and self.llm.has_unfinished():
            self._step()

    def _admit(self, sub: Submission) -> None:
        if sub.cancelled:
            return
        try:
            ids = self._tokenize(sub.prompt)
            params = self._fit(sub.params, len(ids)) if sub.fit_max_tokens else sub.params
            if _one_group(params):  # n choices of one request: the engine computes the prompt once and shares it
                seq = self.llm.add_request(ids, dataclasses.replace(params[0], n=len(params)))
                sub.seqs.extend(seq.group)
            else:
                for p in params:
                    sub.seqs.append(self.llm.add_request(ids, p))
        except Exception as err:  # noqa: BLE001  ValueError / TypeError (a bad request) or a tokenizer's error:
            # it fails this submission only, and nothing of it may stay queued
            for seq in sub.seqs:
                self.llm.abort(seq)
            sub.seqs.clear()
            self.metrics.inc("requests_rejected_total", len(sub.params), reason="invalid")
            sub.sink(Failed(err))
            return
        for index, seq in enumerate(sub.seqs):
            self._live[seq.seq_id] = _Live(sub, index, seq)
        self.metrics.inc("prompt_tokens_total", len(ids) * len(sub.seqs))
        sub.sink(Admitted(len(ids)))

    def _tokenize(self, prompt: Prompt) -> list[int]:
        # Tokenized here (not by add_request) so that fit_max_tokens knows the length; same tokenizer call.
        if isinstance(prompt, str) and self.llm.tokenizer is not None:
            return self.llm.tokenizer.encode(prompt).ids
        return prompt  # token ids, or a text prompt the engine will refuse with its own message

    def _fit(self, params: list[SamplingParams], prompt_len: int) -> list[SamplingParams]:
        bm = self.llm.block_manager
        room = min(self.llm.max_len, bm.num_pages * bm.page_size) - prompt_len
        return [dataclasses.replace(p, max_tokens=max(1, min(p.max_tokens, room))) for p in params]

    def _cancel(self, sub: Submission) -> None:
        for seq in sub.seqs:
            live = self._live.get(seq.seq_id)
            if live is not None and not seq.is_finished:
                self.llm.abort(seq)
                self._emit(live)

    def _step(self) -> None:
        try:
            self.llm.step()
        except Exception as err:  # an engine failure fails the requests in flight, not the server
            log.exception("engine step failed; failing %d requests", len(self._live))
            self._fail_all(err)
            return
        for live in list(self._live.values()):
            self._emit(live)

    def _emit(self, live: _Live) -> None:
        """Send ``live``'s new text and tokens (if any) and retire it once finished."""
        seq, now = live.seq, time.perf_counter()
        finished = seq.is_finished
        safe = seq.shown_text_end(live.sent_chars)
        new_ids = seq.output_ids[live.sent_tokens:]
        if safe == live.sent_chars and not new_ids and not finished:
            return
        delta = Delta(live.index, seq.text[live.sent_chars:safe], new_ids)
        if seq.params.logprobs:
            delta.logprobs = seq.logprobs[live.sent_tokens:]
            delta.tokens = [self._token_text(t) for t in new_ids]
        if seq.params.top_logprobs:
            delta.top = [[(self._token_text(t), lp) for t, lp in alts]
                         for alts in seq.top_logprobs[live.sent_tokens:]]
        live.sent_chars, live.sent_tokens = safe, len(seq.output_ids)
        self._count_tokens(live, len(new_ids), now)
        if finished:
            delta.finish_reason = seq.finish_reason
            del self._live[seq.seq_id]
            self.metrics.inc("requests_finished_total", finish_reason=seq.finish_reason or "unknown")
            self.metrics.observe("e2e_request_latency_seconds", now - seq.arrival_time)
        live.sub.sink(delta)

    def _count_tokens(self, live: _Live, count: int, now: float) -> None:
        if not count:
            return
        self.metrics.inc("generation_tokens_total", count)
        if live.last_token_time is None:
            first = live.seq.first_token_time or now
            self.metrics.observe("time_to_first_token_seconds", first - live.seq.arrival_time)
            live.last_token_time, count = first, count - 1
        for _ in range(count):  # a step gives a sequence one token; should several arrive, spread the gap evenly
            self.metrics.observe("inter_token_latency_seconds", (now - live.last_token_time) / count)
        live.last_token_time = now

    def _token_text(self, token_id: int) -> str:
        tok = self.llm.tokenizer
        return str(token_id) if tok is None else tok.decode([token_id], skip_special_tokens=False)

    def _fail_all(self, err: Exception) -> None:
        subs = {id(live.sub): live.sub for live in self._live.values()}
        for live in list(self._live.values()):
            if not live.seq.is_finished:
                try:
                    self.llm.abort(live.seq)
                except Exception:  # the scheduler may be inconsistent after a failed step: free the rest
                    log.exception("abort after a failed step failed")
        self._live.clear()
        for sub in subs.values():
            sub.sink(Failed(err))

    def _stop(self, inbox: list[Submission]) -> None:
        for sub in inbox:
            sub.sink(Failed(ShuttingDown("the server is shutting down")))
        for live in list(self._live.values()):
            if not live.seq.is_finished:
                self.llm.abort(live.seq)
            self._emit(live)
        with self._cond:
            self._in_transit = 0
        self._publish_stats(admitted=0)

    def _publish_stats(self, admitted: int) -> None:
        stats = dict(self.llm.stats())
        with self._cond:
            self._in_transit = max(0, self._in_transit - admitted)
            self._engine_waiting = int(stats["num_waiting"])
            self._stats = stats
