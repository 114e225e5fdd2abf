"""The tiny models and texts the eval tests share: a random-weight Llama with a byte-level tokenizer (``tiny_vocab``:
256 byte tokens, BOS/EOS control tokens, one merge) that runs a window in milliseconds, as a Hugging Face directory
and as a GGUF file with packed weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

BOS, EOS = 256, 257  # tiny_vocab's control tokens
CTX = 16  # tokens per window in the tests
MAX_POSITION = 64


def sample_text(chars: int, seed: int = 0) -> str:
    """Random letters and spaces: one token per character, except "ab" (tiny_vocab's only merge)."""
    rng = np.random.default_rng(seed)
    return "".join(rng.choice(list("abcdefgh "), size=chars))


def tiny_llama(directory: Path) -> tuple[Path, Any, Any]:
    """A tiny random Llama saved in ``directory`` with a tokenizer that adds no BOS; returns the directory, the model
    loaded by Tessera and the transformers model."""
    import transformers

    from tessera.models import load_model
    from tessera.models.gguf_tokenizer import build_tokenizer
    from tests.models.helpers import save_tiny
    from tests.models.test_gguf import tiny_vocab

    config = transformers.LlamaConfig(vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=MAX_POSITION, bos_token_id=BOS, eos_token_id=EOS)
    hf = save_tiny(transformers.LlamaForCausalLM, config, directory)
    (directory / "tokenizer.json").write_text(build_tokenizer(tiny_vocab(pre="smollm")).to_str())
    return directory, load_model(directory), hf


def tiny_gguf(directory: Path) -> Path:
    """A tiny random Llama GGUF file in ``directory``: the synthetic writer's ``TINY`` shape (hidden 64, 2 layers),
    Q4_0 projections and a tied Q8_0 token table, over ``tiny_vocab`` (no BOS added)."""
    import gguf

    from tessera.bench.synthetic_gguf import TINY, write_synthetic_gguf
    from tests.models.test_gguf import tiny_vocab

    vocab = tiny_vocab(pre="smollm")
    source = directory / "vocab.gguf"
    writer = gguf.GGUFWriter(source, "llama")
    writer.add_tokenizer_model(vocab["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(vocab["tokenizer.ggml.pre"])
    writer.add_token_list(vocab["tokenizer.ggml.tokens"])
    writer.add_token_types(vocab["tokenizer.ggml.token_type"])
    writer.add_token_merges(vocab["tokenizer.ggml.merges"])
    writer.add_bos_token_id(vocab["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(vocab["tokenizer.ggml.eos_token_id"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return write_synthetic_gguf(directory / "tiny-q4_0.gguf", TINY, "Q4_0", seed=5, vocab_from=source)
