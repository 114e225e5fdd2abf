"""The mlir backend's tunables: the attention kernel's tiling and its key-layout rule.

==========================  =====================================================================  ==============
tunable                     what it decides                                                        read in
==========================  =====================================================================  ==============
``mlir_attention_rows``     query rows per work item (4: 4 x D/16 accumulators fill the vector     planner.py
                            registers up to D = 128)
``mlir_attention_kv_tile``  keys per kv tile (16: one vector); bigger tiles rescale the online      planner.py
                            softmax less often and visit more masked keys at a mask's edge
``mlir_tokens_max_q``       queries per sequence up to which a batch reads keys in place           planner.py
                            ("tokens" layout) instead of packing them ("tiles")
==========================  =====================================================================  ==============

The planner reads them once per plan and records ``rows`` and ``kv_tile`` in it; the backend lowers the kernel with
the plan's values, and the lowered kernel is cached per ``(structure, layout, element, rows, kv_tile)`` (the IREE
binary by its text, which spells both out). Each default is the constant the kernel used before it was tunable.

The measurements time the public ``attention(..., backend="mlir")`` on the workload's attention shape
(:mod:`tessera.tuning.workload`: SmolLM2's 9/3 heads of 64 by default): a causal prefill of 1024 tokens (512 with
``--quick``) for the tiling, and a batch of 4 sequences of 1024 keys at a grid of query counts for the layout
crossover. Importing this module imports neither IREE nor torch kernels; the first measurement compiles.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch

from tessera.backends.mlir import planner
from tessera.mlir.attention_kernel import KV_TILE, KV_TILE_CHOICES, ROW_CHOICES, ROWS
from tessera.tuning.registry import Crossover, Tunable, overriding, register

#: batch of the layout crossover's measurement (sequences of ``_kv_len()`` keys)
CROSSOVER_BATCH = 4
#: query counts per sequence the layout crossover is timed at (and the thresholds it can choose)
CROSSOVER_GRID = (1, 2, 4, 8, 16, 32)


def _kv_len() -> int:
    from tessera.tuning import search

    return 512 if search.options().quick else 1024


def _shape() -> tuple[int, int, int]:
    from tessera.tuning import search
    from tessera.tuning.workload import workload

    w = search.options().workload or workload()
    return w.num_q_heads, w.num_kv_heads, w.head_dim


@functools.lru_cache(maxsize=4)
def _inputs(batch: int, q_len: int, kv_len: int, shape: tuple[int, int, int]
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hq, hkv, d = shape
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(batch, q_len, hq, d, generator=gen), torch.randn(batch, kv_len, hkv, d, generator=gen),
            torch.randn(batch, kv_len, hkv, d, generator=gen))


def time_attention(batch: int, q_len: int, kv_len: int, overrides: dict[str, object] | None = None,
                   shape: tuple[int, int, int] | None = None) -> float:
    """Seconds of one causal ``attention(..., backend="mlir")`` call with the tunables in ``overrides`` in effect
    (the first call of a configuration compiles its kernel: time a second one)."""
    from tessera.attention import AttentionSpec, attention, causal

    shape = shape or _shape()
    q, k, v = _inputs(batch, q_len, kv_len, shape)
    spec = AttentionSpec(*shape, mask=causal())
    with _overriding(dict(overrides or {})):
        start = time.perf_counter()
        attention(q, k, v, spec, backend="mlir")
        return time.perf_counter() - start


class _overriding:
    """Several :func:`~tessera.tuning.registry.overriding` blocks as one."""

    def __init__(self, values: dict[str, object]) -> None:
        self.blocks = [overriding(name, value) for name, value in values.items()]

    def __enter__(self) -> None:
        for block in self.blocks:
            block.__enter__()

    def __exit__(self, *exc: object) -> None:
        for block in reversed(self.blocks):
            block.__exit__(*exc)


def _measure(name: str) -> Callable[[int, str | None], float]:
    def measure(value: int, shape_class: str | None) -> float:
        n = _kv_len()
        return time_attention(1, n, n, {name: value})
    return measure


def _layout_path(tokens: bool) -> Callable[[int, str | None], float]:
    # A threshold of 2**30 sends every batch to the tokens layout, 0 every batch to the tiles layout.
    def timed(m: int, shape_class: str | None) -> float:
        return time_attention(CROSSOVER_BATCH, m, _kv_len(), {"mlir_tokens_max_q": (1 << 30) if tokens else 0})
    return timed


def _register_all() -> None:
    register(Tunable(
        "mlir_attention_rows", ROWS, ROW_CHOICES, _measure("mlir_attention_rows"),
        doc="Query rows per work item of the MLIR attention kernel: more rows share each key and value read, "
            "too many spill the accumulators out of the vector registers.",
    ), replace=True)
    register(Tunable(
        "mlir_attention_kv_tile", KV_TILE, KV_TILE_CHOICES, _measure("mlir_attention_kv_tile"),
        doc="Keys per kv tile of the MLIR attention kernel (a multiple of 16): bigger tiles rescale the online "
            "softmax less often, smaller ones skip more of a mask's empty tiles.",
    ), replace=True)
    register(Tunable(
        "mlir_tokens_max_q", planner.TOKENS_MAX_Q, CROSSOVER_GRID, None,
        doc="Queries per sequence up to which the MLIR attention reads keys in place (tokens layout, dot "
            "products) instead of packing them into transposed tiles (outer products).",
        crossover=Crossover(_layout_path(True), _layout_path(False), inclusive=True, unit="queries",
                            names=("tokens layout", "tiles layout")),
    ), replace=True)


def release_inputs() -> None:
    """Free the measurement inputs."""
    _inputs.cache_clear()


_register_all()
