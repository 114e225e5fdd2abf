"""Decode attention over int8 KV pages with Q.K in int8 dot products (the cpu backend's ``kv_qk`` variants
``vnni512`` / ``vnni``, :mod:`tessera.backends.cpu.decode_qk8`): every variant this CPU runs, forced.

The query is rounded to int8 per (token, head), an error the float path does not make, so the conformance rule has
two parts, both against the float64 oracle:

- on the **de-quantized query** (:func:`~tessera.backends.cpu.decode_qk8.quantize_queries`' codes times their row
  scales, the very codes the kernel used) and the de-quantized K/V: within the ordinary float32 tolerance;
- on the **unquantized** q, K and V: within :data:`QK8_BOUND` (norm-relative, standard-normal inputs).

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
              monkeypatch, gen: torch.Generator) -> tuple[float, float]:
    """Run the case under ``kv_qk=variant``; assert both rules; return (error vs the q-quantized oracle, error vs
    the unquantized one)."""
    skip_unless_runs("kv_qk", variant)
    monkeypatch.setenv("TESSERA_CPU_VARIANTS", f"kv_qk={variant}")
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
    context = f"kv_qk={variant} ps={page_size} {spec!r} {layout}"
    assert_matches_oracle(out, lse, ref_out.float(), ref_lse.float(), torch.float32, context)
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
