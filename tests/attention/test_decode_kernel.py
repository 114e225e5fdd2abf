"""The cpu decode kernel's two code paths against the float64 oracle.

Head dims that are multiples of the SIMD width run the register-blocked micro-kernels (4 query rows x 4 keys, with
1-row and 1-key edges); other head dims run the scalar kernel. The conformance suite only uses multiples of 16, so
this file covers the edges: GQA groups and query counts whose row count per kv head is not a multiple of 4, key
counts that are not multiples of the 32-key chunk or of 4, head dims 8 .. 72 off the vector width, split-KV, and
(in a fresh interpreter) the 8-lane build that AVX2-only machines get.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tessera.attention import AttentionSpec, alibi, causal, sliding_window, softcap
from tessera.backends.cpu.simd import LANES
from tests.attention.cases import DTYPE_PARAMS, check_against_oracle, varlen_layout

# (q_lens, kv_lens, Hq, Hkv, D)
SHAPES = [
    pytest.param((1, 1, 1), (5, 37, 70), 12, 2, 128, id="group6-rows-4+2"),
    pytest.param((3, 1, 2), (3, 301, 67), 8, 2, 128, id="group4-q3-rows12"),
    pytest.param((2, 1), (90, 33), 10, 2, 64, id="group5-q2-rows10"),
    pytest.param((1, 1), (129, 4), 3, 3, 96, id="group1-1-row"),
    pytest.param((1, 2), (45, 46), 6, 2, 40, id="d40-scalar-path"),
    pytest.param((1,), (75,), 4, 1, 8, id="d8-scalar-path"),
    pytest.param((1, 1), (1100, 777), 8, 1, 72, id="d72-split-kv"),
    pytest.param((1, 8), (2500, 40), 16, 2, 128, id="split-kv-blocked"),
]


@pytest.mark.parametrize(("q_lens", "kv_lens", "hq", "hkv", "d"), SHAPES)
@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_decode_shapes(q_lens, kv_lens, hq, hkv, d, dtype: torch.dtype, gen: torch.Generator) -> None:
    layout = varlen_layout(q_lens, kv_lens, hq, hkv, d)
    check_against_oracle("cpu", layout, AttentionSpec(hq, hkv, d, mask=causal()), dtype, gen)


@pytest.mark.parametrize("variant", ["window", "softcap", "alibi"])
def test_decode_blocked_with_scores_and_partial_tiles(variant: str, gen: torch.Generator) -> None:
    hq, hkv, d = 8, 2, 2 * LANES
    spec = {
        "window": AttentionSpec(hq, hkv, d, mask=sliding_window(45)),  # partial tiles: the kernel's mask path
        "softcap": AttentionSpec(hq, hkv, d, mask=causal(), score=softcap(5.0)),
        "alibi": AttentionSpec(hq, hkv, d, mask=causal(), score=alibi(torch.rand(hq, generator=gen))),
    }[variant]
    check_against_oracle("cpu", varlen_layout((1, 3, 1), (300, 97, 33), hq, hkv, d), spec, torch.float32, gen)


_EIGHT_LANES = textwrap.dedent("""
    import torch
    from tessera.attention import AttentionSpec, causal, varlen_attention
    from tessera.backends.cpu.simd import LANES
    assert LANES == 8, LANES
    gen = torch.Generator().manual_seed(0)
    for dtype, d, tol in ((torch.float32, 64, 2e-4), (torch.bfloat16, 40, 3e-2)):
        q_lens, kv_lens = [1, 3, 1], [70, 45, 5]
        spec = AttentionSpec(8, 2, d, mask=causal())
        q = torch.randn(sum(q_lens), 8, d, generator=gen).to(dtype)
        k, v = (torch.randn(sum(kv_lens), 2, d, generator=gen).to(dtype) for _ in range(2))
        out = varlen_attention(q, k, v, q_lens, kv_lens, spec, backend="cpu").double()
        ref = varlen_attention(q.float(), k.float(), v.float(), q_lens, kv_lens, spec, backend="reference").double()
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        assert err < tol, (dtype, d, err)
    print("ok")
""")


def test_eight_lane_build_in_a_fresh_interpreter(tmp_path) -> None:
    """The 8-lane (AVX2) build of the same kernels, forced on this machine; its own Numba cache, so nothing
    compiled for the host's width is reused."""
    env = dict(os.environ, TESSERA_SIMD_LANES="8", NUMBA_CACHE_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", _EIGHT_LANES], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "ok" in done.stdout, done.stdout + done.stderr
