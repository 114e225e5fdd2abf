"""GGUF loader: SmolLM2-135M-Instruct against transformers' own GGUF loading (tokenizer ids, greedy text, logits),
tiny written GGUF files for the other architectures, keep_quantized, and the loader's errors.

transformers loads the real file once per module (fixtures), dequantized to float32. Its ``from_pretrained`` needs
``accelerate`` for GGUF files; without it those tests skip.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from tessera.kernels.quant import QuantizedWeight, dequantize
from tessera.models import CheckpointError, default_model_path, load_model
from tessera.models.gguf import load_gguf, unpermute_rows
from tessera.models.gguf_tokenizer import UnsupportedTokenizer, build_tokenizer, byte_alphabet
from tests.models.helpers import FP32_REL_TOL, rel_err

Q = gguf.GGMLQuantizationType
NEW_TOKENS = 32
PROMPTS = ("The capital of France is",
           "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
           "def fibonacci(n):")
TEXTS = ("Hello world", "12345 apples cost 3.14 each", "<|im_start|>user\nHi<|im_end|>\n<|endoftext|>",
         "héllo 世界 🙂 naïve café", "  two  spaces\n\n\ttab", "I'm sure they'LL say don't",
         "<repo_name>x<file_sep>y")


# ---------------------------------------------------------------------------------------------- SmolLM2 fixtures
@pytest.fixture(scope="module")
def smollm_path() -> Path:
    try:
        return default_model_path()
    except FileNotFoundError as err:
        pytest.skip(str(err))


@pytest.fixture(scope="module")
def transformers_gguf():
    """transformers, when it can load GGUF files (it needs accelerate for that)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers loads GGUF files only with accelerate installed")
    transformers.logging.set_verbosity_error()
    return transformers


@pytest.fixture(scope="module")
def ours(smollm_path):
    start = time.perf_counter()
    model = load_gguf(smollm_path, torch.float32, keep_quantized=False)  # the weights transformers computes with
    print(f"\nload_gguf({smollm_path.name}): {time.perf_counter() - start:.2f} s")
    return model


@pytest.fixture(scope="module")
def hf_tokenizer(smollm_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(smollm_path.parent, gguf_file=smollm_path.name)


@pytest.fixture(scope="module")
def hf_model(smollm_path, transformers_gguf):
    return transformers_gguf.AutoModelForCausalLM.from_pretrained(smollm_path.parent, gguf_file=smollm_path.name,
                                                             dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_greedy(hf_model, hf_tokenizer) -> dict[str, list[int]]:
    """transformers' greedy continuation (KV cache, stops at EOS) of every prompt."""
    out = {}
    for prompt in PROMPTS:
        ids = torch.tensor([hf_tokenizer.encode(prompt)])
        with torch.no_grad():
            gen = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                    do_sample=False, pad_token_id=hf_tokenizer.pad_token_id)
        out[prompt] = gen[0, ids.shape[1]:].tolist()
    return out


# ---------------------------------------------------------------------------------------------- SmolLM2 tests
def test_config(ours):
    c = ours.config
    assert (c.family, c.num_layers, c.hidden_size, c.intermediate_size) == ("llama", 30, 576, 1536)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size, c.max_position) == (9, 3, 64, 49152, 8192)
    assert c.tie_embeddings and "lm_head" not in ours.weights
    assert c.rope_configs["default"]["rope_theta"] == 100000.0 and c.norm_eps == pytest.approx(1e-5)
    assert (c.bos_token_id, c.eos_token_ids) == (1, (2,))


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_transformers(ours, hf_tokenizer, text):
    ids = ours.tokenizer.encode(text).ids
    assert ids == hf_tokenizer.encode(text)
    assert ours.tokenizer.decode(ids, skip_special_tokens=False) == text


def test_chat_template(ours, hf_tokenizer):
    assert ours.chat_template == hf_tokenizer.chat_template
    assert "<|im_start|>" in ours.chat_template


def test_greedy_matches_transformers(ours, hf_tokenizer, hf_greedy):
    for prompt in PROMPTS:
        ids = ours.tokenizer.encode(prompt).ids
        assert ids == hf_tokenizer.encode(prompt)
        assert ours.greedy(ids, NEW_TOKENS) == hf_greedy[prompt], prompt


def test_logits_match_transformers(ours, hf_model):
    ids = torch.tensor([ours.tokenizer.encode(PROMPTS[1]).ids])
    with torch.no_grad():
        ref = hf_model(ids).logits.float()
    err = rel_err(ours.logits(ids), ref)
    print(f"\nSmolLM2 float32 logits vs transformers: max relative error {err:.3g}")
    assert err <= FP32_REL_TOL


def test_keep_quantized_is_exact(ours, smollm_path, monkeypatch):
    """Packed weights hold the file's values exactly; with float activations (the portable qgemv variant) the logits
    match the de-quantized model's to fp32 rounding."""
    monkeypatch.setenv("TESSERA_CPU_VARIANTS", "qgemv=portable")
    packed = load_gguf(smollm_path, torch.float32, keep_quantized=True)
    qkv = packed.weights["layers.0.qkv.weight"]
    assert isinstance(qkv, QuantizedWeight) and qkv.fmt == "int4_min" and qkv.shape == (960, 576)
    embed = packed.weights["embed"]  # the Q8_0 token table stays packed; tied, it is the lm_head too
    assert isinstance(embed, QuantizedWeight) and embed.fmt == "int8" and "lm_head" not in packed.weights
    assert torch.equal(dequantize(embed), ours.weights["embed"])
    for name in ("layers.0.qkv.weight", "layers.29.gate_up.weight", "layers.7.down.weight"):  # rows un-permuted too
        assert torch.equal(dequantize(packed.weights[name]), ours.weights[name]), name
    ids = torch.tensor([ours.tokenizer.encode(PROMPTS[0]).ids])
    assert rel_err(packed.logits(ids), ours.logits(ids)) <= FP32_REL_TOL


def test_default_load_runs_packed_close_to_dequantized(ours, smollm_path):
    """``load_gguf`` keeps the projections packed by default and runs them with the best qgemv variant here (int8
    activations where the CPU has integer dot products, as llama.cpp does): the next-token distribution stays close
    to the de-quantized model's. Measured on SmolLM2 (AVX2, 19 tokens): KL 0.0024 nats, argmax agreement 100%."""
    default = load_gguf(smollm_path, torch.float32)
    assert isinstance(default.weights["layers.3.down.weight"], QuantizedWeight)
    ids = torch.tensor([ours.tokenizer.encode(PROMPTS[0] + " Paris. The capital of Italy is Rome, and of Spain").ids])
    p = torch.log_softmax(ours.logits(ids).double(), -1)
    q = torch.log_softmax(default.logits(ids).double(), -1)
    kl = float((p.exp() * (p - q)).sum(-1).mean())
    agree = float((p.argmax(-1) == q.argmax(-1)).double().mean())
    print(f"\nSmolLM2 packed (default variant) vs de-quantized: KL {kl:.3g} nats, argmax agreement {agree:.0%}")
    assert kl <= 0.02 and agree >= 0.85


# ---------------------------------------------------------------------------------------------- tiny GGUF files
# head_dim = hidden / heads = 128: transformers' qwen3 GGUF reader ignores attention.key_length and assumes 128
TINY = {"vocab": 64, "hidden": 256, "ffn": 64, "layers": 2, "heads": 2, "kv_heads": 1, "head_dim": 128}


def llamacpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Q/K rows: each head's two rotary halves interleaved row by row."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_tensors(dims: dict, qkv_bias: bool, qk_norm: bool) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) of every tensor; kind: "norm" (around 1), "q" / "k" (llama.cpp permutes them), "" ."""
    v, h, f, hq, hkv, d = (dims[k] for k in ("vocab", "hidden", "ffn", "heads", "kv_heads", "head_dim"))
    out = [("token_embd.weight", (v, h), ""), ("output_norm.weight", (h,), "norm")]
    for i in range(dims["layers"]):
        b = f"blk.{i}"
        out += [(f"{b}.attn_norm.weight", (h,), "norm"), (f"{b}.attn_q.weight", (hq * d, h), "q"),
                (f"{b}.attn_k.weight", (hkv * d, h), "k"), (f"{b}.attn_v.weight", (hkv * d, h), "")]
        if qkv_bias:
            out += [(f"{b}.attn_q.bias", (hq * d,), ""), (f"{b}.attn_k.bias", (hkv * d,), ""),
                    (f"{b}.attn_v.bias", (hkv * d,), "")]
        if qk_norm:
            out += [(f"{b}.attn_q_norm.weight", (d,), "norm"), (f"{b}.attn_k_norm.weight", (d,), "norm")]
        out += [(f"{b}.attn_output.weight", (h, hq * d), ""), (f"{b}.ffn_norm.weight", (h,), "norm"),
                (f"{b}.ffn_gate.weight", (f, h), ""), (f"{b}.ffn_up.weight", (f, h), ""),
                (f"{b}.ffn_down.weight", (h, f), "")]
    return out


def write_tiny(path: Path, arch: str = "llama", *, qkv_bias: bool = False, qk_norm: bool = False,
               qtype: Q | None = None, drop: tuple[str, ...] = (), raw: dict | None = None,
               extra: dict[str, int] | None = None) -> Path:
    """A random tiny GGUF (seeded); ``qtype`` quantizes the 2-D projections, ``raw`` = name -> (stored array, type),
    ``extra`` = more uint32 metadata."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(TINY["layers"])
    w.add_context_length(128)
    w.add_embedding_length(TINY["hidden"])
    w.add_feed_forward_length(TINY["ffn"])
    w.add_head_count(TINY["heads"])
    w.add_head_count_kv(TINY["kv_heads"])
    w.add_key_length(TINY["head_dim"])
    w.add_value_length(TINY["head_dim"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(TINY["vocab"])
    for key, value in (extra or {}).items():
        w.add_uint32(key, value)
    for name, shape, kind in tiny_tensors(TINY, qkv_bias, qk_norm):
        if name in drop:
            continue
        if raw and name in raw:
            w.add_tensor(name, raw[name][0], raw_dtype=raw[name][1])
            continue
        x = (rng.standard_normal(shape) * 0.2 + (1.0 if kind == "norm" else 0.0)).astype(np.float32)
        if arch == "llama" and kind in ("q", "k"):
            x = llamacpp_permute(x, TINY["heads"] if kind == "q" else TINY["kv_heads"])
        if qtype is not None and x.ndim == 2 and name != "token_embd.weight":
            w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unpermute_rows_inverts_llamacpp():
    for heads, d in ((3, 8), (1, 64), (9, 64)):
        rows = np.arange(heads * d)
        assert (llamacpp_permute(rows, heads)[unpermute_rows(heads, d).numpy()] == rows).all()


@pytest.mark.parametrize("arch,options", [("llama", {}), ("qwen2", {"qkv_bias": True}), ("qwen3", {"qk_norm": True}),
                                          ("llama", {"qtype": Q.Q8_0})], ids=["llama", "qwen2", "qwen3", "llama-q8"])
def test_tiny_architectures_match_transformers(tmp_path, transformers_gguf, arch, options):
    path = write_tiny(tmp_path / f"{arch}.gguf", arch, **options)
    with pytest.warns(UserWarning, match="no tokenizer"):
        ours = load_gguf(path, keep_quantized=False)
    auto = transformers_gguf.AutoModelForCausalLM
    ref_model = auto.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    ids = torch.randint(0, TINY["vocab"], (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = ref_model(ids).logits.float()
    assert rel_err(ours.logits(ids), ref) <= FP32_REL_TOL


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda q: q.name)
def test_tiny_keep_quantized_matches_dequantized(tmp_path, qtype, monkeypatch):
    monkeypatch.setenv("TESSERA_CPU_VARIANTS", "qgemv=portable")  # float activations: exact up to fp32 rounding
    path = write_tiny(tmp_path / "q.gguf", qtype=qtype)
    with pytest.warns(UserWarning):
        dense, packed = load_gguf(path, keep_quantized=False), load_gguf(path, keep_quantized=True)
        default = load_gguf(path)  # packed where the type allows: every type here does
    assert all(type(default.weights[n]) is type(w) for n, w in packed.weights.items())
    for name, w in packed.weights.items():
        got = dequantize(w) if isinstance(w, QuantizedWeight) else w
        assert torch.equal(got, dense.weights[name]), name
    ids = torch.randint(0, TINY["vocab"], (1, 9), generator=torch.Generator().manual_seed(1))
    assert rel_err(packed.logits(ids), dense.logits(ids)) <= FP32_REL_TOL


def test_load_model_dispatches_to_gguf(tmp_path):
    path = write_tiny(tmp_path / "m.gguf")
    with pytest.warns(UserWarning):
        model = load_model(path, dtype="bfloat16")
    assert model.dtype == torch.bfloat16 and model.logits(torch.tensor([[1, 2, 3]])).dtype == torch.float32


# ---------------------------------------------------------------------------------------------- errors
def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_gguf(tmp_path / "absent.gguf")


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"PK\x03\x04 a zip, not a model")
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        load_gguf(path)


def test_unsupported_architecture(tmp_path):
    path = write_tiny(tmp_path / "m.gguf", "mamba")
    with pytest.raises(CheckpointError, match=r"'mamba' is not supported; supported: \['gemma', 'gemma2', 'gemma3', 'llama', 'phi3', "):
        load_gguf(path)


def test_experts_in_an_architecture_without_a_moe_family(tmp_path):
    path = write_tiny(tmp_path / "moe.gguf", "qwen2", qkv_bias=True, extra={"qwen2.expert_count": 8})
    with pytest.raises(CheckpointError, match="qwen2 files with qwen2.expert_count = 8 are not supported"):
        load_gguf(path)


def raw_blocks(qtype: Q, rows: int, cols: int) -> np.ndarray:
    """Zero bytes shaped as ``rows`` rows of ``cols`` weights in ``qtype``'s blocks."""
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    return np.zeros((rows, cols // block * nbytes), dtype=np.uint8)


def test_unsupported_quant_type(tmp_path):
    q8_1 = raw_blocks(Q.Q8_1, TINY["ffn"], TINY["hidden"])  # a type gguf cannot dequantize
    path = write_tiny(tmp_path / "q81.gguf", raw={"blk.0.ffn_up.weight": (q8_1, Q.Q8_1)})
    with pytest.raises(CheckpointError, match=r"'blk.0.ffn_up.weight' has type Q8_1, which cannot be dequantized"):
        load_gguf(path)


def test_keep_quantized_rejects_inexact_types(tmp_path):
    q3_k = raw_blocks(Q.Q3_K, TINY["heads"] * TINY["head_dim"], TINY["hidden"])
    path = write_tiny(tmp_path / "q3k.gguf", raw={"blk.0.attn_q.weight": (q3_k, Q.Q3_K)})
    with pytest.warns(UserWarning, match="no tokenizer"):
        load_gguf(path)  # dequantizing Q3_K is fine
    with pytest.raises(CheckpointError, match=r"'blk.0.attn_q.weight' is Q3_K, which keep_quantized cannot"):
        load_gguf(path, keep_quantized=True)


def test_missing_tensor(tmp_path):
    path = write_tiny(tmp_path / "m.gguf", drop=("blk.1.ffn_down.weight",))
    with pytest.raises(CheckpointError, match=r"'blk.1.ffn_down.weight' is missing"):
        load_gguf(path)


def test_shape_disagrees_with_metadata(tmp_path):
    wide = np.zeros((TINY["ffn"] + 32, TINY["hidden"]), np.float32)
    path = write_tiny(tmp_path / "bad.gguf", raw={"blk.0.ffn_up.weight": (wide, Q.F32)})
    with pytest.raises(CheckpointError, match=r"'blk.0.ffn_up.weight' has shape \(96, 256\) \(ne = \[256, 96\]\), "
                                              r"but the metadata implies \(64, 256\)"):
        load_gguf(path)


def test_byte_alphabet_is_gpt2s():
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = byte_alphabet()
    assert len(set(alphabet.values())) == 256 and set(alphabet.values()) == set(ByteLevel.alphabet())
    assert alphabet[ord(" ")] == "Ġ" and alphabet[ord("\n")] == "Ċ" and alphabet[ord("A")] == "A"


# ---------------------------------------------------------------------------------------------- tokenizer rules
def tiny_vocab(**keys) -> dict:
    """Tokenizer metadata over the 256 byte tokens, two control tokens, one user-defined, one merge."""
    tokens = [*byte_alphabet().values(), "<s>", "</s>", "<think>", "ab"]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": ["a b"],
            "tokenizer.ggml.token_type": [1] * 256 + [3, 3, 4, 1], "tokenizer.ggml.bos_token_id": 256,
            "tokenizer.ggml.eos_token_id": 257, **{f"tokenizer.ggml.{k}": v for k, v in keys.items()}}


@pytest.mark.parametrize("pre,pieces", [("llama-bpe", ["abc", "Ġ", "123", "45"]),
                                        ("qwen2", ["abc", "Ġ", "1", "2", "3", "4", "5"]),
                                        ("smollm", ["abc", "Ġ", "1", "2", "3", "4", "5"]),
                                        ("default", ["abc", "Ġ12345"])])
def test_pre_tokenizer_follows_the_file(pre, pieces):
    tok = build_tokenizer(tiny_vocab(pre=pre))
    assert [p for p, _ in tok.pre_tokenizer.pre_tokenize_str("abc 12345")] == pieces


def test_added_tokens_and_bos_eos_flags():
    plain = build_tokenizer(tiny_vocab())
    assert plain.encode("ab<think>x</s>").tokens == ["ab", "<think>", "x", "</s>"]  # no BOS unless asked
    flagged = build_tokenizer(tiny_vocab(add_bos_token=True, add_eos_token=True))
    assert flagged.encode("ab").ids == [256, 259, 257]
    assert flagged.decode(flagged.encode("ab<think>").ids, skip_special_tokens=True) == "ab<think>"


def test_unknown_pre_tokenizer_warns():
    with pytest.warns(UserWarning, match="pre-tokenizer 'mystery' is not known"):
        build_tokenizer(tiny_vocab(pre="mystery"))


def test_unsupported_tokenizer_model():
    with pytest.raises(UnsupportedTokenizer, match=r"model 't5' cannot be rebuilt; supported: \['gpt2'\]"):
        build_tokenizer(tiny_vocab(model="t5"))
    with pytest.raises(UnsupportedTokenizer, match="llama tokenizer lacks 'tokenizer.ggml.scores'"):
        build_tokenizer(tiny_vocab(model="llama"))
