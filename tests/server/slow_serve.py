"""``python -m tests.server.slow_serve REPORT STEP_SLEEP SERVE_ARGS...``: ``tessera serve`` as a real process (its own
SIGTERM handling), with every engine step slowed by ``STEP_SLEEP`` seconds so that requests outlive a shutdown.

When the server has stopped it writes ``REPORT`` (JSON): the exit status ``tessera serve`` returned, the signals
that stopped it, the engine's ``LLM.stats()`` and whether it still holds unfinished requests, and the server's
metrics text. The fault-injection test reads it to check that every KV page came back and every request was counted
once.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from typing import Any


def main(argv: list[str]) -> int:
    report, step_sleep, serve_args = Path(argv[0]), float(argv[1]), argv[2:]
    import tessera.server
    from tessera.cli import main as cli
    from tessera.engine import LLM

    step = LLM.step

    def slow_step(self: LLM) -> Any:
        time.sleep(step_sleep)
        return step(self)

    LLM.step = slow_step
    apps: list[Any] = []
    create_app = tessera.server.create_app

    def capturing_create_app(*args: Any, **kwargs: Any) -> Any:  # tools/serve.py looks it up when it runs
        apps.append(create_app(*args, **kwargs))
        return apps[-1]

    tessera.server.create_app = capturing_create_app
    # uvicorn handles SIGTERM itself and, once stopped, raises it again for the handler it found at start-up (by
    # default: die at once); this one records it instead, so that the report below is still written
    received: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    rc = cli(["serve", *serve_args])
    result: dict[str, Any] = {"rc": rc, "signals": received}
    if apps:
        engine = apps[0].state.engine
        result |= {"stats": engine.llm.stats(), "unfinished": engine.llm.has_unfinished(),
                   "engine_alive": engine.is_alive, "metrics": apps[0].state.metrics.render(engine.stats())}
    report.write_text(json.dumps(result))
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
