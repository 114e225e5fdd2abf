"""Speculative decoding in the engine: every proposer leaves greedy output unchanged, sampled output keeps its
distribution (chi-square), rejected drafts give their pages back, and bad configurations are refused."""

from __future__ import annotations

import pytest
import torch
import transformers

from tessera.engine import LLM, SamplingParams
from tessera.engine.speculative import SpeculativeConfig, parse_speculative
from tessera.engine.speculative.ngram import NgramProposer
from tessera.engine.speculative.verify import verify_draft, verify_greedy
from tessera.models import load_model
from tests.engine.conftest import VOCAB, random_prompts
from tests.models.helpers import save_tiny

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
LENGTHS = [3, 17, 9, 30, 1, 22]
#: a p-value below this fails a chi-square test (each test is deterministic: fixed seeds)
P_VALUE_FLOOR = 1e-3


def _tiny_llama(path, vocab: int, layers: int, hidden: int = 64, seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=96,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128)
    save_tiny(transformers.LlamaForCausalLM, config, path)
    return path


@pytest.fixture(scope="module")
def draft_path(tmp_path_factory):
    """A different, smaller random model with the engine tests' vocabulary: it disagrees with the target often."""
    return _tiny_llama(tmp_path_factory.mktemp("draft_llama"), VOCAB, layers=1, hidden=32, seed=7)


def _repetitive(n: int) -> list[int]:
    return [5, 6, 7, 8, 9] * (n // 5) + [5, 6, 7, 8, 9][: n % 5]


def _prompts() -> list[list[int]]:
    return random_prompts(LENGTHS) + [_repetitive(23)]


@pytest.fixture(scope="module")
def plain_greedy(tiny_model):
    return [o.token_ids for o in LLM(tiny_model, page_size=4, num_pages=256).generate(_prompts(), GREEDY)]


def _config(method: str, draft_path=None, **kwargs) -> SpeculativeConfig:
    extra = {"draft_path": str(draft_path)} if method == "draft" else {}
    if method.startswith("self:"):
        method, extra = "self", {"self_format": method[5:]}
    return SpeculativeConfig(method, **{"num_draft": 4, "adaptive": False, **extra, **kwargs})


@pytest.mark.parametrize("method", ["ngram", "self:q8_0", "self:q4_0", "draft"])
def test_greedy_output_is_unchanged(make_llm, plain_greedy, draft_path, method):
    llm = make_llm(max_num_batched_tokens=16, speculative=_config(method, draft_path))  # prompt chunks + decodes
    outs = llm.generate(_prompts(), GREEDY)
    assert [o.token_ids for o in outs] == plain_greedy
    stats = llm.stats()
    assert stats["spec_draft_tokens"] > 0 and stats["spec_num_steps"] > 0
    assert 0 <= stats["spec_accepted_tokens"] <= stats["spec_draft_tokens"]
    if method != "draft":  # the quantized self and the repeated prompt get drafts accepted
        assert stats["spec_accepted_tokens"] > 0
    llm.block_manager.check_invariants()
    assert llm.block_manager.num_free_pages == llm.block_manager.num_pages
    proposer_bm = getattr(llm.speculative.proposer, "block_manager", None)
    if proposer_bm is not None:  # the draft cache gave every page back too
        proposer_bm.check_invariants()
        assert proposer_bm.num_free_pages == proposer_bm.num_pages


def test_adaptive_draft_length_keeps_greedy_output(make_llm, plain_greedy):
    llm = make_llm(speculative="ngram", num_draft=7)
    assert [o.token_ids for o in llm.generate(_prompts(), GREEDY)] == plain_greedy


def test_request_can_opt_out(make_llm, plain_greedy):
    llm = make_llm(speculative=_config("ngram"))
    params = SamplingParams(temperature=0.0, max_tokens=16, speculative=False)
    assert [o.token_ids for o in llm.generate(_prompts(), params)] == plain_greedy
    assert llm.stats()["spec_draft_tokens"] == 0


def test_pages_come_back_after_rejections_preemption_and_aborts(tiny_model, draft_path):
    # a disagreeing draft (many rejections) in a cache too small for all requests at once (preemptions)
    llm = LLM(tiny_model, page_size=4, num_pages=24, max_num_batched_tokens=32,
              speculative=_config("draft", draft_path, num_draft=5))
    params = [SamplingParams(temperature=t, seed=i, max_tokens=20, ignore_eos=True)
              for i, t in enumerate([0.0, 0.9, 0.0, 1.3, 0.7, 0.0])]
    seqs = [llm.add_request(p, sp) for p, sp in zip(random_prompts(LENGTHS, seed=3), params)]
    for _ in range(6):
        llm.step()
        llm.block_manager.check_invariants()
    llm.abort(seqs[1])
    llm.abort(seqs[4])
    while llm.has_unfinished():
        llm.step()
        llm.block_manager.check_invariants()
    assert llm.scheduler.num_preemptions > 0
    assert llm.stats()["spec_draft_tokens"] > llm.stats()["spec_accepted_tokens"]
    assert [s.finish_reason for s in seqs] == ["length", "abort", "length", "length", "abort", "length"]
    assert all(len(s.output_ids) == 20 for i, s in enumerate(seqs) if i not in (1, 4))
    assert llm.block_manager.num_free_pages == 24
    draft_bm = llm.speculative.proposer.block_manager
    draft_bm.check_invariants()
    assert draft_bm.num_free_pages == draft_bm.num_pages


def test_seeded_sampling_is_reproducible_and_reports_model_logprobs(make_llm, tiny_model):
    params = SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.2, seed=11, max_tokens=12,
                            ignore_eos=True, logprobs=True, top_logprobs=2)
    prompts = _prompts()[:3]
    first = make_llm(speculative=_config("self:q4_0")).generate(prompts, params)
    again = make_llm(speculative=_config("self:q4_0")).generate(prompts, params)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    out, prompt = first[0], prompts[0]
    logits = tiny_model.logits(torch.tensor([prompt + out.token_ids]))[0, len(prompt) - 1:-1]
    expected = torch.log_softmax(logits.double(), dim=-1)
    picked = expected.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(out.logprobs, dtype=torch.float64), picked, atol=1e-4, rtol=0)
    assert [len(t) for t in out.top_logprobs] == [2] * len(out.token_ids)


# ------------------------------------------------------------------------------------------- the accept rule
def _chi_square_p(observed: torch.Tensor, expected: torch.Tensor) -> float:
    keep = expected > 0
    stat = float((((observed - expected) ** 2)[keep] / expected[keep]).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def _homogeneity_p(a: torch.Tensor, b: torch.Tensor) -> float:
    """Two-sample chi-square test of equal distributions over the categories either sample saw."""
    total = a + b
    keep = total > 0
    a, b, total = a[keep].double(), b[keep].double(), total[keep].double()
    ea, eb = total * a.sum() / total.sum(), total * b.sum() / total.sum()
    stat = float(((a - ea) ** 2 / ea).sum() + ((b - eb) ** 2 / eb).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.mark.parametrize("deterministic", [False, True])
def test_accept_rule_emits_the_target_distribution(deterministic):
    gen = torch.Generator().manual_seed(0)
    vocab, trials = 8, 20000
    p = torch.softmax(torch.randn(2, vocab, generator=gen) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(1, vocab, generator=gen) * 1.5, dim=-1)
    q[0, 3] = 0.0  # a token the draft never proposes, which the target may still emit (from the residual)
    q /= q.sum()
    counts = torch.zeros(vocab)
    for _ in range(trials):
        x = 5 if deterministic else int(torch.multinomial(q[0], 1, generator=gen))
        verdict = verify_draft(p[:1], [x], None if deterministic else q, gen)
        token = x if verdict.num_accepted == 1 else verdict.correction
        counts[token] += 1
    assert _chi_square_p(counts, p[0] * trials) > P_VALUE_FLOOR


def test_greedy_rule_accepts_the_argmax_prefix():
    assert verify_greedy([4, 5, 6], [4, 5, 6]).num_accepted == 3
    verdict = verify_greedy([4, 5, 6], [4, 9, 6])
    assert (verdict.num_accepted, verdict.correction) == (1, 5)
    point = torch.zeros(2, 5)
    point[0, 2] = point[1, 4] = 1.0  # greedy targets are point masses: no randomness, no draw
    verdict = verify_draft(point, [2, 1], None, None)
    assert (verdict.num_accepted, verdict.correction) == (1, 4)


def test_speculative_sampling_is_distributed_as_plain_sampling(tmp_path):
    """Per position of a 3-token continuation on a 16-token vocabulary: 1500 seeded samples with a disagreeing
    draft model against 1500 plain ones."""
    vocab, n = 16, 1500
    target = load_model(_tiny_llama(tmp_path / "t", vocab, layers=2, seed=1))
    draft = _tiny_llama(tmp_path / "d", vocab, layers=1, hidden=32, seed=2)
    prompt = [3, 4, 5, 6]
    results = []
    for spec in (None, SpeculativeConfig("draft", 3, draft_path=str(draft), adaptive=False)):
        llm = LLM(target, page_size=4, num_pages=2048, max_num_seqs=64, max_num_batched_tokens=512,
                  enable_prefix_caching=False, speculative=spec)
        params = [SamplingParams(temperature=1.0, top_k=12, seed=(0 if spec is None else 10**6) + i, max_tokens=3,
                                 ignore_eos=True) for i in range(n)]
        outs = llm.generate([prompt] * n, params)
        results.append(torch.tensor([o.token_ids for o in outs]))
        if spec is not None:
            assert llm.stats()["spec_accepted_tokens"] < llm.stats()["spec_draft_tokens"]  # the residual ran
    plain, spec = results
    for pos in range(3):
        a = torch.bincount(plain[:, pos], minlength=vocab)
        b = torch.bincount(spec[:, pos], minlength=vocab)
        assert _homogeneity_p(a, b) > P_VALUE_FLOOR, f"position {pos}: {a.tolist()} vs {b.tolist()}"


# ------------------------------------------------------------------------------------------------- the pieces
def test_ngram_lookup_prefers_the_longest_latest_match():
    ngram = NgramProposer(n_max=3, n_min=1)
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 4, 2, 3]
    assert ngram.lookup(0, tokens, 3) == [7, 8, 4]  # "4 2 3" never occurred before; "2 3" last preceded 7
    assert ngram.lookup(1, [1, 2, 3], 4) == []  # nothing repeats
    assert ngram.lookup(2, [5, 6, 5, 6, 5], 2) == [6, 5]


def test_parse_and_errors(tiny_model, tmp_path):
    assert parse_speculative(None) is None and parse_speculative("off") is None
    assert parse_speculative("ngram", 6) == SpeculativeConfig("ngram", 6)
    assert parse_speculative("self:Q4_0").self_format == "q4_0"
    assert parse_speculative("draft:/m.gguf").draft_path == "/m.gguf"
    with pytest.raises(ValueError, match="expected 'ngram', 'draft:PATH' or 'self:FORMAT'"):
        parse_speculative("medusa")
    with pytest.raises(ValueError, match="needs self_format"):
        parse_speculative("self:q2_k")
    with pytest.raises(ValueError, match="needs draft_path"):
        parse_speculative("draft")
    with pytest.raises(ValueError, match=r"num_draft must be an int in \[1, 7\]"):
        parse_speculative("ngram", 8)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(tiny_model, num_pages=16, speculative=f"draft:{tmp_path / 'missing'}")
    other = _tiny_llama(tmp_path / "other", VOCAB + 5, layers=1, hidden=32)
    with pytest.raises(ValueError, match="vocabulary has 216 tokens but the target's has 211"):
        LLM(tiny_model, num_pages=16, speculative=f"draft:{other}")


def test_step_costs_ignore_compiling_and_thin_samples():
    from tessera.engine.speculative.costs import DRAFT_COST_PRIOR, VERIFY_COST_PRIOR, StepCosts

    costs = StepCosts()
    assert costs.ratios() == (DRAFT_COST_PRIOR, DRAFT_COST_PRIOR, VERIFY_COST_PRIOR)
    costs.observe_step(5.0, 5)  # a verification step that compiled its kernel: dropped
    costs.observe_step(0.012, 5)  # a single 5-token sample is too thin to fit a slope on
    for t in (9.0, 0.010, 0.010, 0.011, 0.010):  # the first 1-token step compiled too
        costs.observe_step(t, 1)
    assert costs.ratios()[2] == VERIFY_COST_PRIOR
    for _ in range(3):
        costs.observe_step(0.012, 5)
    first, following, verify = costs.ratios()
    assert verify == pytest.approx(0.05, rel=0.01)  # (12 - 10) ms over 4 tokens, per 10 ms step
    for t in (3.0, 0.003, 0.003, 0.003):
        costs.observe_draft(t, t)
    assert costs.ratios()[:2] == (pytest.approx(0.3), pytest.approx(0.3))
