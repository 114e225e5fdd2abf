"""The paged, cached step forward equals the whole-sequence forward: chunked prefill, decode, mixed batches."""

from __future__ import annotations

import pytest
import torch
import transformers

from tessera.models import load_model
from tessera.models.paged import StepBatch, forward_step, new_cache
from tests.models.helpers import save_tiny, step_batch

PAGE = 4
_ATTN = dict(vocab_size=211, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(_ATTN, intermediate_size=96, num_hidden_layers=2)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(_ATTN, intermediate_size=96, num_hidden_layers=2, head_dim=16,
                                                         sliding_window=6, query_pre_attn_scalar=16)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(vocab_size=211, n_embd=64, n_layer=2, n_head=4, n_positions=64)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(_ATTN, intermediate_size=48, num_hidden_layers=2,
                                                            num_local_experts=4, num_experts_per_tok=2)),
}


def _model(name, tmp_path):
    config_cls, model_cls, kwargs = MODELS[name]
    save_tiny(getattr(transformers, model_cls), getattr(transformers, config_cls)(**kwargs), tmp_path)
    return load_model(tmp_path)


def _step(seqs: dict[int, list[int]], new: dict[int, int], tables: dict[int, list[int]]) -> StepBatch:
    return step_batch(seqs, new, tables, PAGE)


@pytest.mark.parametrize("name", list(MODELS))
def test_chunked_prefill_then_decode_matches_full_forward(name, tmp_path):
    model = _model(name, tmp_path)
    gen = torch.Generator().manual_seed(3)
    prompts = {0: torch.randint(0, 211, (13,), generator=gen).tolist(), 1: torch.randint(0, 211, (5,), generator=gen).tolist()}
    tables = {0: [7, 2, 9, 4, 11, 1], 1: [3, 8, 0, 5]}  # shuffled pages, partial last pages
    cache = new_cache(model, num_pages=12, page_size=PAGE)
    # step 1: a 9-token chunk of prompt 0 and all of prompt 1
    got = forward_step(model, cache, _step({0: prompts[0][:9], 1: prompts[1]}, {0: 9, 1: 5}, tables))
    ref = torch.stack([model.logits(torch.tensor([prompts[0][:9]]))[0, -1], model.logits(torch.tensor([prompts[1]]))[0, -1]])
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    # step 2: the rest of prompt 0 and a decode token for sequence 1; then three decode steps for both
    seqs = {0: prompts[0], 1: prompts[1] + [int(got[1].argmax())]}
    new = {0: 4, 1: 1}
    for _ in range(4):
        got = forward_step(model, cache, _step(seqs, new, tables))
        for row, s in enumerate(seqs):
            ref = model.logits(torch.tensor([seqs[s]]))[0, -1]
            torch.testing.assert_close(got[row], ref, rtol=1e-4, atol=1e-4)
        for row, s in enumerate(seqs):
            seqs[s] = seqs[s] + [int(got[row].argmax())]
        new = {0: 1, 1: 1}


def test_all_logits_for_verification(tmp_path):
    model = _model("llama", tmp_path)
    tokens = torch.randint(0, 211, (11,), generator=torch.Generator().manual_seed(4)).tolist()
    cache = new_cache(model, num_pages=4, page_size=PAGE)
    table = {0: [2, 0, 3]}
    forward_step(model, cache, _step({0: tokens[:7]}, {0: 7}, table))
    got = forward_step(model, cache, _step({0: tokens}, {0: 4}, table), all_logits=True)  # 4 "draft" tokens at once
    ref = model.logits(torch.tensor([tokens]))[0, 7:]
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
