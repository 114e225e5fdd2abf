"""``SamplingParams.n > 1``: samples share the prompt's pages (copy-on-write) and equal independent requests."""

from __future__ import annotations

import pytest

from tessera.engine import SamplingParams
from tests.engine.conftest import random_prompts


def test_greedy_samples_equal_the_single_request(make_llm, tiny_model):
    prompts = random_prompts([9, 14])
    outs = make_llm().generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, n=3))
    for out, prompt in zip(outs, prompts):
        want = tiny_model.greedy(prompt, 8)
        assert [o.index for o in out.outputs] == [0, 1, 2]
        assert all(o.token_ids == want for o in out.outputs)
        assert out.token_ids == want and out.finish_reason == out.outputs[0].finish_reason


def test_seeded_samples_equal_requests_seeded_seed_plus_i(make_llm):
    prompt = random_prompts([11], seed=3)[0]
    params = dict(temperature=1.0, top_p=0.9, max_tokens=10, logprobs=True)
    group = make_llm().generate([prompt], SamplingParams(**params, n=3, seed=40))[0]
    alone = make_llm().generate([prompt] * 3, [SamplingParams(**params, seed=40 + i) for i in range(3)])
    assert [o.token_ids for o in group.outputs] == [o.token_ids for o in alone]
    for mine, theirs in zip(group.outputs, alone):
        assert mine.logprobs == pytest.approx(theirs.logprobs, abs=1e-5)
    assert len({tuple(o.token_ids) for o in group.outputs}) > 1  # they really are different samples


def test_samples_share_prompt_pages_then_copy_on_write(make_llm):
    prompt = random_prompts([10], seed=4)[0]  # pages of 4: two full pages and a partial one shared by all
    llm = make_llm()
    seq = llm.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=6, n=3))
    llm.step()  # the whole prompt in one step, then the two other samples fork
    bm = llm.block_manager
    tables = [bm.page_table(s.seq_id) for s in seq.group]
    assert tables[0] == tables[1] == tables[2] and len(tables[0]) == 3
    assert [bm.ref_count(p) for p in tables[0]] == [3, 3, 3]
    llm.step()  # each sample writes its first token into the shared partial page: two of them copy it first
    tables = [bm.page_table(s.seq_id) for s in seq.group]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]
    assert len({t[2] for t in tables}) == 3
    while not seq.group_finished:
        llm.step()
    assert bm.num_free_pages == bm.num_pages
    bm.check_invariants()


def test_parallel_samples_survive_preemption(make_llm, tiny_model):
    prompts = random_prompts([13, 6], seed=8)
    llm = make_llm(num_pages=9, max_num_batched_tokens=32)  # 3 samples x 2 prompts do not fit together
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, n=3, ignore_eos=True))
    for out, prompt in zip(outs, prompts):
        want = tiny_model.greedy(prompt, 12)
        assert all(o.token_ids == want[: len(o.token_ids)] for o in out.outputs)
    assert llm.scheduler.num_preemptions > 0
    assert llm.block_manager.num_free_pages == 9


def test_abort_of_sample_zero_aborts_the_group(make_llm):
    llm = make_llm()
    seq = llm.add_request(random_prompts([5])[0], SamplingParams(temperature=0.0, max_tokens=20, n=2))
    llm.step()
    llm.abort(seq)
    assert all(s.finish_reason == "abort" for s in seq.group) and not llm.has_unfinished()
    assert llm.block_manager.num_free_pages == llm.block_manager.num_pages


def test_bad_n(make_llm):
    with pytest.raises(ValueError, match="n must be an int >= 1"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="max_num_seqs"):
        make_llm(max_num_seqs=2).generate([[1, 2]], SamplingParams(n=3))
    with pytest.raises(ValueError, match="n=2"):
        next(make_llm().stream([1, 2], SamplingParams(n=2)))


def test_a_sample_aborted_before_its_fork_is_skipped(make_llm, tiny_model):
    prompt = random_prompts([7], seed=9)[0]
    llm = make_llm()
    seq = llm.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=5, n=3, ignore_eos=True))
    llm.abort(seq.group[1])  # still pending inside sample 0
    while not seq.group_finished:
        llm.step()
    want = tiny_model.greedy(prompt, 5)
    assert [o.finish_reason for o in seq.output().outputs] == ["length", "abort", "length"]
    assert seq.output().outputs[0].token_ids == seq.output().outputs[2].token_ids == want
    assert seq.group[1].output_ids == [] and llm.block_manager.num_free_pages == llm.block_manager.num_pages
