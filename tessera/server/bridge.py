"""The asyncio side of the engine loop: submit from a handler, then await the loop's events.

Each call gets its own ``asyncio.Queue``; the loop thread puts events on it with ``call_soon_threadsafe`` (the only
thread-safe way into an event loop). Exceptions from the loop become :class:`~tessera.server.protocol.APIError` with
the status OpenAI's clients expect.

A call given the HTTP request watches the connection on a task of its own: once the body has been read, an ASGI
server's ``receive()`` returns only when the client disconnects, so the disconnect is seen at once, whether the
request waits in the queue or decodes, and the engine call is cancelled (its pages freed) without waiting for the
handler.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from starlette.requests import Request

from tessera.engine import SamplingParams
from tessera.server.engine_loop import (
    Admitted,
    Delta,
    EngineLoop,
    Event,
    Failed,
    Prompt,
    QueueFull,
    ShuttingDown,
)
from tessera.server.protocol import APIError

class ClientGone(Exception):
    """The HTTP client disconnected before its (non-streaming) answer was ready."""


#: What the connection watcher puts on a call's queue when the client has gone.
_GONE = object()


def to_api_error(err: Exception) -> APIError:
    """The HTTP answer for an exception from submitting or running a request."""
    if isinstance(err, APIError):
        return err
    if isinstance(err, QueueFull):
        return APIError(503, f"The server is overloaded: {err}", type="server_error", code="queue_full")
    if isinstance(err, ShuttingDown):
        return APIError(503, "The server is shutting down; retry on another replica", type="server_error",
                        code="shutting_down")
    if isinstance(err, ValueError | TypeError):
        return APIError(400, str(err), param="prompt" if "prompt" in str(err) else None)
    return APIError(500, f"The engine failed: {type(err).__name__}: {err}", type="server_error")


class EngineCall:
    """One HTTP request's submission: ``await admitted()``, then ``async for delta in deltas()``; ``cancel()`` on
    any early exit (``deltas`` does it itself when the client disconnects or the task is cancelled).

    Parameters
    ----------
    engine : the running :class:`EngineLoop`.
    prompt : text or token ids.
    params : one :class:`SamplingParams` per choice.
    fit_max_tokens : let the loop lower ``max_tokens`` to what fits after the prompt.
    request : the HTTP request, whose body has been read; its connection is watched until the call ends or
        :meth:`stop_watching` (a disconnect cancels the call and makes ``admitted`` / ``deltas`` raise
        :class:`ClientGone`).

    Raises
    ------
    APIError
        503 when the queue is full or the server is shutting down.
    """

    def __init__(self, engine: EngineLoop, prompt: Prompt, params: list[SamplingParams],
                 fit_max_tokens: bool = False, request: Request | None = None) -> None:
        self.engine = engine
        self.num_choices = len(params)
        self._queue: asyncio.Queue[Event | object] = asyncio.Queue()
        self._done = 0
        self._watcher: asyncio.Task[None] | None = None
        self._gone = False  # the watched client disconnected
        aloop = asyncio.get_running_loop()

        def sink(event: Event) -> None:
            try:
                aloop.call_soon_threadsafe(self._queue.put_nowait, event)
            except RuntimeError:  # the event loop closed (server stopped): nobody is waiting for this event
                pass

        try:
            self._sub = engine.submit(prompt, params, sink, fit_max_tokens)
        except (QueueFull, ShuttingDown) as err:
            raise to_api_error(err) from err
        if request is not None:
            self._watcher = aloop.create_task(self._watch(request), name="tessera-disconnect-watch")

    @property
    def finished(self) -> bool:
        return self._done == self.num_choices

    async def admitted(self) -> int:
        """Wait until the loop validated and queued the request; returns the prompt's token count."""
        try:
            event = await self._next()
        except BaseException:  # the handler was cancelled (client gone, server stopping) while queued
            self.cancel()
            raise
        if isinstance(event, Failed):
            self._done = self.num_choices  # nothing of it is queued: nothing to cancel
            self.stop_watching()
            raise to_api_error(event.error)
        assert isinstance(event, Admitted), event
        return event.prompt_tokens

    async def deltas(self) -> AsyncIterator[Delta]:
        """Every choice's deltas in arrival order until all have finished; :class:`ClientGone` when the watched
        client disconnects."""
        try:
            while not self.finished:
                event = await self._next()
                if isinstance(event, Failed):
                    self._done = self.num_choices
                    raise to_api_error(event.error)
                assert isinstance(event, Delta), event
                if event.finish_reason is not None:
                    self._done += 1
                yield event
            if self._gone:  # gone while the consumer held a delta: the loop ended without reading _GONE
                raise ClientGone()
        finally:  # client gone, task cancelled or the consumer stopped early: free the engine's pages
            self.cancel()

    def cancel(self) -> None:
        """Abort every unfinished choice (the loop frees their KV pages) and stop watching the client."""
        self.stop_watching()
        self._abort()

    def stop_watching(self) -> None:
        """Stop watching the connection; a streaming response does it before it starts, because Starlette then
        listens for the disconnect itself and an ASGI server may hand ``http.disconnect`` to one listener only."""
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None

    def _abort(self) -> None:
        if not self.finished:
            self._done = self.num_choices
            self.engine.cancel(self._sub)

    async def _watch(self, request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass  # the body was read before the call: nothing else can arrive but the disconnect
        self._watcher, self._gone = None, True
        self._abort()  # at once: the handler may be waiting on anything
        self._queue.put_nowait(_GONE)

    async def _next(self) -> Event:
        event = await self._queue.get()
        if event is _GONE:
            raise ClientGone()
        return event  # type: ignore[return-value]
