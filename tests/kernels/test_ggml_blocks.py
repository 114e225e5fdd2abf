"""ggml's block formats kept whole (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K): Tessera's definition and every backend's
dequantize and qmatmul against gguf-py's de-quantizer (the independent oracle) on random blocks, odd row counts and
x row counts on both sides of the GEMV / BLAS-tile switch; loading them packed from a GGUF file; and bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tessera.kernels import ggml_blocks as G
from tessera.kernels import quant as Q
from tessera.tuning.random_weights import GGML_HALF_FIELDS
from tests.kernels.conftest import kernel_backends
from tests.kernels.tolerances import assert_close_to_oracle

gguf = pytest.importorskip("gguf")



def random_rows(fmt: str, n: int, k: int, seed: int) -> np.ndarray:
    """uint8 ``[n, row_bytes]`` of random blocks with finite scales of both signs and mixed magnitudes."""
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, 256, size=(n, G.row_bytes(fmt, k)), dtype=np.uint8)
    blocks = rows.reshape(-1, G.BLOCKS[fmt][2])
    for at in GGML_HALF_FIELDS[fmt]:  # finite scales (random bytes would make NaN / inf)
        scale = rng.uniform(-1, 1, size=(blocks.shape[0], 1)) * 10.0 ** rng.integers(-3, 1, size=(blocks.shape[0], 1))
        blocks[:, at:at + 2] = scale.astype(np.float16).view(np.uint8)
    return rows


def oracle(rows: np.ndarray, fmt: str) -> torch.Tensor:
    """gguf-py's de-quantization, float64 ``[n, k]``."""
    tid = G.BLOCKS[fmt][0]
    return torch.from_numpy(gguf.quants.dequantize(rows, gguf.GGMLQuantizationType(tid)).astype(np.float64))


@pytest.mark.parametrize("fmt", sorted(G.BLOCKS))
def test_definition_matches_gguf_py(fmt: str) -> None:
    rows = random_rows(fmt, 5, 3 * G.BLOCKS[fmt][1], seed=1)
    want = oracle(rows, fmt)
    got = G.dequantize_rows(torch.from_numpy(rows), fmt, want.shape[1])
    # gguf-py computes in float32: its values are ours rounded once or twice
    torch.testing.assert_close(got, want, rtol=2e-7, atol=1e-12)


@pytest.mark.parametrize("backend", kernel_backends())
@pytest.mark.parametrize("fmt", sorted(G.BLOCKS))
@pytest.mark.parametrize("m", [0, 1, 3, 17, 40])  # 17 and 40: past the GEMV's 16 rows, the BLAS tiles
def test_qmatmul_and_dequantize_match_gguf_py(backend: str, fmt: str, m: int) -> None:
    n, k = 7, 3 * G.BLOCKS[fmt][1]  # an odd row count, three blocks per row
    rows = random_rows(fmt, n, k, seed=2 + m)
    qw = Q.from_gguf(rows, G.BLOCKS[fmt][0], (n, k))
    assert qw.fmt == fmt and qw.scales is None and qw.nbytes == rows.nbytes
    w = oracle(rows, fmt)
    assert_close_to_oracle(Q.dequantize(qw, backend=backend), w, torch.float32, f"{backend} dequantize {fmt}")
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    out = Q.qmatmul(x, qw, backend=backend)
    assert out.shape == (m, n) and out.dtype == torch.float32
    x_seen, dtype = _as_the_cpu_kernels_see_it(backend, x, qw)
    assert_close_to_oracle(out, x_seen.double() @ w.T, dtype, f"{backend} qmatmul {fmt} m={m}", reduction=True)


def _as_the_cpu_kernels_see_it(backend: str, x: torch.Tensor, qw: Q.QuantizedWeight) -> tuple[torch.Tensor, torch.dtype]:
    """The x the cpu backend's chosen variants multiply (int8-quantized per block of 32 by the ``qgemv`` GEMV of up
    to 16 rows when an int8-activation variant runs), and the tolerance of their arithmetic (bf16 for the ``qgemm``
    tiles above 16 rows when a bf16 variant runs); x itself and float32 elsewhere."""
    if backend != "cpu":
        return x, torch.float32
    from tessera.backends.cpu import variants
    from tessera.backends.cpu.ops import _qdot
    from tessera.backends.cpu.ops.quant import GGML_GEMV_MAX_M

    if x.shape[0] <= GGML_GEMV_MAX_M:
        return (_qdot.quantized_activation(x) if _qdot.chosen_token(qw) is not None else x), torch.float32
    return x, (torch.float32 if variants.choose("qgemm").name == "fp32" else torch.bfloat16)


def test_from_gguf_keeps_the_rows_without_copying() -> None:
    rows = random_rows("q4_k", 3, 512, seed=3)
    qw = Q.from_gguf(rows, "Q4_K", (3, 512))
    assert qw.data.data_ptr() == rows.ctypes.data  # a view: a mapped file's pages are not duplicated
    assert Q.from_gguf(rows.tobytes(), "q4_k", (3, 512)).data.shape == (3, 288)  # bytes are copied, and work


def test_bad_input_is_named() -> None:
    rows = random_rows("q6_k", 2, 256, seed=4)
    with pytest.raises(ValueError, match=r"Q6_K \(2, 512\): expected 840 bytes"):
        Q.from_gguf(rows, "Q6_K", (2, 512))
    with pytest.raises(ValueError, match="multiple of its block of 256"):
        Q.from_gguf(rows, "Q6_K", (2, 128))
    with pytest.raises(ValueError, match="scales, zeros and mins live inside its blocks"):
        Q.QuantizedWeight("q6_k", (2, 256), 256, torch.from_numpy(rows), torch.ones(2, 1))
    with pytest.raises(ValueError, match="quantize makes"):
        Q.quantize(torch.randn(4, 256), "q4_k")


def test_a_gguf_file_keeps_its_block_format_projections_packed(tmp_path, monkeypatch) -> None:
    """A tiny Llama whose projections are Q4_K (q, k, o, gate, up), Q6_K (v of layer 1: its q|k|v mixes types, as a
    Q4_K_M file's do, and stays packed as a StackedWeight of a Q4_K q|k and a Q6_K v) and Q5_1 / Q5_0 (down, whose
    K = 64 is below a K-quant block) loads with every projection and the Q8_0 token table packed, each equal to its
    de-quantized twin, and the same logits."""
    from tessera.kernels.quant import QuantizedWeight, StackedWeight
    from tessera.models.gguf import load_gguf
    from tests.models.test_gguf import TINY, write_tiny

    monkeypatch.setenv("TESSERA_CPU_VARIANTS", "qgemv=portable")  # the Q8_0 lm_head with float activations

    h, f, d = TINY["hidden"], TINY["ffn"], TINY["head_dim"]
    shapes = {"attn_q": (TINY["heads"] * d, h), "attn_k": (TINY["kv_heads"] * d, h), "attn_v": (TINY["kv_heads"] * d, h),
              "attn_output": (h, TINY["heads"] * d), "ffn_gate": (f, h), "ffn_up": (f, h), "ffn_down": (h, f)}
    raw = {}
    for layer in range(TINY["layers"]):
        for i, (name, (n, k)) in enumerate(shapes.items()):
            fmt = "q4_k"
            if name == "ffn_down":
                fmt = "q5_1" if layer else "q5_0"
            elif name == "attn_v" and layer == 1:
                fmt = "q6_k"
            rows = random_rows(fmt, n, k, seed=10 * layer + i)
            tid = gguf.GGMLQuantizationType(G.BLOCKS[fmt][0])
            raw[f"blk.{layer}.{name}.weight"] = (rows, tid)
    embed = np.random.default_rng(7).standard_normal((TINY["vocab"], h)).astype(np.float32)
    raw["token_embd.weight"] = (gguf.quants.quantize(embed, gguf.GGMLQuantizationType.Q8_0),
                                gguf.GGMLQuantizationType.Q8_0)
    path = write_tiny(tmp_path / "k.gguf", raw=raw)
    with pytest.warns(UserWarning, match="no tokenizer"):
        dense, packed = load_gguf(path, keep_quantized=False), load_gguf(path)
    kinds = {name: w.fmt if isinstance(w, QuantizedWeight) else tuple(p.fmt for p in w.parts)
             for name, w in packed.weights.items() if isinstance(w, (QuantizedWeight, StackedWeight))}
    assert kinds == {"embed": "int8",
                     "layers.0.qkv.weight": "q4_k", "layers.0.o.weight": "q4_k", "layers.0.gate_up.weight": "q4_k",
                     "layers.0.down.weight": "q5_0", "layers.1.qkv.weight": ("q4_k", "q6_k"),
                     "layers.1.o.weight": "q4_k", "layers.1.gate_up.weight": "q4_k", "layers.1.down.weight": "q5_1"}, kinds
    assert packed.weights["layers.1.qkv.weight"].shape == dense.weights["layers.1.qkv.weight"].shape
    for name, w in packed.weights.items():
        got = Q.dequantize(w) if isinstance(w, (QuantizedWeight, StackedWeight)) else w
        torch.testing.assert_close(got, dense.weights[name], rtol=1e-6, atol=1e-6 * float(got.abs().max()),
                                   msg=name)
    ids = torch.randint(0, TINY["vocab"], (1, 9), generator=torch.Generator().manual_seed(1))
    assert_close_to_oracle(packed.logits(ids), dense.logits(ids).double(), torch.float32, "logits", reduction=True)
