"""`tessera validate`: the per-layer table, the logits verdict and the exit status."""

from __future__ import annotations

from transformers import Qwen3Config, Qwen3ForCausalLM

from tessera.cli import main
from tessera.tools import validate as V
from tests.models.helpers import save_tiny

CONFIG = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16)


def test_validate_prints_every_layer_and_passes(tmp_path, capsys):
    save_tiny(Qwen3ForCausalLM, Qwen3Config(**CONFIG), tmp_path)
    assert main(["validate", "--model", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for name in ("embeddings", "layer 0", "layer 1", "last layer + final norm", "logits", "KL", "PASS"):
        assert name in out


def test_validate_fails_past_tolerance(tmp_path, monkeypatch, capsys):
    save_tiny(Qwen3ForCausalLM, Qwen3Config(**CONFIG), tmp_path)
    monkeypatch.setitem(V.TOLERANCES, "float32", (0.0, 0.0, 1.0))  # nothing but bit-exact passes
    assert main(["validate", "--model", str(tmp_path)]) == 1
    assert "FAIL" in capsys.readouterr().out
