"""A vanished client frees its KV pages; shutdown aborts in-flight requests; /metrics reports all of it."""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import httpx2
import pytest

from tests.server.conftest import MODEL_NAME, run_uvicorn

LONG = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 200, "temperature": 0.0,
        "ignore_eos": True, "stream": True}
METRIC_NAMES = [
    "tessera_http_requests_total", "tessera_requests_finished_total", "tessera_requests_rejected_total",
    "tessera_prompt_tokens_total", "tessera_generation_tokens_total", "tessera_time_to_first_token_seconds_bucket",
    "tessera_inter_token_latency_seconds_count", "tessera_e2e_request_latency_seconds_sum",
    "tessera_num_requests_running", "tessera_num_requests_waiting", "tessera_kv_pages_used", "tessera_kv_pages_total",
    "tessera_kv_cache_usage_ratio", "tessera_prefix_cache_hit_rate", "tessera_prefix_cache_hit_tokens_total",
    "tessera_num_preemptions_total",
]


def metric(url: str, name: str) -> float:
    text = httpx2.get(f"{url}/metrics").text
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


@pytest.fixture
def slow_steps(server):
    """Each engine step takes >= 10 ms, so a 200-token request outlives the client that asked for it."""
    llm = server.engine.llm
    step = llm.step

    def slow_step():
        time.sleep(0.01)
        return step()

    llm.step = slow_step
    yield
    del llm.step


def test_disconnect_aborts_and_frees_pages(server, slow_steps):
    aborted = 'tessera_requests_finished_total{finish_reason="abort"}'
    before = metric(server.url, aborted)
    with httpx2.Client() as http, http.stream("POST", f"{server.url}/v1/completions", json=LONG) as response:
        assert response.status_code == 200
        lines = response.iter_lines()  # kept: dropping a half-read iterator closes the connection
        first = next(lines)
        assert first.startswith("data: {") and "error" not in first, first
        time.sleep(0.1)
        assert metric(server.url, "tessera_kv_pages_used") > 0 and metric(server.url, aborted) == before
    # the connection is closed mid-stream: the request is aborted long before its 200 tokens (~2 s) are done
    wait_for(lambda: metric(server.url, aborted) == before + 1, timeout=1.5)
    wait_for(lambda: metric(server.url, "tessera_kv_pages_used") == 0)
    assert server.engine.stats()["num_running"] == 0


def test_disconnect_of_a_waiting_non_streaming_request(server, paused):
    aborted = 'tessera_requests_finished_total{finish_reason="abort"}'
    before = metric(server.url, aborted)
    with pytest.raises(httpx2.ReadTimeout):
        httpx2.post(f"{server.url}/v1/completions", json={**LONG, "stream": False}, timeout=0.3)
    wait_for(lambda: metric(server.url, aborted) == before + 1)  # seen within the disconnect poll interval
    assert server.engine.stats()["queue_length"] == 0 and metric(server.url, "tessera_kv_pages_used") == 0


def test_metrics_names_and_counts(server, client):
    text = httpx2.get(f"{server.url}/metrics").text
    for name in METRIC_NAMES:
        assert re.search(rf"^{name}\b", text, re.MULTILINE), name
    assert "# TYPE tessera_time_to_first_token_seconds histogram" in text
    tokens = metric(server.url, "tessera_generation_tokens_total")
    prompt = metric(server.url, "tessera_prompt_tokens_total")
    out = client.completions.create(model=MODEL_NAME, prompt="metrics", max_tokens=5, temperature=0.0, n=2)
    assert metric(server.url, "tessera_generation_tokens_total") == tokens + out.usage.completion_tokens
    assert metric(server.url, "tessera_prompt_tokens_total") == prompt + 2 * out.usage.prompt_tokens
    assert metric(server.url, 'tessera_http_requests_total{endpoint="/v1/completions",status="200"}') >= 1
    client.completions.create(model=MODEL_NAME, prompt="metrics", max_tokens=5, temperature=0.0)
    assert metric(server.url, "tessera_prefix_cache_hit_rate") > 0  # 7 prompt characters: one full page of 4


def test_disconnect_while_decoding_non_streaming(server, slow_steps):
    # a request that gets a token every step: the disconnect must be seen while deltas keep arriving
    aborted = 'tessera_requests_finished_total{finish_reason="abort"}'
    before, generated = metric(server.url, aborted), metric(server.url, "tessera_generation_tokens_total")
    body = json.dumps({**LONG, "stream": False}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_for(lambda: metric(server.url, "tessera_generation_tokens_total") >= generated + 5)  # decoding
        assert metric(server.url, aborted) == before and metric(server.url, "tessera_kv_pages_used") > 0
    # closed mid-decode; 200 tokens take >= 2 s more, and the disconnect must be seen within 0.5 s
    wait_for(lambda: metric(server.url, aborted) == before + 1, timeout=1.5)
    wait_for(lambda: metric(server.url, "tessera_kv_pages_used") == 0)
    assert server.engine.stats()["num_running"] == 0


def sse_lines(url: str, body: dict, out: list[str]) -> None:
    """POST ``body`` and append what came back: the stream's lines, or ``status <code> <json>`` for a whole answer;
    ``<cut>`` when the connection broke before the response ended."""
    try:
        with httpx2.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
            if body.get("stream"):
                out.extend(response.iter_lines())
            else:
                out.append(f"status {response.status_code} {response.read().decode()}")
    except httpx2.HTTPError as err:
        out.append(f"<cut> {err!r}")


def test_graceful_shutdown_finishes_short_and_ends_long_requests(tiny_model):
    import uvicorn

    from tessera.engine import LLM
    from tessera.server import GracefulServer, create_app

    llm = LLM(tiny_model, page_size=4, num_pages=512, max_num_seqs=3)
    step = llm.step
    llm.step = lambda: (time.sleep(0.02), step())[1]  # 200 tokens take >= 4 s, 10 tokens ~0.2 s
    app = create_app(llm, MODEL_NAME)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="critical", lifespan="on",
                            timeout_graceful_shutdown=1.0)
    jobs = {"short stream": {**LONG, "max_tokens": 10}, "long stream": LONG,
            "long whole": {**LONG, "stream": False},  # the three running (max_num_seqs=3) ...
            "queued stream": LONG, "queued whole": {**LONG, "stream": False}}  # ... and two waiting for a slot
    lines: dict[str, list[str]] = {name: [] for name in jobs}
    with run_uvicorn(GracefulServer(config, app.state.engine)) as url:  # leaving the block is SIGTERM
        readers = [threading.Thread(target=sse_lines, args=(url, jobs[name], lines[name])) for name in jobs]
        for r in readers[:3]:
            r.start()
        wait_for(lambda: app.state.engine.stats()["num_running"] == 3)
        for r in readers[3:]:
            r.start()
        wait_for(lambda: app.state.engine.stats()["queue_length"] == 2)
    for r in readers:
        r.join(10)
    short = [x for x in lines["short stream"] if x.startswith("data: ")]
    assert short[-1] == "data: [DONE]" and '"finish_reason": "length"' in short[-2]  # finished in the grace period
    for name in ("long stream", "queued stream"):  # ended at the timeout with an error chunk, then [DONE]
        data = [x for x in lines[name] if x.startswith("data: ")]
        assert data[-1] == "data: [DONE]", (name, lines[name][-3:])
        error = json.loads(data[-2].removeprefix("data: "))["error"]
        assert error["code"] == "shutting_down" and error["type"] == "server_error", error
    for name in ("long whole", "queued whole"):  # a whole answer: 503, OpenAI's error body
        status, _, body = lines[name][0].removeprefix("status ").partition(" ")
        assert status == "503" and json.loads(body)["error"]["code"] == "shutting_down", lines[name]
    assert not app.state.engine.is_alive  # the lifespan joined the loop thread
    assert llm.block_manager.num_free_pages == 512 and not llm.has_unfinished()
    text = app.state.metrics.render(app.state.engine.stats())
    assert 'tessera_requests_finished_total{finish_reason="abort"} 4' in text
    assert 'tessera_requests_finished_total{finish_reason="length"} 1' in text


def test_engine_loop_shutdown_ends_what_is_queued(tiny_model):
    from tessera.engine import LLM, SamplingParams
    from tessera.server import EngineLoop
    from tessera.server.engine_loop import Admitted, Failed, ShuttingDown

    llm = LLM(tiny_model, page_size=4, num_pages=64)
    engine = EngineLoop(llm, max_queue=8)
    events: list = []
    engine.start()
    engine.pause()
    engine.submit([5, 6, 7], [SamplingParams(max_tokens=50)] * 2, events.append)
    wait_for(lambda: len(events) == 1)  # admitted (paused: queued, not running)
    assert engine.stats()["queue_length"] == 2
    engine.shutdown()
    assert isinstance(events[0], Admitted) and events[0].prompt_tokens == 3
    assert len(events) == 2 and isinstance(events[1], Failed) and isinstance(events[1].error, ShuttingDown)
    assert not engine.is_alive and llm.block_manager.num_free_pages == 64 and not llm.has_unfinished()
    assert 'tessera_requests_finished_total{finish_reason="abort"} 2' in engine.metrics.render(engine.stats())
    with pytest.raises(ShuttingDown):
        engine.submit([5], [SamplingParams()], events.append)


def test_drain_refuses_new_work_and_ends_the_rest_at_its_deadline(tiny_model):
    from tessera.engine import LLM, SamplingParams
    from tessera.server import EngineLoop
    from tessera.server.engine_loop import Admitted, Delta, Failed, ShuttingDown

    llm = LLM(tiny_model, page_size=4, num_pages=64)
    step = llm.step
    llm.step = lambda: (time.sleep(0.01), step())[1]
    engine = EngineLoop(llm, max_queue=8)
    events: list = []
    engine.start()
    engine.submit([5, 6, 7], [SamplingParams(max_tokens=200, ignore_eos=True)], events.append)
    wait_for(lambda: any(isinstance(e, Delta) for e in events))
    engine.drain(0.3)
    with pytest.raises(ShuttingDown):
        engine.submit([5], [SamplingParams()], events.append)
    assert engine.is_alive  # still stepping: open requests may finish within the deadline
    wait_for(lambda: isinstance(events[-1], Failed), timeout=5)
    assert isinstance(events[0], Admitted) and isinstance(events[-1].error, ShuttingDown)
    assert len(events) > 3  # it kept decoding until the deadline
    wait_for(lambda: engine.stats()["kv_pages_used"] == 0)
    engine.shutdown()
    assert not engine.is_alive and not llm.has_unfinished()
