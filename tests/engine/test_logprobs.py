"""Logprobs are the model's distribution (log-softmax of the logits), with the top alternatives when asked."""

from __future__ import annotations

import pytest
import torch

from tessera.engine import SamplingParams
from tests.engine.conftest import random_prompts


def test_logprobs_and_top_alternatives_match_the_model(make_llm, tiny_model):
    prompt = random_prompts([9], seed=11)[0]
    params = SamplingParams(temperature=0.0, max_tokens=5, top_logprobs=3, ignore_eos=True,
                            repetition_penalty=1.3)  # penalties steer sampling, not the reported distribution
    out = make_llm().generate([prompt], params)[0]
    assert params.logprobs and len(out.logprobs) == len(out.top_logprobs) == 5
    seq = list(prompt)
    for token, logprob, top in zip(out.token_ids, out.logprobs, out.top_logprobs):
        want = torch.log_softmax(tiny_model.logits(torch.tensor([seq]))[0, -1].double(), -1)
        assert logprob == pytest.approx(float(want[token]), abs=1e-4)
        values, ids = want.topk(3)
        assert [t for t, _ in top] == ids.tolist()
        assert [lp for _, lp in top] == pytest.approx(values.tolist(), abs=1e-4)
        seq.append(token)
    assert out.outputs[0].top_logprobs == out.top_logprobs


def test_no_logprobs_unless_asked_and_bad_top_logprobs(make_llm):
    out = make_llm().generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0]
    assert out.logprobs is None and out.top_logprobs is None
    for bad in (-1, 21, 2.0, True):
        with pytest.raises(ValueError, match="top_logprobs"):
            SamplingParams(top_logprobs=bad)
