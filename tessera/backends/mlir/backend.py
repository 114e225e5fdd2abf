"""The mlir backend: each spec lowered to an MLIR kernel (``tessera.mlir``), compiled by IREE, run on this CPU."""

from __future__ import annotations

import functools
import threading

import numpy as np
import torch

from tessera.attention.spec import AttentionSpec
from tessera.backends.base import AttentionRequest, KVLayout, PlanOptions, RaggedBatch
from tessera.dtypes import FLOAT_DTYPES


class MlirBackend:
    """Attention through MLIR: the spec becomes a FlashAttention-style loop in the upstream dialects
    (:mod:`tessera.mlir.attention_kernel`), which IREE compiles for this CPU's llvm-cpu target.

    Compiled modules are cached in memory and on disk, keyed by the spec's structure and the padded head dim; lengths,
    batch sizes, head counts and the values a mask holds are runtime arguments, so they never recompile. Inputs are
    computed in float32 (bfloat16 and float16 are widened on the host); the output is cast back by the caller.
    """

    name = "mlir"
    #: under the cpu backend: ``backend="auto"`` picks it only when asked by name
    priority = 5
    fused_epilogue = False
    #: registers the kernel's tiling and key-layout tunables (``tessera tune``)
    tunables_module = "tessera.backends.mlir.tunables"

    def available(self) -> list[str]:
        from tessera.mlir.iree_compile import missing

        return missing()

    def device_types(self) -> tuple[str, ...]:
        return ("cpu",)

    def why_not(self, request: AttentionRequest) -> list[str]:
        reasons = []
        if request.device.type != "cpu":
            reasons.append(f"runs on cpu tensors (IREE's llvm-cpu target), got {request.device.type}")
        if request.dtype not in FLOAT_DTYPES:
            reasons.append(f"storage dtype {request.dtype} is not one of float32, bfloat16, float16")
        untranslatable = _translation_error(request.spec)
        if untranslatable:
            reasons.append(untranslatable)
        return reasons

    def plan(self, spec: AttentionSpec, batch: RaggedBatch, layout: KVLayout, options: PlanOptions | None = None):
        from tessera.backends.mlir.planner import build_plan

        return build_plan(spec, batch, layout)

    def run(self, plan, q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, out: torch.Tensor,
            lse: torch.Tensor) -> None:
        """Fill ``out [total_q, Hq, D]`` (float32) and ``lse [total_q, Hq]`` (see :class:`Backend.run`)."""
        from tessera.mlir.iree_compile import as_device, load_function

        if plan.items.shape[0] == 0:
            return  # no query rows: out stays 0 and lse -inf, as the caller allocated them
        element = _ELEMENTS[k_rows.dtype] if plan.key_layout == "tokens" else "f32"
        kernel = kernel_for(plan.spec, plan.key_layout, element, plan.rows, plan.kv_tile)
        fn = load_function(kernel.text, kernel.entry)
        d, dp = plan.spec.head_dim, kernel.head_dim_padded
        qf = _pad_dim(q.float(), dp)
        if plan.key_layout == "tokens":
            k_in, v_in = k_rows, v_rows  # read in place through the page table (kv_map)
        else:
            k_in, v_in = pack_kv(k_rows, v_rows, plan.kv_gather, dp)
        res_out, res_lse = fn(as_device(qf), as_device(k_in), as_device(v_in), plan.items, plan.tiles, plan.kv_map,
                              kernel.aux_i, kernel.aux_f)
        out.copy_(torch.from_numpy(np.asarray(res_out.to_host()))[..., :d])
        lse.copy_(torch.from_numpy(np.asarray(res_lse.to_host())))


def pack_kv(k_rows: torch.Tensor, v_rows: torch.Tensor, gather: np.ndarray, width: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's key and value layouts (:mod:`tessera.mlir.attention_kernel`) from token rows.

    Returns
    -------
    kt : float32 ``[Hkv, rows / 16, width, 16]``: each tile of 16 keys is one contiguous ``width x 16`` block, so the
        score loop reads one vector per ``d`` and walks memory in order.
    v : float32 ``[rows, Hkv, width]``, token-major.
    """
    pad = gather < 0
    index = torch.from_numpy(np.where(pad, 0, gather))
    pad_rows = torch.from_numpy(np.flatnonzero(pad))
    kv_heads = k_rows.shape[1]

    def gathered(rows: torch.Tensor) -> torch.Tensor:
        out = rows.index_select(0, index) if len(index) != rows.shape[0] or not _is_identity(gather) else rows
        out = out.float()
        if len(pad_rows):
            out = out.index_fill(0, pad_rows, 0.0) if out is rows else out.index_fill_(0, pad_rows, 0.0)
        return _pad_dim(out, width)

    keys = gathered(k_rows)
    kt = keys.view(-1, 16, kv_heads, width).permute(2, 0, 3, 1).contiguous()
    return kt, gathered(v_rows)


def _is_identity(gather: np.ndarray) -> bool:
    return bool(gather.size == 0 or (gather[0] == 0 and np.all(np.diff(gather) == 1)))


def _pad_dim(x: torch.Tensor, width: int) -> torch.Tensor:
    if x.shape[-1] == width:
        return x.contiguous()
    return torch.nn.functional.pad(x, (0, width - x.shape[-1])).contiguous()


_BY_STRUCTURE: dict[tuple, object] = {}
_LOCK = threading.Lock()


_ELEMENTS = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


def kernel_for(spec: AttentionSpec, key_layout: str = "tiles", element: str = "f32", rows: int | None = None,
               kv_tile: int | None = None):
    """The lowered kernel of ``spec`` (:class:`~tessera.mlir.attention_kernel.AttentionKernel`) for a key layout,
    storage element type, query rows per item and keys per kv tile (None: the kernel's defaults; a plan passes its
    own): shared by specs of equal structure, else cached per spec object (specs holding tensors or user
    functions)."""
    from tessera.mlir.attention_kernel import KV_TILE, ROWS

    rows = ROWS if rows is None else rows
    kv_tile = KV_TILE if kv_tile is None else kv_tile
    key = spec.structure_key()
    if key is None:
        return _kernel_by_object(spec, key_layout, element, rows, kv_tile)
    key = (key, key_layout, element, rows, kv_tile)
    with _LOCK:
        kernel = _BY_STRUCTURE.get(key)
    if kernel is None:
        from tessera.mlir.attention_kernel import lower_attention

        kernel = lower_attention(spec, key_layout, element, rows=rows, kv_tile=kv_tile)
        with _LOCK:
            _BY_STRUCTURE.setdefault(key, kernel)
    return kernel


@functools.lru_cache(maxsize=256)
def _kernel_by_object(spec: AttentionSpec, key_layout: str, element: str, rows: int, kv_tile: int):
    from tessera.mlir.attention_kernel import lower_attention

    return lower_attention(spec, key_layout, element, rows=rows, kv_tile=kv_tile)


def _translation_error(spec: AttentionSpec) -> str:
    """Why the spec cannot be lowered ("" when it can); the lowering is kept for the run that follows."""
    from tessera.mlir.trace import UntranslatableError

    try:
        kernel_for(spec)
    except UntranslatableError as exc:
        return f"its mask or score function cannot be translated to MLIR: {exc}"
    return ""
