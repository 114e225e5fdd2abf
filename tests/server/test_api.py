"""The OpenAI endpoints through the official ``openai`` client: text, chat, streaming, n, stop, usage, logprobs."""

from __future__ import annotations

import pytest

from tests.server.conftest import EOS, MODEL_NAME, char_tokenizer

PROMPT = "The sea is"
GREEDY = {"temperature": 0.0, "max_tokens": 12}


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    import httpx2

    assert httpx2.get(f"{server.url}/health").json() == {"status": "ok"}


def test_completion_usage_counts_tokens(client):
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, **GREEDY)
    choice = out.choices[0]
    assert out.object == "text_completion" and out.model == MODEL_NAME and out.id.startswith("cmpl-")
    assert choice.index == 0 and choice.finish_reason in ("stop", "length")
    tok = char_tokenizer()
    assert out.usage.prompt_tokens == len(tok.encode(PROMPT).ids) == len(PROMPT)
    # the character tokenizer: every generated token is one character, except a final EOS
    eos = choice.finish_reason == "stop"
    assert out.usage.completion_tokens == len(choice.text) + eos
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert eos or out.usage.completion_tokens == GREEDY["max_tokens"]


def test_prompt_forms_agree(client):
    ids = char_tokenizer().encode(PROMPT).ids
    texts = [client.completions.create(model=MODEL_NAME, prompt=prompt, **GREEDY).choices[0].text
             for prompt in (PROMPT, [PROMPT], ids, [ids])]
    assert len(set(texts)) == 1


def test_stream_equals_non_streaming(client):
    whole = client.completions.create(model=MODEL_NAME, prompt=PROMPT, **GREEDY)
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_and_chat_stream(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    whole = client.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0.0,
                                           max_completion_tokens=10)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    prompt = "<system>Be brief.\n<user>Hi\n<assistant>"
    assert whole.usage.prompt_tokens == len(char_tokenizer().encode(prompt).ids)
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0.0,
                                                 max_tokens=10, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_chat_without_limit_stops_by_itself(client):
    out = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}],
                                         temperature=0.0)
    assert out.choices[0].finish_reason in ("stop", "length")


def test_n_choices_greedy_and_seeded(client):
    greedy = client.completions.create(model=MODEL_NAME, prompt=PROMPT, n=3, **GREEDY)
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert len({c.text for c in greedy.choices}) == 1
    assert greedy.usage.completion_tokens == 3 * (greedy.usage.completion_tokens // 3)
    sampled = {"model": MODEL_NAME, "prompt": PROMPT, "n": 3, "temperature": 1.0, "max_tokens": 16, "seed": 7}
    first = client.completions.create(**sampled)
    again = client.completions.create(**sampled)
    assert [c.text for c in first.choices] == [c.text for c in again.choices]  # seed + i per choice: repeatable
    assert len({c.text for c in first.choices}) > 1  # and the choices differ
    single = client.completions.create(**{**sampled, "n": 1, "seed": 8})
    assert single.choices[0].text == first.choices[1].text  # choice 1 used seed 7 + 1


def test_n_choices_stream(client):
    whole = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "sea"}], n=2,
                                           seed=3, temperature=0.8, max_tokens=8)
    texts = ["", ""]
    for chunk in client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "sea"}],
                                                n=2, seed=3, temperature=0.8, max_tokens=8, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.message.content for c in whole.choices]


@pytest.mark.parametrize("as_list", [False, True])
def test_stop_string(client, as_list):
    full = client.completions.create(model=MODEL_NAME, prompt=PROMPT, temperature=0.0, max_tokens=20,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[5:7]
    params = {"model": MODEL_NAME, "prompt": PROMPT, "temperature": 0.0, "max_tokens": 20,
              "extra_body": {"ignore_eos": True}, "stop": [stop, "\x7f"] if as_list else stop}
    out = client.completions.create(**params).choices[0]
    assert out.finish_reason == "stop" and out.text == full[:full.index(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **params))
    assert streamed == out.text


def test_completion_logprobs(client):
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, logprobs=2, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == out.usage.completion_tokens
    # the model's distribution, not the greedy sampler's: a greedy token has a real (negative) logprob
    assert all(x < 0 for x in lp.token_logprobs)
    for token, logprob, alternatives in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert token in alternatives and 1 <= len(alternatives) <= 3  # the 2 most likely, plus the sampled one
        assert alternatives[token] == pytest.approx(logprob, abs=1e-6)
        assert logprob == pytest.approx(max(alternatives.values()), abs=1e-6)  # greedy: the sampled token leads
    text = "".join(t for t in lp.tokens if t != "</s>")
    assert text == out.choices[0].text and lp.text_offset[0] == 0


def test_chat_logprobs_stream_and_whole(client):
    args = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "temperature": 0.0, "max_tokens": 6,
            "logprobs": True}
    whole = client.chat.completions.create(**args).choices[0]
    content = whole.logprobs.content
    assert "".join(c.token for c in content if c.token != "</s>") == whole.message.content
    assert all(c.bytes == list(c.token.encode()) and c.top_logprobs == [] and c.logprob < 0 for c in content)
    streamed = [t for chunk in client.chat.completions.create(stream=True, **args) for c in chunk.choices
                if c.logprobs for t in c.logprobs.content]
    assert [t.token for t in streamed] == [c.token for c in content]
    assert [t.logprob for t in streamed] == pytest.approx([c.logprob for c in content], abs=1e-5)
    top = client.chat.completions.create(**args, top_logprobs=3).choices[0].logprobs.content
    for t in top:
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token  # greedy: the most likely first
        values = [x.logprob for x in t.top_logprobs]
        assert values == sorted(values, reverse=True) and values[0] == pytest.approx(t.logprob, abs=1e-6)
        assert all(x.bytes == list(x.token.encode()) for x in t.top_logprobs)


def test_penalties_change_the_output(client):
    base = {"model": MODEL_NAME, "prompt": PROMPT, "temperature": 0.0, "max_tokens": 40,
            "extra_body": {"ignore_eos": True}}
    plain = client.completions.create(**base).choices[0].text
    penalized = client.completions.create(**base, frequency_penalty=2.0, presence_penalty=2.0).choices[0].text
    assert penalized != plain  # the random model repeats itself; penalties break the loop


def test_eos_is_not_in_the_text(server, client):
    out = client.completions.create(model=MODEL_NAME, prompt=[EOS + 1] * 3, **GREEDY).choices[0]
    assert "</s>" not in out.text
