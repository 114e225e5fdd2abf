"""The engine on the real SmolLM2-135M-Instruct: greedy equals Model.greedy, text, stop strings, stream, chat."""

from __future__ import annotations

import pytest

from tessera.engine import LLM, SamplingParams
from tessera.engine.chat import render_chat
from tessera.engine.detokenizer import Detokenizer
from tessera.models.model import default_model_path

PROMPTS = ["The capital of France is", "Write a short poem about the sea:"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    try:
        default_model_path()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    return LLM(num_pages=64, page_size=16, keep_quantized=False)  # transformers' numerics: greedy tokens must match


@pytest.fixture(scope="module")
def greedy_outputs(llm):
    return llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16))


def test_greedy_equals_model_greedy(llm, greedy_outputs):
    for prompt, out in zip(PROMPTS, greedy_outputs):
        assert out.prompt_tokens == llm.tokenizer.encode(prompt).ids
        assert out.token_ids == llm.model.greedy(out.prompt_tokens, 16)
        assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_detokenizer_emits_whole_characters(llm):
    text = "héllo 世界 🙂 naïve café"
    ids = llm.tokenizer.encode(text).ids
    detok = Detokenizer(llm.tokenizer, [])
    deltas = [detok.step(t) for t in ids]
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # some characters span several tokens and were held back


def test_stop_string_is_trimmed(llm, greedy_outputs):
    full = greedy_outputs[1].text
    stop = full[6:9]  # three characters from the middle of the greedy text
    out = llm.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=16, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == full[: full.index(stop)]
    assert len(out.token_ids) < len(greedy_outputs[1].token_ids)


def test_stream_matches_generate(llm, greedy_outputs):
    deltas = list(llm.stream(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=16)))
    assert "".join(deltas) == greedy_outputs[0].text and len(deltas) > 1
    full = greedy_outputs[0].text
    stop = full[4:7]
    trimmed = "".join(llm.stream(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=16, stop=[stop])))
    assert trimmed == full[: full.index(stop)]


def test_chat(llm):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    prompt = render_chat(llm.model.chat_template, messages)
    assert prompt.endswith("<|im_start|>assistant\n") and "What is 2+2?" in prompt
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=12))[0]
    assert out.prompt_tokens == llm.tokenizer.encode(prompt).ids
    assert "4" in out.text


def test_abandoned_stream_frees_its_pages(llm):
    stream = llm.stream(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=16))
    next(stream)
    stream.close()
    assert not llm.scheduler.has_unfinished()
    assert llm.block_manager.num_free_pages == llm.block_manager.num_pages


def test_cli_generate_streams_and_reports_speed(capsys):
    from tessera.cli import main

    assert main(["generate", "What is 2+2?", "--chat", "--max-tokens", "6"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip()  # some text was streamed
    assert "prefill" in captured.err and "decode" in captured.err and "tok/s" in captured.err


def test_batched_greedy_equals_transformers_for_32_tokens(llm):
    """The issue's end-to-end check: the engine's batched greedy continuation equals transformers' ``generate`` on
    the same (de-quantized) weights, token for token, for 32 tokens."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    path = default_model_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    prompts = PROMPTS + ["List three colours:"]
    ours = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32))  # both stop at EOS, keeping it
    for prompt, out in zip(prompts, ours):
        ids = torch.tensor([llm.tokenizer.encode(prompt).ids])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                              pad_token_id=0)
        assert out.token_ids == ref[0, ids.shape[1]:].tolist(), prompt


def test_structured_output_validates_on_the_real_vocabulary(llm):
    """Every test schema, greedy and sampled, in one batch, through SmolLM2's byte-level 49k vocabulary, whose
    multi-character tokens straddle JSON syntax ('":"', '},')."""
    import json

    import jsonschema

    from tests.engine.schemas import SCHEMAS

    chat = render_chat(llm.model.chat_template, [{"role": "user", "content": "Give an example as JSON."}])
    schemas = [schema for schema in SCHEMAS.values() for _ in range(2)]
    params = [SamplingParams(temperature=0.8 * (i % 2), seed=i, max_tokens=128, json_schema=schema)
              for i, schema in enumerate(schemas)]
    outs = llm.generate([chat] * len(params), params)
    for out, schema in zip(outs, schemas):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)
