"""End-to-end workloads on the engine and on transformers, shared by ``tessera bench e2e`` and
``benchmarks/e2e_cpu.py``: one request's prefill time, one request's decode rate, with fresh random prompts.

Each function returns a dict of numbers (seconds, tokens/s) and, for generations, the tokens (greedy), so callers
can also check that both sides produced the same text.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from tessera.engine import LLM, SamplingParams


class Prompts:
    """Fresh random prompts of ordinary tokens (no two share a page, so prefix caching never helps)."""

    def __init__(self, seed: int = 0, low: int = 1000, high: int = 40000) -> None:
        self.gen, self.low, self.high = torch.Generator().manual_seed(seed), low, high

    def __call__(self, length: int) -> list[int]:
        return torch.randint(self.low, self.high, (length,), generator=self.gen).tolist()


# ------------------------------------------------------------------------------------------------ Tessera
def tessera_prefill(llm: LLM, prompt: list[int]) -> dict[str, Any]:
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    assert out.num_cached_tokens == 0, "a prefix-cache hit would flatter prefill"
    return {"seconds": out.time_to_first_token, "tok_s": len(prompt) / out.time_to_first_token}


def tessera_decode(llm: LLM, prompt: list[int], new: int) -> dict[str, Any]:
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True))
    decode_s = out.latency - out.time_to_first_token
    return {"ttft_s": out.time_to_first_token, "decode_s": decode_s, "tok_s": (new - 1) / decode_s,
            "tokens": out.token_ids}


# ------------------------------------------------------------------------------------------- transformers
class _Clock:
    """A transformers streamer that only notes when each ``put`` arrives (the prompt first, then each token)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def load_hf(path: Path) -> Any:
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    hf_generate(model, list(range(1000, 1040)), 4)  # warm-up
    return model


@torch.no_grad()
def hf_prefill(model: Any, prompt: list[int]) -> dict[str, Any]:
    ids = torch.tensor([prompt])
    start = time.perf_counter()
    model(ids, use_cache=True, logits_to_keep=1)  # like Tessera: the KV cache is filled, one row of logits
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tok_s": len(prompt) / seconds}


@torch.no_grad()
def hf_generate(model: Any, prompt: list[int], new: int) -> dict[str, Any]:
    ids = torch.tensor([prompt])
    clock = _Clock()
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, use_cache=True, streamer=clock, pad_token_id=0)
    end = time.perf_counter()
    first = clock.times[1]  # times[0] is the prompt being handed over
    return {"ttft_s": first - start, "decode_s": end - first, "tok_s": (new - 1) / (end - first),
            "latency_s": end - start, "tokens": out[0, len(prompt):].tolist()}
