"""SmolLM2-135M in transformers with ``attn_implementation="tessera"`` against ``"sdpa"``: prefill and decode, one run.

The model is transformers' own ``LlamaForCausalLM`` with SmolLM2-135M's config (hidden 576, 30 layers, 9 query heads,
3 kv heads, head_dim 64, vocab 49152) and random weights (seed 0), float32. Only the attention function differs
between the two rows: projections, MLPs, norms, RoPE, the KV cache (``DynamicCache``) and sampling are
transformers'. So the ratio is end-to-end, and attention is a minority of a step's time; the attention-only kernel
comparison is ``benchmarks/attention_cpu.py``.

* prefill: one forward over ``--prompt`` tokens (batch 1).
* decode: ``--gen`` greedy steps of one token each after that prefill (the prefill untimed), ms per token.

Each is reported as the median wall time over ``--reps``, the ratio of the fastest repetitions, and the ratio of
median process CPU times (``time.process_time``, all threads): on a machine shared with other work, wall time
includes the time other processes hold the cores, CPU time does not.

The two implementations alternate within every repetition, so drift on a shared machine hits both alike. The greedy
tokens of both are compared and reported. Usage::

    python benchmarks/transformers_attention.py [--prompt 512] [--gen 32] [--reps 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP (see benchmarks/kernels_cpu.py)
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
import statistics
import time

import torch
import transformers
from rich.console import Console
from rich.table import Table
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from tessera.hw.probes import cpu_model
from tessera.integrations import transformers as tessera_hf

IMPLS = ("sdpa", "tessera")


def smollm2_config() -> LlamaConfig:
    """SmolLM2-135M(-Instruct)'s config.json values."""
    return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                       rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, hidden_act="silu")


def prefill(model: LlamaForCausalLM, ids: torch.Tensor) -> tuple[tuple[float, float], DynamicCache, torch.Tensor]:
    """(wall, CPU) seconds of one forward over ``ids``, its cache, and the greedy next token ``[1, 1]``."""
    cache = DynamicCache(config=model.config)
    wall, cpu = time.perf_counter(), time.process_time()
    out = model(ids, past_key_values=cache, use_cache=True)
    seconds = (time.perf_counter() - wall, time.process_time() - cpu)
    return seconds, out.past_key_values, out.logits[:, -1:].argmax(-1)


def decode(model: LlamaForCausalLM, cache: DynamicCache, token: torch.Tensor,
           steps: int) -> tuple[tuple[float, float], list[int]]:
    """(wall, CPU) seconds per greedy one-token step over ``steps`` steps, and the tokens."""
    tokens = []
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        out = model(token, past_key_values=cache, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        tokens.append(int(token))
    return ((time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps), tokens


def attention_calls(prompt: int, gen: int, reps: int) -> list[dict[str, object]]:
    """One layer's attention call alone, transformers' function for each implementation on the same tensors
    (``[B, H, S, D]`` as transformers passes them): median wall ms of ``reps`` x 10 interleaved calls."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups, module.training = True, 3, False
    calls = {"sdpa": lambda q, k, v: sdpa_attention_forward(module, q, k, v, None, scaling=0.125),
             "tessera": lambda q, k, v: tessera_hf.tessera_attention_forward(module, q, k, v, None, scaling=0.125)}
    gen_t = torch.Generator().manual_seed(2)
    rows = []
    for phase, sq, skv in (("prefill", prompt, prompt), ("decode", 1, prompt + gen)):
        q = torch.randn(1, 9, sq, 64, generator=gen_t)
        k, v = (torch.randn(1, 3, skv, 64, generator=gen_t) for _ in range(2))
        times: dict[str, list[float]] = {impl: [] for impl in IMPLS}
        for impl in IMPLS:
            calls[impl](q, k, v)  # warm
        for _ in range(reps * 10):
            for impl in IMPLS:
                start = time.perf_counter()
                calls[impl](q, k, v)
                times[impl].append(time.perf_counter() - start)
        ms = {impl: 1e3 * statistics.median(times[impl]) for impl in IMPLS}
        rows.append({"phase": f"attention call, {phase}", "shape": f"q{sq} kv{skv} h9/3 d64",
                     "sdpa_ms": ms["sdpa"], "tessera_ms": ms["tessera"],
                     "ratio_tessera_over_sdpa": ms["tessera"] / ms["sdpa"]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--gen", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", type=str, default=None)
    args = parser.parse_args()

    tessera_hf.register()
    torch.manual_seed(0)
    model = LlamaForCausalLM(smollm2_config()).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    samples: dict[str, dict[str, list[float]]] = {impl: {"prefill": [], "decode": [], "prefill_cpu": [],
                                                         "decode_cpu": []} for impl in IMPLS}
    tokens: dict[str, list[int]] = {}
    with torch.no_grad():  # not inference_mode: tessera kernels write outputs from worker threads
        for impl in IMPLS:  # warm-up: kernels compile or load from cache, allocators settle
            model.set_attn_implementation(impl)
            _, cache, tok = prefill(model, ids)
            decode(model, cache, tok, 2)
        for _ in range(args.reps):
            for impl in IMPLS:
                model.set_attn_implementation(impl)
                (wall, cpu), cache, tok = prefill(model, ids)
                samples[impl]["prefill"].append(wall)
                samples[impl]["prefill_cpu"].append(cpu)
                (wall, cpu), gen = decode(model, cache, tok, args.gen)
                samples[impl]["decode"].append(wall)
                samples[impl]["decode_cpu"].append(cpu)
                tokens[impl] = [int(tok)] + gen

    rows = []
    for phase in ("prefill", "decode"):
        ms = {impl: 1e3 * statistics.median(samples[impl][phase]) for impl in IMPLS}
        # The fastest repetition too: on a shared machine other processes only ever add time, so the ratio of minima
        # is the steadier estimate when the medians wander.
        best = {impl: 1e3 * min(samples[impl][phase]) for impl in IMPLS}
        cpu_ms = {impl: 1e3 * statistics.median(samples[impl][phase + "_cpu"]) for impl in IMPLS}
        rows.append({
            "phase": phase,
            "shape": f"b1 prompt{args.prompt}" + (f" gen{args.gen}" if phase == "decode" else ""),
            "unit": "ms per forward" if phase == "prefill" else "ms per token",
            "sdpa_ms": ms["sdpa"], "tessera_ms": ms["tessera"],
            "ratio_tessera_over_sdpa": ms["tessera"] / ms["sdpa"],
            "sdpa_min_ms": best["sdpa"], "tessera_min_ms": best["tessera"],
            "ratio_of_minima": best["tessera"] / best["sdpa"],
            "sdpa_cpu_ms": cpu_ms["sdpa"], "tessera_cpu_ms": cpu_ms["tessera"],
            "ratio_of_cpu_times": cpu_ms["tessera"] / cpu_ms["sdpa"],
            "tessera_tokens_per_s": (args.prompt if phase == "prefill" else 1) * 1e3 / ms["tessera"],
            "sdpa_tokens_per_s": (args.prompt if phase == "prefill" else 1) * 1e3 / ms["sdpa"],
        })
    with torch.no_grad():
        calls = attention_calls(args.prompt, args.gen, args.reps)
    same = tokens["sdpa"] == tokens["tessera"]
    cpu = cpu_model()
    table = Table(title=f"SmolLM2-135M (random weights, fp32) in transformers {transformers.__version__}: "
                        f"tessera vs sdpa attention on {cpu} ({os.cpu_count()} cpus), {time.strftime('%Y-%m-%d')}")
    for col in ("phase", "sdpa ms", "tessera ms", "ratio", "min ratio", "cpu-time ratio"):
        table.add_column(col)
    for r in rows:
        table.add_row(f"{r['phase']} ({r['shape']})", f"{r['sdpa_ms']:.1f}", f"{r['tessera_ms']:.1f}",
                      f"{r['ratio_tessera_over_sdpa']:.2f}", f"{r['ratio_of_minima']:.2f}",
                      f"{r['ratio_of_cpu_times']:.2f}")
    for r in calls:
        table.add_row(f"{r['phase']} ({r['shape']})", f"{r['sdpa_ms']:.3f}", f"{r['tessera_ms']:.3f}",
                      f"{r['ratio_tessera_over_sdpa']:.2f}", "", "")
    console = Console()
    console.print(table)
    console.print(f"greedy tokens equal: {same}")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu, "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
                       "torch": torch.__version__, "transformers": transformers.__version__,
                       "model": "SmolLM2-135M config, random weights (seed 0), float32",
                       "command": f"python benchmarks/transformers_attention.py --prompt {args.prompt} "
                                  f"--gen {args.gen} --reps {args.reps} --json {args.json}",
                       "greedy_tokens_equal": same, "rows": rows, "attention_call_rows": calls,
                       "samples_s": samples}, f, indent=1)


if __name__ == "__main__":
    main()
