"""Every family the GGUF loader runs, from a file written the way llama.cpp's converter writes it.

Each case is a tiny random-weight transformers checkpoint: Tessera loads it, :func:`write_gguf` writes it as GGUF
(llama.cpp's names, Q/K interleave, Gemma's ``1 + w`` norms, RoPE rules as llama.cpp reads them) and
:func:`load_gguf` reads it back; the logits must match transformers' on the original checkpoint (fp32, relative
error <= 1e-4). Where transformers can load that GGUF file itself, its logits must match too: that is the
independent check that the file follows llama.cpp's conventions, not only our own reader's.
"""

from __future__ import annotations

import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from tessera.models import CheckpointError, load_model
from tessera.models.gguf import load_gguf
from tessera.models.gguf_reader import read_gguf
from tessera.models.gguf_write import write_gguf
from tests.models.helpers import FP32_REL_TOL, hf_logits, rel_err, save_tiny, token_batch

pytestmark = pytest.mark.filterwarnings("ignore:.*no tokenizer")
VOCAB = 96
BASE = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "bos_token_id": 0,
        "eos_token_id": 1}
MOE = {"moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2}


def _longrope(rotary: int) -> dict:
    g = torch.Generator().manual_seed(3)
    return {"rope_type": "longrope", "short_factor": (1 + torch.rand(rotary // 2, generator=g)).tolist(),
            "long_factor": (2 + torch.rand(rotary // 2, generator=g)).tolist()}


# head_dim = query_pre_attn_scalar = 256 in the Gemma 2/3 cases transformers reads back: its GGUF reader assumes that
# scale, as llama.cpp does for every size but 27B
#: id -> (config class, model class, config kwargs, whether transformers' GGUF loader can read the file as written)
CASES = {
    "llama3-rope-freqs": ("LlamaConfig", "LlamaForCausalLM", dict(
        head_dim=32, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}), False),
    "qwen2-yarn": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}), False),
    # head_dim 128: transformers' qwen3 GGUF reader ignores attention.key_length and assumes it
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=128), True),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=32, hidden_activation="gelu_pytorch_tanh"), False),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        head_dim=256, query_pre_attn_scalar=256, sliding_window=8), True),
    "gemma2-softcaps": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        head_dim=32, query_pre_attn_scalar=24, sliding_window=8, attn_logit_softcapping=30.0,
        final_logit_softcapping=20.0), False),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=256, query_pre_attn_scalar=256, sliding_window=8, num_hidden_layers=6), True),
    "gemma3-linear": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=32, query_pre_attn_scalar=32, sliding_window=8, num_hidden_layers=6,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 2e4}}), False),
    "phi3-longrope": ("Phi3Config", "Phi3ForCausalLM", dict(
        pad_token_id=None, original_max_position_embeddings=64, rope_scaling=_longrope(16)), False),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2), False),
    "qwen2moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(**MOE, shared_expert_intermediate_size=48,
                                                                 norm_topk_prob=False), False),
    # moe_intermediate_size 768: transformers' qwen3_moe GGUF reader ignores expert_feed_forward_length
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(**{**MOE, "moe_intermediate_size": 768}, head_dim=16,
                                                                 norm_topk_prob=True), True),
    "qwen3moe-dense-layer": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        **MOE, head_dim=16, norm_topk_prob=True, num_hidden_layers=3, mlp_only_layers=[1]), False),
}


def _build(case: str, tmp_path):
    config_cls, model_cls, kwargs, readable = CASES[case]
    config = getattr(transformers, config_cls)(**{**BASE, **kwargs})
    hf = save_tiny(getattr(transformers, model_cls), config, tmp_path / "hf")
    path = write_gguf(tmp_path / f"{case}.gguf", load_model(tmp_path / "hf").config,
                      load_model(tmp_path / "hf").weights, name=case)
    return hf, path, readable


@pytest.mark.parametrize("case", sorted(CASES))
def test_family_from_gguf_matches_transformers(case, tmp_path):
    hf, path, readable = _build(case, tmp_path)
    ids = token_batch(VOCAB, seq=24)
    ref = hf_logits(hf, ids)
    ours = load_gguf(path, torch.float32)
    assert rel_err(ours.logits(ids), ref) <= FP32_REL_TOL
    if readable:  # transformers' own GGUF reader un-does llama.cpp's conventions: it must get the same model
        transformers.logging.set_verbosity_error()
        theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name,
                                                                   dtype=torch.float32)
        assert rel_err(hf_logits(theirs, ids), ref) <= FP32_REL_TOL


def test_the_file_follows_llamacpp_conventions(tmp_path):
    """What llama.cpp reads: Gemma norms stored as 1 + w, the llama3 rule as rope_freqs, the Gemma 3 local base."""
    hf, path, _ = _build("gemma3-linear", tmp_path)
    reader = read_gguf(path)
    norm = torch.from_numpy(reader.tensor_index["blk.0.attn_norm.weight"].data.copy())
    assert torch.allclose(norm, hf.model.layers[0].input_layernorm.weight.detach() + 1)
    assert reader.metadata["gemma3.rope.freq_base_swa"] == 2e4
    assert reader.metadata["gemma3.rope.scaling.type"] == "linear"
    model = load_gguf(path)
    assert model.config.norm == "rms" and model.config.layer_windows == (8,) * 5 + (None,)
    _, path, _ = _build("llama3-rope-freqs", tmp_path)
    factors = read_gguf(path).tensor_index["rope_freqs.weight"].data
    assert factors.shape == (16,) and factors.min() == 1.0 and factors.max() == 8.0


def test_quantized_write_reads_back_packed(tmp_path):
    hf, _, _ = _build("qwen3", tmp_path)
    model = load_model(tmp_path / "hf")
    path = write_gguf(tmp_path / "q8.gguf", model.config, model.weights, qtype="Q8_0")
    packed = load_gguf(path)
    assert type(packed.weights["layers.0.qkv.weight"]).__name__ == "QuantizedWeight"
    ids = token_batch(VOCAB, seq=16)
    assert rel_err(packed.logits(ids), hf_logits(hf, ids)) <= 0.05  # Q8_0 rounding, not a conversion error


def test_per_layer_arrays(tmp_path):
    """Per-layer metadata arrays load when all layers agree; otherwise the error names the key."""
    from tessera.models.gguf_arch import hf_config

    meta = {"llama.embedding_length": 64, "llama.attention.head_count": 4, "llama.block_count": 2,
            "llama.feed_forward_length": [96, 96], "llama.attention.head_count_kv": [2, 2]}
    hf = hf_config(meta, {}, "llama", "llama")
    assert (hf["intermediate_size"], hf["num_key_value_heads"]) == (96, 2)
    with pytest.raises(CheckpointError, match=r"'llama.attention.head_count_kv' differs per layer"):
        hf_config({**meta, "llama.attention.head_count_kv": [2, 4]}, {}, "llama", "llama")


def test_unsupported_rope_scaling_names_the_key():
    from tessera.models.gguf_arch import rope_scaling

    with pytest.raises(CheckpointError, match=r"llama.rope.scaling.type 'su' is not supported"):
        rope_scaling({"llama.rope.scaling.type": "su"}, {}, "llama", 64)
    with pytest.raises(CheckpointError, match="yarn_log_multiplier"):
        rope_scaling({"qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 4.0,
                      "qwen2.rope.scaling.original_context_length": 64,
                      "qwen2.rope.scaling.yarn_log_multiplier": 0.1}, {}, "qwen2", 64)


def test_write_rejects_what_gguf_cannot_hold(tmp_path):
    save_tiny(transformers.GPT2LMHeadModel, transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=1,
                                                                    n_head=4), tmp_path / "gpt2")
    model = load_model(tmp_path / "gpt2")
    with pytest.raises(ValueError, match="family 'gpt2' has no GGUF architecture"):
        write_gguf(tmp_path / "x.gguf", model.config, model.weights)
    with pytest.raises(ValueError, match="qtype 'Q3_K' is not writable"):
        write_gguf(tmp_path / "x.gguf", model.config, model.weights, qtype="Q3_K")


@pytest.mark.parametrize("case", ["llama3-rope-freqs", "qwen2moe"])
def test_validate_against_the_source_checkpoint(case, tmp_path):
    """``tessera validate --reference``: a GGUF file whose keys transformers' GGUF reader ignores, checked layer by
    layer against transformers running the checkpoint it was written from."""
    from tessera.tools.validate import validate

    _, path, _ = _build(case, tmp_path)
    report = validate(path, reference=tmp_path / "hf")
    assert report["ok"] and report["reference"] == str(tmp_path / "hf"), report


def test_metadata_errors_name_the_key_once():
    """A metadata error raised while building the config reaches the caller as it was raised, not re-wrapped."""
    from tessera.models.gguf_arch import config_from_gguf

    meta = {"general.architecture": "llama", "llama.embedding_length": 64, "llama.attention.head_count": 4,
            "llama.block_count": 2, "llama.feed_forward_length": [96, 128]}
    with pytest.raises(CheckpointError) as err:
        config_from_gguf(meta, {}, "x.gguf")
    assert str(err.value).startswith("x.gguf: GGUF metadata key 'llama.feed_forward_length' differs per layer")
