"""The mlir attention kernel's tunables: rows per work item, keys per kv tile, and the key-layout threshold."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tessera.attention import AttentionSpec, causal, sliding_window, varlen_attention
from tessera.backends import RaggedBatch, registered
from tessera.backends.base import KVLayout
from tessera.backends.reference import varlen_attention_f64
from tessera.tuning import overriding, tuned
from tests.attention.tolerances import assert_matches_oracle

mlir = registered()["mlir"]
pytestmark = pytest.mark.skipif(bool(mlir.available()), reason="; ".join(mlir.available()) or "usable")


def _check(spec: AttentionSpec, q_lens: tuple[int, ...], kv_lens: tuple[int, ...], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    d, hq, hkv = spec.head_dim, spec.num_q_heads, spec.num_kv_heads
    q = torch.randn(sum(q_lens), hq, d, generator=gen)
    k = torch.randn(sum(kv_lens), hkv, d, generator=gen)
    v = torch.randn(sum(kv_lens), hkv, d, generator=gen)
    out, lse = varlen_attention(q, k, v, list(q_lens), list(kv_lens), spec, backend="mlir", return_lse=True)
    ref_out, ref_lse = varlen_attention_f64(q.double(), k.double(), v.double(), RaggedBatch(q_lens, kv_lens), spec)
    assert_matches_oracle(out, lse, ref_out, ref_lse, torch.float32, f"mlir {spec!r} q={q_lens} kv={kv_lens}")


def test_tunables_are_registered_with_the_former_constants_as_defaults():
    from tessera.backends.mlir import planner
    from tessera.mlir import attention_kernel

    assert tuned("mlir_attention_rows") == attention_kernel.ROWS == 4
    assert tuned("mlir_attention_kv_tile") == attention_kernel.KV_TILE == 16
    assert tuned("mlir_tokens_max_q") == planner.TOKENS_MAX_Q == 8


@pytest.mark.parametrize(("rows", "kv_tile", "mask", "q_lens", "kv_lens"), [
    (8, 32, causal(), (37, 1, 20), (50, 9, 20)),  # prefill: tiles layout, ragged lengths past a tile's end
    (2, 64, sliding_window(24), (3, 1), (90, 70)),  # decode-sized: tokens layout
])
def test_overridden_tiling_changes_the_kernel_and_matches_the_oracle(rows, kv_tile, mask, q_lens, kv_lens):
    from tessera.backends.mlir.backend import kernel_for
    from tessera.backends.mlir.planner import build_plan

    spec = AttentionSpec(6, 2, 32, mask=mask)
    batch = RaggedBatch(q_lens, kv_lens)
    default = build_plan(spec, batch, KVLayout.contiguous(batch))
    with overriding("mlir_attention_rows", rows), overriding("mlir_attention_kv_tile", kv_tile):
        plan = build_plan(spec, batch, KVLayout.contiguous(batch))
        assert (plan.rows, plan.kv_tile) == (rows, kv_tile)
        kernel = kernel_for(spec, plan.key_layout, "f32", plan.rows, plan.kv_tile)
        base = kernel_for(spec, plan.key_layout, "f32")
        assert kernel is not base and kernel.text != base.text  # the cache keys include both values
        assert f"{rows} query rows per work item,\n// kv tiles of {kv_tile} keys" in kernel.text
        state = kernel.text.split("iter_args(")[1].split(")")[0]
        assert state.count("%m") == rows  # one running max per query row of the item
        assert kernel.text.count("vector.reduction <maximumf>") == rows * kv_tile // 16
        # Every kept tile starts at a multiple of the tile size; bigger tiles mean fewer tile visits.
        assert (plan.tiles % kv_tile == 0).all() and len(plan.tiles) < len(default.tiles)
        _check(spec, q_lens, kv_lens, seed=rows)


def test_the_layout_threshold_is_the_tunable():
    from tessera.backends.mlir.planner import build_plan

    batch = RaggedBatch((12, 1), (40, 30))
    spec = AttentionSpec(4, 2, 32, mask=causal())
    assert build_plan(spec, batch, KVLayout.contiguous(batch)).key_layout == "tiles"
    with overriding("mlir_tokens_max_q", 16):
        assert build_plan(spec, batch, KVLayout.contiguous(batch)).key_layout == "tokens"


def test_bad_tiling_values_say_what_is_expected():
    from tessera.mlir.attention_kernel import lower_attention

    spec = AttentionSpec(4, 2, 32)
    with pytest.raises(ValueError, match=r"rows must be one of \(1, 2, 4, 8\).*got 3"):
        lower_attention(spec, rows=3)
    with pytest.raises(ValueError, match=r"kv_tile must be one of \(16, 32, 64\).*got 24"):
        lower_attention(spec, kv_tile=24)


def test_packing_pads_each_sequence_to_the_kv_tile():
    from tessera.backends.mlir.planner import build_plan

    batch = RaggedBatch((20, 17), (20, 40))
    plan = build_plan(AttentionSpec(4, 2, 32), batch, KVLayout.contiguous(batch), kv_tile=64)
    assert plan.key_layout == "tiles" and len(plan.kv_gather) == 128  # 20 -> 64 rows, 40 -> 64 rows
    assert (plan.kv_gather[20:64] == -1).all() and (plan.kv_gather[64:104] == np.arange(20, 60)).all()


def test_a_forced_value_the_kernel_cannot_take_is_named(monkeypatch):
    from tessera import tuning
    from tessera.backends.mlir.planner import build_plan

    batch = RaggedBatch((4,), (4,))
    monkeypatch.setenv("TESSERA_TUNE_MLIR_ATTENTION_ROWS", "3")
    tuning.reset()
    try:
        with pytest.raises(ValueError, match=r"rows must be one of \(1, 2, 4, 8\).*got rows=3, kv_tile=16"):
            build_plan(AttentionSpec(4, 2, 32), batch, KVLayout.contiguous(batch))
    finally:
        monkeypatch.delenv("TESSERA_TUNE_MLIR_ATTENTION_ROWS")
        tuning.reset()
