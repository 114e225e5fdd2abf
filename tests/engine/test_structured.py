"""Structured output in the engine: every output of every test schema validates (greedy and sampled, batched with
unconstrained requests, which stay token for token what they are alone); regex, Lark and GBNF grammars, JSON objects;
invalid constraints are ValueErrors naming the problem; how constrained requests finish."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from tessera.engine import LLM, SamplingParams
from tessera.engine.sequence import Sequence
from tessera.engine.structured.decoding import GrammarState, PendingMasks, StructuredDecoder
from tessera.models import load_model
from tests.engine.schemas import SCHEMAS
from tests.server.conftest import save_char_llama

MAX_TOKENS = 160


@pytest.fixture(scope="module")
def char_model(tmp_path_factory):
    """A tiny random Llama whose tokenizer has one token per printable character (so every grammar is reachable)."""
    return load_model(save_char_llama(tmp_path_factory.mktemp("tiny_llama_structured"), 512))


@pytest.fixture(scope="module")
def llm(char_model):
    return LLM(char_model, page_size=8, num_pages=1024, max_num_seqs=32, max_num_batched_tokens=256)


def _valid(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


def test_every_schema_validates_greedy_and_sampled_in_a_mixed_batch(llm):
    prompts, params = [], []
    for i, schema in enumerate(SCHEMAS.values()):
        prompts += [f"Data {i}:", f"Sample {i}:"]
        params += [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, json_schema=schema),
                   SamplingParams(temperature=1.0, seed=10 + i, max_tokens=MAX_TOKENS, json_schema=json.dumps(schema))]
    plain = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
             SamplingParams(temperature=0.9, seed=3, max_tokens=24, ignore_eos=True, presence_penalty=0.5)]
    alone = llm.generate(["Plain text", "Plain too"], plain)
    outs = llm.generate(["Plain text", "Plain too", *prompts], [*plain, *params])
    # unconstrained requests are unchanged by the constrained ones beside them, token for token
    assert [o.token_ids for o in outs[:2]] == [o.token_ids for o in alone]
    schemas = [s for s in SCHEMAS.values() for _ in range(2)]
    for out, schema in zip(outs[2:], schemas):
        assert out.finish_reason == "stop", (out.text, schema)
        _valid(out.text, schema)


def test_json_object_regex_and_grammars(llm):
    gbnf = 'root ::= "yes" | "no" | "maybe " digit\ndigit ::= [0-9]'
    lark = 'start: "(" item ("," item)? ")"\nitem: /[a-c]{1,3}/'
    outs = llm.generate(["a", "b", "c", "d"], [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, json_object=True),
        SamplingParams(temperature=1.0, seed=1, max_tokens=40, regex=r"[a-z]{2,5}@[a-z]{2,4}\.(com|org)"),
        SamplingParams(temperature=1.0, seed=2, max_tokens=20, grammar=gbnf),
        SamplingParams(temperature=0.0, max_tokens=60, grammar=lark),
    ])
    assert all(o.finish_reason == "stop" for o in outs), [(o.text, o.finish_reason) for o in outs]
    assert isinstance(json.loads(outs[0].text), dict)
    import re

    assert re.fullmatch(r"[a-z]{2,5}@[a-z]{2,4}\.(com|org)", outs[1].text)
    assert re.fullmatch(r"yes|no|maybe [0-9]", outs[2].text)
    assert re.fullmatch(r"\([a-c]{1,3}(,[a-c]{1,3})?\)", outs[3].text)


def test_a_finished_grammar_ends_without_eos_and_max_tokens_cuts(llm):
    out, = llm.generate(["x"], SamplingParams(temperature=0.0, max_tokens=10, regex="[0-9]{4}", ignore_eos=True))
    assert out.finish_reason == "stop" and len(out.text) == 4 and len(out.token_ids) == 4  # no EOS needed
    cut, = llm.generate(["x"], SamplingParams(temperature=0.0, max_tokens=3, regex="[0-9]{4}"))
    assert cut.finish_reason == "length" and len(cut.text) == 3 and cut.text.isdigit()


def test_parallel_samples_and_preemption_keep_their_grammars(char_model):
    small = LLM(char_model, page_size=4, num_pages=40, max_num_seqs=8, max_num_batched_tokens=64)
    schema = SCHEMAS["arrays_enums"]
    outs = small.generate([f"p{i}" for i in range(6)],
                          SamplingParams(temperature=1.0, seed=5, max_tokens=80, json_schema=schema, n=2))
    assert sum(o.num_preemptions for o in outs) > 0  # 40 pages of 4 tokens do not hold 12 sequences at once
    for o in outs:
        for sample in o.outputs:
            assert sample.finish_reason == "stop"
            _valid(sample.text, schema)
    assert small.block_manager.num_free_pages == 40


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"json_schema": {"type": "nonsense"}}, "json_schema: invalid JSON schema"),
    ({"json_schema": "{not json"}, "not valid JSON text"),
    ({"json_schema": {"$ref": "#/$defs/missing"}}, "does not exist"),
    ({"regex": "[0-9"}, "regex: invalid regular expression"),
    ({"grammar": "start: missing_rule"}, "unknown name"),
    ({"grammar": "root ::= undefined"}, "nor valid GBNF"),
    ({"regex": "a", "json_object": True}, "regex, json_object are set"),
])
def test_invalid_constraints_name_the_problem(kwargs, words):
    with pytest.raises(ValueError, match=None) as err:
        SamplingParams(**kwargs)
    assert words in str(err.value)


def test_a_model_without_tokenizer_refuses_constraints(make_llm):
    with pytest.raises(ValueError, match="structured output .* needs the model's tokenizer"):
        make_llm().generate([[5, 6]], SamplingParams(regex="a+"))


def test_constrained_requests_are_not_drafted():
    assert SamplingParams(regex="a+").speculative is False
    assert SamplingParams().speculative is True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # NumPy path, torch path (any device / dtype)
def test_masks_reach_only_their_rows_and_a_dead_end_gets_eos(dtype):
    decoder = StructuredDecoder(None, 70, (2,))
    words = torch.zeros((2, 3), dtype=torch.int32)
    words[0, 0] = 1 << 5  # row 0 of the step: only token 5 allowed
    words[0, 2] = -1  # ... and tokens 64..95 (past the vocabulary: ignored)
    states = [GrammarState(None, (2,)), GrammarState(None, (2,))]  # row 2: nothing allowed, a dead end
    logits = torch.randn(3, 70, dtype=dtype)
    before = logits.clone()
    decoder.apply(PendingMasks([0, 2], states, words, None, lambda: 0.0), logits)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [5, *range(64, 70)]
    assert torch.equal(logits[1], before[1])
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [2]
    assert states[1].dead_end and not states[0].dead_end


def test_a_dead_end_finishes_with_grammar_and_no_text():
    seq = Sequence(0, [5], SamplingParams(regex="a+", ignore_eos=True), (2,), 100)
    seq.constraint = GrammarState(None, (2,))
    seq.constraint.dead_end = True
    seq.append_token(2, 0.0)  # the EOS the runner forces on a dead end
    assert seq.finish_reason == "grammar" and seq.text == "" and seq.output_ids == [2]
