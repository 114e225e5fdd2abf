"""Build a :class:`TritonPlan` and launch its kernels (this module imports triton; the backend loads it lazily)."""

from __future__ import annotations

import torch

from tessera.attention.spec import AttentionSpec
from tessera.backends.base import KVLayout, RaggedBatch
from tessera.backends.triton import codegen, prelude
from tessera.backends.triton.configs import configs_for, interpreting
from tessera.backends.triton.kernels import attention_kernel, merge_kernel
from tessera.backends.triton.planner import TritonPlan, plan_launches, row_table
from tessera.kv.quantized import QuantizedPages

#: the kernel's KV_QUANT code per quantized KV format
_KV_QUANT = {"int8": 1, "fp8_e4m3": 2}


def build_plan(spec: AttentionSpec, batch: RaggedBatch, layout: KVLayout) -> TritonPlan:
    """Translate the spec and plan the work items (host only; uploads happen on the first run per device)."""
    variant = codegen.generate(spec)
    return TritonPlan(spec, batch, row_table(layout), layout.block, [], variant)


def _device_state(plan: TritonPlan, device: torch.device) -> dict:
    """Launches (their tile sizes depend on the device's tuning entry) and their tables, uploaded once per device."""
    key = str(device)
    if key not in plan.device_state:
        configs = configs_for(device, plan.spec.head_dim)
        launches = plan_launches(plan.spec, plan.batch, configs)
        up = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
        variant = plan.variant
        module = codegen.load(variant.source) if variant.source else None
        sinks = plan.spec.sinks
        plan.device_state[key] = {
            "launches": [(ln, up(ln.items), up(ln.tiles), up(ln.merges)) for ln in launches],
            "row_base": up(plan.row_base),
            "aux_i": up(variant.aux_i),
            "aux_f": up(variant.aux_f),
            "sinks": (sinks.detach().to(device, torch.float32).contiguous() if sinks is not None
                      else torch.zeros(1, dtype=torch.float32, device=device)),
            "mask_fn": module.mask_fn if variant.has_mask else prelude.keep_all,
            "score_fn": module.score_fn if variant.has_score else prelude.identity_score,
        }
    return plan.device_state[key]


def run_plan(plan: TritonPlan, q: torch.Tensor, k_rows, v_rows, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Fill ``out [total_q, Hq, D]`` (q's dtype, sinks folded in) and ``lse [total_q, Hq]`` float32.

    ``k_rows`` / ``v_rows``: ``[rows, Hkv, D]`` tensors in q's dtype, or both
    :class:`~tessera.kv.quantized.QuantizedPages` rows (the kernel de-quantizes each tile as it loads it).
    """
    spec = plan.spec
    if isinstance(k_rows, QuantizedPages):
        quant = _KV_QUANT[k_rows.fmt]
        ks, vs = k_rows.scales, v_rows.scales
        k_rows, v_rows = k_rows.code_bits(), v_rows.code_bits()
    else:
        quant, ks = 0, torch.zeros(1, 1, dtype=torch.float16, device=q.device)
        vs = ks
    state = _device_state(plan, q.device)
    d = spec.head_dim
    block_d = max(16, 1 << (d - 1).bit_length())
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    for launch, items, tiles, merges in state["launches"]:
        cfg = launch.config
        if launch.num_items == 0:
            continue
        part_out = torch.empty(max(launch.num_slots, 1) * cfg.block_m * block_d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(max(launch.num_slots, 1) * cfg.block_m, dtype=torch.float32, device=q.device)
        attention_kernel[(launch.num_items,)](
            q, k_rows, v_rows, ks, vs, out, lse, part_out, part_lse, state["sinks"], items, tiles, state["row_base"],
            state["aux_i"], state["aux_f"],
            state["row_base"].stride(0), plan.block_size,
            q.stride(0), q.stride(1), k_rows.stride(0), k_rows.stride(1), v_rows.stride(0), v_rows.stride(1),
            ks.stride(0), out.stride(0), out.stride(1), lse.stride(0),
            spec.softmax_scale,
            MASK_FN=state["mask_fn"], SCORE_FN=state["score_fn"],
            HAS_MASK=spec.mask is not None, HAS_SCORE=spec.score is not None, HAS_SINKS=spec.sinks is not None,
            HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEADS=launch.heads,
            DOT_PRECISION=precision, DOT_UPCAST=interpreting() and q.dtype == torch.bfloat16, KV_QUANT=quant,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        if len(launch.merges):
            merge_kernel[(len(launch.merges),)](
                out, lse, part_out, part_lse, state["sinks"], merges, out.stride(0), out.stride(1), lse.stride(0),
                HAS_SINKS=spec.sinks is not None, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=cfg.block_m,
                HEADS=launch.heads, num_warps=4,
            )
