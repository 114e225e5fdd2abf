"""Named records the cpu kernels take instead of long positional argument lists.

Each record is a ``typing.NamedTuple``: Numba types it as a tuple whose fields are read by name inside compiled code
(``schedule.item_seq``), so adding a field is one edit here plus the code that reads it, and a wrong order cannot
go unnoticed. Records are built in one place each (:meth:`tessera.backends.cpu.decode.DecodePlan.build`,
:func:`tessera.backends.cpu.ops.fused_decode.fused_layers`).

At the boundary from Python the records travel as plain tuples (``tuple(record)``) and the kernel rebuilds them
(``DecodeSchedule(*t)``): Numba's dispatcher types a plain tuple in its C fast path but a named one in Python, which
measured 2.5 against 1.5 us per call for 20 arrays (``/tmp`` micro-benchmark, Zen 4, 2026-12-03).

A record of arrays and scalars crosses into a Numba ``prange`` body as it is. A record holding a tuple (a packed
weight) cannot: Numba's parallel regions take only arrays, scalars and single values such as a typed list, so the
fused decode layers receive each layer's :class:`LayerWeights` and :class:`LayerNorms` as plain tuples inside a
``numba.typed.List`` and rebuild the records inside the region (``decode_layer._layers_worker``).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class DecodeSchedule(NamedTuple):
    """A decode step's work items and kv segments, built by ``DecodePlan.build`` and read by ``decode_item``.

    A work item is one sequence, or one part of a long one (split-KV), over a range of its kv segments.
    """

    item_seq: np.ndarray  #: int64 ``[items]``: the sequence of each item
    item_seg_lo: np.ndarray  #: int64 ``[items]``: first segment of each item
    item_seg_hi: np.ndarray  #: int64 ``[items]``: one past its last segment
    seq_q_start: np.ndarray  #: int64 ``[seqs]``: first query token of each sequence
    seq_q_len: np.ndarray  #: int64 ``[seqs]``: its query count
    seq_kv_len: np.ndarray  #: int64 ``[seqs]``: its key count
    row_base: np.ndarray  #: int64 ``[seqs, max_blocks]``: key j of s is row ``row_base[s, j // block] + j % block``
    block: np.int64  #: rows per addressing block (the page size, or a contiguous sequence's length)
    seg_start: np.ndarray  #: int64 ``[segments]``: first key of each segment
    seg_end: np.ndarray  #: int64 ``[segments]``: one past its last key
    seg_mask_off: np.ndarray  #: int64 ``[segments]``: offset of its mask bytes in ``mask_buf``, -1 when unmasked
    seg_mask_hstride: np.ndarray  #: int64 ``[segments]``: 1 when the mask differs per head, else 0
    mask_buf: np.ndarray  #: uint8 ``[n]``: each partial segment's keep bytes ``[heads, q_len, seg_len]``
    scale: np.float32  #: softmax scale
    softcap: np.float32  #: logit soft-cap, 0 disables
    slopes: np.ndarray  #: float32 ``[Hq]`` ALiBi slopes, or empty
    item_order: np.ndarray  #: int64 ``[items]``: the items worker by worker (the balanced schedule)
    worker_start: np.ndarray  #: int64 ``[workers + 1]``: each worker's range of ``item_order``
    seq_item_lo: np.ndarray  #: int64 ``[seqs]``: first item of each sequence
    seq_item_hi: np.ndarray  #: int64 ``[seqs]``: one past its last item


class LayerWeights(NamedTuple):
    """A decoder layer's projections: storage arrays ``[N, K]``, or packed tuples ``(codes, scales, offsets,
    has_min, group)`` for int4 / ``(codes, scales, group)`` for int8; biases ``[N]``, empty when absent."""

    qkv_w: object
    qkv_b: np.ndarray
    o_w: object
    o_b: np.ndarray
    gate_up_w: object
    gate_up_b: np.ndarray
    down_w: object
    down_b: np.ndarray


class LayerNorms(NamedTuple):
    """A decoder layer's norm weights (storage ``[H]`` or ``[D]``), empty when the model has no such norm."""

    q_norm_w: np.ndarray
    k_norm_w: np.ndarray
    post_attn_w: np.ndarray
    mlp_norm_w: np.ndarray
    post_mlp_w: np.ndarray
    next_norm_w: np.ndarray  #: the next layer's input norm (the final norm after the last layer)


class LayerConfig(NamedTuple):
    """A decoder layer's scalars. Typed fields, so every caller compiles the same kernel."""

    w_offset: np.float32  #: 1.0 for Gemma's ``(1 + w)`` norms, else 0.0
    eps: np.float32  #: norm epsilon
    act_kind: np.int64  #: 0 SiLU, 1 GELU, 2 GELU (tanh)
    num_q_heads: np.int64

    @staticmethod
    def of(w_offset: float, eps: float, act_kind: int, num_q_heads: int) -> LayerConfig:
        """The record with its fields in the types the compiled kernels take."""
        return LayerConfig(np.float32(w_offset), np.float32(eps), np.int64(act_kind), np.int64(num_q_heads))


class LayerBuffers(NamedTuple):
    """The fused layer's intermediates (allocated per call inside the kernel). Each projection's prepared input is
    three arrays ``*_in0..2`` (see ``decode_layer._new_input``)."""

    qkv_in0: np.ndarray
    qkv_in1: np.ndarray
    qkv_in2: np.ndarray
    qkv_acc: np.ndarray
    qkv: np.ndarray
    o_in0: np.ndarray
    o_in1: np.ndarray
    o_in2: np.ndarray
    o_acc: np.ndarray
    a_out: np.ndarray
    gu_in0: np.ndarray
    gu_in1: np.ndarray
    gu_in2: np.ndarray
    gu_acc: np.ndarray
    gu: np.ndarray
    act: np.ndarray
    down_in0: np.ndarray
    down_in1: np.ndarray
    down_in2: np.ndarray
    down_acc: np.ndarray
    m: np.ndarray
    att_s: np.ndarray
    h2: np.ndarray
    qf: np.ndarray
    part_out: np.ndarray
    part_lse: np.ndarray
    att: np.ndarray
    lse: np.ndarray
    sync: np.ndarray
