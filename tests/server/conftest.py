"""Servers for the server tests: a tiny random Llama with a character tokenizer, run by uvicorn on a thread."""

from __future__ import annotations

import string
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from subprocess import Popen

import httpx2
import openai
import pytest
import transformers
import uvicorn
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from tessera.engine import LLM
from tessera.models import load_model
from tessera.server import EngineLoop, GracefulServer, create_app
from tests.models.helpers import save_tiny

MODEL_NAME = "tiny-llama"
EOS = 2
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def wait_until_healthy(url: str, proc: Popen, log_path: Path, timeout_s: float = 120.0) -> None:
    """Poll ``url``'s /health until it answers 200; fail with the server's log if ``proc`` exits first or
    ``timeout_s`` passes (generous: a server process imports torch, and a busy machine is slow at it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, log_path.read_text()
        try:
            if httpx2.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx2.HTTPError:
            pass
        assert time.monotonic() < deadline, f"the server did not start within {timeout_s:.0f} s"
        time.sleep(0.2)


def char_tokenizer() -> Tokenizer:
    """One token per printable ASCII character, and <unk>, <s>, </s> (ids 0, 1, 2) as special tokens: the text of
    a random model's output is readable and every character count is a token count."""
    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {c: i + 3 for i, c in enumerate(chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return tok


def save_char_llama(path: Path, max_positions: int) -> Path:
    """A tiny random Llama with :func:`char_tokenizer` (one token per printable character) saved in ``path``."""
    tok = char_tokenizer()
    config = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=max_positions, bos_token_id=1, eos_token_id=EOS)
    save_tiny(transformers.LlamaForCausalLM, config, path)
    tok.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return save_char_llama(tmp_path_factory.mktemp("tiny_llama_chars"), 256)


@pytest.fixture(scope="session")
def tiny_model(tiny_dir):
    model = load_model(tiny_dir)
    model.chat_template = CHAT_TEMPLATE
    return model


@dataclass
class Running:
    """A server on a thread: its base URL, the app and the app's engine loop."""

    url: str
    app: object
    engine: EngineLoop

    def client(self, api_key: str = "unused", **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, **kwargs)


@contextmanager
def run_server(app) -> Iterator[str]:
    """Serve ``app`` as ``tessera serve`` does (:class:`GracefulServer`) on a free local port (port 0) on a daemon
    thread; yields the base URL."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on",
                            timeout_graceful_shutdown=5)
    with run_uvicorn(GracefulServer(config, app.state.engine)) as url:
        yield url


@contextmanager
def run_uvicorn(server: uvicorn.Server) -> Iterator[str]:
    """Run a configured ``uvicorn.Server`` on a daemon thread until the block ends; yields its base URL.

    Off the main thread uvicorn installs no signal handlers; ``should_exit`` stops it as SIGTERM would (stop
    accepting, let open requests finish within ``timeout_graceful_shutdown``, then the app's lifespan shutdown).
    """
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        assert not thread.is_alive(), "uvicorn did not stop"


@pytest.fixture(scope="session")
def make_server(tiny_model):
    """``with make_server(**create_app_kwargs, llm_kwargs={...}) as running:`` a fresh engine and server."""
    @contextmanager
    def make(llm_kwargs: dict | None = None, **kwargs) -> Iterator[Running]:
        llm = LLM(tiny_model, **{"page_size": 4, "num_pages": 512, "max_num_seqs": 64, **(llm_kwargs or {})})
        app = create_app(llm, MODEL_NAME, **{"max_tokens_limit": 200, "max_body_bytes": 1 << 16, **kwargs})
        with run_server(app) as url:
            yield Running(url, app, app.state.engine)

    return make


@pytest.fixture(scope="module")
def server(make_server) -> Iterator[Running]:
    with make_server() as running:
        yield running


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


@pytest.fixture
def paused(server) -> Iterator[EngineLoop]:
    """The module's engine loop, not stepping until the test ends (requests queue up)."""
    server.engine.pause()
    try:
        yield server.engine
    finally:
        server.engine.resume()
