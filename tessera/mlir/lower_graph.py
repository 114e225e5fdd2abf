"""Lowering of a captured ``tessera`` function (after the passes) to one IREE module, and running it.

Each tessera op becomes calls of the kernel functions the ``mlir`` backend runs one by one (``op_kernels``: linalg
modules with dynamic dims; ``attention_kernel``: the FlashAttention dispatch), inlined by IREE into one program:

- fused ops lower to their parts in sequence (``norm_matmul`` = rms_norm then matmul, ``matmul_rope`` = [norm,]
  matmul, split, RoPE on q and k, ``matmul_silu_mul`` = [norm,] matmul, gated silu, ``matmul_residual`` = matmul then
  add); IREE's dispatch formation then fuses the elementwise parts into their producers where it can;
- ``split_qkv`` and ``merge_heads`` are ``tensor.extract_slice`` + ``tensor.expand_shape`` / ``tensor.collapse_shape``;
- RoPE's cos/sin come from the positions inside the module (``theta ** (-2i / rotary_dim)``, the default rope type);
- attention's plan (one sequence of ``T`` tokens) is host-built once at lowering time and embedded as constants;
  its work items visit the kv tiles of the op's block-sparse schedule (``block-sparse-schedule``), or, without
  one, of the mask's classification at ``T``. Keys are read in the ``tokens`` layout (the op's operands are
  already ``[T, Hkv, D]``).

The captured function must have a static token count and float32 tensors; ``qmatmul`` also takes int8, int4 and
int4_min packed weights (``i8``) with f32 or f16 scales, int4's ``i8`` zero points and int4_min's mins, de-quantized
by a ``linalg.generic`` in front of the float matmul (:mod:`tessera.mlir.dequant_linalg`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tessera.mlir import dequant_linalg, op_kernels
from tessera.mlir.text import TextBuilder

_DYN2, _DYN3 = "tensor<?x?xf32>", "tensor<?x?x?xf32>"


@dataclass(frozen=True)
class LoweredGraph:
    """One IREE module: its text, the entry function and its argument names (the captured function's)."""

    text: str
    entry: str
    arg_names: tuple[str, ...]

    def run(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Call the module with ``inputs`` by argument name (float32 tensors; positions int64; packed weights, zero
        points int8 or uint8: a uint8 tensor is passed as its int8 view, the bytes unchanged)."""
        from tessera.mlir.iree_compile import as_device, load_function

        missing = [n for n in self.arg_names if n not in inputs]
        if missing:
            raise KeyError(f"LoweredGraph.run: missing inputs {missing}; the function takes {list(self.arg_names)}")
        fn = load_function(self.text, self.entry)
        # IREE checks element types: the module's i8 packed operands take QuantizedWeight's uint8 bytes as int8
        tensors = [inputs[n].view(torch.int8) if inputs[n].dtype == torch.uint8 else inputs[n] for n in self.arg_names]
        args = [as_device(t.contiguous()) for t in tensors]
        return torch.from_numpy(np.asarray(fn(*args).to_host()))


def _attr(op, name: str):
    value = op.properties.get(name) or op.attributes.get(name)
    if value is None:
        return None
    data = getattr(value, "value", value)
    return getattr(data, "data", data)


class _Lowering:
    def __init__(self, func_op) -> None:
        self.fn = func_op
        self.b = TextBuilder(indent=4)
        self.names: dict[int, str] = {}
        self.types: dict[int, str] = {}
        self.helpers: dict[str, str] = {}

    # ---- values -----------------------------------------------------------------------------------------------
    def name(self, value) -> str:
        return self.names[id(value)]

    def bind(self, value, name: str, type_text: str) -> None:
        self.names[id(value)] = name
        self.types[id(value)] = type_text

    def cast(self, name: str, src: str, dst: str) -> str:
        return name if src == dst else self.b.value(f"tensor.cast {name} : {src} to {dst}", "cast")

    def call(self, helper: str, text: str, args: list[tuple[str, str, str]], result: str, result_type: str) -> str:
        """Call ``@helper`` (defined by ``text``) with ``(value, its type, the callee's type)`` args."""
        self.helpers[helper] = text
        names = [self.cast(v, t, want) if want not in ("f32",) else v for v, t, want in args]
        raw = self.b.value(f"func.call @{helper}({', '.join(names)}) : ({', '.join(w for *_, w in args)}) -> "
                           f"{result}", helper)
        return self.cast(raw, result, result_type)

    def f32(self, value: float) -> str:
        # MLIR's float literal needs a '.' before an exponent ("1e-06" does not parse): print with explicit digits
        return self.b.value(f"arith.constant {float(value):.17e} : f32", "cst")

    # ---- ops --------------------------------------------------------------------------------------------------
    def norm(self, x: str, x_type: str, weight, eps: float) -> str:
        return self.call("rms_norm", op_kernels.rms_norm(),
                         [(x, x_type, _DYN2), (self.name(weight), self.types[id(weight)], "tensor<?xf32>"),
                          (self.f32(eps), "f32", "f32"), (self.f32(0.0), "f32", "f32")], _DYN2, x_type)

    def matmul(self, x: str, x_type: str, w, out_type: str) -> str:
        return self.matmul_of(x, x_type, self.name(w), self.types[id(w)], out_type)

    def matmul_of(self, x: str, x_type: str, w: str, w_type: str, out_type: str) -> str:
        return self.call("matmul", op_kernels.matmul(False),
                         [(x, x_type, _DYN2), (w, w_type, _DYN2), (self.f32(1.0), "f32", "f32")], _DYN2, out_type)

    def qmatmul(self, op, out_type: str) -> str:
        """``x @ dequant(w).T``: the packed weight de-quantized by a ``linalg.generic`` (:mod:`.dequant_linalg`)
        feeding the float matmul (two dispatches: IREE does not fuse them)."""
        fmt, group = _attr(op, "format"), _attr(op, "group_size")
        w, scales = op.operands[1], op.operands[2]
        args = (self.name(w), self.types[id(w)], self.name(scales), self.types[id(scales)])
        if fmt == "int8":
            deq, deq_t = dequant_linalg.int8(self.b, *args, group)
        elif fmt in ("int4", "int4_min"):
            offsets = op.offsets
            deq, deq_t = dequant_linalg.int4(self.b, fmt, *args, self.name(offsets), self.types[id(offsets)], group)
        else:
            raise NotImplementedError(f"lower_graph: tessera.qmatmul format {fmt!r} has no lowering (int8, int4 and "
                                      "int4_min do)")
        x = op.operands[0]
        return self.matmul_of(self.name(x), self.types[id(x)], deq, deq_t, out_type)

    def add(self, a: str, b: str, type_text: str) -> str:
        return self.b.value(f"arith.addf {a}, {b} : {type_text}", "sum")

    def rope_tables(self, positions, rotary_dim: int, theta: float, tokens: int) -> tuple[str, str]:
        """cos/sin ``[T, rotary_dim / 2]`` of the default rope type, computed from the positions in the module."""
        half = rotary_dim // 2
        t2 = f"tensor<{tokens}x{half}xf32>"
        empty = self.b.value(f"tensor.empty() : {t2}")
        log_theta = self.f32(float(np.log(theta)))
        step = self.f32(-2.0 / rotary_dim)
        angles = self.b.value(
            f"linalg.generic {{indexing_maps = [affine_map<(t, i) -> (t)>, affine_map<(t, i) -> (t, i)>], "
            f"iterator_types = [\"parallel\", \"parallel\"]}} ins({self.name(positions)} : tensor<{tokens}xi64>) "
            f"outs({empty} : {t2}) {{\n"
            f"    ^bb0(%pos: i64, %unused: f32):\n"
            f"      %i = linalg.index 1 : index\n"
            f"      %ii = arith.index_cast %i : index to i64\n"
            f"      %fi = arith.sitofp %ii : i64 to f32\n"
            f"      %e = arith.mulf %fi, {step} : f32\n"
            f"      %l = arith.mulf %e, {log_theta} : f32\n"
            f"      %inv = math.exp %l : f32\n"
            f"      %fp = arith.sitofp %pos : i64 to f32\n"
            f"      %a = arith.mulf %fp, %inv : f32\n"
            f"      linalg.yield %a : f32\n"
            f"    }} -> {t2}", "angles")
        cos = self.b.value(f"math.cos {angles} : {t2}", "cos")
        sin = self.b.value(f"math.sin {angles} : {t2}", "sin")
        return cos, sin

    def rope(self, x: str, x_type: str, cos: str, sin: str, cs_type: str) -> str:
        return self.call("rope", op_kernels.rope(False),
                         [(x, x_type, _DYN3), (cos, cs_type, _DYN2), (sin, cs_type, _DYN2)], _DYN3, x_type)

    def split_qkv(self, qkv: str, tokens: int, hq: int, hkv: int, d: int) -> list[tuple[str, str]]:
        out, offset = [], 0
        for heads in (hq, hkv, hkv):
            flat_t = f"tensor<{tokens}x{heads * d}xf32>"
            part = self.b.value(f"tensor.extract_slice {qkv}[0, {offset}] [{tokens}, {heads * d}] [1, 1] : "
                                f"tensor<{tokens}x{(hq + 2 * hkv) * d}xf32> to {flat_t}", "part")
            shaped_t = f"tensor<{tokens}x{heads}x{d}xf32>"
            out.append((self.b.value(f"tensor.expand_shape {part} [[0], [1, 2]] output_shape [{tokens}, {heads}, {d}]"
                                     f" : {flat_t} into {shaped_t}", "heads"), shaped_t))
            offset += heads * d
        return out

    def attention(self, op, q: str, k: str, v: str, tokens: int) -> tuple[str, str]:
        from tessera.backends.base import KVLayout, RaggedBatch
        from tessera.backends.mlir.planner import build_plan
        from tessera.mlir.attention_kernel import lower_attention
        from tessera.mlir.dialect import attention_schedule, attention_spec

        spec = attention_spec(op, placeholders=False)
        if spec.head_dim % 16:
            raise NotImplementedError(f"lower_graph: head_dim {spec.head_dim} is not a multiple of 16")
        batch = RaggedBatch((tokens,), (tokens,))
        schedule = attention_schedule(op)
        if schedule is not None and (schedule.q_len, schedule.kv_len) != (tokens, tokens):
            raise ValueError(f"lower_graph: the attention's block-sparse schedule is for q_len={schedule.q_len}, "
                             f"kv_len={schedule.kv_len}, but the layer runs {tokens} tokens; rerun "
                             "block-sparse-schedule on this module")
        plan = build_plan(spec, batch, KVLayout.contiguous(batch), key_layout="tokens",
                          schedules=None if schedule is None else [schedule])
        kernel = lower_attention(spec, "tokens", "f32", entry="attention", rows=plan.rows, kv_tile=plan.kv_tile)
        self.helpers["attention"] = kernel.text
        hq, hkv, d = spec.num_q_heads, spec.num_kv_heads, spec.head_dim
        q_t, kv_t = f"tensor<{tokens}x{hq}x{d}xf32>", f"tensor<{tokens}x{hkv}x{d}xf32>"
        consts = []
        for array, shape in ((plan.items, f"tensor<{plan.items.shape[0]}x{plan.items.shape[1]}xi32>"),
                             (plan.tiles, f"tensor<{plan.tiles.size}xi32>"),
                             (plan.kv_map, f"tensor<{plan.kv_map.size}xi32>"),
                             (kernel.aux_i, f"tensor<{kernel.aux_i.size}xi32>")):
            consts.append((self.b.value(f"arith.constant dense<{_dense(array)}> : {shape}", "plan"), shape))
        aux_f = self.b.value(f"arith.constant dense<{_dense(kernel.aux_f)}> : tensor<{kernel.aux_f.size}xf32>", "auxf")
        args = [self.cast(q, q_t, f"tensor<?x?x{d}xf32>"), self.cast(k, kv_t, f"tensor<?x?x{d}xf32>"),
                self.cast(v, kv_t, f"tensor<?x?x{d}xf32>")]
        want = [f"tensor<?x{plan.items.shape[1]}xi32>", "tensor<?xi32>", "tensor<?xi32>", "tensor<?xi32>"]
        args += [self.cast(c, t, w) for (c, t), w in zip(consts, want)]
        args.append(self.cast(aux_f, f"tensor<{kernel.aux_f.size}xf32>", "tensor<?xf32>"))
        sig = ", ".join([f"tensor<?x?x{d}xf32>"] * 3 + want + ["tensor<?xf32>"])
        res = self.b.fresh("attn")
        self.b.line(f"{res}:2 = func.call @attention({', '.join(args)}) : ({sig}) -> (tensor<?x?x{d}xf32>, {_DYN2})")
        return self.cast(f"{res}#0", f"tensor<?x?x{d}xf32>", q_t), q_t


def _dense(array: np.ndarray) -> str:
    return np.array2string(np.asarray(array), separator=", ", threshold=1 << 30, max_line_width=1 << 30,
                           floatmode="unique").replace("\n", "")


def lower_graph(module) -> LoweredGraph:
    """The IREE module of the first ``func.func`` of a captured (and optionally fused) ``tessera`` module."""
    fn = next(iter(module.ops), None)
    if fn is None or fn.name != "func.func":
        raise ValueError("lower_graph: the module holds no func.func; capture one with capture_layer(config, layer, "
                         "num_tokens)")
    low = _Lowering(fn)
    b = low.b
    args = []
    for i, arg in enumerate(fn.body.block.args):
        type_text = str(arg.type)
        element = type_text.rsplit("x", 1)[-1].rstrip(">")
        packed = element in ("i8", "f16") and all(use.operation.name == "tessera.qmatmul" and use.index > 0
                                                    for use in arg.uses)  # a weight, its scales, zeros or mins
        if "?" in type_text or not (element in ("f32", "i64") or packed):
            raise NotImplementedError(f"lower_graph: argument {arg.name_hint} has type {type_text}; only static "
                                      "float32 tensors (and i64 positions, i8 packed weights and zero points, f32/f16 "
                                      "scales and mins of a tessera.qmatmul) are lowered")
        name = f"%arg{i}"
        low.bind(arg, name, type_text)
        args.append((arg.name_hint or f"arg{i}", name, type_text))
    result_type = None
    for op in fn.body.block.ops:
        kind = op.name
        if kind == "func.return":
            ret = op.operands[0]
            result_type = low.types[id(ret)]
            b.line(f"return {low.name(ret)} : {result_type}")
            continue
        out_types = [str(r.type) for r in op.results]
        operands = list(op.operands)
        if kind in ("tessera.rms_norm",):
            value = low.norm(low.name(operands[0]), low.types[id(operands[0])], operands[1], _attr(op, "eps"))
        elif kind in ("tessera.matmul", "tessera.norm_matmul", "tessera.matmul_residual", "tessera.matmul_silu_mul",
                      "tessera.matmul_rope"):
            value = _lower_matmul_family(low, op, kind, operands, out_types)
        elif kind == "tessera.qmatmul":
            value = low.qmatmul(op, out_types[0])
        elif kind == "tessera.residual_add":
            value = low.add(low.name(operands[0]), low.name(operands[1]), out_types[0])
        elif kind == "tessera.silu_and_mul":
            value = low.call("gated", op_kernels.gated_activation("silu"),
                             [(low.name(operands[0]), low.types[id(operands[0])], _DYN2)], _DYN2, out_types[0])
        elif kind == "tessera.split_qkv":
            tokens = int(out_types[0].split("<")[1].split("x")[0])
            parts = low.split_qkv(low.name(operands[0]), tokens, _attr(op, "num_q_heads"), _attr(op, "num_kv_heads"),
                                  _attr(op, "head_dim"))
            for result, (name, type_text) in zip(op.results, parts):
                low.bind(result, name, type_text)
            continue
        elif kind == "tessera.rope":
            tokens = int(out_types[0].split("<")[1].split("x")[0])
            cos, sin = low.rope_tables(operands[1], _attr(op, "rotary_dim"), _attr(op, "theta"), tokens)
            cs_t = f"tensor<{tokens}x{_attr(op, 'rotary_dim') // 2}xf32>"
            value = low.rope(low.name(operands[0]), out_types[0], cos, sin, cs_t)
        elif kind == "tessera.attention":
            tokens = int(out_types[0].split("<")[1].split("x")[0])
            value, _ = low.attention(op, *(low.name(o) for o in operands), tokens)
        elif kind == "tessera.merge_heads":
            value = b.value(f"tensor.collapse_shape {low.name(operands[0])} [[0], [1, 2]] : "
                            f"{low.types[id(operands[0])]} into {out_types[0]}", "merged")
        else:
            raise NotImplementedError(f"lower_graph: {kind} has no lowering yet")
        low.bind(op.results[0], value, out_types[0])
    signature = ", ".join(f"{name}: {t}" for _, name, t in args)
    body = b.text()
    helpers = "\n".join(_private(text) for text in low.helpers.values())
    text = (f"{helpers}\nfunc.func @{fn.sym_name.data}({signature}) -> {result_type} {{\n{body}\n}}\n")
    return LoweredGraph(text, fn.sym_name.data, tuple(a[0] for a in args))


def _private(text: str) -> str:
    """A helper module's function made private (IREE inlines it and exports only the graph's entry)."""
    return text.replace("func.func @", "func.func private @", 1)


def _lower_matmul_family(low: _Lowering, op, kind: str, operands: list, out_types: list[str]) -> str:
    x, x_type = low.name(operands[0]), low.types[id(operands[0])]
    weight = operands[1]
    norm_weight = None
    if kind == "tessera.norm_matmul":
        norm_weight, weight = operands[1], operands[2]
    elif kind in ("tessera.matmul_silu_mul", "tessera.matmul_rope"):
        extra = {"tessera.matmul_silu_mul": 2, "tessera.matmul_rope": 3}[kind]
        norm_weight = operands[extra] if len(operands) > extra else None
    if norm_weight is not None:
        x = low.norm(x, x_type, norm_weight, _attr(op, "eps"))
    tokens = int(x_type.split("<")[1].split("x")[0])
    rows = str(weight.type).split("<")[1].split("x")[0]
    mm_type = f"tensor<{tokens}x{rows}xf32>"
    y = low.matmul(x, x_type, weight, mm_type)
    if kind in ("tessera.matmul", "tessera.norm_matmul"):
        return y
    if kind == "tessera.matmul_residual":
        return low.add(y, low.name(operands[2]), out_types[0])
    if kind == "tessera.matmul_silu_mul":
        return low.call("gated", op_kernels.gated_activation("silu"), [(y, mm_type, _DYN2)], _DYN2, out_types[0])
    hq, hkv, d = _attr(op, "num_q_heads"), _attr(op, "num_kv_heads"), _attr(op, "head_dim")
    (q, q_t), (k, k_t), (v, v_t) = low.split_qkv(y, tokens, hq, hkv, d)
    rotary = _attr(op, "rotary_dim")
    cos, sin = low.rope_tables(operands[2], rotary, _attr(op, "theta"), tokens)
    cs_t = f"tensor<{tokens}x{rotary // 2}xf32>"
    q_rot = low.rope(q, q_t, cos, sin, cs_t)
    k_rot = low.rope(k, k_t, cos, sin, cs_t)
    for result, (name, type_text) in zip(op.results, [(q_rot, q_t), (k_rot, k_t), (v, v_t)]):
        low.bind(result, name, type_text)
    return q_rot
