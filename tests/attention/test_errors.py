"""Bad input gets a clear error: the right exception type and a message naming what was expected."""

from __future__ import annotations

import math

import pytest
import torch

from tessera.attention import (
    AttentionSpec,
    alibi,
    alibi_slopes,
    attention,
    causal,
    chunked,
    custom,
    custom_mask,
    custom_score,
    document,
    merge_states,
    prefix_lm,
    sliding_window,
    softcap,
    varlen_attention,
)
from tessera.backends import BackendUnavailableError
from tests.attention.cases import backend_params

BACKENDS = backend_params()


def qkv(b=1, sq=4, skv=6, hq=4, hkv=2, d=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(b, sq, hq, d, generator=g).to(dtype), torch.randn(b, skv, hkv, d, generator=g).to(dtype),
            torch.randn(b, skv, hkv, d, generator=g).to(dtype))


def flat_qkv(tq=4, tkv=6, hq=4, hkv=2, d=16):
    q, k, v = qkv(1, tq, tkv, hq, hkv, d)
    return q[0], k[0], v[0]


SPEC = AttentionSpec(4, 2, 16)


# ---- AttentionSpec ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("heads", [(6, 4), (8, 3), (1, 2)])
def test_spec_heads_not_divisible(heads):
    with pytest.raises(ValueError, match=r"must be a multiple of num_kv_heads"):
        AttentionSpec(*heads, 64)


@pytest.mark.parametrize("field, args", [
    ("num_q_heads", (0, 1, 64)), ("num_kv_heads", (4, -1, 64)), ("head_dim", (4, 2, 0)),
    ("num_q_heads", (4.0, 2, 64)), ("head_dim", (4, 2, True)),
])
def test_spec_sizes_must_be_positive_ints(field, args):
    with pytest.raises(ValueError, match=rf"AttentionSpec\.{field} must be an int >= 1"):
        AttentionSpec(*args)


@pytest.mark.parametrize("scale", [math.nan, math.inf, -math.inf, "0.1", True])
def test_spec_scale_must_be_finite(scale):
    with pytest.raises(ValueError, match=r"scale must be a finite float"):
        AttentionSpec(4, 2, 16, scale=scale)


def test_spec_mask_and_score_types():
    with pytest.raises(TypeError, match=r"mask must be a Mask"):
        AttentionSpec(4, 2, 16, mask=lambda b, h, q, k: k <= q)
    with pytest.raises(TypeError, match=r"mask must be a Mask"):
        AttentionSpec(4, 2, 16, mask=softcap(5.0))
    with pytest.raises(TypeError, match=r"score must be a ScoreMod"):
        AttentionSpec(4, 2, 16, score=causal())


@pytest.mark.parametrize("sinks, exc, phrase", [
    (torch.zeros(3), ValueError, r"shape \[num_q_heads\] = \[4\]"),
    (torch.zeros(1, 4), ValueError, r"shape \[num_q_heads\]"),
    (torch.zeros(4, dtype=torch.int64), TypeError, r"sinks must be a float tensor"),
    ([0.0, 0.0, 0.0, 0.0], TypeError, r"sinks must be a float tensor"),
    (torch.tensor([0.0, math.nan, 0.0, 0.0]), ValueError, r"sinks must be finite"),
    (torch.tensor([0.0, math.inf, 0.0, 0.0]), ValueError, r"sinks must be finite"),
])
def test_spec_bad_sinks(sinks, exc, phrase):
    with pytest.raises(exc, match=phrase):
        AttentionSpec(4, 2, 16, sinks=sinks)


# ---- masks and score functions ------------------------------------------------------------------------------------

@pytest.mark.parametrize("make, value, phrase", [
    (sliding_window, 0, r"sliding_window\(window\) expects an int >= 1"),
    (sliding_window, -3, r"sliding_window\(window\) expects an int >= 1"),
    (sliding_window, 2.5, r"sliding_window\(window\) expects an int >= 1"),
    (sliding_window, True, r"sliding_window\(window\) expects an int >= 1"),
    (chunked, 0, r"chunked\(chunk_size\) expects an int >= 1"),
    (chunked, None, r"chunked\(chunk_size\) expects an int >= 1"),
    (prefix_lm, -1, r"prefix_lm\(prefix_len\) expects an int >= 0"),
    (prefix_lm, 1.0, r"prefix_lm\(prefix_len\) expects an int >= 0"),
])
def test_bad_mask_sizes(make, value, phrase):
    with pytest.raises(ValueError, match=phrase):
        make(value)


@pytest.mark.parametrize("other", [3, None, "causal", lambda b, h, q, k: k <= q, softcap(5.0)])
@pytest.mark.parametrize("op", ["&", "|"])
def test_compose_mask_with_non_mask(op, other):
    with pytest.raises(TypeError, match=r"masks compose only with masks.*custom_mask"):
        (causal() & other) if op == "&" else (causal() | other)


def test_document_bad_ids():
    with pytest.raises(TypeError, match=r"document\(doc_ids\) expects an integer torch tensor"):
        document(torch.zeros(8))
    with pytest.raises(TypeError, match=r"document\(doc_ids\) expects an integer torch tensor"):
        document([0, 0, 1])
    with pytest.raises(TypeError, match=r"document\(doc_ids\) expects an integer torch tensor"):
        document(torch.zeros(8, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"expects shape \[num_positions\] or \[batch, num_positions\]"):
        document(torch.zeros(1, 2, 8, dtype=torch.int64))


@pytest.mark.parametrize("fn", [
    lambda b, h, q: q,
    lambda s, b, h, q, k, extra: s,
    lambda *args: args[0],
    lambda: None,
])
def test_custom_ambiguous_arity(fn):
    phrase = r"cannot tell a mask from a score function.*custom_mask\(fn\) or custom_score\(fn\)"
    with pytest.raises(TypeError, match=phrase):
        custom(fn)


def test_custom_wrappers_need_callables():
    with pytest.raises(TypeError, match=r"custom_mask\(fn\) expects a callable"):
        custom_mask(3)
    with pytest.raises(TypeError, match=r"custom_score\(fn\) expects a callable"):
        custom_score("tanh")


@pytest.mark.parametrize("cap", [0, -1.0, math.inf, math.nan, "5"])
def test_bad_softcap(cap):
    with pytest.raises(ValueError, match=r"softcap\(cap\) expects a finite float > 0"):
        softcap(cap)


def test_bad_alibi_slopes():
    with pytest.raises(ValueError, match=r"expected one slope per query head \(4\), got 3"):
        AttentionSpec(4, 2, 16, score=alibi(alibi_slopes(3)))
    with pytest.raises(TypeError, match=r"alibi\(slopes\) expects a 1-D float tensor"):
        alibi(torch.ones(2, 2))
    with pytest.raises(TypeError, match=r"alibi\(slopes\) expects a 1-D float tensor"):
        alibi(torch.arange(4))
    with pytest.raises(ValueError, match=r"slopes must be finite"):
        alibi(torch.tensor([1.0, math.nan]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_custom_mask_returning_non_bool(backend):
    q, k, v = qkv()
    for fn in (lambda b, h, q_pos, kv_pos: (kv_pos <= q_pos).float(), lambda b, h, q_pos, kv_pos: kv_pos - q_pos):
        spec = AttentionSpec(4, 2, 16, mask=custom_mask(fn))
        with pytest.raises(TypeError, match=r"must return a bool tensor"):
            attention(q, k, v, spec, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_custom_score_returning_non_float(backend):
    q, k, v = qkv()
    spec = AttentionSpec(4, 2, 16, score=custom_score(lambda s, b, h, q_pos, kv_pos: s > 0))
    with pytest.raises(TypeError, match=r"must return a float tensor"):
        attention(q, k, v, spec, backend=backend)


# ---- tensors at the API boundary ----------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_mismatched_shapes(backend):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"k and v must have the same shape"):
        attention(q, k, v[:, :5], SPEC, backend=backend)
    with pytest.raises(ValueError, match=r"q has batch 2 but k/v have batch 1"):
        attention(torch.cat([q, q]), k, v, SPEC, backend=backend)
    with pytest.raises(ValueError, match=r"q must be \[B, S, H, D\] \(4 dims\)"):
        attention(q[0], k, v, SPEC, backend=backend)
    with pytest.raises(ValueError, match=r"k must be \[tokens, H, D\] \(3 dims\)"):
        varlen_attention(q[0], k, v[0], [4], [6], SPEC, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mismatched_dtypes(backend):
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"q, k, v must share one dtype.*cast them first"):
        attention(q, k.to(torch.bfloat16), v, SPEC, backend=backend)
    with pytest.raises(TypeError, match=r"must share one dtype"):
        attention(q.half(), k.half(), v.bfloat16(), SPEC, backend=backend)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.int64, torch.bool, torch.complex64])
def test_unsupported_dtype(dtype):
    q, k, v = (t.to(dtype) for t in qkv())
    with pytest.raises(TypeError, match=r"supported storage dtypes are float32, bfloat16, float16"):
        attention(q, k, v, SPEC)


def test_not_tensors_or_spec():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"spec must be an AttentionSpec"):
        attention(q, k, v, {"num_q_heads": 4})
    with pytest.raises(TypeError, match=r"k must be a torch.Tensor"):
        attention(q, k.numpy(), v, SPEC)


def test_tensors_on_different_devices():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"q, k, v must be on one device"):
        attention(q, k.to("meta"), v, SPEC)


@pytest.mark.parametrize("hq, hkv", [(8, 2), (4, 1), (2, 2)])
def test_head_counts_differ_from_spec(hq, hkv):
    q, k, v = qkv(hq=hq, hkv=hkv)
    with pytest.raises(ValueError, match=r"head counts differ from the spec"):
        attention(q, k, v, SPEC)


def test_head_dim_differs_from_spec():
    q, k, v = qkv(d=32)
    with pytest.raises(ValueError, match=r"head_dim differs: spec says 16"):
        attention(q, k, v, SPEC)
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"head_dim differs"):
        attention(q, k[..., :8], v[..., :8], SPEC)


def test_more_queries_than_keys():
    q, k, v = qkv(sq=7, skv=6)
    with pytest.raises(ValueError, match=r"Sq \(7\) > Skv \(6\).*append the new tokens"):
        attention(q, k, v, SPEC)
    q, k, v = flat_qkv(tq=7, tkv=9)
    with pytest.raises(ValueError, match=r"sequence 1 has q_len 5 > kv_len 3"):
        varlen_attention(q, k, v, [2, 5], [6, 3], SPEC)


def test_varlen_length_errors():
    q, k, v = flat_qkv(tq=4, tkv=6)
    with pytest.raises(ValueError, match=r"must equal the token counts of q \(4\) and k/v \(6\)"):
        varlen_attention(q, k, v, [1, 2], [3, 3], SPEC)
    with pytest.raises(ValueError, match=r"must equal the token counts"):
        varlen_attention(q, k, v, [2, 2], [3, 4], SPEC)
    with pytest.raises(ValueError, match=r"2 q_lens but 3 kv_lens"):
        varlen_attention(q, k, v, [2, 2], [2, 2, 2], SPEC)
    with pytest.raises(ValueError, match=r"q_lens must be >= 0"):
        varlen_attention(q, k, v, [5, -1], [3, 3], SPEC)
    with pytest.raises(TypeError, match=r"kv_lens must be a 1-D integer tensor"):
        varlen_attention(q, k, v, [2, 2], torch.tensor([3.0, 3.0]), SPEC)
    with pytest.raises(TypeError, match=r"q_lens must be a 1-D integer tensor"):
        varlen_attention(q, k, v, torch.tensor([[2, 2]]), [3, 3], SPEC)
    with pytest.raises(TypeError, match=r"q_lens must be a list of ints"):
        varlen_attention(q, k, v, ["two", 2], [3, 3], SPEC)


def test_document_ids_wrong_length():
    q, k, v = qkv(b=2, sq=4, skv=6)
    for n in (5, 7):
        spec = AttentionSpec(4, 2, 16, mask=document(torch.zeros(n, dtype=torch.int64)) & causal())
        with pytest.raises(ValueError, match=rf"expected exactly 6 positions \(the kv length\), got {n}"):
            attention(q, k, v, spec)
    spec = AttentionSpec(4, 2, 16, mask=document(torch.zeros(3, 6, dtype=torch.int64)))
    with pytest.raises(ValueError, match=r"doc_ids has 3 rows but the batch has 2 sequences"):
        attention(q, k, v, spec)
    fq, fk, fv = flat_qkv(tq=4, tkv=9)
    spec = AttentionSpec(4, 2, 16, mask=~document(torch.zeros(5, dtype=torch.int64)))
    with pytest.raises(ValueError, match=r"expected at least 6 positions \(the kv length\), got 5"):
        varlen_attention(fq, fk, fv, [1, 3], [3, 6], spec)
    spec = AttentionSpec(4, 2, 16, mask=causal() | document(torch.zeros(1, 6, dtype=torch.int64)))
    with pytest.raises(ValueError, match=r"doc_ids has 1 rows but the batch has 2 sequences"):
        varlen_attention(fq, fk, fv, [1, 3], [3, 6], spec)


# ---- backends -------------------------------------------------------------------------------------------------

def test_unknown_backend():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"unknown backend 'tpu'; choose one of .*'cpu'.*'reference'.*or 'auto'"):
        attention(q, k, v, SPEC, backend="tpu")


def test_triton_on_cpu_tensors_lists_reasons(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the suite interprets triton kernels; a user's CPU machine does not
    q, k, v = qkv()
    with pytest.raises(BackendUnavailableError, match=r"backend 'triton' cannot run") as info:
        attention(q, k, v, SPEC, backend="triton")
    assert "runs on cuda tensors, got cpu" in str(info.value)


# ---- merge_states -------------------------------------------------------------------------------------------------

def test_merge_states_shape_errors():
    out, lse = torch.randn(3, 4, 16), torch.randn(3, 4)
    with pytest.raises(ValueError, match=r"merge_states: shapes differ"):
        merge_states(out, lse, out[:2], lse[:2])
    with pytest.raises(ValueError, match=r"lse must be out's shape without the last dim"):
        merge_states(out, lse[:, :2], out, lse[:, :2])
