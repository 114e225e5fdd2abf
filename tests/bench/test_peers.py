"""``tessera.bench.peers`` without llama.cpp: fake binaries and a fake streaming server stand in for the real ones.

The real binaries are exercised by ``benchmarks/e2e_cpu.py``; the one integration test here skips when ``make peers``
has not built them.
"""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tessera.bench import peers


def _fake_build(tmp_path, bench_stdout: str, exit_code: int = 0) -> peers.LlamaCpp:
    bench = tmp_path / "llama-bench"
    bench.write_text(f"#!/bin/sh\ncat <<'EOF'\n{bench_stdout}\nEOF\nexit {exit_code}\n")
    server = tmp_path / "llama-server"
    server.write_text("#!/bin/sh\necho 'loading model...'\necho 'error: no such model' >&2\nexit 3\n")
    for f in (bench, server):
        f.chmod(0o755)
    (tmp_path / "peer-build.json").write_text(json.dumps({"isa": {"GGML_AVX2": "ON", "GGML_AMX_INT8": "OFF"}}))
    found = peers.find_llama_cpp(tmp_path)
    assert found is not None
    return found


def test_find_llama_cpp_reports_missing_binaries(tmp_path):
    assert peers.find_llama_cpp(tmp_path) is None
    assert "make peers" in peers.MISSING_HINT


def test_llama_bench_json_is_parsed(tmp_path):
    entries = [{"n_prompt": 512, "n_gen": 0, "avg_ts": 100.5, "stddev_ts": 1.5, "samples_ts": [99.0, 102.0],
                "build_commit": "abc", "cpu_info": "AMD EPYC"},
               {"n_prompt": 0, "n_gen": 64, "avg_ts": 20.25, "stddev_ts": 0.25, "samples_ts": [20.0, 20.5]}]
    llama = _fake_build(tmp_path, json.dumps(entries))
    assert llama.isa == {"GGML_AVX2": "ON", "GGML_AMX_INT8": "OFF"}
    r = peers.llama_bench(llama, "m.gguf", prompt=512, gen=64, threads=2, reps=2)
    assert (r["pp_tok_s"], r["pp_std"], r["tg_tok_s"], r["tg_std"]) == (100.5, 1.5, 20.25, 0.25)
    assert r["samples"]["tg"] == [20.0, 20.5] and "-t 2" in r["command"]
    with pytest.raises(ValueError):
        peers.llama_bench(llama, "m.gguf", prompt=0, gen=0)


def test_llama_bench_failure_names_the_command(tmp_path):
    llama = _fake_build(tmp_path, "not json")
    with pytest.raises(peers.PeerError, match="printed no JSON"):
        peers.llama_bench(llama, "m.gguf")
    llama = _fake_build(tmp_path, "[]", exit_code=1)
    with pytest.raises(peers.PeerError, match="exit 1"):
        peers.llama_bench(llama, "m.gguf")


def test_a_server_that_exits_early_names_its_log(tmp_path):
    llama = _fake_build(tmp_path, "[]")
    port = peers.free_port()
    log = tmp_path / "server.log"
    with pytest.raises(peers.PeerError, match=str(log)) as err:
        with peers.Server(peers.llama_server_cmd(llama, "m.gguf", port), port, log, start_timeout=20):
            pass
    assert "no such model" in str(err.value)  # the log's tail is in the message


def test_a_server_that_never_gets_healthy_times_out(tmp_path):
    port = peers.free_port()
    cmd = [sys.executable, "-c", "import time; time.sleep(30)"]
    srv = peers.Server(cmd, port, tmp_path / "slow.log", start_timeout=1.0, name="slow")
    with pytest.raises(peers.PeerError, match="within 1 s"):
        srv.__enter__()
    assert srv.proc is not None and srv.proc.poll() is not None  # stopped, not left running


class _FakeCompletions(BaseHTTPRequestHandler):
    """Streams ``max_tokens`` one-token chunks, then a usage chunk (what both real servers do)."""

    bodies: list[dict] = []

    def do_POST(self) -> None:  # noqa: N802  (http.server's naming)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(body["max_tokens"]):
            self.wfile.write(f"data: {json.dumps({'choices': [{'text': f't{i}'}]})}\n\n".encode())
        usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"]}}
        self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())

    def log_message(self, *args: object) -> None:
        pass


def test_stream_load_counts_tokens_and_ttft():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _FakeCompletions)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        r = peers.stream_load(url, [[1, 2, 3]] * 6, max_tokens=5, concurrency=3)
    finally:
        httpd.shutdown()
    assert r["tokens"] == r["expected_tokens"] == 30 and r["requests"] == 6
    assert r["tok_s"] > 0 and 0 <= r["ttft_p50_s"] <= r["latency_p50_s"]
    body = _FakeCompletions.bodies[0]
    assert body["ignore_eos"] is True and body["stream"] is True and body["temperature"] == 0.0
    assert body["prompt"] == [1, 2, 3]
    with pytest.raises(ValueError):
        peers.stream_load(url, [], max_tokens=5, concurrency=1)


@pytest.mark.skipif(peers.find_llama_cpp() is None, reason="llama.cpp peers not built (make peers)")
def test_real_llama_bench_runs_the_default_model():
    from tessera.models import default_model_path

    r = peers.llama_bench(peers.find_llama_cpp(), default_model_path(), prompt=32, gen=4, threads=2, reps=1)
    assert r["pp_tok_s"] > 0 and r["tg_tok_s"] > 0


def test_peers_run_without_tesseras_thread_pool_settings(tmp_path, monkeypatch):
    """llama.cpp must not inherit OMP_WAIT_POLICY=PASSIVE (which ``import tessera`` sets): it made llama-bench's tg64
    3x slower than the same binary launched from a shell."""
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("OPENBLAS_THREAD_TIMEOUT", "4")
    monkeypatch.setenv("GOMP_SPINCOUNT", "20000")
    monkeypatch.setenv("TESSERA_PEER_KEEP", "yes")
    env = peers.peer_env()
    assert "OMP_WAIT_POLICY" not in env and "OPENBLAS_THREAD_TIMEOUT" not in env and "GOMP_SPINCOUNT" not in env
    assert env["TESSERA_PEER_KEEP"] == "yes"
    seen = tmp_path / "env.txt"
    entries = json.dumps([{"n_prompt": 0, "n_gen": 8, "avg_ts": 1.0}])
    bench = tmp_path / "llama-bench"
    bench.write_text(f"#!/bin/sh\necho \"wait=${{OMP_WAIT_POLICY:-unset}}\" > {seen}\ncat <<'EOF'\n{entries}\nEOF\n")
    bench.chmod(0o755)
    llama = peers.LlamaCpp(tmp_path, bench, tmp_path / "llama-server")
    peers.llama_bench(llama, "m.gguf", prompt=0, gen=8)
    assert seen.read_text().strip() == "wait=unset"
