"""The ``block-sparse-schedule`` pass: IR in, IR out, and a lowering that visits only the tiles it keeps."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from xdsl.utils.exceptions import VerifyException

from tessera.attention import causal, sliding_window
from tessera.attention.tiles import classify_tiles, tile_bounds
from tessera.mlir import dialect as td
from tessera.mlir.passes import pipeline

T, HQ, HKV, D = 40, 4, 2, 16
_TYPES = f"tensor<{T}x{HQ}x{D}xf32>, tensor<{T}x{HKV}x{D}xf32>, tensor<{T}x{HKV}x{D}xf32>"


def _module(mask: str, extra: str = "", tokens: str = str(T)) -> str:
    q_t, kv_t = f"tensor<{tokens}x{HQ}x{D}xf32>", f"tensor<{tokens}x{HKV}x{D}xf32>"
    return f"""builtin.module {{
  func.func @attn(%q: {q_t}, %k: {kv_t}, %v: {kv_t}) -> {q_t} {{
    %o = tessera.attention %q, %k, %v {{num_q_heads = {HQ} : i64, num_kv_heads = {HKV} : i64, head_dim = {D} : i64, \
scale = 2.500000e-01 : f64, {mask}, score = "none"{extra}}} : {q_t}, {kv_t}, {kv_t} -> {q_t}
    func.return %o : {q_t}
  }}
}}"""


def _attention(module) -> td.AttentionOp:
    return next(op for op in module.walk() if isinstance(op, td.AttentionOp))


CAUSAL = 'mask = "causal"'
WINDOW = 'mask = "sliding_window", window = 12 : i64'


def test_causal_and_window_schedules_in_the_ir():
    """IR in, IR out: q tiles [0, 16), [16, 32), [32, 40) keep the kv tiles their mask reaches."""
    causal_ir = str(pipeline(td.parse_module(_module(CAUSAL)), "block-sparse-schedule"))
    assert ("schedule_shape = array<i64: 40, 40, 16, 16>, schedule_row_ptr = array<i64: 0, 1, 3, 6>, "
            "schedule_kv = array<i64: 0, 0, 16, 0, 16, 32>") in causal_ir
    # window 12: queries 16..31 reach keys 5..31, queries 32..39 keys 21..39
    window_ir = str(pipeline(td.parse_module(_module(WINDOW)), "block-sparse-schedule"))
    assert "schedule_row_ptr = array<i64: 0, 1, 3, 5>, schedule_kv = array<i64: 0, 0, 16, 16, 32>" in window_ir
    wide = str(pipeline(td.parse_module(_module(CAUSAL)), "block-sparse-schedule{q_tile=32 kv_tile=32}"))
    assert "schedule_shape = array<i64: 40, 40, 32, 32>, schedule_row_ptr = array<i64: 0, 1, 3>" in wide
    # the printed annotation parses and verifies back to the same schedule
    again = td.attention_schedule(_attention(td.parse_module(window_ir)))
    assert again.row_ptr.tolist() == [0, 1, 3, 5] and again.kv_starts.tolist() == [0, 0, 16, 16, 32]


def test_schedule_is_the_planners_classification():
    """The pass asks the classification the planner uses: every tile it does not call EMPTY, nothing else."""
    module = pipeline(td.parse_module(_module(WINDOW, tokens="200")), "block-sparse-schedule")
    sched = td.attention_schedule(_attention(module))
    q_lo, q_hi = tile_bounds(0, 200, 16)
    kv_lo, kv_hi = tile_bounds(0, 200, 16)
    classes = classify_tiles(causal() & sliding_window(12), 0, q_lo, q_hi, kv_lo, kv_hi)
    for i in range(len(q_lo)):
        assert sched.kept(i).tolist() == kv_lo[classes[i] != 0].tolist()
    assert sched.visited() < len(q_lo) * len(kv_lo) // 4  # O(T * w), not O(T^2)


def test_runtime_masks_keep_every_tile_and_bad_options_say_why():
    doc = td.attention_schedule(_attention(pipeline(td.parse_module(_module('mask = "document"')),
                                                    "block-sparse-schedule")))
    assert doc.visited() == 3 * 3
    with pytest.raises(ValueError, match=r"kv_tile must be 0 \(the tuned value\) or one of \[16, 32, 64\], got 24"):
        pipeline(td.parse_module(_module(CAUSAL)), "block-sparse-schedule{kv_tile=24}")
    with pytest.raises(ValueError, match="q_len=8 but the op's tensor has 40 tokens"):
        pipeline(td.parse_module(_module(CAUSAL)), "block-sparse-schedule{q_len=8}")
    unknown = pipeline(td.parse_module(_module(CAUSAL, tokens="?")), "block-sparse-schedule")
    assert td.attention_schedule(_attention(unknown)) is None  # lowering classifies at its own length
    dynamic = pipeline(td.parse_module(_module(CAUSAL, tokens="?")), "block-sparse-schedule{q_len=20 kv_len=20}")
    assert td.attention_schedule(_attention(dynamic)).row_ptr.tolist() == [0, 1, 3]


def test_the_verifier_rejects_inconsistent_schedules():
    partial = ', schedule_shape = array<i64: 40, 40, 16, 16>'
    with pytest.raises(VerifyException, match="come together"):
        td.parse_module(_module(CAUSAL, partial))
    short = partial + ", schedule_row_ptr = array<i64: 0, 1>, schedule_kv = array<i64: 0>"
    with pytest.raises(VerifyException, match="row_ptr must be 4 non-decreasing offsets"):
        td.parse_module(_module(CAUSAL, short))
    odd = partial + ", schedule_row_ptr = array<i64: 0, 1, 1, 1>, schedule_kv = array<i64: 8>"
    with pytest.raises(VerifyException, match=r"multiples of kv_tile=16 in \[0, kv_len=40\), got \[8\]"):
        td.parse_module(_module(CAUSAL, odd))
    other = ', schedule_shape = array<i64: 32, 40, 16, 16>, schedule_row_ptr = array<i64: 0, 1, 1>, ' \
            'schedule_kv = array<i64: 0>'
    with pytest.raises(VerifyException, match="q dim 0 must be 32 .schedule_shape's q_len., got 40"):
        td.parse_module(_module(CAUSAL, other))


mlir_backend = pytest.importorskip("tessera.backends").registered()["mlir"]
needs_iree = pytest.mark.skipif(bool(mlir_backend.available()), reason="; ".join(mlir_backend.available()) or "ok")


@needs_iree
@pytest.mark.parametrize("mask", [CAUSAL, WINDOW])
def test_lowering_visits_the_scheduled_tiles_and_matches_the_oracle(mask):
    from tessera.backends import RaggedBatch
    from tessera.backends.reference import varlen_attention_f64
    from tessera.mlir.lower_graph import lower_graph

    module = pipeline(td.parse_module(_module(mask)), "block-sparse-schedule{kv_tile=32}")
    op = _attention(module)
    sched = td.attention_schedule(op)
    graph = lower_graph(module)
    # the plan embedded in the module lists exactly the annotated tiles, in q-tile order
    tiles = f"arith.constant dense<{sched.kv_starts.tolist()}> : tensor<{sched.visited()}xi32>".replace(" ", "")
    assert tiles in graph.text.replace(" ", "") and "kv tiles of 32 keys" in graph.text
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(T, HQ, D, generator=gen), torch.randn(T, HKV, D, generator=gen), \
        torch.randn(T, HKV, D, generator=gen)
    out = graph.run({"q": q, "k": k, "v": v})
    ref, _ = varlen_attention_f64(q.double(), k.double(), v.double(), RaggedBatch((T,), (T,)),
                                  td.attention_spec(op))
    err = float((out.double() - ref).abs().max())
    assert err < 1e-5, f"{mask}: max abs error {err:.3g} against the float64 oracle"


@needs_iree
def test_lowering_refuses_a_schedule_for_other_lengths():
    from tessera.mlir.lower_graph import lower_graph
    from tessera.mlir.schedule import tile_schedule

    module = td.parse_module(_module(CAUSAL))
    td.set_attention_schedule(_attention(module), tile_schedule(causal(), 0, 20, 20, 16, 16))
    with pytest.raises(ValueError, match="schedule is for q_len=20, kv_len=20, but the layer runs 40 tokens"):
        lower_graph(module)
    assert np.array_equal(td.attention_schedule(_attention(module)).row_ptr, [0, 1, 3])
