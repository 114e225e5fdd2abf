"""The engine loop: one thread owns the :class:`~tessera.engine.LLM`; HTTP handlers talk to it through a queue.

The engine is not thread-safe, so every call into it (``add_request``, ``step``, ``abort``, ``stats``, even the
tokenizer through ``add_request``) happens on the loop thread. Handlers ``submit`` a prompt with one
:class:`SamplingParams` per choice and a ``sink``; the loop answers through the sink with :class:`Admitted` or
:class:`Failed`, then :class:`Delta` events (new text, token ids, logprobs) until every choice has finished. The sink
is called on the loop thread and must only hand the event over (the server's sink does
``loop.call_soon_threadsafe(queue.put_nowait, event)``).

Shutdown has two steps. :meth:`EngineLoop.drain` refuses new work and lets open requests run until a deadline, then
ends every request still queued or running with :class:`Failed` (:class:`ShuttingDown`), so that each handler
answers its client (an error chunk and ``[DONE]``, or a 503) before the HTTP server would cut the connection.
:meth:`EngineLoop.shutdown` does the same at once and joins the thread.
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
from tessera.engine.text_check import surrogate_message
from tessera.server.metrics import ServerMetrics

log = logging.getLogger("tessera.server")
Prompt = str | list[int]


class QueueFull(Exception):
    """``submit`` found that the request would leave more than ``max_queue`` requests waiting for a running slot."""


class ShuttingDown(Exception):
    """The loop is draining or stopped: no new work is accepted, and work still open at the deadline is ended."""


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
    set on the choice's last delta ("stop", "length", "abort", or "grammar" for a structured output whose grammar
    allowed no token).
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
    max_queue : requests (choices) that may wait for a slot in the running batch; :meth:`submit` raises
        :class:`QueueFull` for a request that would make more wait. Requests that will run at the next step (the
        batch has a free slot for them, ``max_num_seqs`` less those running) do not count as waiting.

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
        self._max_running = llm.scheduler.max_num_seqs
        self._cond = threading.Condition()
        self._inbox: list[Submission] = []
        self._cancels: list[Submission] = []
        self._in_transit = 0  # choices submitted but not yet in the engine's waiting queue (or rejected)
        self._engine_waiting = 0
        self._paused = False
        self._draining = False  # drain() was called: submit refuses new work
        self._deadline: float | None = None  # time.monotonic() at which a drain ends what is still open
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
            With this request more than ``max_queue`` requests would wait for a running slot (the caller answers
            503).
        ShuttingDown
            :meth:`drain` or :meth:`shutdown` was called.
        """
        sub = Submission(prompt, list(params), sink, fit_max_tokens)
        with self._cond:
            if self._stopping or self._draining:
                raise ShuttingDown("the server is shutting down")
            waiting = self._waiting_after(len(params))
            if waiting > self.max_queue:
                self.metrics.inc("requests_rejected_total", len(params), reason="queue_full")
                raise QueueFull(f"{waiting - len(params)} requests are waiting for a running slot and the queue "
                                f"holds {self.max_queue}; retry later")
            self._in_transit += len(params)
            self._inbox.append(sub)
            self._cond.notify()
        return sub

    def _waiting_after(self, choices: int) -> int:
        """Requests that would wait for a running slot once ``choices`` more arrive (lock held): everything not yet
        running, less the free slots of the running batch, which the next step fills."""
        free = max(0, self._max_running - int(self._stats["num_running"]))
        return max(0, self._in_transit + self._engine_waiting + choices - free)

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

    def drain(self, timeout: float | None) -> None:
        """Begin a graceful shutdown: refuse new work (:class:`ShuttingDown`) and let open requests go on; after
        ``timeout`` seconds (never, when None) end every request still queued or running as :meth:`shutdown`
        does, without stopping the thread."""
        with self._cond:
            self._draining = True
            if timeout is not None:
                self._deadline = time.monotonic() + max(0.0, timeout)
            self._cond.notify()

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop accepting work, end every request queued or running with :class:`Failed` (:class:`ShuttingDown`;
        its choices are aborted, their pages freed, and counted with finish reason "abort"), and join the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("engine loop did not stop within %s s (a step is still running)", timeout)

    # ------------------------------------------------------------------------------ loop thread
    def _until_deadline(self) -> float | None:
        """Seconds until the drain deadline (lock held); None without one, 0 once it passed."""
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._inbox or self._cancels or self._stopping or self._until_deadline() == 0
                           or (not self._paused and self.llm.has_unfinished())):
                    self._cond.wait(self._until_deadline())
                inbox, self._inbox = self._inbox, []
                cancels, self._cancels = self._cancels, []
                stopping, paused = self._stopping, self._paused
                expired = self._until_deadline() == 0
                if expired:
                    self._deadline = None  # ended once; draining still refuses new work
            if stopping:
                self._stop(inbox)
                return
            try:
                if expired:
                    self._end_all(inbox)
                else:
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
            bad_text = surrogate_message(prompt, "the prompt")
            if bad_text is not None:  # the tokenizer's own error ("TextInputSequence must be str") says nothing
                raise ValueError(bad_text)
            return self.llm.tokenizer.encode(prompt).ids
        return prompt  # token ids, or a text prompt the engine will refuse with its own message

    def _fit(self, params: list[SamplingParams], prompt_len: int) -> list[SamplingParams]:
        room = self.llm.max_seq_tokens - prompt_len
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
        """End every live request with ``err``: abort its choices (pages freed, each counted as finished) and send
        its submission one :class:`Failed`."""
        subs = {id(live.sub): live.sub for live in self._live.values()}
        for live in list(self._live.values()):
            if not live.seq.is_finished:
                try:
                    self.llm.abort(live.seq)
                except Exception:  # the scheduler may be inconsistent after a failed step: free the rest
                    log.exception("abort after a failed step failed")
            self.metrics.inc("requests_finished_total", finish_reason=live.seq.finish_reason or "abort")
        self._live.clear()
        for sub in subs.values():
            sub.sink(Failed(err))

    def _end_all(self, inbox: list[Submission]) -> None:
        """Shutdown's end of every open request: not yet admitted (``inbox``), queued in the engine, or running."""
        err = ShuttingDown("the server is shutting down")
        for sub in inbox:
            sub.sink(Failed(err))
        self._fail_all(err)

    def _stop(self, inbox: list[Submission]) -> None:
        self._end_all(inbox)
        with self._cond:
            self._in_transit = 0
        self._publish_stats(admitted=0)

    def _publish_stats(self, admitted: int) -> None:
        stats = dict(self.llm.stats())
        with self._cond:
            self._in_transit = max(0, self._in_transit - admitted)
            self._engine_waiting = int(stats["num_waiting"])
            self._stats = stats
