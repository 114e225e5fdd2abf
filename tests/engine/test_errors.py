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
    with pytest.raises(ValueError, match="request 0: prompt \\+ max_tokens need 5 KV pages but the cache has 4"):
        make_llm(num_pages=4).generate([[4] * 10], SamplingParams(max_tokens=10))


def test_top_level_names_as_the_issue_spells_them():
    import tessera
    from tessera.engine import LLM, SamplingParams

    assert tessera.LLM is LLM and tessera.SamplingParams is SamplingParams
    assert tessera.RequestOutput.__name__ == "RequestOutput" and callable(tessera.load_model)
