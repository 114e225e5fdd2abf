"""Bad requests fail before anything runs, naming the request."""

from __future__ import annotations

import pytest

from tessera.engine import SamplingParams


@pytest.mark.parametrize("prompt, match", [
    ([], "request 1: the prompt is empty"),
    ([5, 211], r"request 1: token ids must be ints in \[0, 211\)"),
    ([5, -1], r"request 1: token ids"),
    (list(range(3, 131)), "request 1: the prompt has 128 tokens but the context holds 128"),
])
def test_bad_prompt_names_the_request(make_llm, prompt, match):
    llm = make_llm()
    with pytest.raises(ValueError, match=match):
        llm.generate([[4, 5, 6], prompt], SamplingParams(temperature=0.0, max_tokens=4))
    assert not llm.scheduler.has_unfinished()  # the good request was not queued either


def test_bad_params():
    with pytest.raises(ValueError, match="max_tokens must be an int >= 1, got 0"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="stop must be a list of non-empty strings"):
        SamplingParams(stop=[""])


def test_params_count_and_type(make_llm):
    llm = make_llm()
    with pytest.raises(ValueError, match="2 prompts but 3 SamplingParams"):
        llm.generate([[4], [5]], [SamplingParams()] * 3)
    with pytest.raises(TypeError, match="wrap a single prompt in a list"):
        llm.generate([4, 5, 6], SamplingParams())


def test_text_prompt_without_tokenizer(make_llm):
    with pytest.raises(ValueError, match="request 0: a text prompt needs a tokenizer"):
        make_llm().generate(["hello"], SamplingParams())


def test_request_larger_than_the_cache(make_llm):
    llm = make_llm(num_pages=4)
    with pytest.raises(ValueError, match="request 0: prompt \\+ max_tokens need 5 KV pages but the cache has 4 "
                                         "\\(16 tokens\\); the prompt has 10 tokens, so lower max_tokens to at "
                                         "most 6"):
        llm.generate([[4] * 10], SamplingParams(max_tokens=10))
    assert llm.max_seq_tokens == 16  # what the server derives its default max_tokens limit from
    assert llm.generate([[4] * 10], SamplingParams(max_tokens=6))[0].finish_reason is not None


def test_lone_surrogate_in_a_prompt_is_named(make_llm, tiny_model, monkeypatch):
    from tests.server.conftest import char_tokenizer

    monkeypatch.setattr(tiny_model, "tokenizer", char_tokenizer())  # the real failure is inside a tokenizer
    llm = make_llm()
    with pytest.raises(ValueError, match="request 1: the prompt holds a lone UTF-16 surrogate U\\+D800 at "
                                         "character 2"):
        llm.generate(["fine", "ab\ud800c"], SamplingParams(max_tokens=2))
    assert not llm.has_unfinished()


@pytest.mark.parametrize("kwargs, match", [
    ({"temperature": "hot"}, "SamplingParams.temperature must be a number \\(int or float\\), got str 'hot'"),
    ({"top_p": None}, "SamplingParams.top_p must be a number"),
    ({"top_k": 3.0}, "SamplingParams.top_k must be an int, got float 3.0"),
    ({"ignore_eos": "yes"}, "SamplingParams.ignore_eos must be True or False, got str 'yes'"),
])
def test_wrong_types_name_the_field(kwargs, match):
    with pytest.raises(TypeError, match=match):
        SamplingParams(**kwargs)


def test_top_level_names_as_the_issue_spells_them():
    import tessera
    from tessera.engine import LLM, SamplingParams

    assert tessera.LLM is LLM and tessera.SamplingParams is SamplingParams
    assert tessera.RequestOutput.__name__ == "RequestOutput" and callable(tessera.load_model)
