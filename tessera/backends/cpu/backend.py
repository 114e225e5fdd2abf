"""The cpu backend: routes each sequence of a ragged batch to the BLAS tile path or the Numba decode kernel."""

from __future__ import annotations

import torch

from tessera.attention.merge import add_sinks
from tessera.attention.spec import AttentionSpec
from tessera.backends.base import AttentionRequest, RaggedBatch
from tessera.backends.cpu.decode import DECODE_MAX_Q, decode_attention, kernel_supports
from tessera.backends.cpu.prefill import prefill_attention

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class CpuBackend:
    """FlashAttention-style attention for x86/ARM CPUs (torch BLAS for prefill tiles, Numba for decode)."""

    name = "cpu"
    priority = 10

    def available(self) -> list[str]:
        return []

    def why_not(self, request: AttentionRequest) -> list[str]:
        reasons = []
        if request.device.type != "cpu":
            reasons.append(f"runs on CPU tensors, got {request.device.type}")
        if request.dtype not in _DTYPES:
            reasons.append(f"storage dtype {request.dtype} is not one of float32, bfloat16, float16")
        return reasons

    def varlen_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: RaggedBatch, spec: AttentionSpec
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.zeros(batch.total_q, spec.num_q_heads, spec.head_dim, dtype=torch.float32)
        lse = torch.full((batch.total_q, spec.num_q_heads), float("-inf"), dtype=torch.float32)
        decode_seqs, prefill_seqs = self._split(batch, spec)
        if decode_seqs:
            decode_attention(q, k, v, batch, decode_seqs, spec, out, lse)
        if prefill_seqs:
            prefill_attention(q, k, v, batch, prefill_seqs, spec, out, lse)
        if spec.sinks is not None:
            out, lse = add_sinks(out, lse, spec.sinks)
        return out.to(q.dtype), lse

    @staticmethod
    def _split(batch: RaggedBatch, spec: AttentionSpec) -> tuple[list[int], list[int]]:
        """Decode-shaped sequences (few queries) go to Numba when the spec allows it; the rest to BLAS tiles."""
        use_kernel = kernel_supports(spec)
        decode, prefill = [], []
        for s in range(batch.num_seqs):
            if batch.q_lens[s] == 0:
                continue
            (decode if use_kernel and batch.q_lens[s] <= DECODE_MAX_Q else prefill).append(s)
        return decode, prefill
