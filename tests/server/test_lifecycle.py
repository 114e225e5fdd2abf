"""A vanished client frees its KV pages; shutdown aborts in-flight requests; /metrics reports all of it."""

from __future__ import annotations

import re
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


def test_graceful_shutdown_finishes_short_and_aborts_long_requests(tiny_model):
    import uvicorn

    from tessera.engine import LLM
    from tessera.server import create_app

    llm = LLM(tiny_model, page_size=4, num_pages=512)
    step = llm.step
    llm.step = lambda: (time.sleep(0.02), step())[1]  # 200 tokens take >= 4 s, 10 tokens ~0.2 s
    app = create_app(llm, MODEL_NAME)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="critical", lifespan="on",
                            timeout_graceful_shutdown=1.0)
    lines: dict[int, list[str]] = {10: [], 200: []}
    with run_uvicorn(uvicorn.Server(config)) as url:  # leaving the block is SIGTERM: should_exit

        def read(max_tokens: int) -> None:
            try:
                with httpx2.stream("POST", f"{url}/v1/completions", json={**LONG, "max_tokens": max_tokens},
                                   timeout=30) as response:
                    lines[max_tokens].extend(response.iter_lines())
            except httpx2.HTTPError:  # the long one: its connection is cut after the graceful period
                lines[max_tokens].append("<cut>")

        readers = [threading.Thread(target=read, args=(n,)) for n in lines]
        for r in readers:
            r.start()
        wait_for(lambda: app.state.engine.stats()["num_running"] == 2)
    for r in readers:
        r.join(10)
    short = [x for x in lines[10] if x.startswith("data: ")]
    assert short[-1] == "data: [DONE]" and '"finish_reason": "length"' in short[-2]  # finished in the grace period
    assert "data: [DONE]" not in lines[200] and "<cut>" in lines[200]  # cancelled after it
    assert not app.state.engine.is_alive  # the lifespan joined the loop thread
    assert llm.block_manager.num_free_pages == 512 and not llm.has_unfinished()
    text = app.state.metrics.render(app.state.engine.stats())
    assert 'tessera_requests_finished_total{finish_reason="abort"} 1' in text
    assert 'tessera_requests_finished_total{finish_reason="length"} 1' in text


def test_engine_loop_shutdown_aborts_what_is_running(tiny_model):
    from tessera.engine import LLM, SamplingParams
    from tessera.server import EngineLoop
    from tessera.server.engine_loop import Admitted, Delta, Failed, ShuttingDown

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
    assert sorted((e.index, e.finish_reason) for e in events[1:] if isinstance(e, Delta)) == [(0, "abort"),
                                                                                               (1, "abort")]
    assert not engine.is_alive and llm.block_manager.num_free_pages == 64
    with pytest.raises(ShuttingDown):
        engine.submit([5], [SamplingParams()], events.append)
    assert not any(isinstance(e, Failed) for e in events)
