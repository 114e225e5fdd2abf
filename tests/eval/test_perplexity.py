"""Perplexity by llama-perplexity's protocol on a tiny random Llama, against a straightforward float64 computation of
the same protocol written here (and against transformers' logits): windows, BOS replacement, the dropped partial
window, --chunks, the standard error, and the inputs refused at the boundary."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from tessera.eval.perplexity import bos_token, perplexity, tokenize
from tessera.models.gguf_tokenizer import build_tokenizer
from tests.eval.tiny import BOS, CTX, EOS, MAX_POSITION, sample_text
from tests.models.test_gguf import tiny_vocab


def with_bos(model):
    """``model`` with a tokenizer whose vocabulary adds BOS (``tokenizer.ggml.add_bos_token``)."""
    return dataclasses.replace(model, tokenizer=build_tokenizer(tiny_vocab(pre="smollm", add_bos_token=True)))


def reference(logits_of, ids: list[int], ctx: int, bos: int | None, chunks: int | None = None):
    """The protocol written out: every whole window (up to ``chunks``), BOS first if given, float64 log-softmax,
    the NLL of tokens ctx//2+1 .. ctx-1; returns (ppl, stderr, running ppl per window, scored count)."""
    n = len(ids) // ctx if chunks is None else min(chunks, len(ids) // ctx)
    nll: list[float] = []
    running = []
    for c in range(n):
        window = list(ids[c * ctx:(c + 1) * ctx])
        if bos is not None:
            window[0] = bos
        logp = torch.log_softmax(logits_of(window).double(), dim=-1)  # [ctx, vocab]
        for pos in range(ctx // 2, ctx - 1):
            nll.append(-float(logp[pos, window[pos + 1]]))
        running.append(math.exp(np.mean(nll)))
    x = np.array(nll)
    ppl = math.exp(x.mean())
    return ppl, ppl * x.std() / math.sqrt(len(x) - 1), running, len(x)


def ours_logits(model):
    return lambda window: model.logits(torch.tensor([window]))[0]


def test_matches_the_protocol_written_out(tiny):
    _, model, hf = tiny
    text = sample_text(CTX * 7 + 5)
    ids = model.tokenizer.encode(text).ids
    result = perplexity(model, text, ctx=CTX)
    ppl, stderr, running, scored = reference(ours_logits(model), ids, CTX, None)
    assert not result.add_bos and result.n_tokens == len(ids) and ids[0] != BOS
    assert result.n_chunks == len(ids) // CTX and result.n_scored == scored == result.n_chunks * (CTX - 1 - CTX // 2)
    assert result.ppl == pytest.approx(ppl, rel=1e-12)
    assert result.stderr == pytest.approx(stderr, rel=1e-9)
    assert [r.ppl for r in result.running] == pytest.approx(running, rel=1e-12)
    assert [r.chunks for r in result.running] == list(range(1, result.n_chunks + 1))
    assert result.running[-1].ppl == result.ppl and result.running[-1].stderr == result.stderr
    assert result.nll == pytest.approx(math.log(ppl), rel=1e-12)
    # and against transformers' logits of the same windows (float32 forward passes: close, not equal)
    with torch.no_grad():
        hf_ppl, *_ = reference(lambda w: hf(torch.tensor([w])).logits[0], ids, CTX, None)
    assert result.ppl == pytest.approx(hf_ppl, rel=1e-4)


def test_bos_replaces_the_first_token_of_every_window(tiny):
    _, model, _ = tiny
    model = with_bos(model)
    text = sample_text(CTX * 5)
    ids = model.tokenizer.encode(text).ids
    assert ids[0] == BOS and bos_token(model.tokenizer) == BOS
    result = perplexity(model, text, ctx=CTX)
    ppl, stderr, _, _ = reference(ours_logits(model), ids, CTX, BOS)
    assert result.add_bos and result.ppl == pytest.approx(ppl, rel=1e-12)
    assert result.stderr == pytest.approx(stderr, rel=1e-9)
    # forcing it off scores the windows as cut (only the first starts with BOS, from the tokenizer)
    off = perplexity(model, text, ctx=CTX, add_bos=False)
    assert not off.add_bos and off.ppl == pytest.approx(reference(ours_logits(model), ids, CTX, None)[0], rel=1e-12)
    assert off.ppl != pytest.approx(result.ppl, rel=1e-6)


def test_token_ids_input_and_add_bos_from_the_config(tiny):
    _, model, _ = tiny
    ids = model.tokenizer.encode(sample_text(CTX * 4)).ids
    assert perplexity(model, token_ids=ids, ctx=CTX).ppl == pytest.approx(perplexity(model, token_ids=torch.tensor(
        ids), ctx=CTX).ppl, rel=0)
    bare = dataclasses.replace(model, tokenizer=None)  # no tokenizer: BOS off unless asked, then the config's BOS
    assert not perplexity(bare, token_ids=ids, ctx=CTX).add_bos
    forced = perplexity(bare, token_ids=ids, ctx=CTX, add_bos=True)
    assert forced.add_bos and forced.ppl == pytest.approx(reference(ours_logits(model), ids, CTX, BOS)[0], rel=1e-12)


def test_the_partial_last_window_is_dropped(tiny):
    _, model, _ = tiny
    ids = list(np.random.default_rng(3).integers(0, 256, size=3 * CTX + CTX - 1))
    result = perplexity(model, token_ids=ids, ctx=CTX)
    assert result.n_chunks == 3 and result.n_tokens == len(ids)
    whole = perplexity(model, token_ids=ids[:3 * CTX], ctx=CTX)
    assert result.ppl == whole.ppl and result.stderr == whole.stderr


def test_max_chunks_stops_early_with_the_running_value(tiny):
    _, model, _ = tiny
    ids = list(np.random.default_rng(4).integers(0, 256, size=6 * CTX))
    full = perplexity(model, token_ids=ids, ctx=CTX)
    two = perplexity(model, token_ids=ids, ctx=CTX, max_chunks=2)
    assert two.n_chunks == 2 and two.n_scored == 2 * (CTX - 1 - CTX // 2)
    assert two.ppl == pytest.approx(full.running[1].ppl, rel=1e-12)
    assert two.stderr == pytest.approx(full.running[1].stderr, rel=1e-12)
    assert perplexity(model, token_ids=ids, ctx=CTX, max_chunks=99).n_chunks == 6


def test_batched_windows_give_the_same_figure(tiny):
    _, model, _ = tiny
    ids = list(np.random.default_rng(5).integers(0, 256, size=5 * CTX))
    seen = []
    one = perplexity(model, token_ids=ids, ctx=CTX)
    three = perplexity(model, token_ids=ids, ctx=CTX, batch=3, on_chunk=lambda r, n: seen.append((r.chunks, n)))
    assert three.ppl == pytest.approx(one.ppl, rel=1e-6)
    assert [r.ppl for r in three.running] == pytest.approx([r.ppl for r in one.running], rel=1e-6)
    assert seen == [(c, 5) for c in range(1, 6)]


def test_odd_context_scores_ctx_minus_one_minus_half(tiny):
    _, model, _ = tiny
    ids = list(np.random.default_rng(6).integers(0, 256, size=4 * 7))
    result = perplexity(model, token_ids=ids, ctx=7)
    assert result.n_scored == 4 * (7 - 1 - 3)
    assert result.ppl == pytest.approx(reference(ours_logits(model), ids, 7, None)[0], rel=1e-12)


def test_control_token_text_is_plain_text():
    tokenizer = build_tokenizer(tiny_vocab(pre="smollm"))
    assert tokenizer.encode("x</s>").ids[-1] == EOS  # the tokenizer's own default: matched as the control token
    ids = tokenize(tokenizer, "x</s>")
    assert EOS not in ids and len(ids) == 5  # llama.cpp's parse_special=false: "<", "/", "s", ">" as text
    assert tokenizer.encode_special_tokens is False  # the shared tokenizer's switch is put back
    assert tokenize(tokenizer, "ab<think>") == [259, 258]  # user-defined tokens are still matched whole


@pytest.mark.parametrize("kwargs,error,match", [
    ({"ctx": 2}, ValueError, r"ctx must be an int >= 3"),
    ({"ctx": MAX_POSITION + 1}, ValueError, rf"ctx {MAX_POSITION + 1} exceeds the model's {MAX_POSITION} positions"),
    ({"ctx": CTX, "max_chunks": 0}, ValueError, "max_chunks must be a positive int"),
    ({"ctx": CTX, "batch": 0}, ValueError, "batch must be a positive int"),
])
def test_bad_sizes(tiny, kwargs, error, match):
    with pytest.raises(error, match=match):
        perplexity(tiny[1], sample_text(200), **kwargs)


def test_text_shorter_than_two_windows_says_how_many_tokens(tiny):
    model = tiny[1]
    text = sample_text(2 * CTX - 1)
    count = len(model.tokenizer.encode(text).ids)
    with pytest.raises(ValueError, match=rf"needs at least {2 * CTX} tokens .* the text has {count}$"):
        perplexity(model, text, ctx=CTX)


def test_inputs_refused(tiny):
    model = tiny[1]
    with pytest.raises(TypeError, match="exactly one of text and token_ids"):
        perplexity(model, ctx=CTX)
    with pytest.raises(TypeError, match="exactly one of text and token_ids"):
        perplexity(model, "abc", token_ids=[1, 2], ctx=CTX)
    with pytest.raises(TypeError, match="1-D sequence of ints"):
        perplexity(model, token_ids=torch.zeros(2, 40, dtype=torch.long), ctx=CTX)
    with pytest.raises(TypeError, match="1-D sequence of ints"):
        perplexity(model, token_ids=[0.5] * 40, ctx=CTX)
    with pytest.raises(ValueError, match=rf"needs at least {2 * CTX} tokens .* the text has 0$"):
        perplexity(model, token_ids=[], ctx=CTX)
    with pytest.raises(ValueError, match="has no tokenizer"):
        perplexity(dataclasses.replace(model, tokenizer=None), "abc" * 40, ctx=CTX)
    with pytest.raises(ValueError, match="token ids must lie in"):
        perplexity(model, token_ids=[999] * 40, ctx=CTX)
    appends_eos = dataclasses.replace(model, tokenizer=build_tokenizer(tiny_vocab(add_eos_token=True)))
    with pytest.raises(ValueError, match="only a single BOS in front is supported"):
        perplexity(appends_eos, sample_text(100), ctx=CTX)
    no_bos = dataclasses.replace(model, tokenizer=None, config=dataclasses.replace(model.config, bos_token_id=None))
    with pytest.raises(ValueError, match="names a BOS token"):
        perplexity(no_bos, token_ids=[1] * 40, ctx=CTX, add_bos=True)


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_kv_cache_dtype_runs_windows_through_quantized_pages(tiny, fmt):
    """With kv_cache_dtype every window runs through a paged cache in that format: the figure is the protocol over
    CacheLogits' logits, close to the float one but not equal (the K/V were quantized)."""
    from tessera.eval.cache_logits import CacheLogits

    _, model, _ = tiny
    text = sample_text(CTX * 5 + 3, seed=4)
    ids = model.tokenizer.encode(text).ids
    plain = perplexity(model, text, ctx=CTX)
    quantized = perplexity(model, text, ctx=CTX, kv_cache_dtype=fmt, batch=2)
    logits = CacheLogits(model, fmt)
    ppl, *_ = reference(lambda w: logits(torch.tensor([w]))[0], ids, CTX, None)
    assert quantized.ppl == pytest.approx(ppl, rel=1e-6)
    assert quantized.ppl != plain.ppl and quantized.ppl == pytest.approx(plain.ppl, rel=0.05)
    # an unquantized cache is Model.logits exactly
    assert torch.equal(CacheLogits(model)(torch.tensor([ids[:CTX]])), model.logits(torch.tensor([ids[:CTX]])))
    with pytest.raises(ValueError, match="kv_cache_dtype must be"):
        perplexity(model, text, ctx=CTX, kv_cache_dtype="int4")
