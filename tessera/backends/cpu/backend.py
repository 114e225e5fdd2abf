"""The cpu backend: routes each sequence of a ragged batch to the BLAS tile path or the Numba decode kernel."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from tessera.attention.spec import AttentionSpec
from tessera.backends.base import DEFAULT_PLAN_OPTIONS, AttentionRequest, KVLayout, PlanOptions, RaggedBatch
from tessera.backends.cpu.cascade import Cascade, cascade_prefix, find_cascades, merge_cascade
from tessera.backends.cpu.decode import DECODE_MAX_Q, DecodePlan, kernel_supports
from tessera.backends.cpu.prefill import prefill_attention
from tessera.dtypes import FLOAT_DTYPES
from tessera.kv.quantized import KV_FORMATS

#: A prefill with at most this many score entries (q_len * kv_len * Hq) runs in the Numba decode kernel: its fixed
#: cost is ~20 us, the BLAS tile path's ~50 small torch ops ~0.4 ms. Measured crossover (one layer, causal, paged):
#: 9 heads D=64: 64 tokens 0.28 vs 0.38 ms, 128 tokens 0.89 vs 0.76; 32 heads D=128: 32 tokens 0.44 vs 0.61 ms,
#: 64 tokens 1.7 vs 0.94.
SMALL_PREFILL_SCORES = 1 << 15


@dataclass(frozen=True, slots=True)
class CpuPlan:
    spec: AttentionSpec
    batch: RaggedBatch
    layout: KVLayout
    decode: DecodePlan | None
    prefill_seqs: list[int]
    cascades: list[Cascade]


class CpuBackend:
    """FlashAttention-style attention for x86/ARM CPUs (BLAS tiles for prefill, Numba kernels for decode)."""

    name = "cpu"
    priority = 10
    #: registers this backend's thresholds with :mod:`tessera.tuning` (``tessera tune`` measures them)
    tunables_module = "tessera.backends.cpu.tunables"

    #: runs a model at once, compiling nothing, while this backend's kernels compile on a first run
    #: (:mod:`tessera.tools.first_run`)
    quick_start_backend = "reference"

    def available(self) -> list[str]:
        return []

    def warm_marker_dir(self) -> Path | None:
        """Where tools record which models' kernels are all compiled: inside Numba's cache directory for the current
        kernel sources (:mod:`tessera._numba_cache`), per CPU (one home directory can serve several machines, and
        Numba keys its machine code by the host CPU). None when Numba has no cache directory set (no writable cache:
        every process compiles, so a marker would mean nothing)."""
        root = os.environ.get("NUMBA_CACHE_DIR")
        if not root:
            return None
        import llvmlite.binding as llvm  # what Numba keys its own cache by

        cpu = hashlib.sha256((llvm.get_host_cpu_name() + llvm.get_host_cpu_features().flatten()).encode())
        return Path(root) / "warm" / cpu.hexdigest()[:12]

    def device_types(self) -> tuple[str, ...]:
        return ("cpu",)

    def kernel_variants(self) -> list[dict[str, object]]:
        """Per op family, the kernel variant chosen for this CPU and why (:func:`.variants.explain`)."""
        from tessera.backends.cpu import variants

        return variants.explain()

    def compute_peaks(self) -> dict[str, float]:
        """Roofline peaks of this backend's variants beyond the fp32 GEMM ceiling (measured: :mod:`.peaks`)."""
        from tessera.backends.cpu import peaks

        return peaks.compute_peaks()

    def compute_roof(self, op: str, args: tuple) -> str | None:
        """Which of :meth:`compute_peaks` an accounted op call runs on (None: the model dtype's roof)."""
        from tessera.backends.cpu import peaks

        return peaks.roof_of(op, args)

    def kv_storage(self):
        """Host KV pools written by a Numba kernel (:class:`.kv_storage.CpuKVStorage`)."""
        from tessera.backends.cpu.kv_storage import CpuKVStorage

        return CpuKVStorage()

    def profile_targets(self) -> tuple:
        """This backend's own kernels that ``tessera profile`` counts: ``(module, attribute, op name, cost)``."""
        from tessera.backends.cpu.profile_costs import PROFILE_TARGETS

        return PROFILE_TARGETS

    def why_not(self, request: AttentionRequest) -> list[str]:
        reasons = []
        if request.device.type != "cpu":
            reasons.append(f"runs on CPU tensors, got {request.device.type}")
        if request.dtype not in FLOAT_DTYPES:
            reasons.append(f"storage dtype {request.dtype} is not one of float32, bfloat16, float16")
        return reasons

    def plan(self, spec: AttentionSpec, batch: RaggedBatch, layout: KVLayout,
             options: PlanOptions = DEFAULT_PLAN_OPTIONS) -> CpuPlan:
        """Host-side work of one step: routing, decode segments, masks of partial decode tiles and, when
        ``options.shared_prefix``, the cascades over shared prefixes."""
        decode_seqs, prefill_seqs = self._split(batch, spec)
        cascades = find_cascades(batch, decode_seqs, spec, layout) if options.shared_prefix else []
        kv_begin = {s: c.prefix_len for c in cascades for s in c.members}
        decode = DecodePlan.build(batch, decode_seqs, spec, layout, kv_begin) if decode_seqs else None
        return CpuPlan(spec, batch, layout, decode, prefill_seqs, cascades)

    def run(self, plan: CpuPlan, q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor,
            out: torch.Tensor, lse: torch.Tensor) -> None:
        """Fill ``out`` / ``lse`` (float32, without sinks) for one layer; K/V are token rows addressed by the plan."""
        # Shared prefixes first (see cascade_prefix), then every decode including the cascades' suffixes, then the
        # prefixes merge into those suffix rows.
        prefixes = [cascade_prefix(c, plan.spec, q, k_rows, v_rows) for c in plan.cascades]
        if plan.decode is not None:
            plan.decode.run(q, k_rows, v_rows, out, lse)
        for cascade, parts in zip(plan.cascades, prefixes, strict=True):
            merge_cascade(cascade, parts, out, lse)
        if plan.prefill_seqs:
            prefill_attention(q, k_rows, v_rows, plan.batch, plan.layout, plan.prefill_seqs, plan.spec, out, lse)

    def reads_quantized_kv(self, plan: CpuPlan, fmt: str) -> bool:
        """Whether :meth:`run` takes quantized rows (``fmt``: a :data:`tessera.kv.quantized.KV_FORMATS` name) as they
        are: always. The decode kernel reads int8 and e4m3 codes in its loads; prefill tiles and cascade prefixes
        de-quantize the rows they read inside the one float32 gather pass they make anyway (``kv_gather.py``)."""
        return fmt in KV_FORMATS

    @staticmethod
    def _split(batch: RaggedBatch, spec: AttentionSpec) -> tuple[list[int], list[int]]:
        """Decode-shaped sequences (few queries) and tiny prefills go to Numba when the spec allows it; the rest to
        BLAS tiles."""
        use_kernel = kernel_supports(spec)
        decode, prefill = [], []
        for s in range(batch.num_seqs):
            ql = batch.q_lens[s]
            if ql == 0:
                continue
            small = ql <= DECODE_MAX_Q or ql * batch.kv_lens[s] * spec.num_q_heads <= SMALL_PREFILL_SCORES
            (decode if use_kernel and small else prefill).append(s)
        return decode, prefill
