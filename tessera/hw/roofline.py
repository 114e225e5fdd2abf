"""The roofline model, and the FLOP and byte counts of the ops an LLM step runs.

``predict_seconds = max(flops / peak_flops, bytes / mem_bw)``: the time an op needs when it either saturates the
compute units or streams its bytes from main memory at full bandwidth, whichever takes longer. It is a lower bound:
no overlap losses between compute and memory, no kernel launch or Python overheads, every byte moved exactly once
(caches assumed to hold the reuse). ``tessera profile`` (and benchmarks) count FLOPs and bytes with the ``*_cost``
functions here, so every tool means the same thing by "GFLOP/s" and "GB/s".

Counting conventions: a multiply-add is 2 FLOPs; bytes are those read plus those written, each once.

Examples
--------
>>> from tessera.hw import devices, roofline
>>> flops, nbytes = roofline.matmul_cost(1, 4096, 4096, weight_bytes_per_elem=2, act_bytes_per_elem=2)
>>> roofline.bound(flops, nbytes, devices.H100_SXM, "bf16")          # a GEMV: 1 FLOP per byte
'memory'
>>> roofline.predict_seconds(flops, nbytes, devices.H100_SXM, "bf16")  # ~10 us reading 32 MiB at 3.35 TB/s
1.0...e-05
"""

from __future__ import annotations

from collections.abc import Sequence

from tessera.hw.devices import Device

Cost = tuple[float, float]  # (flops, bytes)


def predict_seconds(flops: float, bytes_moved: float, device: Device, dtype: str = "fp32") -> float:
    """Roofline time of an op: ``max(flops / peak, bytes / mem_bw)`` in seconds (a lower bound, see the module doc).

    Parameters
    ----------
    flops : float
        Floating-point operations (a multiply-add counts 2).
    bytes_moved : float
        Bytes read from and written to main memory.
    device : Device
    dtype : str
        Key into ``device.peak_flops`` (``"fp32"``, ``"bf16"``, ...).
    """
    _check_counts(flops, bytes_moved)
    return max(flops / device.peak(dtype), bytes_moved / device.mem_bw)


def arithmetic_intensity(flops: float, bytes_moved: float) -> float:
    """FLOPs per byte moved (``inf`` when nothing moves and something is computed, 0 when neither)."""
    _check_counts(flops, bytes_moved)
    if bytes_moved == 0:
        return float("inf") if flops > 0 else 0.0
    return flops / bytes_moved


def ridge_point(device: Device, dtype: str = "fp32") -> float:
    """The intensity (FLOP/byte) where the memory roof meets the compute roof: ``peak / mem_bw``."""
    return device.peak(dtype) / device.mem_bw


def bound(flops: float, bytes_moved: float, device: Device, dtype: str = "fp32") -> str:
    """``"compute"`` when the op's intensity reaches the ridge point (the compute roof is the lower one), else
    ``"memory"``."""
    return "compute" if arithmetic_intensity(flops, bytes_moved) >= ridge_point(device, dtype) else "memory"


def attainable_flops(intensity: float, device: Device, dtype: str = "fp32") -> float:
    """FLOP/s the roofline allows at ``intensity`` FLOP/byte: ``min(peak, intensity * mem_bw)``."""
    if intensity < 0:
        raise ValueError(f"attainable_flops: intensity must be >= 0 FLOP/byte, got {intensity}")
    return min(device.peak(dtype), intensity * device.mem_bw)


def _check_counts(flops: float, bytes_moved: float) -> None:
    if flops < 0 or bytes_moved < 0:
        raise ValueError(f"flops and bytes must be >= 0, got flops={flops}, bytes={bytes_moved}")


# ----------------------------------------------------------------------------------------------- op cost models
def matmul_cost(m: int, n: int, k: int, weight_bytes_per_elem: float, act_bytes_per_elem: float,
                out_bytes_per_elem: float | None = None) -> Cost:
    """``y [m, n] = x [m, k] @ w[n, k].T``: ``2 m n k`` FLOPs; bytes = weight + x + y.

    ``weight_bytes_per_elem`` may be fractional for packed quantized weights (their total bytes, scales included,
    over ``n * k``). ``out_bytes_per_elem`` defaults to the activation's.
    """
    out = act_bytes_per_elem if out_bytes_per_elem is None else out_bytes_per_elem
    return 2.0 * m * n * k, n * k * weight_bytes_per_elem + m * k * act_bytes_per_elem + m * n * out


def attention_cost(q_lens: int | Sequence[int], kv_lens: int | Sequence[int], num_q_heads: int, num_kv_heads: int,
                   head_dim: int, bytes_per_elem: float, causal: bool = True) -> Cost:
    """Attention of a ragged batch: sequence ``s`` has ``q_lens[s]`` queries at its last positions of ``kv_lens[s]``.

    FLOPs: ``4 * head_dim * num_q_heads`` per visited (query, key) pair (``q.k`` and ``p @ v``, 2 each; softmax not
    counted). Causal visits ``pos + 1`` keys per query at absolute position ``pos``, so a full prefill (q = kv = S)
    costs the causal half ``S (S + 1) / 2`` pairs and a decode step (q = 1) reads all ``kv`` keys.
    Bytes: q read and out written, plus every K and V row read once (GQA shares them across the group).

    Examples
    --------
    >>> attention_cost(1, 1024, 32, 8, 128, 2)      # one decode token: 16.8 MFLOP, 4.2 MB of KV
    (16777216.0, 4210688.0)
    """
    q_list = [q_lens] if isinstance(q_lens, int) else list(q_lens)
    kv_list = [kv_lens] if isinstance(kv_lens, int) else list(kv_lens)
    if len(q_list) != len(kv_list):
        raise ValueError(f"attention_cost: {len(q_list)} q_lens but {len(kv_list)} kv_lens; give one of each per "
                         "sequence")
    pairs = 0
    for q, kv in zip(q_list, kv_list):
        if not 0 <= q <= kv:
            raise ValueError(f"attention_cost: need 0 <= q_len <= kv_len, got q_len={q}, kv_len={kv}")
        # queries sit at positions kv-q .. kv-1 and see keys 0..pos: the sum of an arithmetic series
        pairs += q * (2 * kv - q + 1) // 2 if causal else q * kv
    flops = 4.0 * pairs * num_q_heads * head_dim
    q_total, kv_total = sum(q_list), sum(kv_list)
    nbytes = (2 * q_total * num_q_heads + 2 * kv_total * num_kv_heads) * head_dim * bytes_per_elem
    return flops, float(nbytes)


def norm_cost(rows: int, hidden: int, bytes_per_elem: float, residual: bool = False, bias: bool = False) -> Cost:
    """RMSNorm / LayerNorm over ``[rows, hidden]``: about 4 FLOPs per element (square, sum, scale, weight) and one
    more with a fused residual add; bytes = x read + out written + the weight (+ bias) (+ residual read and the new
    residual written)."""
    elems = rows * hidden
    flops = (5.0 if residual else 4.0) * elems
    streams = 4 if residual else 2
    nbytes = (streams * elems + hidden * (2 if bias else 1)) * bytes_per_elem
    return flops, float(nbytes)


def elementwise_cost(read_elems: int, written_elems: int, bytes_per_elem: float, flops_per_elem: float = 1.0) -> Cost:
    """An elementwise op (activation, RoPE, copy): ``flops_per_elem`` per written element; bytes read + written."""
    return flops_per_elem * written_elems, float((read_elems + written_elems) * bytes_per_elem)
