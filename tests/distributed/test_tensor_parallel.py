"""Tensor parallelism over two ranks (gloo on this machine) against the single-process engine, and its failures.

Each LLM(tensor_parallel_size=2) spawns one worker rank (a few seconds); the tests keep their number small.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import transformers

from tessera.distributed.comm import TensorParallelError
from tessera.engine import LLM, SamplingParams
from tessera.models import load_model
from tessera.models.paged import StepBatch, forward_step, new_cache
from tests.models.helpers import save_tiny

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _prompts(vocab: int, lengths=(5, 17, 9), seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def _prefill_step(ids: list[int], page_size: int = 4) -> StepBatch:
    n = len(ids)
    table = torch.arange((n + page_size - 1) // page_size, dtype=torch.int32)[None]
    return StepBatch(torch.tensor(ids), [n], [n], table, torch.arange(n))


def _compare(model, prompts: list[list[int]], atol_rel: float, page_size: int = 4,
             params: SamplingParams = GREEDY) -> None:
    """Greedy tokens of a mixed batch identical; one prefill's logits close, single-process vs two ranks."""
    ref = [o.token_ids for o in LLM(model, page_size=page_size, num_pages=64).generate(prompts, params)]
    step = _prefill_step(prompts[1], page_size)
    ref_logits = forward_step(model, new_cache(model, 8, page_size), step, all_logits=True, fused=False)
    llm = LLM(model, page_size=page_size, num_pages=64, max_num_batched_tokens=16, tensor_parallel_size=2)
    try:
        got = [o.token_ids for o in llm.generate(prompts, params)]
        logits = llm.runner.forward_step(llm.model, llm.cache, step, all_logits=True)
    finally:
        llm.shutdown()
    assert got == ref
    err = float((logits - ref_logits).abs().max() / ref_logits.abs().max())
    assert err < atol_rel, err


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_random_models_match_single_process(tmp_path, family):
    # llama: 2 KV heads, one per rank; qwen2: q/k/v biases and 1 KV head replicated on both ranks; qwen3: q/k norms
    common = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=128)
    cls, config = {
        "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig(num_key_value_heads=2, **common)),
        "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config(num_key_value_heads=1, **common)),
        "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config(num_key_value_heads=2, head_dim=16,
                                                                          **common)),
    }[family]
    save_tiny(cls, config, tmp_path)
    _compare(load_model(tmp_path), _prompts(211), 1e-5)


def test_packed_gguf_shards_stay_packed(tmp_path, monkeypatch):
    from tests.eval.tiny import tiny_gguf

    from tessera.kernels.quant import QuantizedWeight

    model = load_model(tiny_gguf(tmp_path))
    assert isinstance(model.weights["layers.0.down.weight"], QuantizedWeight)
    llm = LLM(model, page_size=4, num_pages=64, tensor_parallel_size=2)
    try:
        w = llm.model.weights
        assert isinstance(w["layers.0.down.weight"].weight, QuantizedWeight)  # Q4_0 columns cut on group bounds
        assert w["layers.0.down.weight"].shape == (64, 64)
        assert isinstance(w["embed"].table, QuantizedWeight)  # the tied Q8_0 table, by vocabulary rows
        prompts = _prompts(model.config.vocab_size, (6, 11))
        got = [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4))]
        step = _prefill_step(prompts[1])
        logits = llm.runner.forward_step(llm.model, llm.cache, step, all_logits=True)
    finally:
        llm.shutdown()
    ref_llm = LLM(model, page_size=4, num_pages=64)
    ref = [o.token_ids for o in ref_llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4))]
    ref_logits = forward_step(model, new_cache(model, 8, 4), step, all_logits=True, fused=False)
    # the packed GEMV quantizes activations to int8 per block, a step function that turns the all-reduce's other
    # summation order into differences of the int8 rounding's size (docs/distributed.md); float activations match
    # to 1e-6 (TESSERA_CPU_VARIANTS=qgemv=portable)
    err = float((logits - ref_logits).abs().max() / ref_logits.abs().max())
    assert err < 5e-2, err
    assert torch.equal(logits.argmax(-1), ref_logits.argmax(-1))
    assert got == ref


@pytest.mark.filterwarnings("ignore:.*no tokenizer")
def test_k_quant_gguf_shards_match_single_process(tmp_path):
    """A Q4_K_M file under two ranks: Q4_K everywhere in layer 0 (the tied table too), a Q6_K down and a q|k|v that
    stacks Q4_K and Q6_K rows in layer 1. Every projection is cut on whole 256-value blocks and stays packed, and
    greedy tokens match one process. The shape makes each row-parallel cut a block boundary: o and down take 512
    input columns, 256 per rank."""
    from tessera.kernels.quant import QuantizedWeight
    from tessera.models.gguf_write import write_gguf

    config = transformers.LlamaConfig(vocab_size=211, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=8, head_dim=64, num_key_value_heads=2,
                                      max_position_embeddings=128, tie_word_embeddings=True)
    save_tiny(transformers.LlamaForCausalLM, config, tmp_path / "hf")
    source = load_model(tmp_path / "hf")
    model = load_model(write_gguf(tmp_path / "q4_k_m.gguf", source.config, source.weights, qtype="Q4_K_M"))
    down = model.weights["layers.0.down.weight"]
    assert isinstance(down, QuantizedWeight) and down.fmt in ("q4_k", "q6_k")
    prompts = _prompts(model.config.vocab_size, (6, 11))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm = LLM(model, page_size=4, num_pages=64, tensor_parallel_size=2)
    try:
        w = llm.model.weights
        shard = w["layers.0.down.weight"].weight
        assert isinstance(shard, QuantizedWeight) and shard.fmt == down.fmt and shard.shape == (256, 256)
        got = [o.token_ids for o in llm.generate(prompts, params)]
        step = _prefill_step(prompts[1])
        logits = llm.runner.forward_step(llm.model, llm.cache, step, all_logits=True)
    finally:
        llm.shutdown()
    ref = [o.token_ids for o in LLM(model, page_size=4, num_pages=64).generate(prompts, params)]
    ref_logits = forward_step(model, new_cache(model, 8, 4), step, all_logits=True, fused=False)
    err = float((logits - ref_logits).abs().max() / ref_logits.abs().max())
    assert err < 5e-2, err  # int8 activations: see test_packed_gguf_shards_stay_packed
    assert torch.equal(logits.argmax(-1), ref_logits.argmax(-1))
    assert got == ref


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purpose only once reaped
        return f.read().split()[2] == "Z"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp_llama")
    config = transformers.LlamaConfig(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    save_tiny(transformers.LlamaForCausalLM, config, path)
    return load_model(path)


def test_killed_worker_fails_requests_cleanly(tiny_llama):
    llm = LLM(tiny_llama, page_size=4, num_pages=64, tensor_parallel_size=2)
    (pid,) = llm.tensor_parallel.worker_pids
    seqs = [llm.add_request(p, SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
            for p in _prompts(211)]
    llm.step()
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match=f"rank 1 \\(pid {pid}\\) killed by signal 9"):
        while llm.has_unfinished():
            llm.step()
    assert time.monotonic() - start < 30
    for seq in seqs:
        llm.abort(seq)
    assert llm.block_manager.num_free_pages == llm.block_manager.num_pages
    with pytest.raises(TensorParallelError):  # the engine stays stopped, and says so
        llm.generate([[5, 6, 7]], GREEDY)
    llm.shutdown()
    assert _pid_gone(pid)


def test_hung_worker_times_out_and_shutdown_leaves_no_process(tiny_llama, monkeypatch):
    monkeypatch.setenv("TESSERA_TP_TIMEOUT", "3")
    llm = LLM(tiny_llama, page_size=4, num_pages=64, tensor_parallel_size=2)
    (pid,) = llm.tensor_parallel.worker_pids
    assert llm.generate([[5, 6, 7]], GREEDY)[0].token_ids
    os.kill(pid, signal.SIGSTOP)  # alive but stuck
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match="alive"):
        llm.generate([[5, 6, 7]], GREEDY)
    assert time.monotonic() - start < 30
    llm.shutdown()
    assert _pid_gone(pid)


def test_shutdown_stops_workers(tiny_llama):
    llm = LLM(tiny_llama, page_size=4, num_pages=64, tensor_parallel_size=2)
    (pid,) = llm.tensor_parallel.worker_pids
    llm.shutdown()
    llm.shutdown()  # idempotent
    assert _pid_gone(pid)


def test_worker_dying_at_start_fails_at_once_and_says_why(tmp_path):
    # a script without the `if __name__ == "__main__":` guard: each spawned worker re-runs it on import and dies
    # before it joins; rank 0 must report that at once rather than wait out the rendezvous timeout
    import subprocess
    import sys

    config = transformers.LlamaConfig(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    save_tiny(transformers.LlamaForCausalLM, config, tmp_path / "model")
    script = tmp_path / "unguarded.py"
    script.write_text("import sys\nfrom tessera.engine import LLM\n"
                      "LLM(sys.argv[1], page_size=4, num_pages=16, tensor_parallel_size=2)\n")
    start = time.monotonic()
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "model")], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "TESSERA_TP_TIMEOUT": "100"})
    assert done.returncode != 0
    assert time.monotonic() - start < 60
    assert "exited before it joined" in done.stderr and '__name__ == "__main__"' in done.stderr, done.stderr[-3000:]
