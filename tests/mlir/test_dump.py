"""``tessera mlir dump``: the CLI on a small config, and once on SmolLM2's installed GGUF."""

from __future__ import annotations

import pytest

from tessera import cli
from tessera.mlir import dump as dump_module
from tessera.mlir.attention_kernel import lower_attention
from tessera.models.layers import layer_spec
from tessera.models.model import default_model_path
from tests.mlir.helpers import tiny_config


def test_dump_on_a_small_config(monkeypatch, capsys):
    config = tiny_config(layer_windows=(None, 6))
    monkeypatch.setattr(dump_module, "read_config", lambda path: config)
    assert cli.main(["mlir", "dump", "--layer", "1", "--tokens", "8",
                     "--passes", "fuse-rope,attention-layout{kv=head}"]) == 0
    out = capsys.readouterr().out
    headers = [line for line in out.splitlines() if line.startswith("// ----")]
    assert headers[0] == "// ---- captured: layer 1 of a llama model, T = 8, f32"
    assert headers[1:3] == ["// ---- after fuse-rope", '// ---- after attention-layout{kv="head"}']
    assert headers[3].startswith("// ---- lowered attention kernel: AttentionSpec(4q/2kv x 8, "
                                 "mask=(causal() & sliding_window(6))") and "key layout 'tiles'" in headers[3]
    assert out.count("tessera.matmul_rope") == 2  # after each pass
    kernel = lower_attention(layer_spec(config, 1), "tiles").text
    assert out.rstrip().endswith(kernel.rstrip())


def test_dump_prints_the_layer_as_one_iree_module(monkeypatch, capsys):
    monkeypatch.setattr(dump_module, "read_config", lambda path: tiny_config(head_dim=16))
    assert cli.main(["mlir", "dump", "--tokens", "8", "--module"]) == 0
    out = capsys.readouterr().out
    module = out.split("// ---- the layer as one IREE module (lower_graph)\n", 1)[1]
    assert "func.func @layer_0(" in module and "func.call @attention(" in module
    assert "func.func private @rms_norm(" in module and "flow.dispatch.workgroups" in module


def test_dump_rejects_unknown_passes(monkeypatch, capsys):
    monkeypatch.setattr(dump_module, "read_config", lambda path: tiny_config())
    assert cli.main(["mlir", "dump", "--passes", "fuse-all"]) == 2
    assert "known passes: fuse-norm-matmul" in capsys.readouterr().err


@pytest.mark.skipif(not default_model_path().is_file(), reason="SmolLM2's GGUF is not installed")
def test_dump_smollm2_layer(capsys):
    assert cli.main(["mlir", "dump", "--passes", "all", "--layer", "0"]) == 0
    out = capsys.readouterr().out
    assert "func.func @layer_0(%x: tensor<16x576xf32>" in out
    assert "tessera.matmul_rope %x, %l0_qkv, %positions norm(%l0_attn_norm" in out
    assert "AttentionSpec(9q/3kv x 64, mask=causal(), scale=0.125), key layout 'tokens'" in out
    assert "func.func @attention(" in out
