"""``tessera serve``: an OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn). docs/server.md"""

from tessera.server.app import create_app
from tessera.server.engine_loop import EngineLoop
from tessera.server.graceful import GracefulServer

__all__ = ["EngineLoop", "GracefulServer", "create_app"]
