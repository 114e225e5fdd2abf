"""Cross-checks against attention implementations outside this project: torch's SDPA and FlexAttention (eager).

The outside implementation runs in float64 on the same inputs upcast to float64, with masks and score functions
written here directly from their definitions (not through tessera's Mask objects), and queries placed at the last
``Sq`` of ``Skv`` absolute positions. Each backend must match it within the dtype tolerance; the float64 oracle
must match it to rounding.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

from tessera.attention import AttentionSpec, alibi, alibi_slopes, attention, causal, document, sliding_window, softcap
from tests.attention.cases import DTYPE_PARAMS, backend_params, dense_layout, make_inputs, oracle, random_doc_ids
from tests.attention.tolerances import LSE_FLOOR, rel_err, tolerance

try:
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention
except ImportError as exc:  # pragma: no cover - depends on the torch build
    flex_attention = None
    FLEX_MISSING = f"torch {torch.__version__} has no usable FlexAttention: {exc}"

BACKENDS = backend_params()
B, SQ, SKV, HQ, HKV, D = 2, 50, 90, 6, 2, 64
OFFSET = SKV - SQ  # query i sits at absolute position OFFSET + i
ORACLE_TOL = 1e-10


@dataclass(frozen=True)
class Case:
    """A tessera spec and the same variant written as an outside mask (``keep(b, h, q_abs, kv)``) and bias."""

    name: str
    spec: Callable[[torch.Tensor], AttentionSpec]                    # doc_ids -> spec
    keep: Callable[[torch.Tensor, object, object, object, object], torch.Tensor] | None  # doc_ids, b, h, q, kv
    score: Callable | None = None                                     # score_mod(score, b, h, q_abs, kv)


SLOPES = alibi_slopes(HQ).double()


def _keep_causal(ids, b, h, q, kv):
    return kv <= q


def _keep_window(ids, b, h, q, kv):
    return (kv <= q) & (q - kv < 16)


def _keep_doc_causal(ids, b, h, q, kv):
    return (ids[b, q] == ids[b, kv]) & (kv <= q)


def _keep_doc(ids, b, h, q, kv):
    return ids[b, q] == ids[b, kv]


def _softcap_score(score, b, h, q, kv):
    return 20.0 * torch.tanh(score / 20.0)


def _alibi_score(score, b, h, q, kv):
    return score + SLOPES.to(score.dtype)[h] * (kv - q)


CASES = [
    Case("full_gqa", lambda ids: AttentionSpec(HQ, HKV, D), None),
    Case("causal", lambda ids: AttentionSpec(HQ, HKV, D, mask=causal()), _keep_causal),
    Case("sliding_window", lambda ids: AttentionSpec(HQ, HKV, D, mask=sliding_window(16)), _keep_window),
    Case("document_causal", lambda ids: AttentionSpec(HQ, HKV, D, mask=document(ids) & causal()), _keep_doc_causal),
    Case("document", lambda ids: AttentionSpec(HQ, HKV, D, mask=document(ids)), _keep_doc),
    Case("alibi_causal", lambda ids: AttentionSpec(HQ, HKV, D, mask=causal(), score=alibi(alibi_slopes(HQ))),
         _keep_causal, _alibi_score),
    Case("softcap_causal", lambda ids: AttentionSpec(HQ, HKV, D, mask=causal(), score=softcap(20.0), scale=0.5),
         _keep_causal, _softcap_score),
    Case("softcap_window", lambda ids: AttentionSpec(HQ, HKV, D, mask=sliding_window(16), score=softcap(20.0)),
         _keep_window, _softcap_score),
]
SDPA_CASES = [pytest.param(c, id=c.name) for c in CASES if c.score is not _softcap_score]
FLEX_CASES = [pytest.param(c, id=c.name) for c in CASES]


def _inputs(dtype: torch.dtype, gen: torch.Generator):
    layout = dense_layout(B, SQ, SKV, HQ, HKV, D)
    q, k, v = make_inputs(layout, dtype, gen)
    return layout, q, k, v, random_doc_ids(gen, B, SKV)


def _heads_first(t: torch.Tensor) -> torch.Tensor:
    return t.double().transpose(1, 2)  # [B, S, H, D] -> [B, H, S, D]


def _positions():
    b = torch.arange(B).view(-1, 1, 1, 1)
    h = torch.arange(HQ).view(1, -1, 1, 1)
    q = torch.arange(OFFSET, SKV).view(1, 1, -1, 1)
    kv = torch.arange(SKV).view(1, 1, 1, -1)
    return b, h, q, kv


def sdpa_reference(case: Case, q, k, v, ids, scale: float) -> torch.Tensor:
    """SDPA in float64 with an explicit (bool or additive) mask; returns ``[B, SQ, HQ, D]``."""
    b, h, qp, kvp = _positions()
    keep = torch.ones(B, HQ, SQ, SKV, dtype=torch.bool) if case.keep is None else torch.broadcast_to(
        case.keep(ids, b, h, qp, kvp), (B, HQ, SQ, SKV))
    attn_mask: torch.Tensor = keep
    if case.score is not None:  # ALiBi is a bias on the scaled scores: SDPA adds a float mask exactly there
        bias = case.score(torch.zeros((), dtype=torch.float64), b, h, qp, kvp)
        attn_mask = torch.where(keep, bias, float("-inf"))
    out = F.scaled_dot_product_attention(_heads_first(q), _heads_first(k), _heads_first(v), attn_mask=attn_mask,
                                         scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


def flex_reference(case: Case, q, k, v, ids, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """FlexAttention (eager) in float64 with a block mask and score_mod; returns out and lse (natural log)."""
    block_mask = None
    if case.keep is not None:
        block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: case.keep(ids, b, h, q_idx + OFFSET, kv_idx),
                                       B, HQ, SQ, SKV, device="cpu")
    score_mod = None
    if case.score is not None:
        score_mod = lambda s, b, h, q_idx, kv_idx: case.score(s, b, h, q_idx + OFFSET, kv_idx)  # noqa: E731
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        out, aux = flex_attention(_heads_first(q), _heads_first(k), _heads_first(v), score_mod=score_mod,
                                  block_mask=block_mask, scale=scale, enable_gqa=True,
                                  return_aux=AuxRequest(lse=True))
    return out.transpose(1, 2), aux.lse.transpose(1, 2)


def _check(name: str, got: torch.Tensor, expected: torch.Tensor, tol: float, floor: float = 1e-3) -> None:
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    err = rel_err(got, expected, floor)
    assert err <= tol, f"{name}: error {err:.3g} > {tol:g}"


@pytest.mark.parametrize("case", SDPA_CASES)
@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_against_sdpa(backend: str, dtype: torch.dtype, case: Case, gen: torch.Generator) -> None:
    layout, q, k, v, ids = _inputs(dtype, gen)
    spec = case.spec(ids)
    expected = sdpa_reference(case, q, k, v, ids, spec.softmax_scale)
    _check("float64 oracle vs SDPA", oracle(q, k, v, layout, spec)[0], expected, ORACLE_TOL)
    out = attention(q, k, v, spec, backend=backend)
    _check(f"{backend} vs SDPA", out, expected, tolerance(dtype))


@pytest.mark.skipif(flex_attention is None, reason=FLEX_MISSING if flex_attention is None else "")
@pytest.mark.parametrize("case", FLEX_CASES)
@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_against_flex_attention(backend: str, dtype: torch.dtype, case: Case, gen: torch.Generator) -> None:
    layout, q, k, v, ids = _inputs(dtype, gen)
    spec = case.spec(ids)
    expected_out, expected_lse = flex_reference(case, q, k, v, ids, spec.softmax_scale)
    ref_out, ref_lse = oracle(q, k, v, layout, spec)
    _check("float64 oracle vs flex out", ref_out, expected_out, ORACLE_TOL)
    _check("float64 oracle vs flex lse", ref_lse, expected_lse, ORACLE_TOL, LSE_FLOOR)
    out, lse = attention(q, k, v, spec, backend=backend, return_lse=True)
    _check(f"{backend} vs flex out", out, expected_out, tolerance(dtype))
    _check(f"{backend} vs flex lse", lse, expected_lse, tolerance(dtype), LSE_FLOOR)
