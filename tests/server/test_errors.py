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


def post_json(url: str, body: dict) -> httpx2.Response:
    """POST ``body`` as JSON with ASCII escapes, as most clients send it (and the only way to send a lone
    surrogate, which UTF-8 cannot encode)."""
    return httpx2.post(url, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"})


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
    # strict types, as OpenAI's: no numbers in strings, no booleans as numbers, no floats as integers
    ({**OK, "temperature": "0.5"}, "temperature", 'valid number, got the string "0.5"'),
    ({**OK, "temperature": True}, "temperature", "got the boolean true"),
    ({**OK, "stream": "yes"}, "stream", 'valid boolean, got the string "yes"'),
    ({**OK, "stream": 1}, "stream", "valid boolean, got the integer 1"),
    ({**OK, "max_tokens": True}, "max_tokens", "valid integer, got the boolean true"),
    ({**OK, "max_tokens": 3.0}, "max_tokens", "valid integer, got the number 3.0"),
    ({**OK, "n": "2"}, "n", "valid integer"),
    ({**OK, "logprobs": 1.0}, "logprobs", "valid integer"),
    ({**OK, "stream_options": {"include_usage": "true"}}, "stream_options", "valid boolean"),
    ({**OK, "prompt": [1.0, 2.0]}, "prompt", "a list of token ids (integers)"),
    ({**OK, "prompt": {"text": "hi"}}, "prompt", "got an object"),
    ({**OK, "prompt": "ab\ud800c"}, "prompt", "lone UTF-16 surrogate U+D800 at character 2"),
])
def test_bad_fields_are_400(server, body, param, words):
    message = check_error(post_json(f"{server.url}/v1/completions", body), 400, param=param)
    assert words in message


def test_a_json_integer_is_a_number(server):
    response = httpx2.post(f"{server.url}/v1/completions", json={**OK, "temperature": 0, "top_p": 1})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(("body", "words"), [
    ({"model": MODEL_NAME, "messages": []}, "at least 1"),
    ({"model": MODEL_NAME, "messages": [{"role": "robot", "content": "x"}]}, "role"),
    ({"model": MODEL_NAME, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ({"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     "tools.0.function"),
])
def test_bad_chat_requests_are_400(server, body, words):
    assert words in check_error(httpx2.post(f"{server.url}/v1/chat/completions", json=body), 400)


USER = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"messages": USER, "logprobs": "true"}, "logprobs", 'valid boolean, got the string "true"'),
    ({"messages": USER, "max_completion_tokens": 2.5}, "max_completion_tokens", "valid integer"),
    ({"messages": USER, "top_logprobs": 2}, "top_logprobs", "top_logprobs needs logprobs: true"),
    ({"messages": USER, "logprobs": False, "top_logprobs": 0}, "top_logprobs", "needs logprobs: true"),
    ({"messages": [{"role": "user", "content": "x\udc00"}]}, "messages", "lone UTF-16 surrogate U+DC00"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}]}, "messages",
     "content part 0 holds a lone UTF-16 surrogate U+D83D at character 0"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages", "messages.0.content: Input should be"),
])
def test_bad_chat_fields_name_the_param(server, body, param, words):
    response = post_json(f"{server.url}/v1/chat/completions", {"model": MODEL_NAME, **body})
    assert words in check_error(response, 400, param=param)


def test_malformed_json_is_400(server):
    response = httpx2.post(f"{server.url}/v1/completions", content=b'{"prompt": "hi",',
                           headers={"Content-Type": "application/json"})
    message = check_error(response, 400)
    assert response.json()["error"]["param"] is None  # a character offset is not a parameter
    assert "not valid JSON" in message and "at character 16" in message


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


def test_default_max_tokens_limit_is_what_the_kv_cache_holds(make_server):
    # 16 pages of 4 tokens hold 64 tokens, fewer than the 256-token context: the limit is 63, and every max_tokens
    # up to it is served (a 400 about KV pages below the limit was the inconsistency)
    with make_server(max_tokens_limit=None, llm_kwargs={"num_pages": 16}) as running:
        assert running.app.state.settings.max_tokens_limit == 63
        url = f"{running.url}/v1/completions"
        message = check_error(httpx2.post(url, json={**OK, "prompt": "x", "max_tokens": 64}), 400, param="max_tokens")
        assert "ask for at most 63" in message
        done = httpx2.post(url, json={**OK, "prompt": "x", "max_tokens": 63, "ignore_eos": True}, timeout=60)
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 63


def test_max_tokens_limit_above_the_kv_cache_is_refused_at_start(tiny_model):
    from tessera.engine import LLM
    from tessera.server import create_app

    llm = LLM(tiny_model, page_size=4, num_pages=16)
    with pytest.raises(ValueError, match=r"max_tokens_limit must be in \[1, 63\], got 100: one sequence holds 64 "
                                         r"tokens \(the context is 256, the KV cache 16 pages of 4\)"):
        create_app(llm, MODEL_NAME, max_tokens_limit=100)


@pytest.mark.parametrize("key", ["", "  "])
def test_empty_api_key_is_refused_at_start(tiny_model, key, monkeypatch, capsys):
    from tessera.cli import main
    from tessera.engine import LLM
    from tessera.server import create_app

    with pytest.raises(ValueError, match="the API key is empty"):
        create_app(LLM(tiny_model, page_size=4, num_pages=16), MODEL_NAME, api_key=key)
    assert main(["serve", "--model", "/nonexistent", "--api-key", key]) == 2  # refused before loading the model
    assert "the API key is empty" in capsys.readouterr().err
    monkeypatch.setenv("TESSERA_API_KEY", key)  # exported but empty: the flag's default
    assert main(["serve", "--model", "/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert "the API key is empty" in err and "TESSERA_API_KEY" in err


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
    # one running slot and a queue of 2: three requests are taken (the one to run and two waiting), not two
    with make_server(max_queue=2, llm_kwargs={"max_num_seqs": 1}) as running:
        running.engine.pause()
        results: list[int] = []
        threads = [threading.Thread(target=lambda: results.append(
            httpx2.post(f"{running.url}/v1/completions", json=OK, timeout=30).status_code)) for _ in range(3)]
        for i, t in enumerate(threads):
            t.start()
            deadline = time.monotonic() + 10
            while running.engine.stats()["queue_length"] < i + 1:
                assert time.monotonic() < deadline, (running.engine.stats(), results)
                time.sleep(0.01)
        message = check_error(httpx2.post(f"{running.url}/v1/completions", json=OK), 503, code="queue_full")
        assert "2 requests are waiting for a running slot and the queue holds 2" in message
        check_error(httpx2.post(f"{running.url}/v1/completions", json={**OK, "n": 3}), 503)
        running.engine.resume()
        for t in threads:
            t.join(30)
        assert results == [200, 200, 200]
        assert httpx2.post(f"{running.url}/v1/completions", json=OK).status_code == 200
        metrics = httpx2.get(f"{running.url}/metrics").text
        assert 'tessera_requests_rejected_total{reason="queue_full"} 4' in metrics


def test_queue_counts_only_requests_without_a_running_slot(make_server):
    # the probe's case: 6 at once through 1 slot and a queue of 2 serve 3 (before: 2, the one about to run counted)
    with make_server(max_queue=2, llm_kwargs={"max_num_seqs": 1}) as running:
        running.engine.pause()  # nothing finishes while the six arrive: the count is deterministic
        statuses: list[int] = []
        threads = [threading.Thread(target=lambda: statuses.append(
            httpx2.post(f"{running.url}/v1/completions", json=OK, timeout=30).status_code)) for _ in range(6)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while statuses.count(503) < 3:
            assert time.monotonic() < deadline, (statuses, running.engine.stats())
            time.sleep(0.01)
        running.engine.resume()
        for t in threads:
            t.join(30)
        assert sorted(statuses) == [200, 200, 200, 503, 503, 503]


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
