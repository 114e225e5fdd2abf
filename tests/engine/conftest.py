"""A tiny random Llama checkpoint shared by the engine tests (made once per worker)."""

from __future__ import annotations

import pytest
import torch
import transformers

from tessera.engine import LLM
from tessera.models import load_model
from tests.models.helpers import save_tiny

VOCAB = 211
EOS = 2  # LlamaConfig's default eos_token_id: the engine and Model.greedy both stop on it


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    save_tiny(transformers.LlamaForCausalLM, config, path)
    return load_model(path)


@pytest.fixture
def make_llm(tiny_model):
    """``make_llm(**kwargs)``: an LLM over the shared tiny model (small pages so prompts span several)."""
    def make(**kwargs):
        kwargs = {"page_size": 4, "num_pages": 256, "max_num_batched_tokens": 64, **kwargs}
        return LLM(tiny_model, **kwargs)

    return make


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # ids from 3 up: never the EOS (2) in a prompt, so prompts are ordinary text
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]
