"""tessera.profiling and `tessera profile` on a tiny random Llama (made offline, once per module)."""

from __future__ import annotations

import importlib
import json

import pytest
import torch
import transformers

from tessera import kernels as K
from tessera.cli import main
from tessera.models import load_model
from tessera.profiling import account_ops, targets
from tessera.profiling.accounting import _resolve
from tests.models.helpers import save_tiny

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, VOCAB = 64, 96, 2, 4, 2, 211
HEAD_DIM = HIDDEN // HEADS


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama_profile")
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
                                      num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                      num_key_value_heads=KV_HEADS, max_position_embeddings=128)
    save_tiny(transformers.LlamaForCausalLM, config, path)
    return path


def _originals() -> list[object]:
    return [getattr(*_resolve(module, attr)) for module, attr, _, _ in targets()]


def test_one_matmul_is_counted_exactly() -> None:
    x, w = torch.randn(3, 5), torch.randn(7, 5)
    with account_ops() as acct:
        K.matmul(x, w)
    op = acct.stats["matmul"]
    assert (op.calls, op.flops, op.bytes) == (1, 2 * 3 * 7 * 5, (15 + 35 + 21) * 4)
    assert op.seconds > 0


def test_quantized_matmul_counts_the_packed_bytes() -> None:
    x, qw = torch.randn(2, 64), K.quantize(torch.randn(32, 64), "int4", group_size=32)
    with account_ops() as acct:
        K.qmatmul(x, qw)
    op = acct.stats["qmatmul"]
    assert op.flops == 2 * 2 * 32 * 64
    assert op.bytes == qw.nbytes + (2 * 64 + 2 * 32) * 4
    assert qw.nbytes < 32 * 64  # packed: about half a byte per weight


def test_dense_forward_counts_every_layer_op(tiny_dir) -> None:
    model = load_model(tiny_dir)
    batch, seq = 2, 8
    ids = torch.randint(3, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(0))
    with account_ops() as acct:
        model.logits(ids)
    tokens = batch * seq
    # per layer: qkv, o, gate_up, down
    assert acct.stats["matmul"].calls == 4 * LAYERS
    per_layer = (HEADS + 2 * KV_HEADS) * HEAD_DIM * HIDDEN + HIDDEN * HIDDEN + 2 * INTER * HIDDEN + HIDDEN * INTER
    assert acct.stats["matmul"].flops == 2 * tokens * per_layer * LAYERS
    assert acct.stats["lm_head"].flops == 2 * tokens * VOCAB * HIDDEN
    assert acct.stats["rms_norm"].calls == 2 * LAYERS + 1  # attn + mlp norm per layer, the final norm fused in
    assert acct.stats["apply_rope"].calls == LAYERS and acct.stats["silu_and_mul"].calls == LAYERS
    assert acct.stats["embed"].calls == 1


def test_patches_are_restored_even_on_errors() -> None:
    before = _originals()
    from tessera.models import paged

    fused = paged.fused_decode_op
    with pytest.raises(RuntimeError, match="boom"), account_ops(unfused=True):
        assert K.matmul is not before[0]
        assert paged.fused_decode_op is not fused
        raise RuntimeError("boom")
    assert all(a is b for a, b in zip(_originals(), before))
    assert paged.fused_decode_op is fused
    # the package's attribute is the function layers.py will look up again
    assert importlib.import_module("tessera.kernels").matmul is before[0]


def test_nested_ops_count_once() -> None:
    """A wrapped op called from inside another wrapped op belongs to the outer one (op times never overlap)."""
    x, w = torch.randn(2, 4), torch.randn(3, 4)
    with account_ops() as acct:
        patched = K.matmul
        K.rms_norm(x, torch.ones(4), 1e-5)
        acct._depth += 1  # as if inside another op
        patched(x, w)
        acct._depth -= 1
    assert "matmul" not in acct.stats and acct.stats["rms_norm"].calls == 1


@pytest.mark.parametrize("unfused", [False, True])
def test_cli_writes_a_trace_and_prints_the_table(tiny_dir, tmp_path, capsys, monkeypatch, unfused) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    trace = tmp_path / "trace.json"
    argv = ["profile", "--model", str(tiny_dir), "--prompt-len", "12", "--gen-len", "4", "--trace", str(trace)]
    assert main(argv + (["--unfused"] if unfused else [])) == 0
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"matmul", "attention", "lm_head"} <= names
    out = capsys.readouterr().out
    for column in ("op", "time %", "GFLOP/s", "GB/s", "roof ms", "bound", "python/other"):
        assert column in out
    assert "matmul (prefill)" in out and "lm_head (decode)" in out and "tok/s" in out
    # decode steps of the tiny model fit the fused kernel unless --unfused
    assert ("fused_decoder_layers (decode)" in out) != unfused
    assert ("matmul (decode)" in out) == unfused


def test_phases_split_prefill_from_decode(tiny_dir) -> None:
    from tessera.engine import LLM, SamplingParams

    llm = LLM(str(tiny_dir), max_num_seqs=1, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    with account_ops(unfused=True, phases=True) as acct:
        llm.generate([[5, 6, 7, 8, 9]], params)
    # one prefill step, then two decode steps (the first token comes from the prefill)
    assert acct.stats["matmul (prefill)"].calls == 4 * LAYERS
    assert acct.stats["matmul (decode)"].calls == 2 * 4 * LAYERS
    assert acct.stats["lm_head (prefill)"].calls == 1 and acct.stats["lm_head (decode)"].calls == 2
    # all-greedy steps pick their token inside the forward (an argmax of the logits), not through the sampler
    assert acct.stats["argmax (decode)"].calls == 2 and "sample (decode)" not in acct.stats
    prefill_attn = acct.stats["attention (prefill)"]
    assert prefill_attn.flops == 4 * (5 * 6 // 2) * HEADS * HEAD_DIM * LAYERS


def test_fused_layer_with_int4_projections_counts_packed_bytes(tiny_dir) -> None:
    """A model with packed int4 projections takes the fused decode layer too; its cost counts the packed bytes."""
    from tessera.engine import LLM, SamplingParams

    model = load_model(tiny_dir)
    for i in range(LAYERS):
        for name in ("qkv", "o", "gate_up", "down"):
            key = f"layers.{i}.{name}.weight"
            model.weights[key] = K.quantize(model.weights[key], "int4_min", 32)
    llm = LLM(model, page_size=4, num_pages=32)
    with account_ops() as acct:
        llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    op = acct.stats["fused_decoder_layers"]
    params = LAYERS * ((HEADS + 2 * KV_HEADS) * HEAD_DIM * HIDDEN + HIDDEN * HIDDEN + 3 * INTER * HIDDEN)
    # the 3-token prompt is a decode-shaped step too (at most 8 tokens), then two decode steps; each step's layers
    # are one call (they share their types and shapes)
    assert op.calls == 3 and op.flops >= 2 * (3 + 2) * params
    assert op.bytes < 3 * params * 4 / 4  # packed: well under a quarter of the fp32 bytes of three steps


def test_tensor_parallel_reports_communication(tiny_dir, tmp_path, capsys, monkeypatch) -> None:
    """TP=2 on the tiny model: a communication table with the collectives a step runs, and the cost model's
    prediction for them (no timing assertions: the machine is shared)."""
    from tessera.hw.links import LOOPBACK_GLOO
    from tessera.tools import profile as tool

    monkeypatch.setenv("COLUMNS", "250")
    captured = {}
    summary = tool.comm_summary
    monkeypatch.setattr(tool, "comm_summary", lambda *a: captured.setdefault("rows", summary(*a)))
    argv = ["profile", "--model", str(tiny_dir), "--prompt-len", "12", "--gen-len", "4", "--trace",
            str(tmp_path / "trace.json"), "--tensor-parallel-size", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "communication of a tensor-parallel step" in out and "all_reduce (decode)" in out
    rows = {r["phase"]: r for r in captured["rows"]}
    assert set(rows) == {"prefill", "decode"}
    decode = rows["decode"]
    assert decode["steps"] == 3  # 4 tokens: the first comes from the prefill step
    # per step: 2 all-reduces per layer and the embedding's; greedy rows exchange their best logit, no gather
    assert decode["kinds"]["all_reduce"] == 2 * LAYERS + 1 and decode["kinds"]["argmax_across"] == 1
    # one token's float32 hidden row per all-reduce, one (value, id) float64 pair per rank
    assert decode["bytes"] == (2 * LAYERS + 1) * HIDDEN * 4 + 2 * 16
    assert rows["prefill"]["bytes"] == (2 * LAYERS + 1) * 12 * HIDDEN * 4 + 2 * 16
    assert 0 < decode["comm_s"] <= decode["step_s"] and 0 <= decode["share"] <= 1
    # the model's prediction for the same byte counts: 2 hops of latency per all-reduce, 1 per all-gather
    from tessera.hw.links import collective_seconds

    expected = (collective_seconds(LOOPBACK_GLOO, "all_reduce", 2 * LAYERS + 1, (2 * LAYERS + 1) * HIDDEN * 4, 2)
                + collective_seconds(LOOPBACK_GLOO, "all_gather", 1, 32, 2))
    assert decode["predicted_s"] == pytest.approx(expected)
