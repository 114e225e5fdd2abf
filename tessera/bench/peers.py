"""llama.cpp as a peer baseline: find the binaries ``make peers`` builds, run ``llama-bench``, and drive OpenAI-style
servers (``tessera serve`` or ``llama-server``) with the same streaming client load.

Everything here talks to processes and sockets only, so one client measures both servers the same way:

>>> llama = find_llama_cpp()                       # None when not built: print MISSING_HINT and go on
>>> llama_bench(llama, "model.gguf", prompt=512, gen=64, threads=2)["tg_tok_s"]
>>> with Server(llama_server_cmd(llama, "model.gguf", port, parallel=8, ctx=4096), port, log) as srv:
...     stream_load(srv.url, prompts, max_tokens=128, concurrency=8)["tok_s"]
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
#: where ``make peers`` (benchmarks/peers/build_llama_cpp.sh) puts the binaries; $TESSERA_LLAMA_CPP_BIN overrides
DEFAULT_BIN_DIR = REPO_ROOT / ".peers" / "build" / "llama.cpp" / "bin"
MISSING_HINT = ("llama.cpp peers are not built. Build them with `make peers` (llama-bench and llama-server from "
                "source into .peers/, about 10 minutes on 2 cores), then rerun; continuing with Tessera only.")


#: Variables that tune *Tessera's* thread pools (``tessera/__init__.py`` and the benchmarks set them for this process)
#: and must not reach llama.cpp: its OpenMP threads spin-wait between graph launches by default, and a passive wait
#: policy makes each token wake sleeping threads. Measured on Zen 4 (2026-12-02, SmolLM2 Q4_1, ``llama-bench -t 2``):
#: tg64 122.4 tok/s as launched from a shell, 39.2 with ``OMP_WAIT_POLICY=PASSIVE`` inherited.
TESSERA_ONLY_ENV = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OPENBLAS_THREAD_TIMEOUT", "OMP_NUM_THREADS",
                    "NUMBA_NUM_THREADS")


def peer_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a peer binary runs in: ``base`` (default this process's) without :data:`TESSERA_ONLY_ENV`,
    so llama.cpp runs with its own defaults, as its users launch it (threads come from its ``-t`` flag)."""
    env = dict(os.environ if base is None else base)
    for name in TESSERA_ONLY_ENV:
        env.pop(name, None)
    return env


class PeerError(RuntimeError):
    """A peer binary or server failed; the message names the command or log file to look at."""


@dataclass(frozen=True)
class LlamaCpp:
    """The llama.cpp binaries of one build and what the build recorded about itself (``peer-build.json``)."""

    bin_dir: Path
    bench: Path
    server: Path
    build: dict[str, Any] = field(default_factory=dict)

    @property
    def isa(self) -> dict[str, str]:
        """The GGML ISA options the build used (``{"GGML_AVX2": "ON", ...}``; empty when unrecorded)."""
        return dict(self.build.get("isa", {}))


def find_llama_cpp(bin_dir: str | Path | None = None) -> LlamaCpp | None:
    """The llama.cpp build in ``bin_dir`` ($TESSERA_LLAMA_CPP_BIN, else :data:`DEFAULT_BIN_DIR`), or None.

    Parameters
    ----------
    bin_dir : path, optional
        Directory holding ``llama-bench`` and ``llama-server``.

    Returns
    -------
    LlamaCpp or None
        None when either binary is missing (callers print :data:`MISSING_HINT`).
    """
    directory = Path(bin_dir or os.environ.get("TESSERA_LLAMA_CPP_BIN") or DEFAULT_BIN_DIR)
    bench, server = directory / "llama-bench", directory / "llama-server"
    if not (os.access(bench, os.X_OK) and os.access(server, os.X_OK)):
        return None
    stamp = directory / "peer-build.json"
    build = json.loads(stamp.read_text()) if stamp.is_file() else {}
    return LlamaCpp(directory, bench, server, build)


# ---------------------------------------------------------------------------------------------- llama-bench
def llama_bench(llama: LlamaCpp, model: str | Path, *, prompt: int = 512, gen: int = 64, threads: int = 2,
                reps: int = 3, timeout: float = 1200.0) -> dict[str, Any]:
    """Prefill (``pp<prompt>``) and batch-1 decode (``tg<gen>``) rates from one ``llama-bench -o json`` run.

    llama-bench times each test ``reps`` times after a warm-up and reports the mean and standard deviation of
    tokens/s; ``pp`` is one ``prompt``-token batch from an empty context, ``tg`` ``gen`` single-token steps.

    Parameters
    ----------
    llama : LlamaCpp
        The build to use.
    model : path
        GGUF file.
    prompt, gen : int
        Prompt length of the prefill test and tokens of the decode test (0 skips that test).
    threads : int
        ``-t``: compute threads.
    reps : int
        ``-r``: repetitions per test.
    timeout : float
        Seconds before the run is killed and :class:`PeerError` raised.

    Returns
    -------
    dict
        ``pp_tok_s``, ``pp_std``, ``tg_tok_s``, ``tg_std`` (those run), ``samples`` per test, ``build_commit``,
        ``cpu_info`` as llama-bench reports them, and the ``command``.
    """
    if prompt < 0 or gen < 0 or prompt == gen == 0:
        raise ValueError(f"llama_bench needs prompt > 0 or gen > 0, got prompt={prompt}, gen={gen}")
    cmd = [str(llama.bench), "-m", str(model), "-p", str(prompt), "-n", str(gen), "-t", str(threads),
           "-r", str(reps), "-o", "json"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False, env=peer_env())
    except subprocess.TimeoutExpired as err:
        raise PeerError(f"llama-bench ran past {timeout:.0f} s: {' '.join(cmd)}") from err
    if proc.returncode != 0:
        raise PeerError(f"llama-bench failed (exit {proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-2000:]}")
    try:
        entries = json.loads(proc.stdout)
    except json.JSONDecodeError as err:
        raise PeerError(f"llama-bench printed no JSON: {' '.join(cmd)}\n{proc.stdout[-1000:]}") from err
    out: dict[str, Any] = {"command": " ".join(cmd), "samples": {}}
    for e in entries:
        kind = "pp" if e.get("n_prompt", 0) > 0 and e.get("n_gen", 0) == 0 else "tg"
        out[f"{kind}_tok_s"] = float(e["avg_ts"])
        out[f"{kind}_std"] = float(e.get("stddev_ts", 0.0))
        out["samples"][kind] = [float(s) for s in e.get("samples_ts", [])]
        out["build_commit"], out["cpu_info"] = e.get("build_commit"), e.get("cpu_info")
    return out


# ------------------------------------------------------------------------------------------------- servers
def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tessera_server_cmd(model: str | Path, port: int, *, max_num_seqs: int = 8, keep_quantized: bool = False,
                       dtype: str = "float32", max_num_batched_tokens: int | None = None) -> list[str]:
    """The ``tessera serve`` command line for ``model`` on 127.0.0.1:``port`` (this interpreter's install).

    ``keep_quantized`` picks ``--keep-quantized`` (packed projections) or ``--dequantize`` (every weight in
    ``dtype``); the flag is always explicit because the loader's default keeps Q4_0/Q4_1/Q8_0 packed.
    """
    exe = Path(sys.executable).parent / "tessera"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "tessera.cli"]
    cmd += ["serve", "--model", str(model), "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
            "--max-num-seqs", str(max_num_seqs), "--log-level", "warning",
            "--keep-quantized" if keep_quantized else "--dequantize"]
    if max_num_batched_tokens is not None:
        cmd += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
    return cmd


def llama_server_cmd(llama: LlamaCpp, model: str | Path, port: int, *, parallel: int = 8, ctx: int = 4096,
                     threads: int = 2) -> list[str]:
    """The ``llama-server`` command line: ``parallel`` slots sharing ``ctx`` tokens of KV, ``threads`` threads.

    ``ctx`` is the total over all slots (llama-server gives each slot ``ctx / parallel``). The prompt cache is left
    on (its default); the load's prompts are random, so it never hits, as Tessera's prefix cache never does.
    """
    return [str(llama.server), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-np", str(parallel),
            "-c", str(ctx), "-t", str(threads), "-tb", str(threads), "--no-webui"]


class Server:
    """A server process started for a measurement and always stopped after it (a context manager).

    Parameters
    ----------
    cmd : list of str
        The command; its stdout and stderr go to ``log_path``.
    port : int
        Port it listens on (127.0.0.1).
    log_path : path
        Log file, named in every error.
    start_timeout : float
        Seconds to wait for ``GET /health`` to answer 200 (model loading included).
    name : str
        For messages.
    env : dict, optional
        The child's environment (default: this process's).
    """

    def __init__(self, cmd: list[str], port: int, log_path: str | Path, *, start_timeout: float = 300.0,
                 name: str = "server", env: dict[str, str] | None = None) -> None:
        self.cmd, self.port, self.log_path = cmd, port, Path(log_path)
        self.start_timeout, self.name, self.env = start_timeout, name, env
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_s: float | None = None

    def __enter__(self) -> Server:
        if shutil.which(self.cmd[0]) is None and not Path(self.cmd[0]).exists():
            raise PeerError(f"{self.name}: {self.cmd[0]} not found")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")
        start = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=self.env)
        log.close()  # the child holds its own descriptor
        try:
            self._wait_healthy(start)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - start
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wait_healthy(self, start: float) -> None:
        assert self.proc is not None
        while time.perf_counter() - start < self.start_timeout:
            if self.proc.poll() is not None:
                raise PeerError(f"{self.name} exited with code {self.proc.returncode} before it was ready; see "
                                f"{self.log_path}:\n{self._log_tail()}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", "/health")
                status = conn.getresponse().status
                conn.close()
                if status == 200:
                    return
            except OSError:
                pass  # not listening yet
            time.sleep(0.5)
        raise PeerError(f"{self.name} did not answer GET /health with 200 within {self.start_timeout:.0f} s; see "
                        f"{self.log_path}:\n{self._log_tail()}")

    def _log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds; only this object's own child process."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


# ------------------------------------------------------------------------------------------- client load
def _one_request(url: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    """POST a streaming completion; note when the first token arrives and how many tokens came."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    payload = json.dumps(body).encode()
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", payload, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise PeerError(f"POST {url}/v1/completions -> {resp.status}: {resp.read()[:500]!r}")
    first: float | None = None
    chunks = 0
    usage: dict[str, Any] | None = None
    while True:
        line = resp.readline()
        if not line:
            break
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        msg = json.loads(data)
        if "error" in msg:
            raise PeerError(f"{url}: error in stream: {msg['error']}")
        if msg.get("usage"):
            usage = msg["usage"]
        if msg.get("choices"):
            chunks += 1
            if first is None:
                first = time.perf_counter()
    end = time.perf_counter()
    conn.close()
    tokens = int(usage["completion_tokens"]) if usage and "completion_tokens" in usage else chunks
    return {"ttft_s": (first or end) - start, "latency_s": end - start, "tokens": tokens, "chunks": chunks,
            "start": start, "end": end}


def stream_load(url: str, prompts: list[list[int]], *, max_tokens: int, concurrency: int,
                extra: dict[str, Any] | None = None, timeout: float = 900.0) -> dict[str, Any]:
    """Send every prompt as a streaming ``/v1/completions`` request, ``concurrency`` in flight at a time.

    Requests are greedy with EOS ignored and a fixed ``max_tokens`` (both servers take ``ignore_eos``), so every
    server generates the same number of tokens. Throughput is all generated tokens over the wall time from the first
    send to the last finish; TTFT is measured per request from its send to its first streamed chunk, so under load
    it includes queueing behind the requests already in flight.

    Parameters
    ----------
    url : str
        ``http://127.0.0.1:PORT``.
    prompts : list of list of int
        Token-id prompts (both servers accept token ids, so prompt lengths are exactly equal).
    max_tokens : int
        Tokens to generate per request.
    concurrency : int
        Requests in flight at once.
    extra : dict, optional
        Extra body fields.
    timeout : float
        Socket timeout per request.

    Returns
    -------
    dict
        ``tok_s``, ``wall_s``, ``tokens``, ``ttft_p50_s``, ``ttft_p90_s``, ``latency_p50_s``, ``requests``.
    """
    if not prompts or max_tokens < 1 or concurrency < 1:
        raise ValueError(f"stream_load needs prompts, max_tokens >= 1 and concurrency >= 1 (got {len(prompts)}, "
                         f"{max_tokens}, {concurrency})")
    body = {"max_tokens": max_tokens, "temperature": 0.0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}, **(extra or {})}
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: _one_request(url, {**body, "prompt": p}, timeout), prompts))
    wall = max(r["end"] for r in results) - start
    tokens = sum(r["tokens"] for r in results)
    ttfts = sorted(r["ttft_s"] for r in results)
    return {"tok_s": tokens / wall, "wall_s": wall, "tokens": tokens, "requests": len(results),
            "expected_tokens": len(prompts) * max_tokens, "ttft_p50_s": statistics.median(ttfts),
            "ttft_p90_s": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))],
            "latency_p50_s": statistics.median(r["latency_s"] for r in results)}
