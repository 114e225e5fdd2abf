"""LLM.generate on a tiny random Llama: batching, chunked prefill, prefix caching and preemption never change the
greedy output, and seeded sampling does not depend on the batch."""

from __future__ import annotations

import pytest

from tessera.engine import SamplingParams
from tests.engine.conftest import random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
LENGTHS = [3, 17, 9, 30, 1, 22]


@pytest.fixture(scope="module")
def reference(tiny_model):
    """Model.greedy (whole-sequence recompute) of every prompt: the ground truth."""
    return [tiny_model.greedy(p, GREEDY.max_tokens) for p in random_prompts(LENGTHS)]


def test_batched_greedy_equals_one_by_one_and_model_greedy(make_llm, reference):
    prompts = random_prompts(LENGTHS)
    llm = make_llm(max_num_batched_tokens=16)  # forces chunked prefill of the longer prompts next to decodes
    batched = llm.generate(prompts, GREEDY)
    single = [make_llm().generate([p], GREEDY)[0] for p in prompts]
    assert [o.token_ids for o in batched] == reference
    assert [o.token_ids for o in single] == reference
    for out, prompt in zip(batched, prompts):
        assert out.prompt_tokens == prompt
        assert out.finish_reason in ("stop", "length")
        assert out.finish_reason == ("length" if len(out.token_ids) == GREEDY.max_tokens and
                                     out.token_ids[-1] != 2 else "stop")
        assert out.latency is not None and out.time_to_first_token <= out.latency


@pytest.mark.parametrize("caching", [True, False])
def test_prefix_caching_keeps_outputs(make_llm, tiny_model, caching):
    system = random_prompts([21], seed=5)[0]  # 5 full pages of 4 tokens, shared by every prompt
    prompts = [system + tail for tail in random_prompts([4, 7, 2], seed=6)]
    llm = make_llm(enable_prefix_caching=caching)
    first = llm.generate(prompts[:1], GREEDY)
    rest = llm.generate(prompts[1:], GREEDY)
    outs = first + rest
    assert [o.token_ids for o in outs] == [tiny_model.greedy(p, GREEDY.max_tokens) for p in prompts]
    cached = [o.num_cached_tokens for o in rest]
    assert cached == ([20, 20] if caching else [0, 0])


def test_preemption_keeps_outputs(make_llm, reference):
    prompts = random_prompts(LENGTHS)
    # 14 pages of 4 tokens: each request alone fits (<= 11 pages), all of them together do not
    llm = make_llm(num_pages=14, max_num_batched_tokens=32)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert llm.scheduler.num_preemptions > 0 and sum(o.num_preemptions for o in outs) > 0
    assert llm.block_manager.num_free_pages == 14  # every page came back


def test_max_num_seqs_and_small_budget(make_llm, reference):
    llm = make_llm(max_num_seqs=2, max_num_batched_tokens=5)
    assert [o.token_ids for o in llm.generate(random_prompts(LENGTHS), GREEDY)] == reference


def test_seeded_sampling_independent_of_batch(make_llm):
    prompts = random_prompts([5, 12, 8, 20], seed=3)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, repetition_penalty=1.3, seed=1234, max_tokens=10,
                            ignore_eos=True, logprobs=True)
    alone = make_llm().generate([prompts[0]], seeded)[0]
    others = [SamplingParams(temperature=1.0, max_tokens=10), SamplingParams(temperature=0.5, seed=7, max_tokens=3),
              SamplingParams(temperature=0.0, max_tokens=10)]
    mixed = make_llm().generate([prompts[3], prompts[1], prompts[0], prompts[2]],
                                [others[0], others[1], seeded, others[2]])[2]
    # last in line, so the youngest: the tight page pool preempts it and it recomputes its tokens
    tight = make_llm(num_pages=12, max_num_batched_tokens=8).generate(
        [prompts[1], prompts[3], prompts[2], prompts[0]], [others[1], others[0], others[2], seeded])[3]
    assert tight.num_preemptions > 0
    assert len(alone.token_ids) == 10
    assert mixed.token_ids == alone.token_ids == tight.token_ids
    assert len(alone.logprobs) == 10 and all(lp <= 0 for lp in alone.logprobs)
    assert mixed.logprobs == pytest.approx(alone.logprobs, abs=1e-4)


def test_stop_token_ids_and_max_tokens(make_llm, reference):
    prompt = random_prompts(LENGTHS)[1]
    ref = reference[1]
    stop_at = ref[3]
    out = make_llm().generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_at]))[0]
    assert out.token_ids == ref[: ref.index(stop_at) + 1] and out.finish_reason == "stop"
    out = make_llm().generate([prompt], SamplingParams(temperature=0.0, max_tokens=2))[0]
    assert out.token_ids == ref[:2] and out.finish_reason == "length"


def test_context_full_finishes_with_length(make_llm, tiny_model):
    prompt = random_prompts([125], seed=9)[0]  # the tiny model's context is 128
    out = make_llm().generate([prompt], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"
