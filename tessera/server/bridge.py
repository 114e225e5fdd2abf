"""The asyncio side of the engine loop: submit from a handler, then await the loop's events.

Each call gets its own ``asyncio.Queue``; the loop thread puts events on it with ``call_soon_threadsafe`` (the only
thread-safe way into an event loop). Exceptions from the loop become :class:`~tessera.server.protocol.APIError` with
the status OpenAI's clients expect.
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

#: Seconds between checks that a non-streaming client is still connected.
DISCONNECT_POLL = 0.5


class ClientGone(Exception):
    """The HTTP client disconnected before its (non-streaming) answer was ready."""


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

    Raises
    ------
    APIError
        503 when the queue is full or the server is shutting down.
    """

    def __init__(self, engine: EngineLoop, prompt: Prompt, params: list[SamplingParams],
                 fit_max_tokens: bool = False) -> None:
        self.engine = engine
        self.num_choices = len(params)
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._done = 0
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

    @property
    def finished(self) -> bool:
        return self._done == self.num_choices

    async def admitted(self) -> int:
        """Wait until the loop validated and queued the request; returns the prompt's token count."""
        try:
            event = await self._queue.get()
        except BaseException:  # the handler was cancelled (client gone, server stopping) while queued
            self.cancel()
            raise
        if isinstance(event, Failed):
            self._done = self.num_choices  # nothing of it is queued: nothing to cancel
            raise to_api_error(event.error)
        assert isinstance(event, Admitted), event
        return event.prompt_tokens

    async def deltas(self, request: Request | None = None) -> AsyncIterator[Delta]:
        """Every choice's deltas in arrival order until all have finished.

        With ``request``, the client's connection is checked every :data:`DISCONNECT_POLL` seconds and
        :class:`ClientGone` is raised when it is gone (a streaming response learns it from Starlette instead).
        """
        try:
            while not self.finished:
                event = await self._next(request)
                if isinstance(event, Failed):
                    self._done = self.num_choices
                    raise to_api_error(event.error)
                assert isinstance(event, Delta), event
                if event.finish_reason is not None:
                    self._done += 1
                yield event
        finally:  # client gone, task cancelled or the consumer stopped early: free the engine's pages
            self.cancel()

    def cancel(self) -> None:
        if not self.finished:
            self._done = self.num_choices
            self.engine.cancel(self._sub)

    async def _next(self, request: Request | None) -> Event:
        if request is None:
            return await self._queue.get()
        while True:
            try:
                return await asyncio.wait_for(self._queue.get(), DISCONNECT_POLL)
            except TimeoutError:
                if await request.is_disconnected():
                    raise ClientGone() from None
