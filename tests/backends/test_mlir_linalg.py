"""The linalg attention kernel (the form cuda, rocm and vulkan-spirv compile), run on llvm-cpu against the float64
oracle: no GPU is needed to check that the IR shipped to GPUs computes the spec.
"""

from __future__ import annotations

import pytest
import torch

from tessera.attention import (
    AttentionSpec,
    alibi,
    alibi_slopes,
    causal,
    custom_mask,
    custom_score,
    document,
    sliding_window,
    softcap,
)
from tessera.backends import registered
from tessera.backends.reference import sequence_attention
from tests.attention.tolerances import assert_matches_oracle

mlir = registered()["mlir"]
pytestmark = pytest.mark.skipif(bool(mlir.available()), reason="; ".join(mlir.available()) or "usable")

_DOCS = torch.tensor([[0, 0, 1, 1, 1, 2, 2, 2, 2, 3, 3], [0, 1, 1, 1, 1, 1, 2, 2, 3, 3, 3]])

#: (spec, batch, query tokens, keys): odd lengths, GQA/MQA/MHA, every mask and score kind the translation knows
CASES = {
    "causal_gqa_odd": (AttentionSpec(6, 2, 24, mask=causal()), 2, 5, 9),
    "window_softcap_scale": (AttentionSpec(4, 2, 20, mask=sliding_window(3), score=softcap(5.0), scale=0.4), 1, 7, 13),
    "sinks_mqa": (AttentionSpec(4, 1, 16, mask=causal(), sinks=torch.tensor([0.5, -1.0, 2.0, 0.0])), 1, 6, 6),
    "fully_masked_rows": (AttentionSpec(2, 2, 8, mask=~causal()), 1, 5, 5),
    "document_alibi_batch": (AttentionSpec(4, 2, 40, mask=document(_DOCS) & causal(), score=alibi(alibi_slopes(4))),
                             2, 11, 11),
    "custom_functions": (AttentionSpec(2, 1, 16, mask=custom_mask(lambda b, h, q, kv: (kv % 2 == 0) | (kv == q)),
                                       score=custom_score(lambda s, b, h, q, kv: s * 0.5 + h)), 1, 3, 10),
    "bidirectional_decode": (AttentionSpec(8, 8, 64), 3, 1, 17),
}


#: the online-softmax form, with tiles that do not divide the key count (a short last tile)
TILED = {"causal_gqa_odd": 4, "window_softcap_scale": 5, "sinks_mqa": 4, "fully_masked_rows": 2}


@pytest.mark.parametrize(("case", "kv_tile"), [(c, None) for c in sorted(CASES)] + sorted(TILED.items()))
def test_linalg_kernel_matches_the_oracle_on_cpu(case, kv_tile, tmp_path, monkeypatch):
    from tessera.backends.mlir.linalg_run import dense_attention
    from tessera.backends.mlir.targets import lower_attention_for

    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path))
    spec, batch, tq, s = CASES[case]
    g = torch.Generator().manual_seed(len(case))
    q = torch.randn(batch, tq, spec.num_q_heads, spec.head_dim, generator=g)
    k = torch.randn(batch, s, spec.num_kv_heads, spec.head_dim, generator=g)
    v = torch.randn(batch, s, spec.num_kv_heads, spec.head_dim, generator=g)
    out, lse = dense_attention(lower_attention_for(spec, "llvm-cpu", lowering="linalg", kv_tile=kv_tile), q, k, v)
    for b in range(batch):
        ref_out, ref_lse = sequence_attention(q[b], k[b], v[b], spec, b)
        assert_matches_oracle(out[b], lse[b], ref_out, ref_lse, torch.float32, f"linalg {case} kv_tile={kv_tile} b={b}")


def test_runtime_values_do_not_change_the_text():
    from tessera.mlir.attention_linalg import lower_attention_linalg

    a = lower_attention_linalg(AttentionSpec(8, 2, 64, mask=sliding_window(16), score=softcap(30.0)))
    b = lower_attention_linalg(AttentionSpec(4, 1, 64, mask=sliding_window(99), score=softcap(3.0), scale=0.2))
    assert a.text == b.text and "linalg.generic" in a.text and "scf.for" not in a.text
    assert a.aux_f.tolist() != b.aux_f.tolist()


def test_targets_pick_their_lowering():
    from tessera.backends.mlir.targets import TARGETS, lower_attention_for
    from tessera.mlir.attention_kernel import AttentionKernel
    from tessera.mlir.attention_linalg import LinalgAttentionKernel
    from tessera.mlir.iree_compile import TARGETS as FLAGS

    assert set(TARGETS) == set(FLAGS)
    spec = AttentionSpec(8, 2, 64, mask=causal())
    assert isinstance(lower_attention_for(spec, "llvm-cpu"), AttentionKernel)  # the backend's kernel is unchanged
    for name in ("cuda", "rocm", "vulkan-spirv"):
        assert isinstance(lower_attention_for(spec, name), LinalgAttentionKernel)
    tiled = lower_attention_for(spec, "cuda", kv_tile=64)
    assert tiled.kv_tile == 64 and "scf.for" in tiled.text and "tensor.extract_slice %k" in tiled.text
    with pytest.raises(ValueError, match="takes the options"):
        lower_attention_for(spec, "cuda", rows=2)
    with pytest.raises(ValueError, match="kv_tile"):
        lower_attention_for(spec, "cuda", kv_tile=0)
    with pytest.raises(ValueError, match="unknown IREE target"):
        lower_attention_for(spec, "tpu")


def test_untranslatable_specs_are_declined_the_same_way():
    from tessera.mlir.attention_linalg import lower_attention_linalg
    from tessera.mlir.trace import UntranslatableError

    with pytest.raises(UntranslatableError, match="branches"):
        lower_attention_linalg(AttentionSpec(2, 1, 16, mask=custom_mask(lambda b, h, q, kv: kv if q else kv)))
