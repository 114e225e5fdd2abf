"""The triton backend's own pieces: translation of masks and scores, planning, poisoned outputs, a property test
under the interpreter, compilation for Hopper without a GPU, and the GPU script's smoke run.

The shared conformance suite (tests/attention) runs the kernels themselves against the float64 oracle.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings

from tessera.attention import (
    AttentionSpec,
    alibi,
    alibi_slopes,
    causal,
    chunked,
    custom_mask,
    custom_score,
    document,
    prefix_lm,
    sliding_window,
    softcap,
    varlen_attention,
)
from tessera.backends import RaggedBatch, registered
from tessera.backends.triton import codegen
from tessera.backends.triton.configs import Configs, LaunchConfig, interpreting
from tessera.backends.triton.kernels import FULL_CNT, HEAD0, PART_CNT
from tessera.backends.triton.planner import plan_launches
from tessera.backends.triton.trace import ReturnTypeError, UntranslatableError
from tests.attention import strategies as S
from tests.attention.cases import make_inputs, oracle, run_api, varlen_layout
from tests.attention.tolerances import assert_matches_oracle

ROOT = Path(__file__).resolve().parents[2]
usable = pytest.mark.skipif(bool(registered()["triton"].available()), reason="triton cannot run here")


# ---- translation -----------------------------------------------------------------------------------------------------

def _source(**kwargs) -> codegen.Variant:
    return codegen.generate(AttentionSpec(4, 2, 16, **kwargs))


def test_runtime_values_do_not_change_the_source():
    """Window sizes, chunk sizes, caps, slopes and doc ids are kernel arguments: one compiled kernel serves all."""
    pairs = [
        (sliding_window(8), sliding_window(4096)),
        (chunked(16) & causal(), chunked(8192) & causal()),
        (prefix_lm(3), prefix_lm(300)),
        (document(torch.tensor([0, 0, 1])), document(torch.arange(50))),
    ]
    for a, b in pairs:
        va, vb = _source(mask=a), _source(mask=b)
        assert va.source == vb.source and not np.array_equal(va.aux_i, vb.aux_i)
    assert _source(score=softcap(5.0)).source == _source(score=softcap(50.0)).source
    assert _source(score=alibi(alibi_slopes(4))).source == _source(score=alibi(torch.ones(4))).source


def test_closure_constants_are_runtime_values():
    def window(w):
        return custom_mask(lambda b, h, q_pos, kv_pos: (kv_pos <= q_pos) & (q_pos - kv_pos < w))

    assert _source(mask=window(3)).source == _source(mask=window(300)).source


def test_python_rounding_of_floor_division_and_modulo():
    src = _source(mask=custom_mask(lambda b, h, q_pos, kv_pos: (q_pos - kv_pos) % 3 == (kv_pos // 2) % 2)).source
    assert "floormod(" in src and "floordiv(" in src


def test_captured_tensors_are_read_with_clamped_indices():
    bias = torch.randn(4, 10)
    src = _source(score=custom_score(lambda s, b, h, q_pos, kv_pos: s + bias[h, kv_pos])).source
    assert "lookup_float(AUX_F" in src and "clamp_index(kv_pos, 10)" in src


@pytest.mark.parametrize(("fn", "message"), [
    (lambda b, h, q_pos, kv_pos: kv_pos <= q_pos if q_pos > 3 else kv_pos > 0, "branches on a position"),
    (lambda b, h, q_pos, kv_pos: torch.isin(kv_pos, torch.tensor([1, 2])), "torch.isin has no Triton translation"),
    (lambda b, h, q_pos, kv_pos: (kv_pos <= q_pos) & torch.ones(3, dtype=torch.bool), "captured tensor"),
    (lambda b, h, q_pos, kv_pos: kv_pos.cumsum(0) > 0, "method .cumsum()"),
    (lambda b, h, q_pos, kv_pos: torch.ones(3) > q_pos, "used whole"),  # a tensor's own operator, not recursion
])
def test_untranslatable_functions_say_why(fn, message):
    with pytest.raises(UntranslatableError, match=message):
        _source(mask=custom_mask(fn))


def test_untranslatable_spec_falls_back_with_the_reason():
    spec = AttentionSpec(4, 2, 16, mask=custom_mask(lambda b, h, q_pos, kv_pos: torch.isin(kv_pos, torch.tensor([1]))))
    from tessera.backends.base import AttentionRequest

    reasons = registered()["triton"].why_not(AttentionRequest(spec, torch.float32, torch.device("cpu")))
    assert any("cannot be translated to Triton" in r and "torch.isin" in r for r in reasons)


def test_wrong_return_kinds_are_type_errors_like_on_every_backend():
    with pytest.raises(ReturnTypeError, match="must return a bool tensor, got int"):
        _source(mask=custom_mask(lambda b, h, q_pos, kv_pos: kv_pos - q_pos))
    with pytest.raises(ReturnTypeError, match="must return a float tensor, got bool"):
        _source(score=custom_score(lambda s, b, h, q_pos, kv_pos: s > 0))


def test_generated_module_is_written_where_people_can_read_it(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path))
    variant = _source(mask=sliding_window(8), score=softcap(3.0))
    module = codegen.load(variant.source + "\n# private copy for this test\n")
    files = list((tmp_path / "triton").glob("variant_*.py"))
    assert len(files) == 1 and "def mask_fn" in files[0].read_text() and hasattr(module, "score_fn")


# ---- planning ---------------------------------------------------------------------------------------------------------

CONFIGS = Configs(LaunchConfig(32, 32), LaunchConfig(16, 16), target_programs=64, min_tiles_per_split=2)


def test_causal_prefill_skips_tiles_above_the_diagonal():
    spec = AttentionSpec(4, 2, 64, mask=causal())
    (launch,) = plan_launches(spec, RaggedBatch((256,), (256,)), CONFIGS)
    # 16 tokens x 2 heads per tile: q tile i (tokens 16i..16i+15) needs kv tiles 0..i//2, the last one partial.
    visited = launch.items[:, FULL_CNT] + launch.items[:, PART_CNT]
    dense = 256 // 32
    assert visited.sum() < launch.num_items * dense * 0.6
    assert (launch.items[:, PART_CNT] == 1).all()  # exactly the diagonal tile is masked


def test_decode_items_are_split_and_merged():
    spec = AttentionSpec(8, 2, 64)
    launch, = plan_launches(spec, RaggedBatch((1, 1), (1000, 40)), CONFIGS)
    assert launch.num_slots > 0 and len(launch.merges) > 0
    assert launch.merges[:, 5].sum() == launch.num_slots  # every slot belongs to exactly one merge


def test_long_group_is_split_over_head_subtiles():
    spec = AttentionSpec(128, 1, 32)  # MQA: 128 heads do not fit one (at most 64-row) decode tile
    launch, = plan_launches(spec, RaggedBatch((1,), (20,)), CONFIGS)
    assert sorted(set(launch.items[:, HEAD0].tolist())) == [0, 64]


# ---- running under the interpreter -----------------------------------------------------------------------------------

@usable
def test_every_output_element_is_written():
    """Poison the outputs; the kernels must overwrite every row (fused epilogue: no zero-initialised buffers)."""
    from tessera.backends.base import KVLayout

    gen = torch.Generator().manual_seed(3)
    layout = varlen_layout((1, 20, 3), (40, 20, 90), 6, 2, 48)
    spec = AttentionSpec(6, 2, 48, mask=causal(), sinks=torch.randn(6, generator=gen))
    q, k, v = make_inputs(layout, torch.float16, gen)
    backend = registered()["triton"]
    batch = RaggedBatch(layout.q_lens, layout.kv_lens)
    state = backend.plan(spec, batch, KVLayout.contiguous(batch))
    out = torch.full((batch.total_q, 6, 48), float("nan"), dtype=torch.float16)
    lse = torch.full((batch.total_q, 6), float("nan"))
    backend.run(state, q, k, v, out, lse)
    ref_out, ref_lse = oracle(q, k, v, layout, spec)
    assert_matches_oracle(out, lse, ref_out, ref_lse, torch.float16, "poisoned outputs")


@usable
@settings(max_examples=12, deadline=None, derandomize=True, database=None,
          phases=[Phase.explicit, Phase.generate], suppress_health_check=[HealthCheck.too_slow])
@given(data=S.st.data())
def test_property_matches_oracle(data):
    """Random specs, ragged batches and dtypes (the generic property tests, fewer examples: the interpreter is slow)."""
    hq, hkv, d = data.draw(S.heads(), label="heads")
    q_lens, kv_lens = data.draw(S.ragged_lens(max_seqs=3), label="lens")
    layout = varlen_layout(q_lens, kv_lens, hq, hkv, d)
    spec = AttentionSpec(hq, hkv, d, mask=data.draw(S.masks(layout.batch, layout.max_kv + 3, False), label="mask"),
                         score=data.draw(S.scores(hq, False), label="score"), sinks=data.draw(S.sinks(hq)),
                         scale=data.draw(S.scales))
    dtype = data.draw(S.dtypes, label="dtype")
    gen = torch.Generator().manual_seed(data.draw(S.seeds, label="seed"))
    q, k, v = make_inputs(layout, dtype, gen)
    out, lse = run_api(q, k, v, layout, spec, "triton")
    assert_matches_oracle(out, lse, *oracle(q, k, v, layout, spec), dtype, f"{spec!r} {layout}")


@usable
def test_floor_semantics_match_torch_on_negative_operands():
    layout = varlen_layout((40,), (40,), 2, 1, 16)
    spec = AttentionSpec(2, 1, 16, mask=custom_mask(lambda b, h, q_pos, kv_pos: (kv_pos - q_pos) % 5 == (kv_pos - q_pos) // 7 % 5))
    gen = torch.Generator().manual_seed(5)
    q, k, v = make_inputs(layout, torch.float32, gen)
    out, lse = varlen_attention(q, k, v, [40], [40], spec, backend="triton", return_lse=True)
    assert_matches_oracle(out, lse, *oracle(q, k, v, layout, spec), torch.float32, "negative // and %")


# ---- compilation for Hopper, and the GPU script -------------------------------------------------------------------------

def _run_without_interpreter(args: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)


@pytest.mark.parametrize(("phase", "extra"), [("prefill", ["--mask", "causal"]),
                                              ("decode", ["--mask", "window", "--softcap"])])
def test_kernels_compile_for_hopper_without_spilling(phase, extra):
    """ptxas from Triton's wheel compiles the bf16 D=128 kernels for sm_90: tensor cores, no spills, smem fits."""
    proc = _run_without_interpreter(["-m", "tessera.backends.triton.aot", "--phase", phase, *extra])
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = json.loads(proc.stdout)
    assert info["tensor_core_op"] == "wgmma" or (phase == "decode" and info["tensor_core_op"] == "mma"), info
    assert info["spill_bytes"] in (0, -1), info
    assert info["shared_bytes"] <= 232_448, info


@pytest.mark.skipif(not interpreting() and not torch.cuda.is_available(), reason="needs the interpreter or a GPU")
def test_gpu_script_smoke(tmp_path):
    """`benchmarks/gpu.py --smoke` end to end: correctness section, timing tables and JSON, on tiny shapes."""
    out = tmp_path / "gpu-smoke.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "benchmarks/gpu.py", "--smoke", "--no-flex", "--json", str(out)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["correctness"] and all(r["ok"] for r in report["correctness"])
    assert report["prefill"] and report["decode"] and "tessera_tflops" in report["prefill"][0]
    assert report["engine"].get("throughput_tok_s", 0) > 0, report["engine"]
