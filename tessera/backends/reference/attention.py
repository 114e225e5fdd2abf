"""Float64 attention oracle: materializes every score, applies the spec literally, one sequence at a time."""

from __future__ import annotations

import dataclasses

import torch

from tessera.attention.spec import AttentionSpec
from tessera.backends.base import RaggedBatch


def sequence_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec, seq_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one sequence in float64.

    Parameters
    ----------
    q : ``[q_len, Hq, D]``; k, v : ``[kv_len, Hkv, D]``, any float dtype.
    seq_index : the batch index ``b`` passed to masks and score functions.

    Returns
    -------
    out ``[q_len, Hq, D]`` float64 and lse ``[q_len, Hq]`` float64 (sinks included; -inf for fully masked rows).
    """
    q_len, kv_len = q.shape[0], k.shape[0]
    qd = q.double().permute(1, 0, 2)  # [Hq, q_len, D]
    kd = k.double().repeat_interleave(spec.group_size, dim=1).permute(1, 0, 2)
    vd = v.double().repeat_interleave(spec.group_size, dim=1).permute(1, 0, 2)
    s = torch.matmul(qd, kd.transpose(1, 2)) * spec.softmax_scale  # [Hq, q_len, kv_len]
    # Positions live on q's device: the oracle also checks CUDA kernels in place (benchmarks/gpu.py).
    dev = q.device
    b = torch.tensor(seq_index, device=dev)
    h = torch.arange(spec.num_q_heads, device=dev).view(-1, 1, 1)
    q_pos = torch.arange(kv_len - q_len, kv_len, device=dev).view(1, -1, 1)
    kv_pos = torch.arange(kv_len, device=dev).view(1, 1, -1)
    if spec.score is not None:
        s = spec.score.apply(s, b, h, q_pos, kv_pos).double()
    if spec.mask is not None:
        keep = torch.broadcast_to(spec.mask.evaluate(b, h, q_pos, kv_pos), s.shape)
        s = s.masked_fill(~keep, float("-inf"))
    if spec.sinks is not None:
        sink = spec.sinks.to(dev, torch.float64).view(-1, 1, 1).expand(-1, q_len, 1)
        lse = torch.logsumexp(torch.cat([s, sink], dim=-1), dim=-1)
    else:
        empty = torch.full((spec.num_q_heads, q_len), float("-inf"), dtype=torch.float64, device=dev)
        lse = torch.logsumexp(s, dim=-1) if kv_len else empty
    finite = torch.isfinite(lse)
    p = torch.where(finite.unsqueeze(-1), torch.exp(s - torch.where(finite, lse, 0.0).unsqueeze(-1)), 0.0)
    out = torch.matmul(p, vd)  # [Hq, q_len, D]
    return out.permute(1, 0, 2), lse.permute(1, 0)


def varlen_attention_f64(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: RaggedBatch, spec: AttentionSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged-batch oracle: float64 ``out [total_q, Hq, D]`` and ``lse [total_q, Hq]``."""
    out = torch.zeros(batch.total_q, spec.num_q_heads, spec.head_dim, dtype=torch.float64, device=q.device)
    lse = torch.full((batch.total_q, spec.num_q_heads), float("-inf"), dtype=torch.float64, device=q.device)
    for s in range(batch.num_seqs):
        qs, ql, ks, kl = batch.q_starts[s], batch.q_lens[s], batch.kv_starts[s], batch.kv_lens[s]
        if ql == 0:
            continue
        o, l = sequence_attention(q[qs : qs + ql], k[ks : ks + kl], v[ks : ks + kl], spec, s)
        out[qs : qs + ql], lse[qs : qs + ql] = o, l
    return out, lse


class ReferenceBackend:
    """The float64 oracle. Slow and memory-hungry by design; every other backend is tested against it."""

    name = "reference"
    priority = 0

    def available(self) -> list[str]:
        return []

    def device_types(self) -> tuple[str, ...]:
        """Plain torch in float64: wherever torch runs (on CUDA too, slowly; it is the oracle, not a fast path)."""
        return ("cpu", "cuda")

    def why_not(self, request) -> list[str]:
        return []

    def plan(self, spec, batch, layout, options=None):
        return (spec, batch, layout)

    def run(self, plan, q, k_rows, v_rows, out, lse):
        """Gather each sequence's rows into a contiguous batch (the oracle may copy) and fill ``out`` / ``lse``.

        Like every backend's ``run``, the result excludes sinks: the caller folds them in once (``add_sinks``).
        """
        spec, batch, layout = plan
        k_rows, v_rows = _gather(k_rows, batch, layout), _gather(v_rows, batch, layout)
        o, l = varlen_attention_f64(q, k_rows, v_rows, batch, dataclasses.replace(spec, sinks=None))
        out.copy_(o)
        lse.copy_(l)


def _gather(rows: torch.Tensor, batch, layout) -> torch.Tensor:
    parts = []
    for s in range(batch.num_seqs):
        r = layout.rows(s, batch.kv_lens[s])
        parts.append(rows[r] if isinstance(r, slice) else rows[torch.from_numpy(r)])
    return torch.cat(parts) if parts else rows[:0]
