"""The cpu backend's tunables: where each threshold's two code paths trade places on this machine.

============================  ==================================================================  ============
tunable                       what it decides                                                     read in
============================  ==================================================================  ============
``quant_tile_n``              weight rows de-quantized per BLAS tile above the GEMV crossover      ops/quant.py
``quant_gemv_max_m``          rows of x up to which the packed quantized GEMV beats the tiles,    ops/quant.py
                              per format
``gemv_serial_work``          multiply-adds (M * N * K) below which the float GEMV stays on the    ops/quant.py
                              calling thread
``decode_serial_max_bytes``   K+V bytes (as float32) below which a decode step runs serially      decode.py
``fused_parallel_work``       multiply-adds of a step's biggest GEMV from which the fused decode   decode_layer
                              layer runs over all threads (:mod:`.tunables_fused_layer`)
``prefill_q_tile``            query positions per prefill attention tile (BLAS path)              prefill.py
``qgemv_variant``             which int8-activation GEMV variant runs the packed projections       variants.py
                              (``auto``: the ISA order)
============================  ==================================================================  ============

Each default is the module constant the code used before (measured on one 2-core AMD EPYC). The measurements use
realistic shapes (:mod:`tessera.tuning.workload`): SmolLM2-135M's projections (N x K = 3072 x 576, 576 x 1536, 960 x 576) and, outside ``--quick``,
a 1B-class model's (2048 x 2048, 11264 x 2048), or a given model's (``tessera tune --model``). Inputs rotate through
enough copies to exceed twice the L3 (at most one per layer of a 30-layer model), so each timed call reads its
weights or K/V from where a real forward pass would: memory for big models, L3 for small ones.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tessera.backends.base import KVLayout, RaggedBatch
from tessera.backends.cpu import decode, prefill, tunables_fused_layer, variants
from tessera.backends.cpu.ops import _gemv as float_gemv
from tessera.backends.cpu.ops import quant
from tessera.bench.harness import copies_for, rotating
from tessera.kernels.quant import QuantizedWeight
from tessera.tuning import search
from tessera.tuning.fingerprint import fingerprint
from tessera.tuning.random_weights import random_qweight
from tessera.tuning.registry import Crossover, Tunable, overriding, register
from tessera.tuning.workload import workload

#: prompt rows of x the quantized crossover is timed at (and the thresholds it can choose)
GEMV_ROWS = (8, 16, 32, 64, 128, 256)
#: rows of x the tile-size candidates are timed at: prompt-sized, above every default crossover
TILE_ROWS = 256
#: a model this many layers deep visits this many distinct weights / K/V per step: the most copies worth rotating
MAX_COPIES = 30


def _l3_bytes() -> int:
    return fingerprint()["caches"].get("L3") or (32 << 20)


def _copies(bytes_each: int) -> int:
    """Copies of an input that make a round of calls read from where a real step would (see the module doc)."""
    return copies_for(bytes_each, total=2 * _l3_bytes(), most=MAX_COPIES)


# ---------------------------------------------------------------------------------------------------- quantized GEMV

@functools.lru_cache(maxsize=1)  # one format's weights at a time: a 1B-class int8 set is ~30 MB per copy
def _quant_inputs(fmt: str, projections: tuple[tuple[int, int], ...], rows: int
                  ) -> tuple[Callable[[], list[QuantizedWeight]], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    first = [random_qweight(fmt, n, k, gen) for n, k in projections]
    copies = _copies(sum(w.nbytes for w in first))
    sets = [first] + [[random_qweight(fmt, n, k, gen) for n, k in projections] for _ in range(copies - 1)]
    xs = [torch.randn(rows, k, generator=gen) for _, k in projections]
    return rotating(sets), xs


def _time_quant_path(kernel: Callable[[torch.Tensor, QuantizedWeight], torch.Tensor], fmt: str, m: int) -> float:
    """Seconds of one pass of ``kernel`` over the workload's projections at ``m`` rows (the next copy of the
    weights)."""
    next_set, xs = _quant_inputs(fmt, workload().projections, max(GEMV_ROWS[-1], TILE_ROWS))
    weights = next_set()
    start = time.perf_counter()
    for w, x in zip(weights, xs):
        kernel(x[:m], w)
    return time.perf_counter() - start


def _gemv_path(m: int, fmt: str | None) -> float:
    return _time_quant_path(quant._gemv, fmt or "int4", m)


def _tiles_path(m: int, fmt: str | None) -> float:
    return _time_quant_path(quant._gemm_tiled, fmt or "int4", m)


#: rows of x the qgemv variants are timed at: a batch-1 decode step and a full batch of eight
VARIANT_ROWS = (1, 8)


def _measure_qgemv_variant(name: str, shape_class: str | None) -> float:
    """One pass of the quantized GEMV over the workload's projections, at each of :data:`VARIANT_ROWS`, in each of
    its packed formats (Q4_1-style int4_min and Q8_0-style int8 when the workload does not say), with variant
    ``name`` in effect."""
    formats = workload().formats or ("int4_min", "int8")
    with overriding("qgemv_variant", name):
        return sum(_time_quant_path(quant._gemv, fmt, m) for fmt in formats if fmt != "fp8_e4m3"
                   for m in VARIANT_ROWS)


def _measure_tile_n(tile_n: int, shape_class: str | None) -> float:
    with overriding("quant_tile_n", tile_n):
        return _time_quant_path(quant._gemm_tiled, "int4", TILE_ROWS)


# ------------------------------------------------------------------------------------------------- prefill tiles

#: prompt length the prefill tile size is timed at (``--quick``: the first)
PREFILL_LEN = (512, 2048)


@functools.lru_cache(maxsize=1)
def _prefill_inputs(length: int, shape: tuple[int, int, int]) -> tuple[Any, ...]:
    from tessera.attention import AttentionSpec, causal

    hq, hkv, d = shape
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(length, h, d, generator=gen) for h in (hq, hkv, hkv))
    batch = RaggedBatch((length,), (length,))
    spec = AttentionSpec(hq, hkv, d, mask=causal())
    return q, k, v, batch, KVLayout.contiguous(batch), spec, torch.empty(length, hq, d), torch.empty(length, hq)


def _measure_q_tile(q_tile: int, shape_class: str | None) -> float:
    """One causal fp32 prefill of the workload's attention shape with ``q_tile`` query positions per tile."""
    w = workload()
    length = PREFILL_LEN[0] if search.options().quick else PREFILL_LEN[1]
    q, k, v, batch, layout, spec, out, lse = _prefill_inputs(length, (w.num_q_heads, w.num_kv_heads, w.head_dim))
    with overriding("prefill_q_tile", q_tile):
        start = time.perf_counter()
        prefill.prefill_attention(q, k, v, batch, layout, [0], spec, out, lse)
        return time.perf_counter() - start


# ------------------------------------------------------------------------------------------------------- float GEMV

#: multiply-adds of one GEMV (M = 1, N x K) the serial / parallel crossover is timed at
GEMV_WORK = tuple(1 << e for e in range(19, 26))


@functools.lru_cache(maxsize=len(GEMV_WORK))
def _float_inputs(work: int) -> tuple[Callable[[], np.ndarray], np.ndarray, np.ndarray]:
    k = 576 if work <= 1 << 22 else 2048  # SmolLM2's hidden size for the small products, a 1B model's above
    n = max(16, round(work / k / 16) * 16)
    copies = _copies(n * k * 4)
    # fill_ rather than random values: it touches every page at memory speed, and no value is subnormal
    weights = [torch.empty(n, k).fill_(0.01).numpy() for _ in range(copies)]
    return rotating(weights), np.full((1, k), 0.5, dtype=np.float32), np.empty((1, n), dtype=np.float32)


def _float_gemv_path(kernel: Callable[..., None]) -> Callable[[int, str | None], float]:
    def timed(work: int, shape_class: str | None) -> float:
        next_w, x, out = _float_inputs(work)
        start = time.perf_counter()
        for _ in range(_copies(x.shape[1] * out.shape[1] * 4)):  # one call per "layer": every copy once
            kernel(x, next_w(), out)
        return time.perf_counter() - start

    return timed


# ----------------------------------------------------------------------------------------------------------- decode

#: K+V bytes (counted as float32, as decode.py does) of the decode steps the serial / parallel crossover is timed at
DECODE_BYTES = tuple(1 << e for e in range(17, 24))


@functools.lru_cache(maxsize=2 * len(DECODE_BYTES))
def _decode_inputs(num_bytes: int, serial: bool, shape: tuple[int, int, int]) -> tuple[Any, ...]:
    from tessera.attention import AttentionSpec, causal

    hq, hkv, d = shape
    keys = max(1, num_bytes // (hkv * d * 8))
    spec = AttentionSpec(hq, hkv, d, mask=causal())
    batch = RaggedBatch((1,), (keys,))
    # the plan reads the threshold while it is built: force the path under test
    with overriding("decode_serial_max_bytes", (1 << 62) if serial else 0):
        plan = decode.DecodePlan.build(batch, [0], spec, KVLayout.contiguous(batch))
    gen = torch.Generator().manual_seed(0)
    copies = _copies(2 * keys * hkv * d * 4)
    kv = [(torch.randn(keys, hkv, d, generator=gen), torch.randn(keys, hkv, d, generator=gen))
          for _ in range(copies)]
    q = torch.randn(1, hq, d, generator=gen)
    return plan, q, rotating(kv), copies, torch.empty(1, hq, d), torch.empty(1, hq)


def _decode_path(serial: bool) -> Callable[[int, str | None], float]:
    def timed(num_bytes: int, shape_class: str | None) -> float:
        w = workload()
        plan, q, next_kv, copies, out, lse = _decode_inputs(num_bytes, serial,
                                                             (w.num_q_heads, w.num_kv_heads, w.head_dim))
        start = time.perf_counter()
        for _ in range(copies):  # one step: every layer's K/V once
            k, v = next_kv()
            plan.run(q, k, v, out, lse)
        return time.perf_counter() - start

    return timed


# ---------------------------------------------------------------------------------------------------- registrations

def _register_all() -> None:
    # Order matters: the crossover of the quantized GEMV times the tiled path with quant_tile_n already tuned.
    register(Tunable(
        "quant_tile_n", quant.TILE_N, (256, 512, 1024, 2048), _measure_tile_n,
        doc="Weight rows de-quantized per BLAS tile by qmatmul above the GEMV crossover: big enough for an "
            "efficient GEMM, small enough that the de-quantized tile stays in cache.",
    ), replace=True)
    register(Tunable(
        "quant_gemv_max_m", {fmt: quant.gemv_max_m_default(fmt) for fmt in quant.QUANT_GEMV_MAX_M}, GEMV_ROWS, None,
        tuple(quant.QUANT_GEMV_MAX_M),
        doc="Rows of x up to which qmatmul streams the packed weights through the quantized GEMV; above it, "
            "de-quantized tiles through BLAS win. Per format.",
        crossover=Crossover(_gemv_path, _tiles_path, inclusive=True, unit="rows", names=("packed GEMV", "BLAS tiles")),
    ), replace=True)
    register(Tunable(
        "gemv_serial_work", quant.SERIAL_WORK, GEMV_WORK, None,
        doc="Multiply-adds (M * N * K) below which the float GEMV runs on the calling thread: waking the thread "
            "pool costs more than splitting the read saves.",
        crossover=Crossover(_float_gemv_path(float_gemv.gemv_serial), _float_gemv_path(float_gemv.gemv),
                            inclusive=False, unit="multiply-adds", names=("serial", "parallel")),
    ), replace=True)
    register(Tunable(
        "decode_serial_max_bytes", decode.SERIAL_MAX_BYTES, DECODE_BYTES, None,
        doc="K+V bytes (as float32) of a decode step below which it runs on the calling thread, unsplit (with one "
            "Numba thread every step is serial and the value is moot).",
        crossover=Crossover(_decode_path(True), _decode_path(False), inclusive=False, unit="bytes",
                            names=("serial", "split-KV parallel")),
    ), replace=True)
    register(Tunable(
        "prefill_q_tile", prefill.Q_TILE, (64, 128, 256), _measure_q_tile,
        doc="Query positions per tile of the BLAS prefill attention: bigger tiles make bigger GEMMs and fewer "
            "tasks, smaller ones skip more of a causal mask's empty corner.",
    ), replace=True)
    tunables_fused_layer.register_all()
    # Only the variants this CPU runs are candidates, so a cache file never names one it cannot execute; one that
    # does anyway (a copied file) is ignored by variants.choose. The portable float kernels never win: not timed.
    runnable = tuple(v for v in variants.available("qgemv") if v != variants.PORTABLE)
    register(Tunable(
        "qgemv_variant", variants.AUTO, (variants.AUTO, *runnable), _measure_qgemv_variant,
        doc="Which int8-activation GEMV variant runs the packed projections (decode and short prompts): 'auto' "
            "keeps the ISA order (VNNI before AVX2); a variant name, the one timed fastest on this machine.",
    ), replace=True)


def release_inputs() -> None:
    """Free the measurement inputs (a few hundred MB while a run of ``tessera tune`` holds them)."""
    for fn in (_quant_inputs, _float_inputs, _decode_inputs, _prefill_inputs):
        fn.cache_clear()
    tunables_fused_layer.release_inputs()


_register_all()
