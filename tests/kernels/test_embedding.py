"""embed (with Gemma's scale) and lm_head (float32 logits, softcap) on every backend against the float64 oracle,
Hugging Face's Gemma normalizer, and the range / argument errors."""

from __future__ import annotations

import pytest
import torch

from tessera.backends.cpu.ops import embedding as cpu_embedding
from tessera.backends.reference.ops.embedding import embed_f64, lm_head_f64
from tessera.kernels.embedding import embed, gemma_embed_scale, lm_head
from tests.kernels.conftest import kernel_backends
from tests.kernels.tolerances import assert_close_to_oracle

DTYPES = [pytest.param(d, id=str(d).removeprefix("torch.")) for d in (torch.float32, torch.bfloat16, torch.float16)]


def _table(gen: torch.Generator, vocab: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(vocab, width, generator=gen).to(dtype)


@pytest.mark.parametrize("backend", kernel_backends())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ids_shape", [(0,), (1,), (2, 7)], ids=str)
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32], ids=["int64", "int32"])
def test_embed_gathers_rows(backend, dtype, ids_shape, id_dtype, gen):
    table = _table(gen, 53, 1100, dtype)  # width > one triton block
    ids = torch.randint(0, 53, ids_shape, generator=gen, dtype=id_dtype)
    out = embed(ids, table, backend=backend)
    assert out.dtype == dtype and out.shape == (*ids_shape, 1100)
    assert torch.equal(out.double(), embed_f64(ids, table)), "an unscaled lookup is an exact copy"


@pytest.mark.parametrize("backend", kernel_backends())
@pytest.mark.parametrize("dtype", DTYPES)
def test_embed_scale(backend, dtype, gen):
    table, ids = _table(gen, 31, 70, dtype), torch.randint(0, 31, (3, 4), generator=gen)
    out = embed(ids, table, scale=1.7, backend=backend)
    assert_close_to_oracle(out, embed_f64(ids, table, 1.7), dtype, "scaled embed")


@pytest.mark.parametrize("backend", kernel_backends())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_gemma_scale_matches_hugging_face_exactly(backend, dtype, gen):
    """HF Gemma: ``embeds * torch.tensor(hidden ** 0.5, dtype=dtype)``; sqrt(2304) = 48 exactly, sqrt(3072) is not."""
    hidden = 3072
    assert gemma_embed_scale(2304, torch.bfloat16) == 48.0
    table, ids = _table(gen, 17, hidden, dtype), torch.randint(0, 17, (5,), generator=gen)
    expected = table[ids] * torch.tensor(hidden**0.5, dtype=dtype)
    assert torch.equal(embed(ids, table, scale=gemma_embed_scale(hidden, dtype), backend=backend), expected)


@pytest.mark.parametrize("backend", kernel_backends())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,vocab", [(1, 37), (5, 129), (0, 16)], ids=str)
@pytest.mark.parametrize("softcap", [None, 30.0], ids=["plain", "softcap"])
def test_lm_head_matches_oracle(backend, dtype, tokens, vocab, softcap, gen):
    table = _table(gen, vocab, 70, dtype)
    hidden = torch.randn(tokens, 70, generator=gen).to(dtype) * 3
    logits = lm_head(hidden, table, softcap=softcap, backend=backend)
    assert logits.dtype == torch.float32 and logits.shape == (tokens, vocab)
    # float32 accumulation whatever the storage: the fp32 tolerance (with the long-reduction slack) applies
    assert_close_to_oracle(logits, lm_head_f64(hidden, table, softcap), torch.float32, "lm_head", reduction=True)
    if softcap is not None and tokens:
        assert logits.abs().max() <= softcap


@pytest.mark.parametrize("backend", kernel_backends())
def test_lm_head_leading_dims_and_mixed_dtypes(backend, gen):
    table = _table(gen, 40, 24, torch.bfloat16)
    hidden = torch.randn(2, 3, 24, generator=gen)  # float32 hidden, bf16 table
    logits = lm_head(hidden, table, backend=backend)
    assert logits.shape == (2, 3, 40)
    assert_close_to_oracle(logits, lm_head_f64(hidden, table), torch.float32, "mixed lm_head", reduction=True)


def test_cpu_lm_head_widens_the_table_in_chunks(monkeypatch, gen):
    monkeypatch.setattr(cpu_embedding, "VOCAB_CHUNK_BYTES", 4 * 24 * 7)  # 7 rows per chunk: 6 chunks, a short last
    # 11 rows: more than the GEMV path takes (M <= 8), so the chunked widening path runs
    table, hidden = _table(gen, 40, 24, torch.bfloat16), torch.randn(11, 24, generator=gen).bfloat16()
    logits = lm_head(hidden, table, softcap=5.0, backend="cpu")
    assert_close_to_oracle(logits, lm_head_f64(hidden, table, 5.0), torch.float32, "chunked lm_head")


def test_parameter_table(gen):
    """Model weights arrive as nn.Parameter (requires_grad); the ops are inference ops and must accept them."""
    table = torch.nn.Parameter(_table(gen, 20, 8, torch.float32))
    ids = torch.tensor([3, 19])
    torch.testing.assert_close(embed(ids, table, scale=2.0), table.detach()[ids] * 2.0)
    assert lm_head(torch.randn(2, 8), table).shape == (2, 20)


# ---- errors ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", kernel_backends())
@pytest.mark.parametrize("bad", [53, 1000, -1])
def test_out_of_range_ids_raise_at_the_boundary(backend, bad):
    table = torch.randn(53, 8)
    ids = torch.tensor([[0, 5], [bad, 2]])
    with pytest.raises(IndexError, match=rf"token id {bad} at index \(1, 0\) is out of range .* \[0, 53\)"):
        embed(ids, table, backend=backend)


def test_errors_name_the_problem():
    table = torch.randn(10, 8)
    with pytest.raises(TypeError, match="ids must be an integer tensor"):
        embed(torch.tensor([1.0]), table)
    with pytest.raises(ValueError, match=r"table must be \[V, H\]"):
        embed(torch.tensor([1]), torch.randn(8))
    with pytest.raises(ValueError, match="scale must be a finite float"):
        embed(torch.tensor([1]), table, scale=float("inf"))
    with pytest.raises(ValueError, match=r"hidden must be \[\.\.\., H\] with H = 8"):
        lm_head(torch.randn(2, 7), table)
    with pytest.raises(ValueError, match="softcap must be a finite float > 0"):
        lm_head(torch.randn(2, 8), table, softcap=0.0)
    with pytest.raises(TypeError, match="hidden must be a float32"):
        lm_head(torch.ones(2, 8, dtype=torch.int64), table)


def _packed_tables(gen: torch.Generator, vocab: int, width: int):
    """The same random table packed in the 32-value formats (float32 scales from Tessera's quantizer, float16 from
    GGUF's Q8_0 / Q4_1 blocks) and a K-quant (width a multiple of 256)."""
    import gguf
    import numpy as np

    from tessera.kernels.ggml_quantize import quantize_rows
    from tessera.kernels.quant import from_gguf, quantize

    w = torch.randn(vocab, width, generator=gen)
    rows = w.numpy().astype(np.float32)
    gguf_block = lambda kind: from_gguf(gguf.quants.quantize(rows, getattr(gguf.GGMLQuantizationType, kind)),  # noqa: E731
                                        kind, (vocab, width))
    return {"int8": quantize(w, "int8", group_size=32), "int4": quantize(w, "int4", group_size=64),
            "int4_min": quantize(w, "int4_min", group_size=32), "q8_0": gguf_block("Q8_0"),
            "q4_1": gguf_block("Q4_1"), "q4_k": from_gguf(quantize_rows(rows, "q4_k"), "Q4_K", (vocab, width))}


@pytest.mark.parametrize("backend", kernel_backends())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ids_shape", [(0,), (1,), (3, 5)], ids=str)
def test_embed_packed_table_reads_the_dequantized_rows(backend, dtype, ids_shape, gen):
    """A packed table (a GGUF file's quantized token table): the rows de-quantized and rounded to ``dtype``, exactly
    what a float table loaded de-quantized in that dtype gives; scaled within the dtype's tolerance of float64."""
    from tessera.kernels.quant import dequantize

    for fmt, packed in _packed_tables(gen, 37, 512).items():
        dense = dequantize(packed, backend="reference").to(dtype)
        ids = torch.randint(0, 37, ids_shape, generator=gen)  # repeats included
        out = embed(ids, packed, dtype=dtype, backend=backend)
        assert out.dtype == dtype and out.shape == (*ids_shape, 512)
        assert torch.equal(out, embed(ids, dense, backend="reference")), fmt
        scaled = embed(ids, packed, scale=1.7, dtype=dtype, backend=backend)
        assert_close_to_oracle(scaled, embed_f64(ids, dense, 1.7), dtype, f"scaled packed embed {fmt}")


def test_embed_packed_errors(gen):
    packed = _packed_tables(gen, 11, 256)["int8"]
    with pytest.raises(IndexError):
        embed(torch.tensor([11]), packed)
    with pytest.raises(TypeError, match="dtype must be one of"):
        embed(torch.tensor([1]), packed, dtype=torch.int32)
    with pytest.raises(TypeError, match="differs from the float table"):
        embed(torch.tensor([1]), torch.zeros(3, 4), dtype=torch.float16)


def test_packed_lm_head_rows_do_not_depend_on_the_batch(gen):
    """Logits of a row are the same bits alone and among up to 128 rows (a verification step), on the cpu."""
    from tessera.kernels import quantize

    table = quantize(torch.randn(300, 64, generator=gen), "int8", 32)
    h = torch.randn(90, 64, generator=gen)
    many = lm_head(h, table, backend="cpu")
    for r in (0, 45, 89):
        assert torch.equal(lm_head(h[r:r + 1], table, backend="cpu")[0], many[r])


@pytest.mark.parametrize("backend", kernel_backends())
@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_lm_head_many_rows_gives_float32_logits(backend, dtype, gen, monkeypatch):
    """Above ROW_CHUNK_UP_TO rows (a perplexity window's every position) a packed table's logits are float32 to
    float32's tolerance, whatever the backend's many-row qmatmul rounds to (the cpu's bf16 qgemm variant rounds its
    outputs to bf16, 2^-9 relative, far outside it); small tiles exercise the vocabulary's tail tile."""
    from tessera.kernels import embedding as kernels_embedding
    from tessera.kernels.quant import dequantize

    monkeypatch.setattr(kernels_embedding, "FLOAT_TILE_BYTES", 4 * 512 * 16)  # tiles of 16 rows: 37 = 16 + 16 + 5
    rows = kernels_embedding.ROW_CHUNK_UP_TO + 72
    for fmt, packed in _packed_tables(gen, 37, 512).items():
        h = torch.randn(2, rows // 2, 512, generator=gen).to(dtype)
        logits = lm_head(h, packed, softcap=30.0, backend=backend)
        assert logits.dtype == torch.float32 and logits.shape == (2, rows // 2, 37)
        dense = dequantize(packed, backend="reference")
        assert_close_to_oracle(logits, lm_head_f64(h, dense, 30.0), torch.float32, f"packed lm_head {fmt}",
                               reduction=True)
