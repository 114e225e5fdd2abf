"""The mlir backend's own pieces: the lowering's text, traced masks and scores, planning, packing, and the IREE
compile cache. The shared conformance suite (tests/attention) runs the kernels against the float64 oracle.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tessera.attention import (
    AttentionSpec,
    alibi,
    alibi_slopes,
    attention,
    causal,
    custom_mask,
    custom_score,
    document,
    sliding_window,
    softcap,
    varlen_attention,
)
from tessera.backends import RaggedBatch, registered
from tessera.backends.base import KVLayout
from tessera.backends.reference import varlen_attention_f64
from tests.attention.tolerances import assert_matches_oracle

mlir = registered()["mlir"]
pytestmark = pytest.mark.skipif(bool(mlir.available()), reason="; ".join(mlir.available()) or "usable")


@pytest.fixture(params=["tiles", "tokens"])
def key_layout(request, monkeypatch) -> str:
    """Run the test with every batch planned for one key layout (the planner picks by query count otherwise)."""
    from tessera.backends.mlir import planner
    from tessera.backends.mlir import tunables  # noqa: F401  (registers the planner's constants as defaults first)

    monkeypatch.setattr(planner, "TOKENS_MAX_Q", 10**9 if request.param == "tokens" else -1)
    return request.param


def _lower(spec: AttentionSpec):
    from tessera.mlir.attention_kernel import lower_attention

    return lower_attention(spec)


# ---- the lowering --------------------------------------------------------------------------------------------------

def test_runtime_values_do_not_change_the_text():
    """Windows, softcaps, slopes and scales are aux values: equal structures share one compiled module."""
    a = _lower(AttentionSpec(8, 2, 64, mask=sliding_window(16), score=softcap(30.0)))
    b = _lower(AttentionSpec(8, 2, 64, mask=sliding_window(900), score=softcap(5.0), scale=0.3))
    assert a.text == b.text
    assert not np.array_equal(a.aux_i, b.aux_i) and not np.array_equal(a.aux_f, b.aux_f)
    assert _lower(AttentionSpec(8, 2, 64, mask=causal())).text != a.text


def test_head_count_and_lengths_are_runtime_but_head_dim_is_not():
    assert _lower(AttentionSpec(8, 2, 64, mask=causal())).text == _lower(AttentionSpec(32, 8, 64, mask=causal())).text
    assert _lower(AttentionSpec(8, 2, 64)).text != _lower(AttentionSpec(8, 2, 128)).text
    assert _lower(AttentionSpec(4, 4, 40)).head_dim_padded == 48


def test_scores_stay_in_vectors_over_kept_tiles():
    """The kernel is a tile loop with online softmax in registers, not a materialized score matrix."""
    text = _lower(AttentionSpec(8, 2, 64, mask=causal())).text
    assert "flow.dispatch.workgroups" in text and "scf.for %t" in text and "%tilesT" in text
    assert "vector.fma" in text and "vector.reduction <maximumf>" in text and "math.exp" in text
    assert "linalg" not in text and "tensor<?x?xf32>" in text  # the only 2-D f32 tensor is lse [T, Hq]


def test_captured_tables_are_stored_once_for_every_row():
    ids = torch.tensor([[0, 0, 1, 1, 1, 2, 2, 2]])
    kernel = _lower(AttentionSpec(4, 2, 32, mask=document(ids) & causal()))
    assert kernel.aux_i.size < 2 * ids.numel() + 16
    assert "vector.gather" in kernel.text


@pytest.mark.parametrize(("fn", "message"), [
    (lambda b, h, q, kv: q > 3 if bool(q > kv) else q < kv, "branches on a position"),
    (lambda b, h, q, kv: torch.erf(q.float()) > 0, "torch.erf has no MLIR translation"),
    (lambda b, h, q, kv: torch.ones(3) > q, "used whole"),
])
def test_untranslatable_masks_say_why(fn, message):
    from tessera.mlir.trace import UntranslatableError

    with pytest.raises(UntranslatableError, match=message):
        _lower(AttentionSpec(4, 2, 32, mask=custom_mask(fn)))


def test_untranslatable_spec_is_declined_with_the_reason():
    from tessera.backends.base import AttentionRequest

    spec = AttentionSpec(4, 2, 32, mask=custom_mask(lambda b, h, q, kv: torch.erf(q.float()) > 0))
    reasons = mlir.why_not(AttentionRequest(spec, torch.float32, torch.device("cpu")))
    assert any("cannot be translated to MLIR" in r and "torch.erf" in r for r in reasons)


def test_python_floor_semantics_on_negative_operands(key_layout):
    """Traced // and % round toward minus infinity, as torch does, on every lane (negative relative positions)."""
    spec = AttentionSpec(2, 1, 16, mask=custom_mask(lambda b, h, q, kv: ((kv - q) // 3) % 2 == 0),
                         score=custom_score(lambda s, b, h, q, kv: s + ((kv - q) % 5).float() * 0.1))
    _check_varlen(spec, (5, 1, 9), (37, 20, 9), torch.float32, seed=3)


def test_alibi_and_softcap_match_the_oracle(key_layout):
    spec = AttentionSpec(8, 2, 32, mask=causal(), score=alibi(alibi_slopes(8)))
    _check_varlen(spec, (7, 1), (40, 33), torch.float32, seed=1)
    _check_varlen(AttentionSpec(8, 8, 32, score=softcap(2.0)), (3,), (19,), torch.bfloat16, seed=2)


@pytest.mark.parametrize("head_dim", [8, 40, 72])
def test_head_dims_that_are_not_a_vector_multiple(head_dim: int, key_layout):
    """The host zero-pads the head dim to a multiple of 16 and slices the output back."""
    _check_varlen(AttentionSpec(6, 2, head_dim, mask=causal()), (1, 17, 0), (30, 17, 4), torch.float32, seed=4)


def test_empty_and_keyless_sequences(key_layout):
    spec = AttentionSpec(4, 2, 16, mask=causal())
    _check_varlen(spec, (0, 2, 0), (0, 5, 3), torch.float32, seed=5)
    nothing = custom_mask(lambda b, h, q, kv: kv < 0)  # rows that keep no key: out 0, lse -inf
    _check_varlen(AttentionSpec(4, 2, 16, mask=nothing), (3, 1), (3, 9), torch.float32, seed=6)


def _check_varlen(spec, q_lens, kv_lens, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    d, hq, hkv = spec.head_dim, spec.num_q_heads, spec.num_kv_heads
    q = torch.randn(sum(q_lens), hq, d, generator=gen).to(dtype)
    k = torch.randn(sum(kv_lens), hkv, d, generator=gen).to(dtype)
    v = torch.randn(sum(kv_lens), hkv, d, generator=gen).to(dtype)
    out, lse = varlen_attention(q, k, v, list(q_lens), list(kv_lens), spec, backend="mlir", return_lse=True)
    ref_out, ref_lse = varlen_attention_f64(q.double(), k.double(), v.double(), RaggedBatch(q_lens, kv_lens), spec)
    assert_matches_oracle(out, lse, ref_out, ref_lse, dtype, f"mlir {spec!r} q={q_lens} kv={kv_lens}")


# ---- planning and packing --------------------------------------------------------------------------------------------

def test_items_cover_every_query_row_exactly_once():
    from tessera.backends.mlir.planner import build_plan
    from tessera.mlir.attention_kernel import F

    spec = AttentionSpec(12, 4, 32, mask=causal())
    batch = RaggedBatch((1, 37, 0, 16), (50, 37, 4, 20))
    plan = build_plan(spec, batch, KVLayout.contiguous(batch))
    seen = np.zeros((batch.total_q, spec.num_q_heads), dtype=int)
    group = spec.group_size
    for item in plan.items:
        for r in range(item[F["num_rows"]]):
            token, g = divmod(item[F["row0"]] + r, group)
            seen[item[F["q_row0"]] + token, item[F["kv_head"]] * group + g] += 1
    assert (seen == 1).all()


def test_decode_reads_keys_in_place_and_prefill_packs_them():
    from tessera.backends.mlir.planner import build_plan

    decode = RaggedBatch((1, 3, 8), (100, 40, 9))
    plan = build_plan(AttentionSpec(4, 2, 32), decode, KVLayout.paged(np.array([[4, 1], [0, -1], [2, -1]]), 64))
    assert plan.key_layout == "tokens" and plan.kv_gather is None
    assert plan.kv_map.tolist() == [64, 2, 256, 64, 0, 0, 128, 0]
    prefill = RaggedBatch((1, 30), (100, 30))
    assert build_plan(AttentionSpec(4, 2, 32), prefill, KVLayout.contiguous(prefill)).key_layout == "tiles"


def test_sliding_window_visits_only_the_kept_tiles():
    from tessera.backends.mlir.planner import build_plan
    from tessera.mlir.attention_kernel import F

    batch = RaggedBatch((1024,), (1024,))
    full = build_plan(AttentionSpec(4, 4, 64), batch, KVLayout.contiguous(batch))
    window = build_plan(AttentionSpec(4, 4, 64, mask=sliding_window(64)), batch, KVLayout.contiguous(batch))
    assert full.items[:, F["tile_count"]].max() == 1024 // 16
    assert window.items[:, F["tile_count"]].max() <= 64 // 16 + 2


def test_paged_keys_are_gathered_with_zero_padding(key_layout):
    """Tiles: pages are gathered so each sequence starts at a multiple of 16, and rows past its end are zeros, never
    stale pages (a NaN there times a zero probability would poison the row). Tokens: pages are read in place, and
    lanes past a sequence's end re-read its last key."""
    from tessera.attention import plan as plan_attention

    gen = torch.Generator().manual_seed(7)
    page, hkv, d = 8, 2, 32
    pages = torch.randn(6, page, hkv, d, generator=gen)
    pages[5] = float("nan")  # a stale page that no sequence owns
    table = torch.tensor([[3, 0], [1, -1]], dtype=torch.int32)
    spec = AttentionSpec(4, 2, d, mask=causal())
    q = torch.randn(3, 4, d, generator=gen)
    p = plan_attention(spec, [2, 1], [13, 5], table, page, backend="mlir")
    assert p.run(q, pages, pages).isfinite().all()
    out, lse = p.run(q, pages, pages, return_lse=True)
    k = torch.cat([pages[[3, 0]].reshape(-1, hkv, d)[:13], pages[[1]].reshape(-1, hkv, d)[:5]])
    ref_out, ref_lse = varlen_attention_f64(q.double(), k.double(), k.double(), RaggedBatch((2, 1), (13, 5)), spec)
    assert_matches_oracle(out, lse, ref_out, ref_lse, torch.float32, "paged")


# ---- compilation -----------------------------------------------------------------------------------------------------

def test_modules_compile_once_and_are_reused_from_disk(tmp_path, monkeypatch):
    from tessera.mlir import iree_compile

    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(iree_compile, "_BINARIES", {})
    text = _lower(AttentionSpec(2, 1, 16, mask=custom_mask(lambda b, h, q, kv: kv != q))).text
    before = iree_compile.STATS.compiles
    first = iree_compile.compile_module(text)
    assert iree_compile.STATS.compiles == before + 1
    assert list((tmp_path / "mlir").glob("llvm-cpu-*.vmfb"))
    monkeypatch.setattr(iree_compile, "_BINARIES", {})  # a new process: the binary comes from disk
    hits = iree_compile.STATS.disk_hits
    assert iree_compile.compile_module(text) == first
    assert iree_compile.STATS.disk_hits == hits + 1 and iree_compile.STATS.compiles == before + 1


def test_compiler_errors_name_the_saved_text(tmp_path, monkeypatch):
    from tessera.mlir import iree_compile

    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path))
    with pytest.raises(iree_compile.CompileError, match=r"failed\.mlir"):
        iree_compile.compile_module("func.func @f() {\n  %x = arith.bogus : i32\n  return\n}\n")
    with pytest.raises(ValueError, match="unknown IREE target"):
        iree_compile.compile_module("", target="tpu")


def test_dense_api_and_gqa_ratio_three(key_layout):
    gen = torch.Generator().manual_seed(8)
    q, k, v = torch.randn(2, 21, 6, 48, generator=gen), torch.randn(2, 30, 2, 48, generator=gen), \
        torch.randn(2, 30, 2, 48, generator=gen)
    spec = AttentionSpec(6, 2, 48, mask=causal())
    out = attention(q, k, v, spec, backend="mlir")
    ref = attention(q, k, v, spec, backend="reference")
    assert (out - ref).abs().max() < 1e-4
