"""Gemma, Gemma 2 and Gemma 3 (text) against transformers on tiny random checkpoints; Gemma config reading.

Sequences of 32 tokens with a window of 8 cover the local layers' masks past the window; 4 layers cover both layer
types (Gemma 2 alternates; Gemma 3 here uses a pattern of 2 so that a 4-layer model has global layers too).
"""

from __future__ import annotations

import json

import pytest
from transformers import (
    Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, GemmaConfig, GemmaForCausalLM,
)

from tessera.models import load_model
from tessera.models.families.gemma import FAMILY as GEMMA
from tessera.models.families.gemma2 import FAMILY as GEMMA2
from tessera.models.families.gemma3 import FAMILY as GEMMA3
from tests.models.helpers import FP32_REL_TOL, check_family, hf_logits, rel_err, save_tiny, token_batch

SMALL = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.1)


def test_gemma(tmp_path):
    # hidden 48: sqrt(48) is not a bf16 number, so the embedding scale's rounding to the dtype matters
    config = GemmaConfig(**dict(SMALL, hidden_size=48, num_hidden_layers=2, head_dim=24))
    check_family(GemmaForCausalLM, config, tmp_path)


@pytest.mark.parametrize("caps", [(50.0, 30.0), (2.0, 3.0)], ids=["default_caps", "tight_caps"])
def test_gemma2_softcaps_and_alternating_windows(tmp_path, caps):
    config = Gemma2Config(**SMALL, sliding_window=8, query_pre_attn_scalar=24, attn_logit_softcapping=caps[0],
                          final_logit_softcapping=caps[1])
    assert config.layer_types[:2] == ["sliding_attention", "full_attention"]
    check_family(Gemma2ForCausalLM, config, tmp_path)


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 8.0}], ids=["plain", "linear_global"])
def test_gemma3_text(tmp_path, scaling):
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": dict(scaling or {"rope_type": "default"}, rope_theta=1_000_000.0)}
    config = Gemma3TextConfig(**SMALL, sliding_window=8, query_pre_attn_scalar=24, rope_parameters=rope,
                              layer_types=["sliding_attention", "full_attention"] * 2, final_logit_softcapping=3.0)
    check_family(Gemma3ForCausalLM, config, tmp_path)


def test_gemma3_legacy_config_json(tmp_path):
    """A config.json as the Gemma 3 checkpoints on the Hub still ship it: top-level rope keys, rope_scaling meant for
    the global layers only, sliding_window_pattern instead of layer_types; transformers reads it the same way."""
    config = Gemma3TextConfig(**SMALL, sliding_window=8, query_pre_attn_scalar=24,
                              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                               "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                  "rope_theta": 10_000.0}},
                              layer_types=["sliding_attention", "full_attention"] * 2)
    save_tiny(Gemma3ForCausalLM, config, tmp_path)
    path = tmp_path / "config.json"
    hf = json.loads(path.read_text())
    for key in ("rope_parameters", "layer_types"):
        del hf[key]
    hf.update(rope_theta=10_000.0, rope_local_base_freq=100.0, rope_scaling={"rope_type": "linear", "factor": 8.0},
              sliding_window_pattern=2)
    path.write_text(json.dumps(hf))
    ids = token_batch(config.vocab_size)
    ref = hf_logits(Gemma3ForCausalLM.from_pretrained(tmp_path).eval(), ids)
    ours = load_model(tmp_path)
    assert ours.config.layer_rope == ("local", "global") * 2
    assert rel_err(ours.logits(ids), ref) <= FP32_REL_TOL


# ---- config reading (no weights) ---------------------------------------------------------------------------------

def _hf(**extra) -> dict:
    return dict(SMALL, num_hidden_layers=7, **extra)


def test_gemma_legacy_gelu_means_tanh():
    assert GEMMA.config_from_hf(_hf(hidden_act="gelu")).activation == "gelu_tanh"
    assert GEMMA2.config_from_hf(_hf(hidden_activation="gelu", sliding_window=8)).activation == "gelu"
    with pytest.raises(ValueError, match="unsupported hidden activation 'relu'"):
        GEMMA2.config_from_hf(_hf(hidden_activation="relu", sliding_window=8))


def test_older_configs_without_layer_types():
    g2 = GEMMA2.config_from_hf(_hf(sliding_window=16))
    assert g2.layer_windows == (16, None, 16, None, 16, None, 16)
    g3 = GEMMA3.config_from_hf(_hf(sliding_window=16, rope_theta=1e6, rope_local_base_freq=1e4,
                                   rope_scaling={"type": "linear", "factor": 8.0}))
    assert g3.layer_windows == (16,) * 5 + (None, 16)  # sliding_window_pattern 6: layer 6 (1-based) is global
    assert g3.layer_rope == ("local",) * 5 + ("global", "local")
    glob, loc = g3.rope_configs["global"], g3.rope_configs["local"]
    assert glob["rope_theta"] == 1e6 and glob["rope_parameters"]["rope_type"] == "linear"
    assert loc["rope_theta"] == 1e4 and loc["rope_parameters"]["rope_type"] == "default"


def test_gemma_config_errors():
    with pytest.raises(ValueError, match="layer_types must list 7 entries"):
        GEMMA2.config_from_hf(_hf(sliding_window=8, layer_types=["full_attention"] * 3))
    with pytest.raises(ValueError, match="sets no sliding_window"):
        GEMMA3.config_from_hf(_hf())
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        GEMMA3.config_from_hf(_hf(sliding_window=8, use_bidirectional_attention=True))
