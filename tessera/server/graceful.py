"""``GracefulServer``: uvicorn's server with a shutdown that ends open requests instead of cutting them.

On SIGTERM uvicorn stops accepting, waits up to ``timeout_graceful_shutdown`` for open requests, then cancels their
handler tasks, and only then runs the app's lifespan shutdown. A cancelled handler writes nothing more: a stream
stops mid-body without an error chunk, ``[DONE]`` or the end of its chunked body, and a queued request gets no
answer at all. Here the engine ends them itself at the graceful timeout (:meth:`EngineLoop.drain`), so each handler
still answers, with an error chunk and ``[DONE]`` or a 503; uvicorn's own cancellation moves
:data:`ANSWER_MARGIN` seconds later and becomes a backstop for a handler that cannot answer.
"""

from __future__ import annotations

import socket

import uvicorn

from tessera.server.engine_loop import EngineLoop

#: Seconds the handlers get, after the engine ended their requests, to write their last bytes before uvicorn
#: cancels them.
ANSWER_MARGIN = 2.0


class GracefulServer(uvicorn.Server):
    """A ``uvicorn.Server`` whose shutdown drains ``engine``: no new work, open requests run until the graceful
    timeout (``config.timeout_graceful_shutdown``; None waits for them without limit), then each still open is
    ended with an error its client receives.

    Parameters
    ----------
    config : uvicorn's configuration; its app is the one :func:`tessera.server.create_app` made over ``engine``.
    engine : that app's engine loop (``app.state.engine``).

    Examples
    --------
    >>> app = create_app(LLM(), "SmolLM2-135M-Instruct")
    >>> GracefulServer(uvicorn.Config(app, timeout_graceful_shutdown=30), app.state.engine).run()  # doctest: +SKIP
    """

    def __init__(self, config: uvicorn.Config, engine: EngineLoop) -> None:
        super().__init__(config)
        self.engine = engine

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        grace = self.config.timeout_graceful_shutdown
        self.engine.drain(grace)
        if grace is not None:
            # uvicorn reads the timeout when it starts waiting: give the handlers time to answer after the drain
            self.config.timeout_graceful_shutdown = grace + ANSWER_MARGIN
        try:
            await super().shutdown(sockets)
        finally:
            self.config.timeout_graceful_shutdown = grace
