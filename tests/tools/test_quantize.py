"""``tessera quantize``: a Hugging Face directory (with a byte-level BPE tokenizer.json) and a GGUF file written as
quantized GGUF files that load back with the same tokenizer and close logits; refusals that lose nothing."""

from __future__ import annotations

import json

import pytest

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from tessera.cli import main
from tessera.models import load_model
from tessera.models.gguf import load_gguf
from tessera.models.gguf_reader import read_gguf
from tessera.models.gguf_tokenizer import build_tokenizer, gguf_tokenizer_keys, tokenizer_document
from tests.models.helpers import hf_logits, rel_err, save_tiny, token_batch
from tests.models.test_gguf import tiny_vocab

TEXT = "ab<think>x 12345 abc</s>"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf")
    config = transformers.LlamaConfig(vocab_size=260, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = save_tiny(transformers.LlamaForCausalLM, config, directory)
    (directory / "tokenizer.json").write_text(build_tokenizer(tiny_vocab(pre="smollm")).to_str())
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    return directory, model


# logits error of a tiny random Llama against transformers (measured 2026-12-03: Q8_0 0.022 with int8 activations,
# Q4_K 0.263; gguf-py's own Q4_0 quantizer gives 0.273 on the same model)
@pytest.mark.parametrize("qtype,tol", [("Q8_0", 0.05), ("Q4_K", 0.35)])
def test_quantize_a_hugging_face_directory(hf_dir, tmp_path, qtype, tol):
    directory, hf = hf_dir
    out = tmp_path / "m.gguf"
    assert main(["quantize", str(directory), str(out), "--type", qtype]) == 0
    types = {t.tensor_type.name for t in read_gguf(out).tensor_index.values()}
    assert types == {qtype, "F32"}
    model = load_gguf(out)
    ids = token_batch(260, seq=12)
    assert rel_err(model.logits(ids), hf_logits(hf, ids)) <= tol
    assert model.tokenizer.encode(TEXT).ids == load_model(directory).tokenizer.encode(TEXT).ids
    assert model.chat_template == "{{ messages }}"


def test_quantize_a_gguf_file_keeps_its_tokenizer(hf_dir, tmp_path):
    first, second = tmp_path / "a.gguf", tmp_path / "b.gguf"
    assert main(["quantize", str(hf_dir[0]), str(first), "--type", "F16"]) == 0
    assert main(["quantize", str(first), str(second), "--type", "Q6_K"]) == 0
    meta_a, meta_b = read_gguf(first).metadata, read_gguf(second).metadata
    assert {k: v for k, v in meta_a.items() if k.startswith("tokenizer.")} == \
        {k: v for k, v in meta_b.items() if k.startswith("tokenizer.")}
    ids = token_batch(260, seq=8)
    assert rel_err(load_gguf(second).logits(ids), load_gguf(first).logits(ids)) <= 0.12  # Q6_K: 0.063 measured


def test_quantize_refuses_to_overwrite(hf_dir, tmp_path, capsys):
    out = tmp_path / "m.gguf"
    out.write_bytes(b"keep me")
    assert main(["quantize", str(hf_dir[0]), str(out)]) == 2
    assert "exists; pass --force" in capsys.readouterr().err and out.read_bytes() == b"keep me"
    assert not list(tmp_path.glob(".*partial"))


def test_tokenizer_keys_round_trip():
    """tokenizer.json -> GGUF keys -> tokenizer: the same ids, for each pre-tokenizer the writer can name."""
    for pre in ("smollm", "llama-bpe", "qwen2", "default"):
        meta = tiny_vocab(pre=pre, add_bos_token=True)
        keys = gguf_tokenizer_keys(tokenizer_document(meta))
        assert keys["tokenizer.ggml.pre"] == ("default" if pre == "default" else pre)
        assert build_tokenizer(keys).encode(TEXT).ids == build_tokenizer(meta).encode(TEXT).ids


def test_quantize_names_the_types(tmp_path, capsys):
    """The CLI parser does not import the writer (torch); a wrong --type is refused with the list, before loading."""
    assert main(["quantize", str(tmp_path / "absent"), str(tmp_path / "x.gguf"), "--type", "q3_k"]) == 2
    err = capsys.readouterr().err
    assert "--type Q3_K is not writable" in err and "'Q4_K'" in err
    import argparse

    from tessera.models.gguf_write import WRITABLE_TYPES
    from tessera.tools import quantize

    commands = argparse.ArgumentParser().add_subparsers()
    quantize.add_parser(commands)
    help_text = commands.choices["quantize"].format_help().replace("\n", " ")
    assert all(t in help_text for t in WRITABLE_TYPES), help_text  # the help lists every writable type


def test_q4_k_m_mix_loads_packed(hf_dir, tmp_path):
    """llama.cpp's Q4_K_M mix: attn_v and ffn_down in Q6_K in the layers that get more bits (with two layers only
    layer 1: 2 // 8 = 0, so the "first eighth" is empty and the last starts at 7 * 2 // 8 = 1) and for the output
    table; the mixed q|k|v stays packed as a StackedWeight of a Q4_K q|k and a Q6_K v."""
    from tessera.kernels.quant import StackedWeight

    out = tmp_path / "m.gguf"
    assert main(["quantize", str(hf_dir[0]), str(out), "--type", "Q4_K_M"]) == 0
    types = {name: t.tensor_type.name for name, t in read_gguf(out).tensor_index.items()}
    assert types["blk.1.attn_v.weight"] == types["blk.1.ffn_down.weight"] == types["output.weight"] == "Q6_K"
    assert types["blk.0.attn_v.weight"] == types["blk.1.attn_q.weight"] == types["token_embd.weight"] == "Q4_K"
    model = load_gguf(out)
    qkv = model.weights["layers.1.qkv.weight"]
    assert isinstance(qkv, StackedWeight) and [p.fmt for p in qkv.parts] == ["q4_k", "q6_k"]
    ids = token_batch(260, seq=12)
    assert rel_err(model.logits(ids), hf_logits(hf_dir[1], ids)) <= 0.35
