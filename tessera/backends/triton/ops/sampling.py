"""Triton kernels for the vocabulary row ops (softmax, log-softmax, argmax, top-k); the sampler falls back to torch.

One program per row walks the vocabulary in blocks: an online max / sum pass, then a write pass (softmax), or a
running (max, first index) pair (argmax). ``sample`` runs the reference filters in float32 on the logits' device: a
fused Triton sampler (histogram threshold search, as the cpu kernel does) is left for when a GPU is at hand to tune it.

Top-k for ``k <= MAX_TRITON_K`` packs each logit and its index into one int64 key, ``(ordered float32 bits) << 32 |
(2^32 - 1 - index)``, so "key descending" is exactly the library's order (value descending, index ascending) and
keys are unique. Phase 1, one program per (row, chunk of the vocabulary): k rounds of max-and-mask over the chunk in
registers write the chunk's k best keys. Phase 2, one program per row (skipped when the row is one chunk): k rounds
over those candidates, each taking the largest key below the previous one. The k best keys of the row are among
the chunks' k best, so the result is the reference's stable sort cut at k, boundary ties included (the lowest
indices win). Values are gathered from the logits by index (exact, ``-0.0`` kept). Larger k uses ``torch.topk`` with
the cpu backend's tie fix-up.
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


#: Largest k the Triton top-k runs (k rounds per chunk); larger k falls back to torch.topk + the tie fix-up.
MAX_TRITON_K = 64
_KEY_MIN: tl.constexpr = -(2**63)  # below every real key (the most negative ordered float, NaN, is > -2^63 >> 32)
_KEY_MAX: tl.constexpr = 2**63 - 1


@triton.jit
def _topk_chunk_kernel(x_ptr, cand_ptr, vocab, stride_x, k, num_chunks, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1).to(tl.int64)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < vocab
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32) + 0.0  # -0.0 -> +0.0
    bits = x.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # signed int order == float order
    keys = (ordered.to(tl.int64) << 32) | (4294967295 - offs)
    keys = tl.where(mask, keys, _KEY_MIN)
    out = cand_ptr + (row * num_chunks + chunk) * k
    for r in range(k):
        best = tl.max(keys, 0)
        tl.store(out + r, best)
        keys = tl.where(keys == best, _KEY_MIN, keys)


@triton.jit
def _topk_merge_kernel(cand_ptr, out_ptr, length, k, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = cand_ptr + row * length
    prev = tl.max(tl.full([BLOCK], _KEY_MAX, tl.int64), 0)
    for r in range(k):
        best = tl.max(tl.full([BLOCK], _KEY_MIN, tl.int64), 0)
        for start in range(0, length, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            c = tl.load(base + offs, mask=offs < length, other=_KEY_MIN)
            best = tl.maximum(best, tl.max(tl.where(c < prev, c, _KEY_MIN), 0))
        tl.store(out_ptr + row * k + r, best)
        prev = best


def topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    batch, vocab = logits.shape
    if k > MAX_TRITON_K or vocab >= 2**31:
        return _torch_topk(logits, k)  # torch fallback (see module docstring)
    x = logits.contiguous()
    if batch == 0:
        return torch.empty(0, k, dtype=torch.float32, device=x.device), torch.empty(0, k, dtype=torch.int64,
                                                                                    device=x.device)
    if interpreting():
        block = 256 if vocab <= 4096 else 8192
    else:
        block = min(1024, max(triton.next_power_of_2(vocab), 128))
    chunks = triton.cdiv(vocab, block)
    cand = torch.empty(batch, chunks * k, dtype=torch.int64, device=x.device)
    _topk_chunk_kernel[(batch, chunks)](x, cand, vocab, x.stride(0), k, chunks, BLOCK=block)
    if chunks == 1:
        keys = cand
    else:
        keys = torch.empty(batch, k, dtype=torch.int64, device=x.device)
        length = chunks * k
        _topk_merge_kernel[(batch,)](cand, keys, length, k, BLOCK=min(4096, triton.next_power_of_2(length)))
    ids = 4294967295 - (keys & 4294967295)
    return x.gather(1, ids).float(), ids


def sample(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    ids, logprobs = draw(filter_logits(logits, batch, torch.float32), batch.uniform)  # torch fallback, float32
    return ids, logprobs.float()


def filtered_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    return torch.softmax(filter_logits(logits, batch, torch.float32), dim=-1)


OPS = {"softmax": softmax, "log_softmax": log_softmax, "argmax": argmax, "topk": topk, "sample": sample,
       "filtered_probs": filtered_probs}
