"""Bad requests get the right status and an OpenAI-style error body; API key, body limit and queue limit hold."""

from __future__ import annotations

import json
import threading
import time

import httpx2
import openai
import pytest

from tests.server.conftest import MODEL_NAME

OK = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}


def check_error(response: httpx2.Response, status: int, code: str | None = None, param: str | None = None) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code, body
    if param is not None:
        assert body["error"]["param"] == param, body
    return body["error"]["message"]


@pytest.mark.parametrize(("body", "param", "words"), [
    ({**OK, "temperature": "hot"}, "temperature", "number"),
    ({**OK, "temperature": 3.0}, "temperature", "less than"),
    ({**OK, "max_tokens": 0}, "max_tokens", "greater than"),
    ({**OK, "n": 0}, "n", "greater than"),
    ({**OK, "stream": "yes please"}, "stream", "boolean"),
    ({"model": MODEL_NAME}, "prompt", "Field required"),
    ({**OK, "prompt": ["a", "b"]}, "prompt", "one prompt per request"),
    ({**OK, "echo": True}, "echo", "not supported"),
    ({**OK, "logit_bias": {"5": 10}}, "logit_bias", "not supported"),
    ({**OK, "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({**OK, "seed": 2**70}, "seed", "less than"),
])
def test_bad_fields_are_400(server, body, param, words):
    message = check_error(httpx2.post(f"{server.url}/v1/completions", json=body), 400, param=param)
    assert words in message


@pytest.mark.parametrize(("body", "words"), [
    ({"model": MODEL_NAME, "messages": []}, "at least 1"),
    ({"model": MODEL_NAME, "messages": [{"role": "robot", "content": "x"}]}, "role"),
    ({"model": MODEL_NAME, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ({"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     "not supported"),
])
def test_bad_chat_requests_are_400(server, body, words):
    assert words in check_error(httpx2.post(f"{server.url}/v1/chat/completions", json=body), 400)


def test_malformed_json_is_400(server):
    response = httpx2.post(f"{server.url}/v1/completions", content=b'{"prompt": "hi",',
                           headers={"Content-Type": "application/json"})
    assert "JSON" in check_error(response, 400)


def test_unknown_model_is_404(server, client):
    check_error(httpx2.post(f"{server.url}/v1/completions", json={**OK, "model": "gpt-9"}), 404,
                code="model_not_found", param="model")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])


def test_unknown_route_is_404(server):
    check_error(httpx2.get(f"{server.url}/v1/embeddings"), 404)


def test_max_tokens_limit_is_400(server, client):
    message = check_error(httpx2.post(f"{server.url}/v1/completions", json={**OK, "max_tokens": 201}), 400,
                          param="max_tokens")
    assert "200" in message
    check_error(httpx2.post(f"{server.url}/v1/chat/completions", json={
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 1000}), 400,
        param="max_completion_tokens")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=10_000)


@pytest.mark.parametrize(("prompt", "words"), [
    ("x" * 300, "context holds 256"),
    ("", "empty"),
    ([5, 99, 7], "token ids must be ints in [0, 99)"),
])
def test_engine_rejections_are_400(server, prompt, words):
    response = httpx2.post(f"{server.url}/v1/completions", json={**OK, "prompt": prompt})
    assert words in check_error(response, 400)
    streamed = httpx2.post(f"{server.url}/v1/completions", json={**OK, "prompt": prompt, "stream": True})
    assert words in check_error(streamed, 400)  # refused before the stream starts: a real status, not a chunk


def test_body_limit_is_413(server):
    big = {**OK, "prompt": "x" * (1 << 16)}
    check_error(httpx2.post(f"{server.url}/v1/completions", json=big), 413, code="request_too_large")

    def chunked():  # no Content-Length: the limit must hold while the body streams in
        data = json.dumps(big).encode()
        for i in range(0, len(data), 4096):
            yield data[i:i + 4096]

    response = httpx2.post(f"{server.url}/v1/completions", content=chunked(),
                           headers={"Content-Type": "application/json"})
    check_error(response, 413)


def test_api_key(make_server):
    with make_server(api_key="s3cret") as running:
        url = f"{running.url}/v1/completions"
        check_error(httpx2.post(url, json=OK), 401, code="invalid_api_key")
        check_error(httpx2.post(url, json=OK, headers={"Authorization": "Bearer wrong"}), 401)
        check_error(httpx2.post(url, json=OK, headers={"Authorization": "s3cret"}), 401)
        assert httpx2.post(url, json=OK, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        with pytest.raises(openai.AuthenticationError):
            running.client(api_key="nope").models.list()
        assert running.client(api_key="s3cret").models.list().data[0].id == MODEL_NAME
        assert httpx2.get(f"{running.url}/health").status_code == 200  # probes need no key


def test_full_queue_is_503(make_server):
    with make_server(max_queue=2) as running:
        running.engine.pause()
        results: list[int] = []
        threads = [threading.Thread(target=lambda: results.append(
            httpx2.post(f"{running.url}/v1/completions", json=OK, timeout=30).status_code)) for _ in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while running.engine.stats()["queue_length"] < 2:
            assert time.monotonic() < deadline, running.engine.stats()
            time.sleep(0.01)
        check_error(httpx2.post(f"{running.url}/v1/completions", json=OK), 503, code="queue_full")
        check_error(httpx2.post(f"{running.url}/v1/completions", json={**OK, "n": 3}), 503)
        running.engine.resume()
        for t in threads:
            t.join(30)
        assert results == [200, 200]
        assert httpx2.post(f"{running.url}/v1/completions", json=OK).status_code == 200
        metrics = httpx2.get(f"{running.url}/metrics").text
        assert 'tessera_requests_rejected_total{reason="queue_full"} 4' in metrics


def test_engine_failure_fails_requests_not_the_server(server, monkeypatch):
    llm = server.engine.llm

    def broken_step():
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(llm, "step", broken_step)
    message = check_error(httpx2.post(f"{server.url}/v1/completions", json=OK), 500)
    assert "kernel exploded" in message
    streamed = httpx2.post(f"{server.url}/v1/completions", json={**OK, "stream": True}).text
    assert '"error"' in streamed and streamed.endswith("data: [DONE]\n\n")
    monkeypatch.undo()
    assert httpx2.post(f"{server.url}/v1/completions", json=OK).status_code == 200
    assert not llm.has_unfinished()
