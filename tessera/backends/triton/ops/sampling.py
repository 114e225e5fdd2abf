"""Triton kernels for the vocabulary row ops (softmax, log-softmax, argmax); top-k and the sampler fall back to torch.

One program per row walks the vocabulary in blocks: an online max / sum pass, then a write pass (softmax), or a
running (max, first index) pair (argmax). Top-k uses ``torch.topk`` with the cpu backend's tie fix-up, and ``sample``
runs the reference filters in float32 on the logits' device: a fused Triton sampler (histogram threshold search, as
the cpu kernel does) is left for when a GPU is at hand to tune it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from tessera.backends.cpu.ops.sampling import topk as _torch_topk
from tessera.backends.reference.ops.sampling import draw, filter_logits
from tessera.backends.triton.configs import interpreting

if TYPE_CHECKING:
    from tessera.kernels.sampling import SamplingBatch


@triton.jit
def _softmax_kernel(x_ptr, temp_ptr, out_ptr, vocab, stride_x, stride_out,
                    HAS_TEMP: tl.constexpr, LOG: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    out_row = out_ptr + row * stride_out
    temp = 1.0
    if HAS_TEMP:
        temp = tl.load(temp_ptr + row)
    m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), 0)
    total = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32) / temp
        m_new = tl.maximum(m, tl.max(x, 0))
        # rescale the running sum to the new max (online softmax): one read of the row for both statistics
        total = total * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    log_total = tl.log(total)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < vocab
        x = tl.load(x_row + offs, mask=mask, other=float("-inf")).to(tl.float32) / temp
        if LOG:
            y = x - m - log_total
        else:
            y = tl.exp(x - m) / total
        tl.store(out_row + offs, y, mask=mask)


@triton.jit
def _argmax_kernel(x_ptr, out_ptr, vocab, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    best = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), 0)
    best_id = tl.sum(tl.zeros([BLOCK], tl.int64), 0)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        block_best = tl.max(x, 0)
        block_id = tl.argmax(x, 0, tie_break_left=True).to(tl.int64) + start
        take = block_best > best  # strict: an earlier block keeps its tie
        best_id = tl.where(take, block_id, best_id)
        best = tl.where(take, block_best, best)
    tl.store(out_ptr + row, best_id)


def _block(vocab: int) -> int:
    # The interpreter pays per block step, the GPU per register: small blocks only where tests need multi-block loops.
    if interpreting():
        return 256 if vocab <= 4096 else 4096
    return min(4096, triton.next_power_of_2(vocab))


def _row_op(logits: torch.Tensor, temperature: torch.Tensor | None, log: bool) -> torch.Tensor:
    x = logits.contiguous()
    batch, vocab = x.shape
    out = torch.empty(batch, vocab, dtype=torch.float32, device=x.device)
    if batch == 0:
        return out
    temp = out if temperature is None else temperature.to(x.device, torch.float32).contiguous()
    block = _block(vocab)
    _softmax_kernel[(batch,)](x, temp, out, vocab, x.stride(0), out.stride(0), HAS_TEMP=temperature is not None,
                              LOG=log, BLOCK=block, num_warps=8 if block >= 2048 else 4)
    return out


def softmax(logits: torch.Tensor, temperature: torch.Tensor | None) -> torch.Tensor:
    return _row_op(logits, temperature, log=False)


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    return _row_op(logits, None, log=True)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    x = logits.contiguous()
    batch, vocab = x.shape
    out = torch.empty(batch, dtype=torch.int64, device=x.device)
    if batch:
        block = _block(vocab)
        _argmax_kernel[(batch,)](x, out, vocab, x.stride(0), BLOCK=block, num_warps=8 if block >= 2048 else 4)
    return out


def topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _torch_topk(logits, k)  # torch fallback (see module docstring)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    ids, logprobs = draw(filter_logits(logits, batch, torch.float32), batch.uniform)  # torch fallback, float32
    return ids, logprobs.float()


OPS = {"softmax": softmax, "log_softmax": log_softmax, "argmax": argmax, "topk": topk, "sample": sample}
