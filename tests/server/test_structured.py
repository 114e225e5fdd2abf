"""Structured output through the official client: ``response_format`` on chat, vLLM's ``guided_*`` and llama.cpp's
``grammar`` / ``json_schema`` on completions; outputs validate whole and streamed, beside unconstrained requests;
bad schemas and grammars are 400s naming the field."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx2
import jsonschema
import pytest

from tests.engine.schemas import SCHEMAS
from tests.server.conftest import MODEL_NAME
from tests.server.test_errors import check_error

MAX = 160
USER = [{"role": "user", "content": "Answer in JSON."}]


def _schema_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


def _streamed_chat(client, **kwargs) -> tuple[str, str]:
    text, finish = "", None
    for chunk in client.chat.completions.create(model=MODEL_NAME, stream=True, **kwargs):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_response_format_json_schema_whole_and_streamed(client, name):
    seeded = {"temperature": 1.0, "seed": 7, "max_tokens": MAX}
    whole = client.chat.completions.create(model=MODEL_NAME, messages=USER, response_format=_schema_format(name),
                                           **seeded)
    assert whole.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(whole.choices[0].message.content), SCHEMAS[name])
    text, finish = _streamed_chat(client, messages=USER, response_format=_schema_format(name), **seeded)
    assert (text, finish) == (whole.choices[0].message.content, "stop")


def test_constrained_and_unconstrained_requests_run_together(client):
    """Concurrent requests share engine steps; the unconstrained ones equal their answers alone."""
    plain = {"model": MODEL_NAME, "prompt": "Once upon", "max_tokens": 24, "temperature": 0.0,
             "extra_body": {"ignore_eos": True}}
    alone = client.completions.create(**plain).choices[0].text

    def constrained(name: str) -> str:
        out = client.completions.create(model=MODEL_NAME, prompt=f"{name}:", max_tokens=MAX, temperature=0.0,
                                        extra_body={"guided_json": SCHEMAS[name]})
        return out.choices[0].text

    with ThreadPoolExecutor(6) as pool:
        texts = pool.map(constrained, sorted(SCHEMAS))
        plains = [pool.submit(lambda: client.completions.create(**plain).choices[0].text) for _ in range(2)]
        for name, text in zip(sorted(SCHEMAS), texts):
            jsonschema.validate(json.loads(text), SCHEMAS[name])
        assert [f.result() for f in plains] == [alone, alone]


def test_json_object_and_completion_extras(client):
    out = client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=MAX, temperature=0.0,
                                         response_format={"type": "json_object"})
    assert isinstance(json.loads(out.choices[0].message.content), dict)
    regex = client.completions.create(model=MODEL_NAME, prompt="Mail:", max_tokens=40, temperature=0.0,
                                      extra_body={"guided_regex": r"[a-z]{3}@[a-z]{3}\.org"})
    assert re.fullmatch(r"[a-z]{3}@[a-z]{3}\.org", regex.choices[0].text)
    gbnf = client.completions.create(model=MODEL_NAME, prompt="Answer:", max_tokens=10, temperature=0.0,
                                     extra_body={"grammar": 'root ::= ("yes" | "no") "!"'})
    assert gbnf.choices[0].text in ("yes!", "no!") and gbnf.choices[0].finish_reason == "stop"
    lark = client.completions.create(model=MODEL_NAME, prompt="Answer:", max_tokens=10, temperature=0.0,
                                     extra_body={"guided_grammar": 'start: "ok" | "fine"'})
    assert lark.choices[0].text in ("ok", "fine")
    stream = client.completions.create(model=MODEL_NAME, prompt="N:", max_tokens=MAX, temperature=0.0, stream=True,
                                       extra_body={"json_schema": SCHEMAS["numbers"]})
    jsonschema.validate(json.loads("".join(c.choices[0].text for c in stream if c.choices)), SCHEMAS["numbers"])


@pytest.mark.parametrize(("path", "body", "param", "words"), [
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                         "schema": {"type": "nonsense"}}}},
     "response_format", "invalid JSON schema"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "needs json_schema"),
    ("chat", {"response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ("chat", {"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "response_format",
     "only one constraint"),
    ("completions", {"guided_regex": "[0-9"}, "guided_regex", "unclosed character class"),
    ("completions", {"grammar": "root ::= missing"}, "grammar", "nor valid GBNF"),
    ("completions", {"guided_grammar": "start: nothing_here"}, "guided_grammar", "unknown name"),
    ("completions", {"guided_json": "{not json"}, "guided_json", "not valid JSON text"),
])
def test_bad_constraints_are_400_naming_the_field(server, path, body, param, words):
    base = ({"model": MODEL_NAME, "messages": USER} if path == "chat" else {"model": MODEL_NAME, "prompt": "x"})
    url = f"{server.url}/v1/{'chat/completions' if path == 'chat' else 'completions'}"
    assert words in check_error(httpx2.post(url, json={**base, **body}), 400, param=param)
