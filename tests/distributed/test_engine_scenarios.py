"""Engine scenarios under two tensor-parallel ranks against the single-process engine on the same random-weight
model (float32, greedy): the tokens must be identical.

Each scenario drives both engines with the same script of requests added at given steps, so the scheduler makes the
same decisions on both (it sees only token ids, never logits) and every step's batch is the same.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from tessera.engine import LLM, SamplingParams
from tessera.models import load_model
from tessera.models.paged import forward_step, new_cache
from tests.distributed.test_tensor_parallel import _pid_gone, _prefill_step, _prompts
from tests.models.helpers import save_tiny

VOCAB = 211


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp_scenarios")
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    save_tiny(transformers.LlamaForCausalLM, config, path)
    return load_model(path)


def _greedy(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, n=n)


def _run(llm: LLM, script: list[tuple[int, list[int], SamplingParams]]) -> tuple[list[list[list[int]]], dict]:
    """Add each ``(step, prompt, params)`` of ``script`` before that step, step until all finish.

    Returns every request's samples' tokens (in script order) and what the steps did: ``mixed`` counts the steps that
    ran a prompt chunk and a decode together, ``copies`` the copy-on-write page copies.
    """
    seqs = []
    seen = {"mixed": 0, "copies": 0, "steps": 0}
    schedule = llm.scheduler.schedule

    def watch():
        out = schedule()
        prefill = [item for item in out.scheduled if item.start < len(item.seq.prompt_ids)]
        seen["mixed"] += bool(prefill) and len(prefill) < len(out.scheduled)
        seen["copies"] += len(out.page_copies)
        return out

    llm.scheduler.schedule = watch
    pending = sorted(script, key=lambda item: item[0])
    step = 0
    while pending or any(not s.group_finished for s in seqs):
        while pending and pending[0][0] <= step:
            _, prompt, params = pending.pop(0)
            seqs.append(llm.add_request(prompt, params))
        if llm.has_unfinished():
            llm.step()
        step += 1
    seen["steps"] = step
    return [[s.output_ids for s in seq.group] for seq in seqs], seen


def _both(model, script, **engine) -> tuple[list, dict, dict, dict, dict]:
    """The script on the single-process engine and on two ranks: tokens, step summaries and final stats of each."""
    ref_llm = LLM(model, **engine)
    ref, ref_seen = _run(ref_llm, script)
    llm = LLM(model, tensor_parallel_size=2, **engine)
    (pid,) = llm.tensor_parallel.worker_pids
    try:
        got, seen = _run(llm, script)
        stats = llm.stats()
    finally:
        llm.shutdown()
    assert _pid_gone(pid)
    assert got == ref
    return got, ref_seen, seen, ref_llm.stats(), stats


def test_mixed_batch_prefill_and_decode_in_one_step(tiny):
    # prompts of different lengths arrive while others decode; 16 new tokens a step cut the long ones into chunks
    # that share steps with decodes; the n=2 request's samples share a partial page and copy it on first write
    prompts = _prompts(VOCAB, (5, 23, 9, 14, 3), seed=1)
    script = [(0, prompts[0], _greedy(10)), (2, prompts[1], _greedy(8)), (3, prompts[2], _greedy(12, n=2)),
              (5, prompts[3], _greedy(6)), (6, prompts[4], _greedy(9))]
    got, ref_seen, seen, _, _ = _both(tiny, script, page_size=4, num_pages=64, max_num_batched_tokens=16)
    assert seen == ref_seen
    assert seen["mixed"] >= 3 and seen["copies"] >= 1, seen
    assert [len(s) for req in got for s in req] == [10, 8, 12, 12, 6, 9]


def test_preemption_and_resume(tiny):
    # 3 requests of 9 prompt + 16 generated tokens need 7 pages of 4 each, 21 in all, and the pool has 12: the
    # youngest is preempted, its pages freed, and it is recomputed from its tokens when pages come back
    prompts = _prompts(VOCAB, (9, 9, 9), seed=2)
    script = [(0, p, _greedy(16)) for p in prompts]
    got, _, _, ref_stats, stats = _both(tiny, script, page_size=4, num_pages=12, max_num_batched_tokens=32)
    assert ref_stats["num_preemptions"] >= 1
    assert stats["num_preemptions"] == ref_stats["num_preemptions"]
    assert all(len(s) == 16 for req in got for s in req)


def test_prefix_cache_hit(tiny):
    # the second request shares the first's 20-token prefix (5 full pages) and arrives after its prompt is
    # computed, so it reads those pages from the cache: its prompt's KV is computed for its own 4 tokens only
    prefix, tail_a, tail_b = _prompts(VOCAB, (20, 3, 4), seed=3)
    script = [(0, prefix + tail_a, _greedy(8)), (3, prefix + tail_b, _greedy(8))]
    got, _, _, ref_stats, stats = _both(tiny, script, page_size=4, num_pages=64, max_num_batched_tokens=32)
    assert stats["prefix_cache_hit_tokens"] == ref_stats["prefix_cache_hit_tokens"] == 20
    assert all(len(s) == 8 for req in got for s in req)


def test_greedy_steps_exchange_only_each_ranks_best(tiny):
    # all-greedy steps pick their tokens across ranks from each rank's best logit; a step with any row that needs
    # the whole distribution (temperature > 0, logprobs) gathers the logits as before
    prompts = _prompts(VOCAB, (5, 17, 9), seed=4)
    sampled = SamplingParams(temperature=0.8, seed=7, max_tokens=6, ignore_eos=True)
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=True)
    ref_llm = LLM(tiny, page_size=4, num_pages=64, max_num_batched_tokens=16)
    ref = [o.token_ids for o in ref_llm.generate(prompts, _greedy(10))]
    ref_lp = ref_llm.generate(prompts[:1], with_logprobs)[0]
    llm = LLM(tiny, page_size=4, num_pages=64, max_num_batched_tokens=16, tensor_parallel_size=2)
    comm = llm.tensor_parallel.comm
    try:
        got = [o.token_ids for o in llm.generate(prompts, _greedy(10))]
        greedy_gathers, argmaxes = comm.num_all_gather, comm.num_argmax
        got_lp = llm.generate(prompts[:1], with_logprobs)[0]
        lp = (comm.num_all_gather - greedy_gathers, comm.num_argmax - argmaxes)
        mixed = llm.generate(prompts[:2], [sampled, _greedy(8)])
        mixed_counts = (comm.num_all_gather - greedy_gathers - lp[0], comm.num_argmax - argmaxes - lp[1])
        # last: this prefill overwrites pages the prefix cache still lists
        step = _prefill_step(prompts[1])
        tp_tokens = llm.runner.forward_step(llm.model, llm.cache, step, all_logits=True, greedy=True)
    finally:
        llm.shutdown()
    assert got == ref
    # one exchange per step, prompt-chunk steps included (16 tokens a step: 31 prompt tokens take 2 steps)
    assert greedy_gathers == 0 and argmaxes >= 10, (greedy_gathers, argmaxes)
    assert got_lp.token_ids == ref_lp.token_ids and lp == (6, 0)  # 1 prompt step + 5 decodes
    assert got_lp.logprobs == pytest.approx(ref_lp.logprobs, abs=1e-4)
    # both prompts are cached by now, so both requests sample from step 1: the sampled request's 6 steps gather
    # (the greedy one shares them), the greedy request's last 2 steps, alone, do not
    assert mixed_counts == (6, 2), mixed_counts
    assert mixed[1].token_ids == ref[1][:8]
    assert len(mixed[0].token_ids) == 6
    # forward_step(greedy=True), one process and two ranks: the argmax of every row's logits
    logits = forward_step(tiny, new_cache(tiny, 8, 4), step, all_logits=True)
    assert torch.equal(forward_step(tiny, new_cache(tiny, 8, 4), step, all_logits=True, greedy=True),
                       logits.argmax(-1))
    assert torch.equal(tp_tokens, logits.argmax(-1))


def test_first_best_prefers_the_lowest_rank_on_ties():
    from tessera.distributed.comm import first_best

    # rows: rank 1 larger; a tie (rank 0, the lower ids, wins); rank 0 larger
    candidates = torch.tensor([[[1.0, 3], [2.0, 5], [4.0, 0]],
                               [[1.5, 110], [2.0, 120], [-1.0, 150]]], dtype=torch.float64)
    assert first_best(candidates).tolist() == [110, 5, 0]


def test_structured_output_and_sampling_match(tmp_path):
    # a grammar's mask applies to rank 0's gathered logits; a seeded sampled row draws from the same distribution
    # up to the all-reduce's rounding (1e-6 of the logits), which does not move a draw in practice
    from tests.server.conftest import save_char_llama

    model = load_model(save_char_llama(tmp_path / "chars", 128))
    prompts = ["name: ", "mail: "]
    params = [SamplingParams(temperature=0.0, max_tokens=24, regex=r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"),
              SamplingParams(temperature=0.9, seed=3, max_tokens=12, ignore_eos=True)]
    ref = [(o.text, o.token_ids) for o in LLM(model, page_size=4, num_pages=64).generate(prompts, params)]
    llm = LLM(model, page_size=4, num_pages=64, tensor_parallel_size=2)
    try:
        got = [(o.text, o.token_ids) for o in llm.generate(prompts, params)]
        gathers = llm.tensor_parallel.comm.num_all_gather
    finally:
        llm.shutdown()
    assert got == ref
    assert "@" in got[0][0] and gathers > 0


@pytest.mark.parametrize("speculative", ["self:q8_0", "ngram"])
def test_speculative_decoding_keeps_the_greedy_tokens(tiny, speculative):
    # the draft runs on rank 0 alone (a self-draft quantizes the whole model, not rank 0's shard; the n-gram lookup
    # reads rank 0's token history and needs no model); the target verifies the drafts in one step over both ranks,
    # with the logits gathered
    prompts = _prompts(VOCAB, (5, 17, 9), seed=5)
    if speculative == "ngram":  # prompt lookup drafts only what the context repeats: give it repeats to find
        prompts = [p * 3 for p in prompts]
    engine = {"page_size": 4, "num_pages": 64, "max_num_batched_tokens": 32}
    ref_llm = LLM(tiny, tensor_parallel_size=2, **engine)
    try:
        ref = [o.token_ids for o in ref_llm.generate(prompts, _greedy(12))]
    finally:
        ref_llm.shutdown()
    llm = LLM(tiny, tensor_parallel_size=2, speculative=speculative, **engine)
    try:
        got = [o.token_ids for o in llm.generate(prompts, _greedy(12))]
        stats = llm.stats()
    finally:
        llm.shutdown()
    assert got == ref
    # 8-bit weights of the same model draft mostly what it picks: drafts were verified and some accepted
    assert stats["spec_num_steps"] >= 1 and stats["spec_accepted_tokens"] >= 1, stats
