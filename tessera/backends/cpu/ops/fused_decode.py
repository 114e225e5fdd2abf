"""Fused cpu decode: a small decode step runs its decoder layers as one Numba call (per run of alike layers).

A small decode step is at most ``SMALL_M`` new tokens, one or a few per sequence (plain decode, or a speculative
verification of drafted tokens). :func:`fused_layers` is the cpu backend's ``fused_decode_layers`` op, which
:func:`tessera.models.paged.forward_step` tries first wherever the model's backend offers one
(``tessera.kernels.registry.resolve_optional``). It takes the step when the model and the step fit
:func:`tessera.backends.cpu.decode_layer.decoder_layers_kernel` (why each condition exists is noted where it is
checked) and returns None otherwise, so the per-op path runs. Both paths call the same Numba
helpers in the same order, so their logits agree to float32 rounding (``tests/models/test_fused_decode.py``; LLVM may
order a fastmath reduction differently where the fused layer's row kernels are compiled).

Measured on SmolLM2-135M fp32, batch 1 (``benchmarks/e2e_cpu.py``): the per-op path spent ~8 ms of a ~21 ms decode
step in Python between kernels; see docs/engine.md for the numbers after fusion.
"""

from __future__ import annotations

import itertools
import operator
import weakref

import numba
import numpy as np
import torch

from tessera import kernels as K
from tessera.backends.cpu import variants
from tessera.backends.cpu.backend import CpuPlan
from tessera.backends.cpu.decode_kernel import code_unit
from tessera.backends.cpu.decode_layer import (
    FLOAT_PAGES, PARALLEL_WORK, decoder_layers_kernel, kv_list, layer_list,
)
from tessera.backends.cpu.kernel_args import LayerConfig, LayerNorms, LayerWeights
from tessera.backends.cpu.ops import _qdot as qdot
from tessera.backends.cpu.ops._narrow import no_rows, storage_view, vector_view
from tessera.backends.cpu.ops.norms import _rms_norm_serial
from tessera.backends.cpu.ops.quant import SMALL_M
from tessera.kernels.quant import QuantizedWeight, StackedWeight
from tessera.kv.quantized import KV_FORMATS
from tessera.models.config import ModelConfig
from tessera.tuning import tuned

_ACT_KINDS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}
_PROJECTIONS = ("qkv", "o", "gate_up", "down")
#: id(model) -> (qgemv variant, identity of every weight, views); an entry leaves with its model (weakref.finalize).
#: The views hold the weights they were built from, so those ids cannot be reused while the entry lives: a weight
#: replaced in ``model.weights`` changes the identity tuple and the views are rebuilt.
_VIEWS: dict[int, tuple] = {}
#: id(cache) -> (its K pages, its V pages, their storage rows), the same way as :data:`_VIEWS`
_KV_ROWS: dict[int, tuple] = {}


def _remember(store: dict[int, tuple], owner: object, entry: tuple) -> None:
    """``store[id(owner)] = entry`` until ``owner`` is collected (nothing is set on the owner itself)."""
    if id(owner) not in store:
        weakref.finalize(owner, store.pop, id(owner), None)
    store[id(owner)] = entry


def unsupported_reason(config: ModelConfig, weights: dict) -> str | None:
    """Why the fused kernel cannot run this model (None when it can). Checked once per model."""
    if config.norm not in ("rms", "rms_gemma"):
        return f"norm {config.norm!r} (the kernel has RMSNorm only)"
    if config.learned_positions:
        return "learned position embeddings"
    if not config.gated_mlp or config.activation not in _ACT_KINDS:
        return f"MLP is not a gated {sorted(_ACT_KINDS)} unit"
    if any(config.is_moe_layer(i) for i in range(config.num_layers)):
        return "mixture-of-experts layers"
    dtype = weights["final_norm.weight"].dtype
    for name, t in weights.items():
        if not name.startswith("layers."):
            continue
        if isinstance(t, (QuantizedWeight, StackedWeight)):
            fmt = t.fmt if isinstance(t, QuantizedWeight) else "+".join(p.fmt for p in t.parts)
            if name.rsplit(".", 2)[-2] not in _PROJECTIONS or t.device.type != "cpu":
                return f"weight {name} is a packed {fmt} {t.device.type} weight outside the four projections"
            if qdot.chosen_token(t) is not None:  # one variant runs every packed projection of the layer
                reason = qdot.unsupported(t)
                if reason is not None:
                    return f"weight {name}: the int8-activation qgemv kernels cannot take it ({reason})"
                continue
            if fmt not in ("int4", "int4_min"):
                return (f"weight {name} is {fmt}: the fused kernel takes float and int4 / int4_min projections "
                        "(and int8 and ggml block-format ones with an int8-activation qgemv variant)")
            if t.group_size < 32 or t.group_size & (t.group_size - 1):
                return f"weight {name}: int4 group size {t.group_size} (the int4 GEMV takes powers of two >= 32)"
        elif not (isinstance(t, torch.Tensor) and t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous()):
            return f"weight {name} is not a contiguous {dtype} CPU tensor (mixed dtypes)"
    return None


def _weight_view(w, isa):
    """A projection as the kernel takes it: a float storage array, or a packed weight's arrays for the ISA token
    ``isa`` (:func:`tessera.backends.cpu.ops._qdot.weight_arrays`)."""
    if isinstance(w, (QuantizedWeight, StackedWeight)):
        return qdot.weight_arrays(w, isa)
    return storage_view(w.detach())


def _shapes(value) -> tuple:
    """The shapes of every array in a nested tuple of arrays and scalars (None for a scalar)."""
    if isinstance(value, tuple):
        return tuple(_shapes(v) for v in value)
    return getattr(value, "shape", None)


def _runs(config: ModelConfig, views: list[tuple]) -> list[tuple[int, int, object]]:
    """The layers cut into runs that one :func:`decoder_layers_kernel` call takes: consecutive layers whose
    arguments have one Numba type and the same shapes (the run shares its buffers), one RoPE table and one attention
    window (the run shares its schedule). ``(start, stop, typed list of the run's views)`` each."""
    keys = [(numba.typeof((tuple(w), tuple(n))), _shapes((tuple(w), tuple(n))), config.layer_rope[i],
             config.layer_windows[i]) for i, (w, n) in enumerate(views)]
    runs, start = [], 0
    for i in range(1, len(views) + 1):
        if i == len(views) or keys[i] != keys[start]:
            runs.append((start, i, layer_list(views[start:i])))
            start = i
    return runs


def _layer_views(model) -> tuple[list[tuple], int, object, list] | None:
    """Per layer, the kernel's weight arguments as NumPy storage views; the multiply-adds of the biggest projection
    at one row of x; the ISA token of the ``qgemv`` variant for the packed projections (None: portable); and the
    layers as :func:`_runs`. None when the model cannot be fused. Built on the first decode step, kept in
    :data:`_VIEWS` while the model lives, and rebuilt when a weight is replaced or the ``qgemv`` variant changes."""
    variant = variants.choose("qgemv").name  # the views embed the variant: a forced change rebuilds them
    cached = _VIEWS.get(id(model))
    # identity by ``is`` over the weights in C (3 us for SmolLM2's 273), not a tuple of ids built per step (10 us)
    if cached is not None and cached[0] == variant and len(cached[1]) == len(model.weights) and \
            all(map(operator.is_, cached[1], model.weights.values())):
        return cached[2]
    identity = list(model.weights.values())
    config, w = model.config, model.weights
    views = None
    if unsupported_reason(config, w) is None:
        absent = storage_view(torch.zeros(0, dtype=model.dtype))
        # the token only when something is packed: choosing it compiles and self-checks the int8 kernels (~30 s
        # cold), which a float model never runs
        packed = [t for name, t in w.items() if name.startswith("layers.")
                  and isinstance(t, (QuantizedWeight, StackedWeight))]
        isa = qdot.chosen_token(*packed) if packed else None

        def get(name: str):
            if name not in w:
                return absent
            return _weight_view(w[name], isa) if name.rsplit(".", 2)[-2] in _PROJECTIONS else storage_view(w[name].detach())

        views = []
        for i in range(config.num_layers):
            p = f"layers.{i}"
            following = f"layers.{i + 1}.attn_norm" if i + 1 < config.num_layers else "final_norm"
            views.append((
                LayerWeights(
                    qkv_w=get(f"{p}.qkv.weight"), qkv_b=get(f"{p}.qkv.bias"),
                    o_w=get(f"{p}.o.weight"), o_b=get(f"{p}.o.bias"),
                    gate_up_w=get(f"{p}.gate_up.weight"), gate_up_b=get(f"{p}.gate_up.bias"),
                    down_w=get(f"{p}.down.weight"), down_b=get(f"{p}.down.bias"),
                ),
                LayerNorms(
                    q_norm_w=get(f"{p}.q_norm.weight") if config.qk_norm else absent,
                    k_norm_w=get(f"{p}.k_norm.weight") if config.qk_norm else absent,
                    post_attn_w=get(f"{p}.post_attn_norm.weight") if config.post_norms else absent,
                    mlp_norm_w=get(f"{p}.mlp_norm.weight"),
                    post_mlp_w=get(f"{p}.post_mlp_norm.weight") if config.post_norms else absent,
                    next_norm_w=get(f"{following}.weight"),
                ),
            ))
        largest = max(int(t.shape[0]) * int(t.shape[1]) for name, t in w.items()
                      if name.startswith("layers.") and name.endswith(".weight")
                      and name.rsplit(".", 2)[-2] in _PROJECTIONS)
        views = (views, largest, isa, _runs(config, views))
    _remember(_VIEWS, model, (variant, identity, views))
    return views


def _kv_lists(cache, config: ModelConfig, runs: list) -> list:
    """Per run of layers (:func:`_runs`), the :func:`~tessera.backends.cpu.decode_layer.kv_list` of its layers'
    K and V pages as the kernel's storage rows ``[rows, Hkv, D]`` and ``kv_quant`` (``decoder_layers_kernel``): built
    once per cache and set of runs instead of two tensor views per layer and step, and rebuilt if its page tensors
    were replaced."""
    cached = _KV_ROWS.get(id(cache))
    bounds = [(start, stop) for start, stop, _ in runs]
    if cached is not None and cached[3] == bounds and all(map(operator.is_, cached[0], cache.k_pages)) and \
            all(map(operator.is_, cached[1], cache.v_pages)):
        return cached[2]
    rows = (-1, config.num_kv_heads, config.head_dim)
    if getattr(cache, "kv_cache_dtype", None) is None:
        views = [(storage_view(k.view(rows)), storage_view(v.view(rows)), FLOAT_PAGES)
                 for k, v in zip(cache.k_pages, cache.v_pages)]
    else:  # codes and their scales, read and written in place
        top = np.float32(KV_FORMATS[cache.kv_cache_dtype][1])
        views = []
        for k, v in zip(cache.k_pages, cache.v_pages):
            k, v = k.reshape(rows), v.reshape(rows)
            codes = k.code_bits().numpy()
            views.append((codes, v.code_bits().numpy(),
                          (storage_view(k.scales), storage_view(v.scales), top, code_unit(codes))))
    lists = [kv_list(views[start:stop]) for start, stop in bounds]
    _remember(_KV_ROWS, cache, (list(cache.k_pages), list(cache.v_pages), lists, bounds))
    return lists


def layer_config_offset(config: ModelConfig) -> float:
    """The RMSNorm weight offset: 1.0 for Gemma's ``(1 + w)``, else 0.0."""
    return 1.0 if config.norm == "rms_gemma" else 0.0


def _workers(work: int) -> int:
    """Workers for a step whose biggest GEMV is ``work`` multiply-adds: all of Numba's threads, unless the step is so
    small that waking them costs more than they save (``fused_parallel_work``, measured by ``tessera tune``)."""
    threads = numba.get_num_threads()
    if threads <= 1 or work < tuned("fused_parallel_work", None, PARALLEL_WORK):
        return 1
    return threads


def fused_layers(model, cache, step, positions: torch.Tensor, ropes: dict, plan_for) -> torch.Tensor | None:
    """Run every layer of a small decode step fused; return the final-normed hidden states ``[T, H]``, or None when
    the step does not qualify (the caller then runs the per-op path).

    A step qualifies with at most ``SMALL_M`` tokens in all and at least one per sequence: one new token each (plain
    decode) or several (a speculative verification's drafted tokens, a short prompt chunk), as long as the attention
    backend planned every sequence as decode-shaped.

    ``plan_for(i)`` gives layer ``i``'s :class:`tessera.attention.plan.AttentionPlan` for this step.
    """
    config = model.config
    t_count = int(step.token_ids.numel())
    # Up to SMALL_M rows of x the per-op path runs the same GEMV rows as the kernel (above, BLAS: faster there, and
    # rounded differently). A sequence without new tokens is left out of the attention plan; such steps stay per-op.
    if t_count == 0 or t_count > SMALL_M or min(step.q_lens) < 1 or not ropes:
        return None
    prepared = _layer_views(model)
    if prepared is None:
        return None
    _, largest, isa, runs = prepared
    states, attention_parallel = {}, False
    # Each sequence's queries must be the consecutive token rows after the previous sequence's: the kernel's rows
    # phase writes token row seq_q_start[s] + i of the o projection's input for every sequence.
    # (accumulate, not np.cumsum of the list: 1 us against 5 on the batch-1 hot path)
    in_order = np.fromiter(itertools.accumulate(step.q_lens[:-1], initial=0), dtype=np.int64, count=len(step.q_lens))
    for i in range(config.num_layers):
        key = config.layer_windows[i]
        if key not in states:
            _, state = plan_for(i).backend_state(model.dtype, torch.device("cpu"))
            decode = state.decode if isinstance(state, CpuPlan) else None  # another attention backend: no fusion
            if (decode is None or state.cascades or state.prefill_seqs
                    or plan_for(i).spec.sinks is not None or not np.array_equal(decode.q_start, in_order)):
                return None  # shared prefixes use the cascade; sinks need the lse pass of the per-op path
            states[key] = decode.schedule
            attention_parallel |= not decode.serial
    # The attention runs inside the layer's region: a plan the planner would spread over the cores (a long context,
    # a big batch) makes the layer parallel even when its GEMVs alone would not.
    n_workers = numba.get_num_threads() if attention_parallel else _workers(t_count * largest)
    slots = step.slots.detach().to(torch.int64).numpy()
    if slots.min() < 0 or slots.max() >= cache.num_slots or (slots.size > 1 and np.unique(slots).size != slots.size):
        raise ValueError(f"forward_step: slots must be distinct and in [0, {cache.num_slots}), got {slots.tolist()}")
    w = model.weights
    scale = K.gemma_embed_scale(config.hidden_size, model.dtype) if config.embed_scale else None
    x = K.embed(step.token_ids.long(), w["embed"], scale=scale, dtype=model.dtype, backend=model.backend)
    x = x.contiguous().clone()  # updated in place, layer by layer
    h = torch.empty_like(x)
    xs, hs = storage_view(x), storage_view(h)
    # the first layer's input norm by the per-op path's own kernel, called directly: through K.rms_norm's dispatch
    # and checks it cost ~25 us a step, with the caches just flushed by the LM head
    none = no_rows(x.dtype)
    _rms_norm_serial(xs, none, vector_view(w["layers.0.attn_norm.weight"]), layer_config_offset(config),
                     float(config.norm_eps), hs, none)  # Python floats, as the per-op call passes: one compilation
    pos = positions.to(torch.int64).numpy()
    layer_config = LayerConfig.of(layer_config_offset(config), config.norm_eps, _ACT_KINDS[config.activation],
                                  config.num_heads)
    tables = {name: (rope.cos.numpy(), rope.sin.numpy()) for name, rope in ropes.items()}
    for (start, _, layers), kvs in zip(runs, _kv_lists(cache, config, runs)):
        cos, sin = tables[config.layer_rope[start]]
        decoder_layers_kernel(xs, hs, layers, kvs, layer_config, pos, cos, sin, slots,
                              states[config.layer_windows[start]], isa, n_workers)
    return h


OPS = {"fused_decode_layers": fused_layers}
