"""Tessera's K-quant quantizers: the bytes they write de-quantize to the same values under gguf-py (the independent
reader) and under :mod:`tessera.kernels.ggml_blocks`, and approximate the input as a 4/5/6-bit format should."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from tessera.kernels.ggml_blocks import dequantize_rows
from tessera.kernels.ggml_quantize import QUANTIZABLE, quantize_rows

#: the relative RMS error each format must stay under on these rows (worst over 200 seeds: 0.130 / 0.060 / 0.038;
#: plain Gaussian rows: 0.073 / 0.037 / 0.019, where gguf-py's Q4_0 gives 0.086 and Q5_0 0.043)
MAX_REL_RMS = {"q4_k": 0.15, "q5_k": 0.075, "q6_k": 0.045}


def _rows(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    x = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0.01, 3.0, (n, 1)).astype(np.float32)
    if n > 2:
        x[0, :256] = 0.0  # an all-zero block: zero scales must not divide by zero
        x[1] = np.abs(x[1])  # no negative values: the offset is 0
        x[2, 5] = 40.0  # one outlier stretches its sub-block
    return x


@pytest.mark.parametrize("fmt", QUANTIZABLE)
@pytest.mark.parametrize("n,k", [(1, 256), (3, 512), (7, 768)])
def test_gguf_reads_back_our_blocks(fmt, n, k):
    x = _rows(np.random.default_rng(zlib.crc32(f"{fmt}{n}{k}".encode())), n, k)
    blocks = quantize_rows(x, fmt)
    ours = dequantize_rows(torch.from_numpy(blocks), fmt, k, torch.float32).numpy()
    theirs = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[fmt.upper()]).reshape(n, k)
    np.testing.assert_array_equal(ours, theirs)
    rel = np.sqrt(((ours - x) ** 2).mean() / (x ** 2).mean())
    assert rel <= MAX_REL_RMS[fmt], rel
    if n > 2:
        assert (ours[0, :256] == 0).all()


def test_quantize_rejects_bad_input():
    with pytest.raises(ValueError, match="whole 256-value blocks"):
        quantize_rows(np.zeros((2, 100), np.float32), "q4_k")
    with pytest.raises(ValueError, match="NaN or infinite"):
        quantize_rows(np.full((1, 256), np.nan, np.float32), "q6_k")
    with pytest.raises(ValueError, match="format 'q3_k' has no quantizer"):
        quantize_rows(np.zeros((1, 256), np.float32), "q3_k")
