"""``tessera tune`` through the CLI entry point, and the real cpu tunables' measurements (one call each)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tessera import tuning
from tessera.cli import main
from tessera.tuning import registry


def test_tune_show_clear(toy, capsys):
    toy(times={1: [0.5], 2: [1.0], 4: [2.0]})
    assert main(["tune", "--quick", "--only", "toy"]) == 0
    out = capsys.readouterr().out
    assert "toy" in out and "2.00x" in out and str(registry.current_path()) in out.replace("\n", "")
    assert json.loads(registry.current_path().read_text())["entries"]["toy"]["*"]["chosen"] == 1
    tuning.reset()
    assert main(["tune", "--show", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert rows["toy"]["value"] == 1 and rows["toy"]["source"] == "tuned"
    assert {"quant_gemv_max_m", "quant_tile_n", "gemv_serial_work", "decode_serial_max_bytes"} <= rows.keys()
    assert main(["tune", "--show"]) == 0
    assert "toy" in capsys.readouterr().out
    assert main(["tune", "--clear"]) == 0
    assert not registry.current_path().exists() and tuning.tuned("toy") == 2


def test_unknown_tunable_is_an_error(capsys):
    assert main(["tune", "--only", "nope"]) == 2
    assert "no tunable named 'nope'" in capsys.readouterr().out


def test_summary_rows(toy, monkeypatch):
    toy()
    monkeypatch.setenv("TESSERA_TUNE_TOY", "x")
    tuning.reset()
    rows = {(r["name"], r["shape_class"]): r for r in tuning.tuning_summary()}
    toy_row = rows["toy", None]
    assert toy_row["source"].startswith("error: TESSERA_TUNE_TOY='x'") and toy_row["value"] == 2
    from tessera.backends.cpu.ops import quant

    # the untuned limits follow the qgemm variant (bf16 tiles win from fewer rows than fp32 ones)
    assert rows["quant_gemv_max_m", "int4"]["default"] == quant.gemv_max_m_default("int4") in (40, 128)
    assert rows["quant_gemv_max_m", "int8"]["default"] == quant.gemv_max_m_default("int8") in (48, 64)


@pytest.mark.slow
def test_real_measurements_run():
    """One call of each built-in measurement on the smallest grid point. A few seconds once the kernels are in
    Numba's cache; minutes when they compile (the first run after an edit of any kernel source)."""
    from tessera.tuning import search

    with search.using(search.Options(quick=True)):
        for name in registry.tunables():
            t = registry.get(name)
            if t.crossover is not None:
                m = min(t.candidates)
                for path in (t.crossover.below, t.crossover.above):
                    assert path(m, t.shape_classes[0]) > 0
            else:
                assert t.measure(t.default_for(None), None) > 0
    for module in registry.tunable_modules():
        module.release_inputs()


def test_model_workload_from_a_config(tmp_path):
    """--model reads only config.json (no weights) for a Hugging Face directory."""
    from tessera.tuning.workload import workload_from_model

    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 160, "num_attention_heads": 4,
              "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 100, "rms_norm_eps": 1e-5,
              "max_position_embeddings": 128, "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    w = workload_from_model(tmp_path)
    assert w.projections == ((128, 64), (64, 64), (320, 64), (64, 160))  # qkv, o, gate_up, down
    assert (w.num_q_heads, w.num_kv_heads, w.head_dim, w.formats) == (4, 2, 16, None)
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        workload_from_model(tmp_path / "missing")


def test_format_classes_restrict_every_format_keyed_tunable():
    from tessera.tuning.workload import SMOLLM2, format_classes

    assert format_classes(None) == {} and format_classes(SMOLLM2) == {}
    q4 = dataclasses.replace(SMOLLM2, formats=("int4_min",))
    assert format_classes(q4) == {"quant_gemv_max_m": ("int4_min",)}
