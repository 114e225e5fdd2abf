"""Sampling family: vocabulary row ops and the batched sampler on LM-head logits (SmolLM2 49152, Llama 3 128256).

Torch eager's sampler is the usual composition (as Hugging Face's warpers and vLLM's torch path): divide by the
temperature, ``topk`` threshold, a full sort + softmax + cumsum for top-p, scatter back, softmax, ``multinomial``.
"""

from __future__ import annotations

import torch

from tessera.bench.kernel_cases import KernelCase
from tessera.bench.machine import host_backend
from tessera.kernels import sampling as ks
from tessera.kernels.sampling import SamplerParams

VOCABS = {"smollm2": 49152, "llama3": 128256}


def _torch_sample(logits: torch.Tensor, temp: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    x = logits.float() / temp[:, None]
    if top_k:
        kth = torch.topk(x, top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1:
        sorted_x, order = torch.sort(x, dim=-1)
        cum = torch.softmax(sorted_x, dim=-1).cumsum(dim=-1)
        drop = cum <= 1 - top_p
        drop[:, -1] = False
        x = x.scatter(1, order, sorted_x.masked_fill(drop, float("-inf")))
    return torch.multinomial(torch.softmax(x, dim=-1), 1)[:, 0]


def _row_cases(name: str, x: torch.Tensor) -> list[KernelCase]:
    ours = host_backend()  # the backend timed as ours, looked up once
    batch, vocab = x.shape
    rw = x.numel() * x.element_size() + batch * vocab * 4  # read logits, write float32
    return [
        KernelCase("sampling", f"softmax {name}", lambda: ks.softmax(x, backend=ours),
                   lambda: torch.softmax(x, dim=-1, dtype=torch.float32), rw),
        KernelCase("sampling", f"log_softmax {name}", lambda: ks.log_softmax(x, backend=ours),
                   lambda: torch.log_softmax(x, dim=-1, dtype=torch.float32), rw),
        KernelCase("sampling", f"argmax {name}", lambda: ks.argmax(x, backend=ours),
                   lambda: torch.argmax(x, dim=-1), x.numel() * x.element_size()),
        KernelCase("sampling", f"topk50 {name}", lambda: ks.topk(x, 50, backend=ours),
                   lambda: torch.topk(x, 50, dim=-1), x.numel() * x.element_size()),
    ]


def _sample_cases(name: str, x: torch.Tensor) -> list[KernelCase]:
    ours = host_backend()  # the backend timed as ours, looked up once
    batch = x.shape[0]
    temp = torch.full((batch,), 0.8)
    cases = []
    for label, top_k, top_p in (("top_k=50 top_p=0.9", 50, 0.9), ("top_p=0.95", 0, 0.95), ("plain", 0, 1.0)):
        params = [SamplerParams(temperature=0.8, top_k=top_k, top_p=top_p)] * batch
        cases.append(KernelCase(
            "sampling", f"sample {label} {name}",
            lambda params=params: ks.sample(x, params, backend=ours),
            lambda top_k=top_k, top_p=top_p: _torch_sample(x, temp, top_k, top_p),
            x.numel() * x.element_size()))
    return cases


def cases(quick: bool) -> list[KernelCase]:
    out = []
    batches = (1, 32)
    for model, vocab in VOCABS.items():
        for batch in batches:
            x = torch.randn(batch, vocab) * 4
            name = f"{model} B={batch}"
            if not quick or model == "llama3":
                out += _row_cases(name, x)
            out += _sample_cases(name, x)
    return out
