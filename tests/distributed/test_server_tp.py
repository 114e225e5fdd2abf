"""The OpenAI-compatible server over a two-rank tensor-parallel engine: streamed greedy text equals the
single-process server's, and the worker ranks stop with the server (in-process, and ``tessera serve`` under
SIGTERM)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tessera.engine import LLM
from tessera.models import load_model
from tessera.server import create_app
from tests.distributed.test_tensor_parallel import _pid_gone
from tests.server.conftest import (CHAT_TEMPLATE, MODEL_NAME, Running, run_server, save_char_llama,
                                   wait_until_healthy)
from tests.server.test_fault_injection import free_port

REPO = Path(__file__).resolve().parents[2]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
PROMPT = "The quick brown fox"
ENGINE = {"page_size": 4, "num_pages": 128, "max_num_seqs": 8}
# ignore_eos (vLLM's extension): the random model would often end at once, leaving little text to compare
GREEDY = {"temperature": 0.0, "max_tokens": 24, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def char_dir(tmp_path_factory) -> Path:
    return save_char_llama(tmp_path_factory.mktemp("tp_server_chars"), 256)


@pytest.fixture(scope="module")
def char_model(char_dir):
    model = load_model(char_dir)
    model.chat_template = CHAT_TEMPLATE
    return model


def _texts(running: Running) -> tuple[str, str]:
    """A streamed chat completion's and a streamed plain completion's text."""
    client = running.client()
    chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, stream=True, **GREEDY)
    chat_text = "".join(c.choices[0].delta.content or "" for c in chat if c.choices)
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPT, stream=True, **GREEDY)
    return chat_text, "".join(c.choices[0].text for c in plain if c.choices)


def _serve(llm: LLM, **kwargs) -> tuple[str, str]:
    app = create_app(llm, MODEL_NAME, **kwargs)
    with run_server(app) as url:
        return _texts(Running(url, app, app.state.engine))


@pytest.fixture(scope="module")
def reference(char_model) -> tuple[str, str]:
    return _serve(LLM(char_model, **ENGINE))


def test_streams_match_single_process_and_workers_stop_with_the_app(char_model, reference):
    llm = LLM(char_model, tensor_parallel_size=2, **ENGINE)
    (pid,) = llm.tensor_parallel.worker_pids
    try:
        got = _serve(llm, shutdown_llm=True)
        assert _pid_gone(pid)  # the app's lifespan stopped the worker, not the finally below
    finally:
        llm.shutdown()
    assert got == reference
    # one character per token, less the special tokens (no text) the random model picks now and then
    assert min(map(len, got)) >= GREEDY["max_tokens"] // 2, got


def _descendants(pid: int) -> set[int]:
    """Process ids of ``pid``'s children and their children (read from /proc)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    # the name field may hold spaces: the parent's pid follows its closing parenthesis
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):  # exited while listed
                pass
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_cli_serve_sigterm_leaves_no_worker(char_dir, reference, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tessera.cli", "serve", "--model", str(char_dir), "--served-model-name",
             MODEL_NAME, "--port", str(port), "--tensor-parallel-size", "2", "--page-size", "4", "--num-pages",
             "128", "--max-num-seqs", "8", "--log-level", "warning"],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_until_healthy(url, proc, log_path)
            workers = _descendants(proc.pid)
            assert workers, "no worker rank was spawned"
            running = Running(url, None, None)
            plain = running.client().completions.create(model=MODEL_NAME, prompt=PROMPT, stream=True, **GREEDY)
            assert "".join(c.choices[0].text for c in plain if c.choices) == reference[1]
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    deadline = time.monotonic() + 10
    while not all(_pid_gone(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_pid_gone(p) for p in workers), (workers, log_path.read_text())
    assert "Traceback" not in log_path.read_text(), log_path.read_text()


def _rank_of(pid: int) -> int | None:
    """The RANK torchrun gave process ``pid`` (read from /proc), or None for a process that is no rank."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
    except OSError:
        return None
    return int(env[b"RANK"]) if b"RANK" in env else None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_torchrun_serve_signal_exits_zero_everywhere(char_dir, reference, tmp_path, sig):
    """``torchrun ... tessera serve``: one SIGTERM or SIGINT to rank 0 stops the server and the worker rank, every
    rank exits 0 (so torchrun does too), and no process is left."""
    from tests.distributed.test_torchrun import _env

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "server.log"
    torchrun = Path(sys.executable).with_name("torchrun")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [str(torchrun), "--nnodes", "1", "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
             str(free_port()), "-m", "tessera.cli", "serve", "--model", str(char_dir), "--served-model-name",
             MODEL_NAME, "--port", str(port), "--tensor-parallel-size", "2", "--page-size", "4", "--num-pages",
             "128", "--max-num-seqs", "8", "--log-level", "warning"],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=_env())
        ranks: dict[int, int] = {}
        try:
            wait_until_healthy(url, proc, log_path)
            ranks = {r: p for p in _descendants(proc.pid) if (r := _rank_of(p)) is not None}
            assert sorted(ranks) == [0, 1], ranks
            running = Running(url, None, None)
            plain = running.client().completions.create(model=MODEL_NAME, prompt=PROMPT, stream=True, **GREEDY)
            assert "".join(c.choices[0].text for c in plain if c.choices) == reference[1]
            everyone = _descendants(proc.pid)
            start = time.monotonic()
            os.kill(ranks[0], sig)
            code = proc.wait(timeout=30)
            assert time.monotonic() - start < 30
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    log_text = log_path.read_text()
    assert code == 0, log_text[-3000:]  # torchrun exits 0 only when every rank did
    deadline = time.monotonic() + 10
    while not all(_pid_gone(p) for p in everyone) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_pid_gone(p) for p in everyone), (everyone, log_text[-3000:])
    assert "Traceback" not in log_text, log_text[-3000:]
