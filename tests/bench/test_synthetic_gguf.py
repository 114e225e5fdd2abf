"""The synthetic GGUF writer: a tiny random Llama that Tessera loads packed and runs to finite logits.

Most tests take the vocabulary from a 258-token byte-level GGUF written here, because parsing SmolLM2's 49k tokens
with gguf-py (what ``load_model`` does) takes seconds; one test checks the SmolLM2 vocabulary through the header
reader alone.
"""

from __future__ import annotations

import gguf
import pytest
import torch

from tessera.bench.synthetic_gguf import (TINY, LlamaShape, read_gguf_header, synthetic_gguf, tensor_bytes,
                                         write_synthetic_gguf)
from tessera.models import default_model_path, load_model
from tessera.models.gguf_tokenizer import byte_alphabet


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    """A byte-level BPE vocabulary: the 256 byte tokens, one merge ("a b" -> "ab") and an end-of-text token."""
    path = tmp_path_factory.mktemp("vocab") / "vocab.gguf"
    alphabet = byte_alphabet()
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([alphabet[b] for b in range(256)] + ["ab", "<|endoftext|>"])
    writer.add_token_types([1] * 257 + [3])
    writer.add_token_merges(["a b"])
    writer.add_eos_token_id(257)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory, small_vocab):
    return synthetic_gguf(TINY, "Q4_0", seed=3, cache_dir=tmp_path_factory.mktemp("synthetic"),
                          vocab_from=small_vocab)


@pytest.mark.parametrize("weight_type", ["Q4_0", "Q8_0"])
def test_tiny_model_loads_packed_and_gives_finite_logits(tmp_path, small_vocab, weight_type):
    path = write_synthetic_gguf(tmp_path / "m.gguf", TINY, weight_type, seed=1, vocab_from=small_vocab)
    # The reference backend: what is tested is the file, and its kernels need no compilation (the cpu backend's
    # Numba kernels run the same files in benchmarks/e2e_cpu.py).
    model = load_model(path, keep_quantized=True, backend="reference")
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (64, 2, 4, 2)
    assert cfg.intermediate_size == 128 and cfg.vocab_size == 258 and cfg.tie_embeddings
    qkv = model.weights["layers.0.qkv.weight"]
    assert type(qkv).__name__ == "QuantizedWeight" and tuple(qkv.shape) == (64 + 2 * 32, 64)
    logits = model.logits(torch.tensor([[1, 2, 3, 200]]))
    assert logits.shape == (1, 4, 258) and torch.isfinite(logits).all() and logits.std() > 0
    assert model.tokenizer.encode("ab").ids == [256]


def test_same_arguments_same_bytes_and_a_cache_hit(tmp_path, small_vocab, tiny_path):
    again = write_synthetic_gguf(tmp_path / "again.gguf", TINY, "Q4_0", seed=3, vocab_from=small_vocab)
    assert again.read_bytes() == tiny_path.read_bytes()
    mtime = tiny_path.stat().st_mtime_ns
    assert synthetic_gguf(TINY, "Q4_0", seed=3, cache_dir=tiny_path.parent, vocab_from=small_vocab) == tiny_path
    assert tiny_path.stat().st_mtime_ns == mtime  # not rewritten
    other = synthetic_gguf(TINY, "Q4_0", seed=4, cache_dir=tiny_path.parent, vocab_from=small_vocab)
    assert other != tiny_path and other.read_bytes() != tiny_path.read_bytes()


def test_smollm2_vocabulary_and_layout(tmp_path):
    path = synthetic_gguf(TINY, "Q4_0", seed=0, cache_dir=tmp_path)  # the default vocabulary source
    keys = ["tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.merges",
            "tokenizer.ggml.token_type", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
            "llama.block_count", "llama.rope.freq_base", "general.file_type"]
    fields, tensors = read_gguf_header(path, keys)
    assert fields["llama.block_count"] == 2 and fields["general.file_type"] == 2
    assert fields["llama.rope.freq_base"] == 10000.0 and len(fields["tokenizer.ggml.tokens"]) == 49152
    # The vocabulary is SmolLM2's, verbatim (so Tessera and llama.cpp tokenize as they do for SmolLM2 itself).
    source, _ = read_gguf_header(default_model_path(), keys[:7])
    assert {k: fields[k] for k in keys[:7]} == source
    types = {name: gguf.GGMLQuantizationType(t).name for name, t, _ in tensors}
    assert types["token_embd.weight"] == "Q8_0" and types["blk.0.ffn_up.weight"] == "Q4_0"
    assert types["blk.1.attn_norm.weight"] == "F32" and "output.weight" not in types  # tied, as in SmolLM2
    # Q4_0: 18 bytes per 32 weights; Q8_0: 34; F32 norms: 4 per weight
    h, kv, i, vocab = 64, 2 * 16, 128, 49152
    per_layer = (2 * h * h + 2 * kv * h + 3 * h * i) // 32 * 18 + 2 * h * 4
    assert tensor_bytes(path) == vocab * h // 32 * 34 + 2 * per_layer + h * 4


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match="weight_type"):
        write_synthetic_gguf(tmp_path / "x.gguf", TINY, "Q4_K")
    with pytest.raises(ValueError, match="multiples of 32"):
        LlamaShape(hidden=48, layers=1, heads=4, kv_heads=2, intermediate=128)
    with pytest.raises(ValueError, match="divide"):
        LlamaShape(hidden=64, layers=1, heads=3, kv_heads=1, intermediate=128)
    with pytest.raises(FileNotFoundError, match="vocabulary source"):
        synthetic_gguf(TINY, cache_dir=tmp_path, vocab_from=tmp_path / "missing.gguf")
    (tmp_path / "bad.gguf").write_bytes(b"GGML" + bytes(20))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf_header(tmp_path / "bad.gguf", [])
    (tmp_path / "bad.gguf").unlink()
    assert not list(tmp_path.iterdir())  # nothing half-written left behind
