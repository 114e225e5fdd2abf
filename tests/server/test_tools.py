"""Tool calling through the official client: ``required`` and named choices forced by the grammar, ``auto`` parsed
from free output, streamed ``tool_calls`` deltas equal to the whole answer, and a round trip (call, tool result,
final answer); the prompt renders tools, assistant calls and tool results through the chat template."""

from __future__ import annotations

import json

import httpx2
import jsonschema
import pytest

from tessera.server import protocol as p
from tessera.server.chat_tools import ChatTools, tool_deltas
from tessera.server.tools import ToolCallParser
from tessera.engine import LLM
from tessera.models import load_model
from tessera.server import create_app
from tests.server.conftest import CHAT_TEMPLATE, MODEL_NAME, Running, run_server, save_char_llama
from tests.server.test_errors import check_error

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
USER = [{"role": "user", "content": "Weather in Paris?"}]
SAMPLED = {"temperature": 1.0, "seed": 3, "max_tokens": 120}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The tests' tiny character-level model with a 2048-token context: the tool list in the prompt is ~700
    characters, more than the shared server's 256."""
    model = load_model(save_char_llama(tmp_path_factory.mktemp("tiny_llama_tools"), 2048))
    model.chat_template = CHAT_TEMPLATE
    llm = LLM(model, page_size=16, num_pages=1024, max_num_seqs=16, max_num_batched_tokens=1024)
    app = create_app(llm, MODEL_NAME, max_tokens_limit=200)
    with run_server(app) as url:
        yield Running(url, app, app.state.engine)


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def _streamed(client, **kwargs) -> tuple[str | None, list[dict], str]:
    """Content, calls (name, arguments) and finish reason rebuilt from a stream's chunks, checking the deltas'
    format: a call's first delta has its id, type and name; later ones only add arguments."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model=MODEL_NAME, stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                if call.index not in calls:
                    assert call.id.startswith("call_") and call.type == "function" and call.function.name
                    calls[call.index] = {"name": call.function.name, "arguments": call.function.arguments or ""}
                else:
                    assert call.id is None and call.function.name is None
                    calls[call.index]["arguments"] += call.function.arguments
            finish = choice.finish_reason or finish
    return content or None, [calls[i] for i in sorted(calls)], finish


def _calls(message) -> list[dict]:
    return [{"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls or []]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_forced_calls_whole_and_streamed(client, choice):
    # one call: the random model, allowed several, rarely picks EOS between them and runs into max_tokens
    kwargs = {"messages": USER, "tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": False, **SAMPLED}
    whole = client.chat.completions.create(model=MODEL_NAME, **kwargs).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    calls = _calls(whole.message)
    assert calls and all(c.id.startswith("call_") for c in whole.message.tool_calls)
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    if isinstance(choice, dict):
        assert [c["name"] for c in calls] == ["add"]
    assert _streamed(client, **kwargs) == (None, calls, "tool_calls")


def test_auto_parses_calls_and_passes_plain_text(client):
    forced_text = '<tool_call>{"name":"get_weather","arguments":{"city":"Oslo","days":3}}</tool_call>'
    # the model is random: a grammar makes it write the call, tool_choice "auto" parses it as any output
    kwargs = {"messages": USER, "tools": TOOLS, "tool_choice": "auto", "temperature": 0.0, "max_tokens": 100,
              "extra_body": {"guided_regex": "Sure\\. " + forced_text.replace("{", "\\{").replace("}", "\\}")}}
    whole = client.chat.completions.create(model=MODEL_NAME, **kwargs).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Sure. "
    assert _calls(whole.message) == [{"name": "get_weather", "arguments": '{"city":"Oslo","days":3}'}]
    assert _streamed(client, **kwargs) == ("Sure. ", _calls(whole.message), "tool_calls")
    plain = client.chat.completions.create(model=MODEL_NAME, messages=USER, tools=TOOLS, temperature=0.0,
                                           max_tokens=12).choices[0]
    assert plain.message.tool_calls is None and plain.finish_reason in ("stop", "length")
    none = client.chat.completions.create(model=MODEL_NAME, messages=USER, tools=TOOLS, tool_choice="none",
                                          extra_body={"guided_regex": "\\{\\}"}, max_tokens=20).choices[0]
    assert none.message.content == "{}" and none.message.tool_calls is None and none.finish_reason == "stop"


def test_round_trip_call_result_answer(client):
    first = client.chat.completions.create(model=MODEL_NAME, messages=USER, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, **SAMPLED).choices[0].message
    assert len(first.tool_calls) == 1
    call = first.tool_calls[0]
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny"}'}]
    final = client.chat.completions.create(model=MODEL_NAME, messages=history, tools=TOOLS, temperature=0.0,
                                           max_tokens=8)
    assert final.choices[0].message.tool_calls is None and final.choices[0].message.content is not None
    # the prompt holds the call and the result, as the template rendered them (one token per character)
    prompt = ChatTools.of(p.ChatCompletionRequest(messages=history, tools=TOOLS)).render(
        CHAT_TEMPLATE, [p.ChatMessage(**m) for m in history])
    assert final.usage.prompt_tokens == len(prompt)
    assert f'"name":"{call.function.name}","arguments":{call.function.arguments}' in prompt
    assert '<tool>{"forecast": "sunny"}' in prompt and "get_weather" in prompt.split("<user>")[0]


def test_native_tool_template_gets_tools_and_calls():
    template = ("{% if tools %}[{% for t in tools %}{{ t.function.name }};{% endfor %}]{% endif %}"
                "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
                "{% if m.tool_calls is defined %}{% for c in m.tool_calls %}CALL {{ c.function.name }}({{ c.function.arguments.a }}){% endfor %}{% endif %}"
                "{% endfor %}")
    history = [{"role": "user", "content": "sum"},
               {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                                     "function": {"name": "add", "arguments": '{"a":1,"b":2}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    req = p.ChatCompletionRequest(messages=history, tools=TOOLS)
    assert ChatTools.of(req).render(template, req.messages) == "[get_weather;add;]<user>sum<assistant>CALL add(1)<tool>3"


def test_streaming_parser_splits_arguments_and_content():
    parser = ToolCallParser({"add"})
    text = 'Hi <tool_call>{"name":"add","arguments":{"a":1,"b":{"c":2}}}</tool_call> bye'
    events = [e for ch in text for e in parser.feed(ch)] + parser.finish()
    deltas = tool_deltas(events)
    assert deltas[0] == {"content": "Hi "} and deltas[-1] == {"content": " bye"}
    assert deltas[1]["tool_calls"][0]["function"] == {"name": "add", "arguments": ""}
    args = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas[2:-1])
    assert args == '{"a":1,"b":{"c":2}}' == parser.calls[0]["arguments"]


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not among the tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [TOOLS[1], TOOLS[1]]}, "tools", "appears more than once"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tool_choice", "invalid"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "only one constraint"),
])
def test_bad_tool_requests_are_400(server, body, param, words):
    response = httpx2.post(f"{server.url}/v1/chat/completions", json={"model": MODEL_NAME, "messages": USER, **body})
    assert words in check_error(response, 400, param=param)
