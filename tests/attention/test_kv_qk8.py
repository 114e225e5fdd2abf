"""Decode attention over int8 KV pages with Q.K in int8 dot products (the cpu backend's ``kv_qk`` variants
``vnni512`` / ``vnni``, :mod:`tessera.backends.cpu.decode_qk8`), and P.V too (``kv_pv``,
:mod:`tessera.backends.cpu.decode_pv8`): every variant this CPU runs, forced.

The query is rounded to int8 per (token, head), an error the float path does not make, so the conformance rule has
two parts, both against the float64 oracle:

- on the **de-quantized query** (:func:`~tessera.backends.cpu.decode_qk8.quantize_queries`' codes times their row
  scales, the very codes the kernel used) and the de-quantized K/V: within the ordinary float32 tolerance;
- on the **unquantized** q, K and V: within :data:`QK8_BOUND` (norm-relative, standard-normal inputs).

With P.V in int8 as well (items with at least ``PV8_MIN_ROWS`` query rows per kv head), the probabilities are
rounded to 8 bits per row and chunk, which no oracle input reproduces: the first rule becomes :data:`PV8_BOUND`.

Fresh random inputs per case, shuffled page tables with spare pages, partial last pages, GQA groups 1-8 (the 4 x 4
blocking's padding rows included), 1-3 queries per sequence, masks and score modifiers, serial and parallel
kernels, and NaN-poisoned output buffers.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tessera.attention import plan
from tessera.backends.cpu import variants
from tessera.backends.cpu.decode_pv8 import PV8_MIN_ROWS, block_dims, interleave_masks, pv_token
from tessera.backends.cpu.decode_qk8 import CODE_BYTES, dequantize_queries, qk_token, quantize_queries
from tessera.kv.quantized import QuantizedPages, dequantize_kv, quantize_kv
from tests.attention.cases import VARIANTS, oracle, seed_of, varlen_layout
from tests.attention.test_paged import paged_inputs
from tests.attention.test_paged_quantized import QUANTIZATION_BOUND
from tests.attention.tolerances import assert_matches_oracle, rel_err
from tests.cpu_variants import skip_unless_runs

INT8_QK = [name for name in CODE_BYTES]
#: norm-relative error against the unquantized oracle with the query rounded to int8 as well as K/V: the query's
#: grid step is its row's absmax / 127, the keys' the same, so the score error grows by about sqrt(2) over K/V
#: quantization alone. Measured over CASES at D=64 and 128 (vnni512, 2026-12-05): 3.9e-3 .. 1.5e-2 against the
#: unquantized oracle, at most 5.4e-7 against the oracle on the de-quantized query and K/V
QK8_BOUND = 2.5e-2
INT8_PV = INT8_QK  # the same VNNI widths
#: max-abs error (relative to the output's largest) of int8 P.V against the oracle on the de-quantized query and
#: K/V: each weight is off by at most 1/510 of its row's largest in the chunk. Measured over the P.V cases below
#: (2026-12-05, Zen 5): 2.0e-3 .. 7.4e-3; the kernel against a float64 model of the same rounding (chunk by chunk,
#: one sequence of 203 keys): ~1e-7
PV8_BOUND = 1e-2
MASKS = {v.name: v for v in VARIANTS if v.name in {"causal", "window16", "alibi_causal", "softcap_causal",
                                                         "sinks_causal"}}


@pytest.fixture(autouse=True)
def _fresh_choices():
    variants.reset()
    yield
    variants.reset()




def _poison_outputs(monkeypatch) -> None:
    """Every fresh float32 buffer of the step (torch's, and the host code's NumPy partial results) starts as NaN, so
    a row the kernel leaves unwritten fails. Only ``decode.py``'s own ``np`` is swapped: jitted code must keep
    NumPy's ``empty``."""
    from tessera.backends.cpu import decode

    t_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *shape, **kw: t_empty(*shape, **kw).fill_(float("nan"))
                        if kw.get("dtype", torch.float32) == torch.float32 else t_empty(*shape, **kw))

    class _PoisonedNumPy:
        def __getattr__(self, name):
            return getattr(np, name)

        @staticmethod
        def empty(shape, dtype=float, **kw):
            return np.full(shape, np.nan, dtype=dtype, **kw) if np.dtype(dtype) == np.float32 else np.empty(
                shape, dtype=dtype, **kw)

    monkeypatch.setattr(decode, "np", _PoisonedNumPy())


def check_qk8(variant: str, q_lens, kv_lens, hq: int, hkv: int, d: int, mask: str, page_size: int,
              monkeypatch, gen: torch.Generator, pv: str = "float") -> tuple[float, float]:
    """Run the case under ``kv_qk=variant,kv_pv=pv``; assert both rules; return (error vs the q-quantized oracle,
    error vs the unquantized one)."""
    skip_unless_runs("kv_qk", variant)
    skip_unless_runs("kv_pv", pv)
    monkeypatch.setenv("TESSERA_CPU_VARIANTS", f"kv_qk={variant},kv_pv={pv}")
    variants.reset()
    layout = varlen_layout(q_lens, kv_lens, hq, hkv, d)
    spec = MASKS[mask].spec(layout, gen)
    q, k_pages, v_pages, table, k, v = paged_inputs(layout, page_size, torch.float32, gen)
    kq = QuantizedPages(*quantize_kv(k_pages, "int8"), "int8")
    vq = QuantizedPages(*quantize_kv(v_pages, "int8"), "int8")
    assert qk_token(kq.code_bits().numpy(), d) is not None, "the case must run the int8 Q.K kernel"
    p = plan(spec, list(q_lens), list(kv_lens), table, page_size, backend="cpu")
    with monkeypatch.context() as poisoned:
        _poison_outputs(poisoned)
        out, lse = p.run(q, kq, vq, return_lse=True)
    # the oracle's inputs: the query as the kernel rounded it (every row is a decode row here), de-quantized K/V
    every = np.array([0], dtype=np.int64), np.array([q.shape[0]], dtype=np.int64)
    codes, row_scale, corr = quantize_queries(q.numpy(), np.float32(spec.softmax_scale), *every)
    assert np.array_equal(corr, 128 * codes.astype(np.int64).sum(-1))
    q_deq = torch.from_numpy(dequantize_queries(codes, row_scale) / spec.softmax_scale)
    kd, vd = dequantize_kv(kq.codes, kq.scales, torch.float32), dequantize_kv(vq.codes, vq.scales, torch.float32)
    rows_k, rows_v = [], []
    for s, kl in enumerate(kv_lens):
        n = -(-kl // page_size)
        rows_k.append(kd[table[s, :n].long()].reshape(-1, hkv, d)[:kl])
        rows_v.append(vd[table[s, :n].long()].reshape(-1, hkv, d)[:kl])
    ref_out, ref_lse = oracle(q_deq, torch.cat(rows_k), torch.cat(rows_v), layout, spec)
    context = f"kv_qk={variant} kv_pv={pv} ps={page_size} {spec!r} {layout}"
    rows_h = (hq // hkv) * max(q_lens)
    if pv == "float" or rows_h < PV8_MIN_ROWS:  # every item's P.V in float32
        assert_matches_oracle(out, lse, ref_out.float(), ref_lse.float(), torch.float32, context)
    else:  # the lse comes from the unrounded probabilities
        err8 = rel_err(out, ref_out)
        assert err8 <= PV8_BOUND, f"{context}: int8 P.V error against the de-quantized oracle {err8:.3g}"
        torch.testing.assert_close(lse, ref_lse.float(), rtol=1e-5, atol=1e-5)
    raw_out, _ = oracle(q, k, v, layout, spec)
    err = rel_err(out, raw_out)
    assert err <= QK8_BOUND, f"{context}: error against the unquantized oracle {err:.3g}"
    return rel_err(out, ref_out), err


#: (q_lens, kv_lens, hq, hkv, page_size): GQA groups 1-8, partial last pages, pages of 1
CASES = [
    ((1, 1, 1, 1), (131, 50, 1, 300), 8, 2, 16),  # group 4: whole 4 x 4 tiles
    ((1, 2, 1), (77, 9, 45), 3, 1, 5),  # group 3: a padding row per tile, 2 queries in one sequence
    ((1, 1), (33, 64), 2, 2, 1),  # group 1
    ((3, 1), (40, 19), 10, 2, 7),  # group 5
    ((1,), (200,), 7, 1, 16),  # group 7
    ((1, 1), (130, 61), 16, 2, 16),  # group 8
    ((2,), (3,), 2, 1, 16),  # fewer keys than a 4-key block
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"hq{c[2]}hkv{c[3]}ps{c[4]}")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("variant", INT8_QK)
def test_int8_qk_matches_both_oracles(variant: str, d: int, case, monkeypatch, request) -> None:
    gen = torch.Generator().manual_seed(seed_of(request.node.nodeid))
    q_lens, kv_lens, hq, hkv, ps = case
    check_qk8(variant, q_lens, kv_lens, hq, hkv, d, "causal", ps, monkeypatch, gen)


@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("variant", INT8_QK)
def test_int8_qk_masks_and_score_modifiers(variant: str, mask: str, monkeypatch, request) -> None:
    gen = torch.Generator().manual_seed(seed_of(request.node.nodeid))
    check_qk8(variant, (1, 3, 1), (131, 50, 64), 8, 2, 64, mask, 16, monkeypatch, gen)


@pytest.mark.parametrize("variant", INT8_QK)
def test_int8_qk_parallel_split_kv(variant: str, monkeypatch, request) -> None:
    """Enough keys for split-KV parts over the thread pool (the parallel kernel and the merge), partial pages."""
    gen = torch.Generator().manual_seed(seed_of(request.node.nodeid))
    check_qk8(variant, (1, 1, 1), (1500, 1029, 700), 8, 2, 128, "causal", 16, monkeypatch, gen)


#: (q_lens, kv_lens, hq, hkv, page_size): query rows per kv head at or above PV8_MIN_ROWS (int8 P.V) and below it
PV_CASES = [
    ((1, 1), (130, 61), 16, 2, 16),  # group 8
    ((2, 1, 3), (77, 200, 9), 8, 2, 5),  # group 4 x 2-3 queries: 8-12 rows; the one-query sequence too
    ((1,), (3,), 8, 1, 16),  # fewer keys than a 4-key block
    ((3, 1), (40, 19), 10, 2, 7),  # group 5 x 3 queries: 4-row blocks and one-row edges
    ((1, 1), (33, 64), 2, 2, 1),  # group 1: float P.V
]


@pytest.mark.parametrize("case", PV_CASES, ids=lambda c: f"hq{c[2]}hkv{c[3]}q{max(c[0])}ps{c[4]}")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("pv", INT8_PV)
def test_int8_pv_matches_both_oracles(pv: str, d: int, case, monkeypatch, request) -> None:
    gen = torch.Generator().manual_seed(seed_of(request.node.nodeid))
    q_lens, kv_lens, hq, hkv, ps = case
    qk = variants.available("kv_qk")[0]
    if qk not in INT8_QK:
        pytest.skip("int8 P.V runs inside the int8 Q.K kernel, which this CPU lacks")
    check_qk8(qk, q_lens, kv_lens, hq, hkv, d, "causal", ps, monkeypatch, gen, pv)


@pytest.mark.parametrize("pv", INT8_PV)
def test_int8_pv_masks_and_split_kv(pv: str, monkeypatch, request) -> None:
    """A sliding window and ALiBi, and enough keys for split-KV parts (the parallel kernel and the merge)."""
    gen = torch.Generator().manual_seed(seed_of(request.node.nodeid))
    qk = variants.available("kv_qk")[0]
    if qk not in INT8_QK:
        pytest.skip("int8 P.V runs inside the int8 Q.K kernel, which this CPU lacks")
    check_qk8(qk, (2, 3, 1), (131, 50, 64), 8, 2, 64, "window16", 16, monkeypatch, gen, pv)
    check_qk8(qk, (2, 3, 1), (131, 50, 64), 8, 2, 64, "alibi_causal", 16, monkeypatch, gen, pv)
    check_qk8(qk, (2, 2, 2), (1500, 1029, 700), 8, 2, 128, "causal", 16, monkeypatch, gen, pv)


@pytest.mark.parametrize("width", [64, 32])
def test_interleave_order_is_the_unpacks(width: int) -> None:
    """The shuffle masks are VPUNPCK{L,H}{BW,WD} per 128-bit lane, and ``block_dims`` is the order they leave:
    simulated on labelled bytes, vector j's 32-bit lane p holds dimension block_dims[j * width // 4 + p] of 4 keys."""
    lo8, hi8, lo16, hi16 = interleave_masks(width)
    rows = [[(key, dim) for dim in range(width)] for key in range(4)]

    def shuffle(a: list, b: list, mask: list[int]) -> list:
        return [(a + b)[i] for i in mask]

    def words(v: list) -> list:  # bytes -> words, each a pair of bytes
        return [v[2 * i] + v[2 * i + 1] for i in range(len(v) // 2)]

    lo01, hi01 = words(shuffle(rows[0], rows[1], lo8)), words(shuffle(rows[0], rows[1], hi8))
    lo23, hi23 = words(shuffle(rows[2], rows[3], lo8)), words(shuffle(rows[2], rows[3], hi8))
    outs = [shuffle(a, b, m) for a, b, m in
            ((lo01, lo23, lo16), (lo01, lo23, hi16), (hi01, hi23, lo16), (hi01, hi23, hi16))]
    dims = block_dims(width)
    for j, out in enumerate(outs):
        for p in range(width // 4):
            lane = out[2 * p] + out[2 * p + 1]  # 4 bytes: (key, dim) pairs flattened
            dim = int(dims[j * width // 4 + p])
            assert [lane[2 * i: 2 * i + 2] for i in range(4)] == [(key, dim) for key in range(4)]
    assert sorted(dims) == list(range(width))


def test_pv_token_choice(monkeypatch) -> None:
    """kv_pv=float, or a head dim off the variant's width, leaves every item on the float P.V."""
    qk = qk_token(np.zeros((1, 1, 128), np.int8), 128)
    if qk is None:
        pytest.skip("no int8 Q.K kernel on this CPU")
    monkeypatch.setenv("TESSERA_CPU_VARIANTS", "kv_pv=float")
    variants.reset()
    assert pv_token(qk, 128) == (qk, 0)
    monkeypatch.delenv("TESSERA_CPU_VARIANTS")
    variants.reset()
    token, rows = pv_token(qk, 128)
    assert rows == PV8_MIN_ROWS and token.name == variants.choose("kv_pv").name
    if token.name == "vnni512":
        assert pv_token(qk, 96) == (qk, 0)


def test_vnni_runs_32_wide_head_dims(monkeypatch, request) -> None:
    """The 256-bit variant takes head dims that are a multiple of 32 (and of the float vector), such as 96."""
    gen = torch.Generator().manual_seed(seed_of(request.node.nodeid))
    check_qk8("vnni", (1, 1), (100, 37), 4, 2, 96, "causal", 16, monkeypatch, gen)


def test_the_float_path_runs_where_int8_qk_does_not(monkeypatch) -> None:
    """fp8 and float rows, the portable variant, and head dims off the variant's width take the float path."""
    monkeypatch.setenv("TESSERA_CPU_VARIANTS", "kv_qk=portable")
    variants.reset()
    assert qk_token(np.zeros((1, 1, 64), np.int8), 64) is None
    monkeypatch.delenv("TESSERA_CPU_VARIANTS")
    variants.reset()
    assert qk_token(np.zeros((1, 1, 64), np.uint8), 64) is None  # e4m3 bits
    assert qk_token(np.zeros((1, 1, 64), np.uint16), 64) is None  # bf16 bits
    if variants.choose("kv_qk").name == "vnni512":
        assert qk_token(np.zeros((1, 1, 96), np.int8), 96) is None  # 96 is not a multiple of 64
        assert qk_token(np.zeros((1, 1, 128), np.int8), 128) is not None
    assert qk_token(np.zeros((1, 1, 40), np.int8), 40) is None


def test_quantize_queries() -> None:
    """Codes within -127..127 with the row's absmax at +-127, half a grid step of error, a zero row all zero, the
    bias term exact, rows outside the planned sequences untouched."""
    gen = torch.Generator().manual_seed(5)
    q = (torch.randn(5, 3, 64, generator=gen) * torch.logspace(-3, 3, 3).view(1, 3, 1)).numpy()
    q[1, 2] = 0.0
    scale = np.float32(0.125)
    codes, row_scale, corr = quantize_queries(q, scale, np.array([0, 3], np.int64), np.array([2, 2], np.int64))
    assert codes.dtype == np.int8 and row_scale.dtype == np.float32 and corr.dtype == np.int32
    assert (codes[2] == 0).all() and (row_scale[2] == 0).all()  # token 2 belongs to no planned sequence
    assert (codes[1, 2] == 0).all() and row_scale[1, 2] == 0 and corr[1, 2] == 0
    live = [0, 1, 3, 4]
    assert int(np.abs(codes[live]).max()) == 127 and (np.abs(codes[live]).max(-1)[row_scale[live] > 0] == 127).all()
    assert np.array_equal(corr, 128 * codes.astype(np.int64).sum(-1))
    back = dequantize_queries(codes, row_scale)[live]
    want = q[live].astype(np.float64) * float(scale)
    step = row_scale[live].astype(np.float64)[..., None]
    assert (np.abs(back - want) <= 0.5 * step * (1 + 1e-5) + 1e-30).all()


def test_bound_is_near_the_kv_bound() -> None:
    """The documented bound of the int8 Q.K class stays within 1.25x int8 K/V quantization's own."""
    assert QK8_BOUND <= 1.25 * QUANTIZATION_BOUND["int8"]
