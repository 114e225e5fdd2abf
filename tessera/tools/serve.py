"""``tessera serve``: load a model and serve the OpenAI API (completions, chat, models) over HTTP with uvicorn."""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tessera.tools.placement_flags import add_placement_flags
from tessera.tools.speculative_flags import add_speculative_flags, speculative_args
from tessera.tools.weight_flags import add_kv_cache_flag, add_weight_flags, keep_quantized

API_KEY_ENV = "TESSERA_API_KEY"


def add_parser(commands: Any) -> None:
    p = commands.add_parser("serve", help="OpenAI-compatible HTTP server (docs/server.md)")
    p.add_argument("--model", help="GGUF file or Hugging Face directory (default: SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--served-model-name", help="the model id clients name (default: the file or directory name)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind; 0.0.0.0 exposes the server to the network")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV})")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    add_placement_flags(p)
    add_weight_flags(p)
    add_kv_cache_flag(p)
    add_speculative_flags(p)
    p.add_argument("--max-num-seqs", type=int, default=16, help="requests in the running batch at most")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="new tokens per engine step at most")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks (processes) the model is split across on this machine, one thread each "
                        "(docs/distributed.md)")
    p.add_argument("--num-pages", type=int, help="KV pages (default: from --kv-cache-memory-mib)")
    p.add_argument("--kv-cache-memory-mib", type=int, default=256, help="KV cache size when --num-pages is unset")
    p.add_argument("--no-prefix-caching", action="store_true", help="do not reuse KV of shared prompt prefixes")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests (choices) waiting for a slot in the running batch at most; more get 503")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    p.add_argument("--max-tokens-limit", type=int,
                   help="largest max_tokens allowed (default and most: what one sequence can hold after a 1-token "
                        "prompt, the context or the KV cache, whichever is smaller)")
    p.add_argument("--graceful-timeout", type=float, default=30.0,
                   help="seconds to let open requests finish on shutdown; then each gets an error chunk or a 503")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(run=_run)


def model_name(path: str | Path | None) -> str:
    """The default served name: the GGUF file's stem or the checkpoint directory's name."""
    if path is None:
        from tessera.models.model import default_model_path

        path = default_model_path()
    path = Path(path)
    return path.stem if path.is_file() else path.resolve().name


def check_api_key(key: str | None) -> None:
    """Refuse an empty key (``--api-key ""``, or ``TESSERA_API_KEY`` exported but empty): it would match requests
    that send no key, so authentication would be off while the flag says it is on."""
    if key is not None and not key.strip():
        raise ValueError(f"the API key is empty (--api-key or ${API_KEY_ENV} is {key!r}), which would turn "
                         f"authentication off; pass a non-empty key (e.g. `openssl rand -hex 16`), or unset "
                         f"{API_KEY_ENV} and drop --api-key to serve without one")


def make_server(args: argparse.Namespace) -> Any:
    """The configured :class:`tessera.server.GracefulServer` (model loaded, not yet running); ``server.run()``
    serves. Raises ValueError for an empty API key before loading anything."""
    import uvicorn

    from tessera.engine import LLM
    from tessera.server import GracefulServer, create_app

    check_api_key(args.api_key)

    llm = LLM(args.model, dtype=args.dtype, backend=args.backend, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, page_size=args.page_size, num_pages=args.num_pages,
              kv_cache_memory=args.kv_cache_memory_mib * 2**20, enable_prefix_caching=not args.no_prefix_caching,
              keep_quantized=keep_quantized(args), device=args.device, kv_cache_dtype=args.kv_cache_dtype,
              tensor_parallel_size=args.tensor_parallel_size, **speculative_args(args))
    app = create_app(llm, args.served_model_name or model_name(args.model), api_key=args.api_key,
                     max_queue=args.max_queue, max_body_bytes=args.max_body_bytes,
                     max_tokens_limit=args.max_tokens_limit, shutdown_llm=True)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.graceful_timeout, lifespan="on")
    return GracefulServer(config, app.state.engine)


def _exposed(host: str) -> bool:
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host != "localhost"


def _run(args: argparse.Namespace) -> int:
    check_api_key(args.api_key)  # before the warning below, which an empty key would also trigger
    if _exposed(args.host) and not args.api_key:
        print(f"warning: serving on {args.host} without --api-key: anyone who can reach this port can use the model",
              file=sys.stderr)
    server = make_server(args)
    from tessera.distributed.torchrun import launch_env

    if launch_env() is not None:  # rank 0 of a torchrun group: the worker ranks never get past make_server()
        exit_cleanly_on_one_signal(server)
    server.run()
    return 0


def exit_cleanly_on_one_signal(server: Any) -> None:
    """Make ``server.run()`` return after one SIGTERM / SIGINT instead of re-raising the signal.

    uvicorn re-raises a signal it caught once it has shut down (so a lone server dies "by" it, as its caller
    expects). Under torchrun that makes rank 0 look killed: the agent counts the group as failed, tears down the
    worker ranks and exits 1, although the app's lifespan has already stopped them cleanly. So on rank 0 of a
    launched group one signal ends the process with 0, like the worker ranks; a second SIGINT (uvicorn's force
    exit) still re-raises, so an impatient user gets the conventional interrupt code.

    Parameters
    ----------
    server : a :class:`uvicorn.Server` (``tessera serve``'s :class:`tessera.server.GracefulServer`) not yet run.
    """
    capture = server.capture_signals

    @contextlib.contextmanager
    def capture_then_forget() -> Iterator[None]:
        with capture():
            yield
            # runs after the lifespan's shutdown (which stopped the workers), before capture()'s exit re-raises
            if not server.force_exit:
                server._captured_signals.clear()

    server.capture_signals = capture_then_forget
