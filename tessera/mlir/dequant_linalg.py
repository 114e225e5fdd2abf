"""The de-quantizing ``linalg.generic`` of a ``tessera.qmatmul`` weight: packed codes -> float32 ``[N, K]``.

The formulas are those of :class:`tessera.kernels.quant.QuantizedWeight` (``tessera.kernels.quant.dequantize`` is
the oracle the tests compare with):

- int8:     ``w[n, k] = q[n, k] * s[n, k // G]``
- int4:     ``w[n, k] = (q[n, k] - z[n, k // G]) * s[n, k // G]``
- int4_min: ``w[n, k] = q[n, k] * s[n, k // G] + m[n, k // G]``

The int4 codes are unsigned nibbles, two per byte, in the group-split order ``QuantizedWeight`` packs them: byte
``j`` of a group holds element ``j`` in its low nibble and element ``j + G/2`` in its high one. The lowering views the
packed ``[N, K/2]`` bytes as ``[N, K/G, G/2]`` and writes a ``[N, K/G, 2, G/2]`` result (axis 2 = which nibble), so
every indexing map is a projected permutation (no ``floordiv`` on the packed operand) and the result collapses to
``[N, K]`` in element order; int8 takes the same ``[N, K/G, G]`` view for its scale.

IREE (as pinned) does not fuse the generic into the matmul that reads it: a qmatmul is two dispatches, the
de-quantization writing the float32 ``[N, K]`` weight and the matmul reading it, on every call.
"""

from __future__ import annotations

from tessera.mlir.text import TextBuilder


def _widen(name: str, element: str, out: str) -> str:
    """The line that makes ``name`` (a block argument of ``element``) f32 as ``out``, or "" when it already is."""
    return "" if element == "f32" else f"\n      {out} = arith.extf {name} : {element} to f32"


def int8(b: TextBuilder, w: str, w_type: str, scales: str, s_type: str, group: int) -> tuple[str, str]:
    """``w * scales[n, k // group]`` as float32 ``[N, K]``; returns ``(value, its type)``.

    The weight is viewed as ``[N, K/G, G]`` so the scale's map is the projection ``(n, g)``: with ``k floordiv G``
    in the map instead, the qmatmul took 2-3x the time (T = 16, N = K = 2048, 2-vCPU Zen 5, 2026-12-05)."""
    n, k = _dims(w_type)
    ng = k // group
    scale_el = _element(s_type)
    grouped_t = f"tensor<{n}x{ng}x{group}xi8>"
    grouped = b.value(f"tensor.expand_shape {w} [[0], [1, 2]] output_shape [{n}, {ng}, {group}] : {w_type} into "
                      f"{grouped_t}", "groups")
    out_t = f"tensor<{n}x{ng}x{group}xf32>"
    empty = b.value(f"tensor.empty() : {out_t}")
    scale = "%s" if scale_el == "f32" else "%sc"
    value = b.value(
        "linalg.generic {indexing_maps = [affine_map<(n, g, i) -> (n, g, i)>, affine_map<(n, g, i) -> (n, g)>, "
        "affine_map<(n, g, i) -> (n, g, i)>], iterator_types = [\"parallel\", \"parallel\", \"parallel\"]} "
        f"ins({grouped}, {scales} : {grouped_t}, {s_type}) outs({empty} : {out_t}) {{\n"
        f"    ^bb0(%q: i8, %s: {scale_el}, %unused: f32):{_widen('%s', scale_el, '%sc')}\n"
        f"      %f = arith.sitofp %q : i8 to f32\n"
        f"      %r = arith.mulf %f, {scale} : f32\n"
        f"      linalg.yield %r : f32\n"
        f"    }} -> {out_t}", "deq")
    deq_t = f"tensor<{n}x{k}xf32>"
    flat = b.value(f"tensor.collapse_shape {value} [[0], [1, 2]] : {out_t} into {deq_t}", "deq")
    return flat, deq_t


def int4(b: TextBuilder, fmt: str, w: str, w_type: str, scales: str, s_type: str, offsets: str, o_type: str,
         group: int) -> tuple[str, str]:
    """An "int4" (offsets = i8 zero points) or "int4_min" (offsets = mins) weight as float32 ``[N, K]``."""
    if fmt not in ("int4", "int4_min"):
        raise ValueError(f"dequant_linalg.int4: format must be 'int4' or 'int4_min', got {fmt!r}")
    n, half_k = _dims(w_type)
    ng, half = 2 * half_k // group, group // 2
    scale_el, off_el = _element(s_type), _element(o_type)
    bytes_t = f"tensor<{n}x{ng}x{half}xi8>"
    grouped = b.value(f"tensor.expand_shape {w} [[0], [1, 2]] output_shape [{n}, {ng}, {half}] : {w_type} into "
                      f"{bytes_t}", "bytes")
    out_t = f"tensor<{n}x{ng}x2x{half}xf32>"
    empty = b.value(f"tensor.empty() : {out_t}")
    scale = "%s" if scale_el == "f32" else "%sc"
    if fmt == "int4":
        # q and z are both in 0..15, so q - z fits i8 exactly; converting after the subtraction keeps it exact
        formula = ("      %d = arith.subi %q, %o : i8\n"
                   "      %f = arith.sitofp %d : i8 to f32\n"
                   f"      %r = arith.mulf %f, {scale} : f32\n")
    else:
        mins = "%o" if off_el == "f32" else "%oc"
        widen = "" if off_el == "f32" else f"      %oc = arith.extf %o : {off_el} to f32\n"
        formula = widen + (
            "      %f = arith.uitofp %q : i8 to f32\n"
            f"      %m = arith.mulf %f, {scale} : f32\n"
            f"      %r = arith.addf %m, {mins} : f32\n")
    value = b.value(
        "linalg.generic {indexing_maps = [affine_map<(n, g, j, h) -> (n, g, h)>, affine_map<(n, g, j, h) -> (n, g)>, "
        "affine_map<(n, g, j, h) -> (n, g)>, affine_map<(n, g, j, h) -> (n, g, j, h)>], iterator_types = "
        "[\"parallel\", \"parallel\", \"parallel\", \"parallel\"]} "
        f"ins({grouped}, {scales}, {offsets} : {bytes_t}, {s_type}, {o_type}) outs({empty} : {out_t}) {{\n"
        f"    ^bb0(%p: i8, %s: {scale_el}, %o: {off_el}, %unused: f32):{_widen('%s', scale_el, '%sc')}\n"
        # j = 0 reads the low nibble, j = 1 the high one; shrui, as the bytes are unsigned codes held in i8
        "      %j = linalg.index 2 : index\n"
        "      %ji = arith.index_cast %j : index to i8\n"
        "      %c4 = arith.constant 4 : i8\n"
        "      %sh = arith.muli %ji, %c4 : i8\n"
        "      %hi = arith.shrui %p, %sh : i8\n"
        "      %c15 = arith.constant 15 : i8\n"
        "      %q = arith.andi %hi, %c15 : i8\n"
        f"{formula}"
        "      linalg.yield %r : f32\n"
        f"    }} -> {out_t}", "deq")
    deq_t = f"tensor<{n}x{2 * half_k}xf32>"
    flat = b.value(f"tensor.collapse_shape {value} [[0], [1, 2, 3]] : {out_t} into {deq_t}", "deq")
    return flat, deq_t


def _dims(type_text: str) -> tuple[int, int]:
    n, k = type_text.split("<")[1].split("x")[:2]
    return int(n), int(k)


def _element(type_text: str) -> str:
    return type_text.rsplit("x", 1)[1].rstrip(">")
