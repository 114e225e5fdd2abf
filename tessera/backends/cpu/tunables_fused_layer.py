"""The fused decode layer's serial / parallel crossover: ``fused_parallel_work``.

The layer runs on the calling thread or over all Numba threads in one parallel region
(:mod:`tessera.backends.cpu.decode_layer`). The crossover is timed on a synthetic layer shaped like a Llama's
(gate/up ``2I x H``, down ``H x I`` with ``I = 8H/3``, GQA 3:1, head dim 64), with Q4_1-style packed weights (GGUF's
most common small-model format) sized so that its biggest GEMV, gate/up, has the candidate's multiply-adds; each
timed call runs one layer's copy of the weights, rotating through enough copies to read from where a real step
would.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from typing import Any

import numba
import numpy as np
import torch

from tessera.attention.masks import causal
from tessera.attention.spec import AttentionSpec
from tessera.backends.base import KVLayout, RaggedBatch
from tessera.backends.cpu import decode
from tessera.backends.cpu.decode_layer import (
    FLOAT_PAGES, PARALLEL_WORK, decoder_layers_kernel, kv_list, layer_list,
)
from tessera.backends.cpu.kernel_args import LayerConfig, LayerNorms, LayerWeights
from tessera.backends.cpu.ops import _qdot as qdot
from tessera.bench.harness import copies_for, rotating
from tessera.tuning.fingerprint import fingerprint
from tessera.tuning.random_weights import random_qweight
from tessera.tuning.registry import Crossover, Tunable, overriding, register

#: multiply-adds of the biggest GEMV of one decode step (gate/up) the crossover is timed at
LAYER_WORK = tuple(1 << e for e in range(16, 25, 2))
HEAD_DIM = 64
KEYS = 64  # cached keys the token attends to: a short chat turn


def _layer_shape(work: int) -> tuple[int, int, int, int]:
    """(hidden, intermediate, q heads, kv heads) of a layer whose gate/up GEMV has about ``work`` multiply-adds."""
    hidden = max(3 * HEAD_DIM, round(math.sqrt(3 * work / 16) / (3 * HEAD_DIM)) * 3 * HEAD_DIM)
    inter = max(32, round(8 * hidden / 3 / 32) * 32)
    heads = hidden // HEAD_DIM
    return hidden, inter, heads, heads // 3


def _packed(n: int, k: int, gen: torch.Generator) -> tuple:

    return qdot.weight_arrays(random_qweight("int4_min", n, k, gen))


@functools.lru_cache(maxsize=1)
def _inputs(work: int) -> tuple[Callable[[], tuple], tuple[Any, ...], tuple[Any, ...]]:
    hidden, inter, hq, hkv = _layer_shape(work)
    gen = torch.Generator().manual_seed(0)
    projections = ((hq + 2 * hkv) * HEAD_DIM, hidden), (hidden, hq * HEAD_DIM), (2 * inter, hidden), (hidden, inter)
    layer_bytes = sum(n * k * 3 // 4 for n, k in projections)  # codes plus float32 scales and mins per 32
    l3 = fingerprint()["caches"].get("L3") or (32 << 20)
    copies = copies_for(layer_bytes, total=2 * l3, most=30)
    layers = [tuple(_packed(n, k, gen) for n, k in projections) for _ in range(copies)]
    spec = AttentionSpec(hq, hkv, HEAD_DIM, mask=causal())
    batch = RaggedBatch((1,), (KEYS,))
    with overriding("decode_serial_max_bytes", 1 << 62):  # one item: the crossover is the GEMVs', not the attention's
        plan = decode.DecodePlan.build(batch, [0], spec, KVLayout.contiguous(batch))
    k_rows = torch.randn(KEYS, hkv, HEAD_DIM, generator=gen).numpy()
    v_rows = torch.randn(KEYS, hkv, HEAD_DIM, generator=gen).numpy()
    half = HEAD_DIM // 2
    angles = np.outer(np.arange(KEYS), 1e-4 ** (np.arange(half) / half)).astype(np.float32)
    ones = np.ones(hidden, dtype=np.float32)
    empty = np.zeros(0, dtype=np.float32)
    x = torch.randn(1, hidden, generator=gen).numpy()
    head = (x, x / np.sqrt(np.mean(x * x)))
    norms = LayerNorms(q_norm_w=empty, k_norm_w=empty, post_attn_w=empty, mlp_norm_w=ones, post_mlp_w=empty,
                       next_norm_w=ones)
    tail = (norms, LayerConfig.of(0.0, 1e-5, 0, hq), np.array([KEYS - 1]), np.cos(angles), np.sin(angles), k_rows,
            v_rows, FLOAT_PAGES, np.array([KEYS - 1]), plan.schedule)
    return rotating(layers), head, tail


def _path(parallel: bool) -> Callable[[int, str | None], float]:
    def timed(work: int, shape_class: str | None) -> float:
        next_layer, (x0, h0), tail = _inputs(work)
        (qkv, o, gate_up, down), empty = next_layer(), np.zeros(0, dtype=np.float32)
        x, h = x0.copy(), h0.copy()  # the kernel updates both in place
        isa = qdot.chosen_token()
        workers = numba.get_num_threads() if parallel else 1
        weights = LayerWeights(qkv_w=qkv, qkv_b=empty, o_w=o, o_b=empty, gate_up_w=gate_up, gate_up_b=empty,
                               down_w=down, down_b=empty)
        norms, config, positions, cos, sin, k_rows, v_rows, kv_quant, slots, schedule = tail
        layers, kvs = layer_list([(weights, norms)]), kv_list([(k_rows, v_rows, kv_quant)])  # outside the timing
        start = time.perf_counter()
        decoder_layers_kernel(x, h, layers, kvs, config, positions, cos, sin, slots, schedule, isa, workers)
        return time.perf_counter() - start

    return timed


def register_all() -> None:
    register(Tunable(
        "fused_parallel_work", PARALLEL_WORK, LAYER_WORK, None,
        doc="Multiply-adds of a decode step's biggest GEMV from which the fused decode layer runs over all threads "
            "in one parallel region instead of on the calling thread.",
        crossover=Crossover(_path(False), _path(True), inclusive=False, unit="multiply-adds",
                            names=("serial", "parallel")),
    ), replace=True)


def release_inputs() -> None:
    _inputs.cache_clear()
