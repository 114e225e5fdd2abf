"""Conformance of the vocabulary ops and the sampler on every backend against the float64 reference, plus
statistical tests of the sampler (chi-square against the filtered softmax) and its seeding guarantees."""

from __future__ import annotations

import pytest
import torch

from tessera.backends.reference.ops import sampling as ref
from tessera.kernels import sampling as ks
from tessera.kernels.sampling import SamplerParams, build_batch
from tests.kernels.conftest import kernel_backends
from tests.kernels.tolerances import assert_close_to_oracle

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1, 1), (1, 7), (3, 1000), (2, 50257)]


def _logits(gen: torch.Generator, shape: tuple[int, int], dtype: torch.dtype, scale: float = 3.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


# ---------------------------------------------------------------- row ops


@pytest.mark.parametrize("backend", kernel_backends())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_softmax_and_log_softmax(backend, dtype, shape, gen):
    x = _logits(gen, shape, dtype)
    temp = torch.rand(shape[0], generator=gen, dtype=torch.float64) + 0.3
    for t in (None, 0.7, temp):
        t_rows = ks._temperature_rows(x, t)
        out = ks.softmax(x, temperature=t, backend=backend)
        assert out.dtype == torch.float32
        assert_close_to_oracle(out, ref.softmax_f64(x, t_rows), torch.float32, f"softmax t={t}", reduction=True)
    out = ks.log_softmax(x, backend=backend)
    assert out.dtype == torch.float32
    assert_close_to_oracle(out, ref.log_softmax_f64(x), torch.float32, "log_softmax", reduction=True)


@pytest.mark.parametrize("backend", kernel_backends())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_argmax(backend, dtype, shape, gen):
    x = _logits(gen, shape, dtype)
    out = ks.argmax(x, backend=backend)
    assert out.dtype == torch.int64
    assert torch.equal(out, torch.argmax(x.double(), dim=-1))


@pytest.mark.parametrize("backend", kernel_backends())
def test_argmax_ties_pick_lowest_index(backend):
    x = torch.zeros(3, 1000)
    x[0, [5, 700]] = 2.0   # tie across blocks
    x[1, [301, 302]] = 1.0  # tie inside a block
    x[2] = -1.0             # all equal
    assert ks.argmax(x, backend=backend).tolist() == [5, 301, 0]


@pytest.mark.parametrize("backend", kernel_backends())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_topk(backend, dtype, shape, gen):
    x = _logits(gen, shape, dtype)
    for k in sorted({1, min(5, shape[1]), shape[1]}):
        values, ids = ks.topk(x, k, backend=backend)
        want_values, want_ids = ref.topk(x, k)
        assert values.dtype == torch.float32 and ids.dtype == torch.int64
        assert torch.equal(values, want_values), f"k={k}"
        assert torch.equal(ids, want_ids), f"k={k}: ties must go to the lowest index"


@pytest.mark.parametrize("backend", kernel_backends())
def test_topk_boundary_ties(backend):
    x = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0, 2.0, 0.0]])
    values, ids = ks.topk(x, 3, backend=backend)
    assert values.tolist() == [[3.0, 3.0, 2.0]] and ids.tolist() == [[1, 3, 2]]


@pytest.mark.parametrize("backend", kernel_backends()[2:])  # triton (skipped where it cannot run)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(2, 600), (2, 5000)])  # 3 chunks + merge / one chunk, under the interpreter
def test_triton_topk_kernel_ties(backend, dtype, shape, gen):
    """The Triton top-k (k <= 64; several vocabulary chunks under the interpreter) on tie-heavy rows, -inf, -0.0,
    and k = 65 (the torch fallback): values bit for bit and ids equal to the reference's stable sort."""
    x = _logits(gen, shape, dtype)
    coarse = (x.float() * 0.3).round().clamp(-1, 1).to(dtype)  # a third of the row ties at the max
    coarse[0, 17] = -0.0
    masked = x.clone()
    masked[:, ::3] = float("-inf")
    zeros = torch.zeros(shape, dtype=dtype)
    zeros[:, 1::2] = -0.0
    for row_set, ks_ in ((x, (1, 64, 65)), (coarse, (5, 64)), (masked, (5,)), (zeros, (64,))):
        for k in ks_:
            values, ids = ks.topk(row_set, k, backend=backend)
            want_values, want_ids = ref.topk(row_set, k)
            assert torch.equal(ids, want_ids), f"k={k}: ties must go to the lowest index"
            assert torch.equal(values.view(torch.int32), want_values.view(torch.int32)), f"k={k}"


@pytest.mark.parametrize("backend", kernel_backends())
def test_empty_batch(backend):
    x = torch.zeros(0, 9)
    assert ks.softmax(x, backend=backend).shape == (0, 9)
    assert ks.log_softmax(x, backend=backend).shape == (0, 9)
    assert ks.argmax(x, backend=backend).shape == (0,)
    assert ks.topk(x, 2, backend=backend)[1].shape == (0, 2)
    ids, lps = ks.sample(x, [], backend=backend)
    assert ids.shape == (0,) and lps.shape == (0,)


# ---------------------------------------------------------------- sampler vs the reference, same draws

CONFIGS = [
    SamplerParams(temperature=1.0),
    SamplerParams(temperature=0.7, top_k=40),
    SamplerParams(temperature=1.1, top_p=0.9),
    SamplerParams(temperature=0.8, min_p=0.05),
    SamplerParams(temperature=0.9, top_k=100, top_p=0.8, min_p=0.02),
    SamplerParams(temperature=1.0, top_p=0.95, repetition_penalty=1.3, presence_penalty=0.4,
                   frequency_penalty=0.2),
    SamplerParams(temperature=0.05, top_k=7),  # scaled logits spread far beyond the histogram's span
    SamplerParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.3),
]


@pytest.mark.parametrize("backend", kernel_backends())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 7, 1000, 50257])
def test_sample_matches_reference(backend, dtype, vocab, gen):
    x = _logits(gen, (len(CONFIGS), vocab), dtype)
    params = [SamplerParams(**{**_fields(p), "seed": 100 + i}) for i, p in enumerate(CONFIGS)]
    seen = [torch.randint(0, vocab, (20,), generator=gen).tolist() for _ in params]
    ids, lps = ks.sample(x, params, token_counts=seen, backend=backend)
    want_ids, want_lps = ref.sample_f64(x, build_batch(params, vocab, seen, None))
    assert ids.dtype == torch.int64 and lps.dtype == torch.float32
    assert torch.equal(ids, want_ids)
    assert torch.allclose(lps.double(), want_lps, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", kernel_backends())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 7, 1000])
def test_filtered_probs_match_reference_and_hold_the_sampled_token(backend, dtype, vocab, gen):
    """The distribution speculative verification compares: the sampler's own, every sampled token inside it."""
    x = _logits(gen, (len(CONFIGS), vocab), dtype)
    seen = [torch.randint(0, vocab, (20,), generator=gen).tolist() for _ in CONFIGS]
    probs = ks.filtered_probs(x, CONFIGS, token_counts=seen, backend=backend)
    want = ref.filtered_probs_f64(x, build_batch(CONFIGS, vocab, seen, None))
    assert probs.dtype == torch.float32 and probs.shape == (len(CONFIGS), vocab)
    assert torch.allclose(probs.double(), want, atol=1e-5, rtol=1e-4)
    params = [SamplerParams(**{**_fields(p), "seed": 7 + i}) for i, p in enumerate(CONFIGS)]
    ids, _ = ks.sample(x, params, token_counts=seen, backend=backend)
    assert bool((probs.gather(1, ids[:, None].to(probs.device)) > 0).all())
    with pytest.raises(ValueError, match="params must be a list of 8 SamplerParams"):
        ks.filtered_probs(x, CONFIGS[:2], backend=backend)


def _fields(p: SamplerParams) -> dict:
    return {name: getattr(p, name) for name in SamplerParams.__slots__}


@pytest.mark.parametrize("backend", kernel_backends())
def test_greedy_is_argmax_of_penalized_logits(backend, gen):
    x = _logits(gen, (5, 1000), torch.float32)
    params = [SamplerParams(temperature=0.0, repetition_penalty=2.0 if b % 2 else 1.0) for b in range(5)]
    seen = [torch.argmax(x[b]).reshape(1).tolist() for b in range(5)]  # penalize each row's top token
    ids, lps = ks.sample(x, params, token_counts=seen, backend=backend)
    penalized = ref.apply_penalties(x.double().clone(), build_batch(params, 1000, seen, None))
    assert torch.equal(ids, torch.argmax(penalized, dim=-1))
    assert torch.equal(ids[0::2], torch.argmax(x[0::2], dim=-1))
    assert torch.all(lps == 0)


def test_penalty_semantics():
    x = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    params = [SamplerParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)]
    batch = build_batch(params, 4, [[0, 1, 1]], None)
    got = ref.apply_penalties(x.double().clone(), batch)
    # token 0 seen once: 2 / 2 - 0.5 - 0.25; token 1 seen twice: -2 * 2 - 0.5 - 0.5; others untouched
    assert got.tolist() == [[0.25, -5.0, 1.0, 0.5]]
    as_tensor = build_batch(params, 4, torch.tensor([[1, 2, 0, 0]]), None)
    assert torch.equal(ref.apply_penalties(x.double().clone(), as_tensor), got)


@pytest.mark.parametrize("backend", kernel_backends())
def test_seeded_rows_do_not_depend_on_the_batch(backend, gen):
    x = _logits(gen, (6, 1000), torch.float32)
    params = [SamplerParams(temperature=1.0, top_p=0.9)] * 6
    params[3] = SamplerParams(temperature=1.0, top_p=0.9, seed=1234)
    alone = ks.sample(x[3:4], [params[3]], backend=backend)[0]
    for _ in range(3):
        assert ks.sample(x, params, backend=backend)[0][3] == alone[0]
    # a request-owned generator advances across steps, identically whatever the batch
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    solo = [ks.sample(x[3:4], [params[0]], generators=[g1], backend=backend)[0][0] for _ in range(4)]
    mixed = [ks.sample(x[2:5], params[2:5], generators=[None, g2, None], backend=backend)[0][1] for _ in range(4)]
    assert solo == mixed


# ---------------------------------------------------------------- statistics

STAT_CONFIGS = [
    SamplerParams(temperature=1.0),
    SamplerParams(temperature=0.6),
    SamplerParams(temperature=1.0, top_k=4),
    SamplerParams(temperature=1.0, top_p=0.7),
    SamplerParams(temperature=1.3, min_p=0.15),
    SamplerParams(temperature=0.9, top_k=7, top_p=0.85, min_p=0.05, repetition_penalty=1.4, presence_penalty=0.3,
                   frequency_penalty=0.1),
]


def _chi_square_pvalue(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Upper tail of the chi-square statistic (df = cells - 1), via the regularized incomplete gamma function."""
    stat = ((observed - expected) ** 2 / expected).sum()
    df = torch.tensor(float(len(expected) - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))


@pytest.mark.parametrize("backend", kernel_backends())
@pytest.mark.parametrize("config", range(len(STAT_CONFIGS)))
def test_sample_distribution_chi_square(backend, config, gen):
    draws, vocab = 20000, 12
    row = torch.linspace(2.0, -1.5, vocab)[torch.randperm(vocab, generator=gen)]
    params = [STAT_CONFIGS[config]] * draws
    seen = [[int(torch.argmax(row)), 3, 3]] * draws
    ids, lps = ks.sample(row.expand(draws, vocab).contiguous(), params, token_counts=seen,
                         generators=[gen] * draws, backend=backend)
    probs = ref.filtered_probs_f64(row[None], build_batch(params[:1], vocab, seen[:1], None))[0]
    observed = torch.bincount(ids, minlength=vocab).double()
    kept = probs > 0
    assert observed[~kept].sum() == 0, "a filtered-out token was sampled"
    assert torch.allclose(lps.double(), probs[ids].log(), atol=1e-5), "logprob is not the filtered distribution's"
    if kept.sum() > 1:
        p = _chi_square_pvalue(observed[kept], draws * probs[kept])
        assert p > 1e-4, f"empirical distribution differs from the filtered softmax (chi-square p={p:.2g})"


@pytest.mark.parametrize("backend", kernel_backends())
def test_top_p_ties_keep_lowest_indices(backend, gen):
    draws = 4000
    x = torch.zeros(draws, 8)  # uniform: 1/8 each, the top-p=0.5 nucleus is exactly tokens 0..3
    ids, lps = ks.sample(x, [SamplerParams(top_p=0.5)] * draws, generators=[gen] * draws, backend=backend)
    assert set(ids.tolist()) == {0, 1, 2, 3}
    assert torch.allclose(lps, torch.full_like(lps, -torch.log(torch.tensor(4.0)).item()))


# ---------------------------------------------------------------- errors


def test_errors():
    x = torch.randn(2, 10)
    with pytest.raises(ValueError, match="2-D"):
        ks.softmax(torch.randn(10))
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        ks.argmax(torch.zeros(2, 10, dtype=torch.int64))
    with pytest.raises(ValueError, match="vocab >= 1"):
        ks.log_softmax(torch.zeros(2, 0))
    with pytest.raises(ValueError, match=r"k must be an int in \[1, vocab=10\]"):
        ks.topk(x, 11)
    with pytest.raises(ValueError, match="temperature must be finite and > 0"):
        ks.softmax(x, temperature=0.0)
    with pytest.raises(ValueError, match="one per row"):
        ks.sample(x, [SamplerParams()])
    with pytest.raises(ValueError, match="outside"):
        ks.sample(x, [SamplerParams(repetition_penalty=1.2)] * 2, token_counts=[[3], [10]])
    with pytest.raises(ValueError, match="generators"):
        ks.sample(x, [SamplerParams()] * 2, generators=[None])
    with pytest.raises(ValueError, match="unknown backend"):
        ks.argmax(x, backend="tpu")


@pytest.mark.parametrize("field, value", [("temperature", -1.0), ("top_k", -2), ("top_p", 0.0), ("top_p", 1.5),
                                          ("min_p", 2.0), ("repetition_penalty", 0.0)])
def test_sampling_params_validate(field, value):
    with pytest.raises(ValueError, match=f"SamplerParams.{field} must be"):
        SamplerParams(**{field: value})
