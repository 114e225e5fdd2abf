"""The ``tessera`` dialect: a decoder's graph-level ops on ranked tensors, defined with xDSL's IRDL.

Ops take and return ``tensor<...xf32|bf16|f16>`` values (ids and positions are ``i32``/``i64``, packed weights
``i8``). Weights are row-major ``[out, in]`` as ``torch.nn.Linear`` holds them, so ``matmul(x, w) = x @ w.T``.
Every op has a verifier that checks ranks, dimensions and attributes; a dynamic (``?``) dimension matches anything,
so a module may leave the token count open. Errors name the op, what was expected and what came.

Base ops (what capture emits)

- ``tessera.embed``       ids ``[T]`` int, table ``[V, H]`` -> ``[T, H]``
- ``tessera.rms_norm``    x ``[..., H]``, weight ``[H]`` -> like x; ``eps``
- ``tessera.matmul``      x ``[T, K]``, w ``[N, K]`` -> ``[T, N]``
- ``tessera.qmatmul``     x ``[T, K]``, packed ``i8`` weight, scales[, zeros or mins] -> ``[T, N]``; ``format``
  (int8, int4, int4_min), ``group_size``
- ``tessera.split_qkv``   qkv ``[T, (Hq + 2 Hkv) D]`` -> q ``[T, Hq, D]``, k, v ``[T, Hkv, D]``
- ``tessera.rope``        x ``[T, heads, D]``, positions ``[T]`` int -> like x; ``theta``, ``rotary_dim``
- ``tessera.attention``   q ``[T, Hq, D]``, k, v ``[S, Hkv, D]`` -> ``[T, Hq, D]``; the AttentionSpec as attributes
- ``tessera.merge_heads`` x ``[T, H, D]`` -> ``[T, H * D]``
- ``tessera.silu_and_mul`` x ``[T, 2 I]`` -> ``[T, I]`` (``silu(gate) * up``, gate first)
- ``tessera.residual_add`` a, b -> a + b (same type)

Fused ops (what the passes in :mod:`tessera.mlir.passes` produce)

- ``tessera.norm_matmul``     ``matmul(rms_norm(x, norm_weight), w)``: the norm in the matmul's prologue
- ``tessera.matmul_silu_mul`` ``silu_and_mul(matmul(x, w_gate_up))``: the gated activation in the epilogue
- ``tessera.matmul_residual`` ``matmul(x, w) + residual``
- ``tessera.matmul_rope``     ``split_qkv(matmul(x, w_qkv))`` with RoPE on q and k in the epilogue -> q, k, v

``matmul_silu_mul`` and ``matmul_rope`` also take an optional ``norm`` operand (with ``eps``): the prologue norm
``fuse-norm-matmul`` folds in, so a projection can carry both a prologue and an epilogue.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from xdsl.context import Context
from xdsl.dialects import arith, builtin, func
from xdsl.dialects.builtin import (
    DYNAMIC_INDEX,
    BFloat16Type,
    DenseArrayBase,
    Float16Type,
    Float32Type,
    FloatAttr,
    IntegerAttr,
    IntegerType,
    StringAttr,
    TensorType,
    UnitAttr,
    f64,
    i64,
)
from xdsl.ir import Attribute, Dialect, Operation, SSAValue
from xdsl.irdl import (
    AttrSizedOperandSegments,
    IRDLOperation,
    ParsePropInAttrDict,
    irdl_op_definition,
    operand_def,
    opt_operand_def,
    opt_prop_def,
    prop_def,
    result_def,
    traits_def,
)
from xdsl.traits import Pure
from xdsl.utils.exceptions import VerifyException

if TYPE_CHECKING:
    from tessera.attention import AttentionSpec
    from tessera.mlir.schedule import TileSchedule

#: mask kinds of ``tessera.attention`` and the int parameter each needs (None: none)
MASK_KINDS: dict[str, str | None] = {
    "none": None, "causal": None, "sliding_window": "window", "chunked": "chunk_size", "prefix_lm": "prefix_len",
    "document": None, "custom": None,
}
#: score kinds of ``tessera.attention`` and the float parameter each needs (None: none)
SCORE_KINDS: dict[str, str | None] = {"none": None, "softcap": "softcap", "alibi": None, "custom": None}
#: ``kv_layout`` values: how the kernel reads keys and values (see ``attention-layout``)
KV_LAYOUTS = ("token", "head")
#: ``qmatmul`` packings: weight elements per byte
QMATMUL_FORMATS = {"int8": 1, "int4": 2, "int4_min": 2}
#: ``qmatmul``'s offsets operand per format (None: the format takes none)
QMATMUL_OFFSETS: dict[str, str | None] = {"int8": None, "int4": "zero points, i8 [N, K / group_size]",
                                          "int4_min": "mins, [N, K / group_size] in the scales' type"}
FLOAT_TYPES = (Float32Type, BFloat16Type, Float16Type)

Dims = tuple["int | None", ...]


# ----------------------------------------------------------------------------------------------------------------
# verification helpers


def dims(value: SSAValue | Attribute) -> Dims:
    """The shape of a ranked tensor value or type, ``None`` for a dynamic dimension."""
    t = value.type if isinstance(value, SSAValue) else value
    assert isinstance(t, TensorType)
    return tuple(None if d == DYNAMIC_INDEX else d for d in t.get_shape())


def _show(shape: Dims) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


class _Check:
    """Collects the checks of one op so each message starts with the op's name."""

    def __init__(self, op: Operation) -> None:
        self.op = op

    def fail(self, message: str) -> None:
        raise VerifyException(f"{self.op.name}: {message}")

    def tensor(self, what: str, value: SSAValue, rank: int | None = None, kind: str = "float") -> Dims:
        """Check that ``value`` is a ranked tensor of ``rank`` with a ``kind`` element ("float", "int", "i8")."""
        t = value.type
        if not isinstance(t, TensorType):
            self.fail(f"{what} must be a ranked tensor, got {t}")
        shape = dims(t)
        if rank is not None and len(shape) != rank:
            self.fail(f"{what} must have rank {rank}, got {_show(shape)} ({t})")
        el = t.element_type
        if kind == "float" and not isinstance(el, FLOAT_TYPES):
            self.fail(f"{what} must hold f32, bf16 or f16, got {el}")
        if kind == "int" and not (isinstance(el, IntegerType) and el.width.data in (32, 64)):
            self.fail(f"{what} must hold i32 or i64, got {el}")
        if kind == "i8" and not (isinstance(el, IntegerType) and el.width.data == 8):
            self.fail(f"{what} must hold i8 (packed weights), got {el}")
        return shape

    def dim(self, what: str, shape: Dims, axis: int, expected: int | None, why: str) -> None:
        """``shape[axis]`` must equal ``expected`` unless either is dynamic."""
        got = shape[axis]
        if got is not None and expected is not None and got != expected:
            self.fail(f"{what} dim {axis} must be {expected} ({why}), got {got} in {_show(shape)}")

    def same_element(self, what: str, a: SSAValue, b: SSAValue) -> None:
        ea, eb = a.type.element_type, b.type.element_type  # type: ignore[attr-defined]
        if ea != eb:
            self.fail(f"{what}: element types must match, got {ea} and {eb}")

    def positive(self, what: str, value: int | None, minimum: int = 1) -> int:
        if value is None or value < minimum:
            self.fail(f"{what} must be an int >= {minimum}, got {value}")
        return value  # type: ignore[return-value]


def _int(attr: IntegerAttr | None) -> int | None:
    return None if attr is None else attr.value.data


def _float(attr: FloatAttr | None) -> float | None:
    return None if attr is None else float(attr.value.data)


def _str(attr: StringAttr | None) -> str | None:
    return None if attr is None else attr.data


def _mul(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else a * b


def _same_tokens(c: _Check, what: str, shape: Dims, tokens: int | None) -> None:
    c.dim(what, shape, 0, tokens, "the token count of x")


def _check_eps(c: _Check, eps: float | None) -> None:
    if eps is None or not math.isfinite(eps) or eps < 0:
        c.fail(f"eps must be a finite float >= 0, got {eps}")


def _check_prologue(c: _Check, op: Operation, x: Dims) -> None:
    """The optional ``norm`` operand of fused ops: weight ``[K]`` and an ``eps``."""
    norm = getattr(op, "norm_weight")
    eps = _float(getattr(op, "eps"))
    if norm is None:
        if eps is not None:
            c.fail("eps is set but there is no norm operand; drop eps or pass the norm weight")
        return
    n = c.tensor("norm weight", norm, 1)
    c.dim("norm weight", n, 0, x[1], "x's last dim K")
    _check_eps(c, eps)


def _fmt(operands: Sequence[str], results: Sequence[str], optional: str | None = None) -> str:
    """An assembly format: ``$a, $b [norm(%n : type)] {attrs} : type(a), type(b) -> type(r)...``."""
    ops = " `,` ".join(f"${n}" for n in operands)
    opt = f" (`norm` `(` ${optional}^ `:` type(${optional}) `)`)?" if optional else ""
    types = " `,` ".join(f"type(${n})" for n in operands)
    outs = " `,` ".join(f"type(${n})" for n in results)
    return f"{ops}{opt} attr-dict `:` {types} `->` {outs}"


_OPTIONS = (ParsePropInAttrDict(),)
_SEGMENTED = (AttrSizedOperandSegments(as_property=True), ParsePropInAttrDict())


# ----------------------------------------------------------------------------------------------------------------
# base ops


@irdl_op_definition
class EmbedOp(IRDLOperation):
    """Token embeddings: ``out[t] = table[ids[t]]``; ids ``[T]`` i32/i64, table ``[V, H]`` -> ``[T, H]``."""

    name = "tessera.embed"
    ids = operand_def(TensorType)
    table = operand_def(TensorType)
    out = result_def(TensorType)
    traits = traits_def(Pure())
    irdl_options = _OPTIONS
    assembly_format = _fmt(("ids", "table"), ("out",))

    def verify_(self) -> None:
        c = _Check(self)
        ids = c.tensor("ids", self.ids, 1, "int")
        table = c.tensor("table", self.table, 2)
        out = c.tensor("result", self.out, 2)
        c.dim("result", out, 0, ids[0], "the number of ids")
        c.dim("result", out, 1, table[1], "the table's hidden size")
        c.same_element("table and result", self.table, self.out)


@irdl_op_definition
class RmsNormOp(IRDLOperation):
    """``x / sqrt(mean(x^2, -1) + eps) * weight``; x ``[..., H]``, weight ``[H]`` -> like x."""

    name = "tessera.rms_norm"
    x = operand_def(TensorType)
    weight = operand_def(TensorType)
    out = result_def(TensorType)
    eps = prop_def(FloatAttr)
    traits = traits_def(Pure())
    irdl_options = _OPTIONS
    assembly_format = _fmt(("x", "weight"), ("out",))

    def verify_(self) -> None:
        c = _Check(self)
        x = c.tensor("x", self.x)
        if not x:
            c.fail("x must have rank >= 1 (the normalized dim is the last)")
        w = c.tensor("weight", self.weight, 1)
        c.dim("weight", w, 0, x[-1], "x's last dim")
        if self.out.type != self.x.type:
            c.fail(f"result type must equal x's type {self.x.type}, got {self.out.type}")
        _check_eps(c, _float(self.eps))


@irdl_op_definition
class MatmulOp(IRDLOperation):
    """``x @ w.T``; x ``[T, K]``, w ``[N, K]`` (row-major as ``torch.nn.Linear``) -> ``[T, N]``."""

    name = "tessera.matmul"
    x = operand_def(TensorType)
    w = operand_def(TensorType)
    out = result_def(TensorType)
    traits = traits_def(Pure())
    irdl_options = _OPTIONS
    assembly_format = _fmt(("x", "w"), ("out",))

    def verify_(self) -> None:
        _verify_matmul(_Check(self), self.x, self.w, self.out)


def _verify_matmul(c: _Check, x_value: SSAValue, w_value: SSAValue, out_value: SSAValue,
                   n_out: int | None = -1) -> tuple[Dims, Dims]:
    """x ``[T, K]``, w ``[N, K]``, result ``[T, n_out]`` (``n_out = -1``: N)."""
    x = c.tensor("x", x_value, 2)
    w = c.tensor("w", w_value, 2)
    c.dim("w", w, 1, x[1], "x's K; w is row-major [N, K] as torch.nn.Linear holds it")
    c.same_element("x and w", x_value, w_value)
    if out_value is not None:
        out = c.tensor("result", out_value, 2)
        c.dim("result", out, 0, x[0], "x's token count")
        c.dim("result", out, 1, w[0] if n_out == -1 else n_out, "w's N" if n_out == -1 else "the output width")
        c.same_element("x and result", x_value, out_value)
    return x, w


@irdl_op_definition
class QMatmulOp(IRDLOperation):
    """``x @ dequant(w).T`` with group-wise scales, in the packings of ``tessera.kernels.quant.QuantizedWeight``.

    x ``[T, K]`` float; scales ``[N, K / group_size]`` f32/f16 -> ``[T, N]``; ``format`` picks the packed weight
    and the optional ``offsets`` operand:

    - "int8": w ``i8 [N, K]``, ``w = q * s``; no offsets.
    - "int4": w ``i8 [N, K / 2]`` holding unsigned nibbles (byte ``j`` of a group: element ``j`` in its low nibble,
      element ``j + group_size / 2`` in its high one), ``w = (q - z) * s``; offsets = zero points ``i8 [N, K / G]``.
    - "int4_min": the same nibbles, ``w = q * s + m``; offsets = mins ``[N, K / G]`` in the scales' element type.
    """

    name = "tessera.qmatmul"
    x = operand_def(TensorType)
    w = operand_def(TensorType)
    scales = operand_def(TensorType)
    offsets = opt_operand_def(TensorType)
    out = result_def(TensorType)
    format = prop_def(StringAttr)
    group_size = prop_def(IntegerAttr)
    traits = traits_def(Pure())
    irdl_options = _SEGMENTED
    assembly_format = ("$x `,` $w `,` $scales (`offsets` `(` $offsets^ `:` type($offsets) `)`)? attr-dict `:` "
                       "type($x) `,` type($w) `,` type($scales) `->` type($out)")

    def verify_(self) -> None:
        c = _Check(self)
        fmt = _str(self.format)
        if fmt not in QMATMUL_FORMATS:
            c.fail(f"format must be one of {list(QMATMUL_FORMATS)}, got {fmt!r}")
        group = c.positive("group_size", _int(self.group_size))
        x = c.tensor("x", self.x, 2)
        out = c.tensor("result", self.out, 2)
        c.same_element("x and result", self.x, self.out)
        c.dim("result", out, 0, x[0], "x's token count")
        w = c.tensor("packed weight", self.w, 2, "i8")
        s = c.tensor("scales", self.scales, 2)
        scale_el = self.scales.type.element_type  # type: ignore[attr-defined]
        if not isinstance(scale_el, (Float32Type, Float16Type)):
            c.fail(f"scales must hold f32 or f16, got {scale_el}")
        k, n, per_byte = x[1], out[1], QMATMUL_FORMATS[fmt]  # type: ignore[index]
        if per_byte > 1 and group % 2:
            c.fail(f"group_size must be even for {fmt} (a group's nibbles pair element j with j + G/2), got {group}")
        if k is not None and k % group:
            c.fail(f"K = {k} must be a multiple of group_size {group}")
        c.dim("packed weight", w, 0, n, "N, the result's width")
        c.dim("packed weight", w, 1, None if k is None else k // per_byte,
              f"K / {per_byte} for {fmt}" if per_byte > 1 else "K for int8")
        c.dim("scales", s, 0, n, "N")
        c.dim("scales", s, 1, None if k is None else k // group, f"K / group_size = {k} / {group}")
        want = QMATMUL_OFFSETS[fmt]
        if (self.offsets is None) != (want is None):
            c.fail(f"format {fmt!r} takes " + (f"an offsets operand ({want})" if want else "no offsets operand")
                   + ("; none came" if self.offsets is None else "; one came"))
        if self.offsets is not None:
            o = c.tensor("offsets", self.offsets, 2, "i8" if fmt == "int4" else "float")
            if fmt == "int4_min" and self.offsets.type.element_type != scale_el:  # type: ignore[attr-defined]
                c.fail(f"mins must hold the scales' element type {scale_el}, got "
                       f"{self.offsets.type.element_type}")  # type: ignore[attr-defined]
            c.dim("offsets", o, 0, n, "N")
            c.dim("offsets", o, 1, None if k is None else k // group, f"K / group_size = {k} / {group}")


@irdl_op_definition
class SplitQkvOp(IRDLOperation):
    """The fused q|k|v projection split into heads.

    qkv ``[T, (Hq + 2 Hkv) D]`` (q rows, then k, then v) -> q ``[T, Hq, D]``, k ``[T, Hkv, D]``, v ``[T, Hkv, D]``.
    """

    name = "tessera.split_qkv"
    qkv = operand_def(TensorType)
    q = result_def(TensorType)
    k = result_def(TensorType)
    v = result_def(TensorType)
    num_q_heads = prop_def(IntegerAttr)
    num_kv_heads = prop_def(IntegerAttr)
    head_dim = prop_def(IntegerAttr)
    traits = traits_def(Pure())
    irdl_options = _OPTIONS
    assembly_format = _fmt(("qkv",), ("q", "k", "v"))

    def verify_(self) -> None:
        c = _Check(self)
        qkv = c.tensor("qkv", self.qkv, 2)
        hq, hkv, d = _heads(c, self)
        c.dim("qkv", qkv, 1, (hq + 2 * hkv) * d, f"(num_q_heads + 2 num_kv_heads) head_dim = ({hq} + 2*{hkv})*{d}")
        _verify_qkv_results(c, self, qkv[0], hq, hkv, d)


def _heads(c: _Check, op: Operation) -> tuple[int, int, int]:
    hq = c.positive("num_q_heads", _int(op.num_q_heads))  # type: ignore[attr-defined]
    hkv = c.positive("num_kv_heads", _int(op.num_kv_heads))  # type: ignore[attr-defined]
    d = c.positive("head_dim", _int(op.head_dim))  # type: ignore[attr-defined]
    if hq % hkv:
        c.fail(f"num_q_heads ({hq}) must be a multiple of num_kv_heads ({hkv}); GQA groups query heads evenly")
    return hq, hkv, d


def _verify_qkv_results(c: _Check, op: Operation, tokens: int | None, hq: int, hkv: int, d: int) -> None:
    src = op.operands[0]
    for name, heads in (("q", hq), ("k", hkv), ("v", hkv)):
        value = getattr(op, name)
        shape = c.tensor(name, value, 3)
        c.dim(name, shape, 0, tokens, "the token count")
        c.dim(name, shape, 1, heads, "num_q_heads" if name == "q" else "num_kv_heads")
        c.dim(name, shape, 2, d, "head_dim")
        c.same_element(f"input and {name}", src, value)


@irdl_op_definition
class RopeOp(IRDLOperation):
    """Rotary embedding, rotate-half pairs ``(i, i + rotary_dim / 2)`` of the first ``rotary_dim`` dims.

    x ``[T, heads, D]``, positions ``[T]`` i32/i64 -> like x; ``theta`` (the base), ``rotary_dim`` (even, <= D).
    """

    name = "tessera.rope"
    x = operand_def(TensorType)
    positions = operand_def(TensorType)
    out = result_def(TensorType)
    theta = prop_def(FloatAttr)
    rotary_dim = prop_def(IntegerAttr)
    traits = traits_def(Pure())
    irdl_options = _OPTIONS
    assembly_format = _fmt(("x", "positions"), ("out",))

    def verify_(self) -> None:
        c = _Check(self)
        x = c.tensor("x", self.x, 3)
        pos = c.tensor("positions", self.positions, 1, "int")
        c.dim("positions", pos, 0, x[0], "x's token count")
        if self.out.type != self.x.type:
            c.fail(f"result type must equal x's type {self.x.type}, got {self.out.type}")
        _check_rope_attrs(c, _float(self.theta), _int(self.rotary_dim), x[2])


def _check_rope_attrs(c: _Check, theta: float | None, rotary_dim: int | None, head_dim: int | None) -> None:
    if theta is None or not math.isfinite(theta) or theta <= 0:
        c.fail(f"theta must be a finite float > 0 (rope base), got {theta}")
    rot = c.positive("rotary_dim", rotary_dim, 2)
    if rot % 2 or (head_dim is not None and rot > head_dim):
        c.fail(f"rotary_dim must be even and <= head_dim ({head_dim}), got {rot}")


@irdl_op_definition
class AttentionOp(IRDLOperation):
    """Scaled dot-product attention of one :class:`~tessera.attention.AttentionSpec`.

    q ``[T, Hq, D]``, k and v ``[S, Hkv, D]`` (token-major; ``S`` may differ from ``T`` when keys come from a cache)
    -> ``[T, Hq, D]``. Attributes: ``num_q_heads``, ``num_kv_heads``, ``head_dim``, ``scale`` (f64), ``mask``
    (:data:`MASK_KINDS`, with ``window`` / ``chunk_size`` / ``prefix_len`` where the kind needs one), ``score``
    (:data:`SCORE_KINDS`, with ``softcap``), ``has_sinks`` (unit), and ``kv_layout`` (:data:`KV_LAYOUTS`: how the
    kernel reads keys and values; set by ``attention-layout``, absent until then).

    The block-sparse schedule (set by ``block-sparse-schedule``, absent until then; all three or none):
    ``schedule_shape`` ``array<i64: q_len, kv_len, q_tile, kv_tile>``, ``schedule_row_ptr`` (one offset per q tile,
    plus one) and ``schedule_kv`` (the first key of every kept kv tile, q tile by q tile): q tile ``i`` visits the
    kv tiles ``schedule_kv[schedule_row_ptr[i] : schedule_row_ptr[i + 1]]``
    (:class:`~tessera.mlir.schedule.TileSchedule`).
    """

    name = "tessera.attention"
    q = operand_def(TensorType)
    k = operand_def(TensorType)
    v = operand_def(TensorType)
    out = result_def(TensorType)
    num_q_heads = prop_def(IntegerAttr)
    num_kv_heads = prop_def(IntegerAttr)
    head_dim = prop_def(IntegerAttr)
    scale = prop_def(FloatAttr)
    mask = prop_def(StringAttr)
    window = opt_prop_def(IntegerAttr)
    chunk_size = opt_prop_def(IntegerAttr)
    prefix_len = opt_prop_def(IntegerAttr)
    score = prop_def(StringAttr)
    softcap = opt_prop_def(FloatAttr)
    has_sinks = opt_prop_def(UnitAttr)
    kv_layout = opt_prop_def(StringAttr)
    schedule_shape = opt_prop_def(DenseArrayBase)
    schedule_row_ptr = opt_prop_def(DenseArrayBase)
    schedule_kv = opt_prop_def(DenseArrayBase)
    traits = traits_def(Pure())
    irdl_options = _OPTIONS
    assembly_format = _fmt(("q", "k", "v"), ("out",))

    def verify_(self) -> None:
        c = _Check(self)
        hq, hkv, d = _heads(c, self)
        q = c.tensor("q", self.q, 3)
        k = c.tensor("k", self.k, 3)
        v = c.tensor("v", self.v, 3)
        c.dim("q", q, 1, hq, "num_q_heads")
        c.dim("q", q, 2, d, "head_dim")
        for name, shape in (("k", k), ("v", v)):
            c.dim(name, shape, 1, hkv, "num_kv_heads")
            c.dim(name, shape, 2, d, "head_dim")
        c.dim("v", v, 0, k[0], "k's token count")
        c.same_element("q and k", self.q, self.k)
        c.same_element("q and v", self.q, self.v)
        if self.out.type != self.q.type:
            c.fail(f"result type must equal q's type {self.q.type}, got {self.out.type}")
        scale = _float(self.scale)
        if scale is None or not math.isfinite(scale):
            c.fail(f"scale must be a finite float, got {scale}")
        self._verify_kinds(c)
        layout = _str(self.kv_layout)
        if layout is not None and layout not in KV_LAYOUTS:
            c.fail(f"kv_layout must be one of {list(KV_LAYOUTS)}, got {layout!r}")
        self._verify_schedule(c, q, k)

    def _verify_schedule(self, c: _Check, q: Dims, k: Dims) -> None:
        parts = (self.schedule_shape, self.schedule_row_ptr, self.schedule_kv)
        if all(p is None for p in parts):
            return
        if any(p is None for p in parts):
            c.fail("schedule_shape, schedule_row_ptr and schedule_kv come together (block-sparse-schedule sets all "
                   "three); got only some")
        shape = self.schedule_shape.get_values()  # type: ignore[union-attr]
        if len(shape) != 4:
            c.fail(f"schedule_shape must be [q_len, kv_len, q_tile, kv_tile], got {list(shape)}")
        c.dim("q", q, 0, shape[0], "schedule_shape's q_len")
        c.dim("k", k, 0, shape[1], "schedule_shape's kv_len")
        try:
            attention_schedule(self)
        except ValueError as err:
            c.fail(str(err))

    def _verify_kinds(self, c: _Check) -> None:
        mask, score = _str(self.mask), _str(self.score)
        if mask not in MASK_KINDS:
            c.fail(f"mask must be one of {list(MASK_KINDS)}, got {mask!r}")
        for param in ("window", "chunk_size", "prefix_len"):
            value = _int(getattr(self, param))
            if MASK_KINDS[mask] == param:
                c.positive(f"{param} (mask {mask!r})", value, 0 if param == "prefix_len" else 1)
            elif value is not None:
                c.fail(f"{param} is set but mask is {mask!r}, which takes "
                       f"{MASK_KINDS[mask] or 'no parameter'}; drop {param} or change the mask")
        if score not in SCORE_KINDS:
            c.fail(f"score must be one of {list(SCORE_KINDS)}, got {score!r}")
        cap = _float(self.softcap)
        if score == "softcap":
            if cap is None or not math.isfinite(cap) or cap <= 0:
                c.fail(f"softcap (score 'softcap') must be a finite float > 0, got {cap}")
        elif cap is not None:
            c.fail(f"softcap is set but score is {score!r}; drop softcap or use score = \"softcap\"")


@irdl_op_definition
class MergeHeadsOp(IRDLOperation):
    """x ``[T, H, D]`` -> ``[T, H * D]`` (the attention output as the o projection's input; a reshape)."""

    name = "tessera.merge_heads"
    x = operand_def(TensorType)
    out = result_def(TensorType)
    traits = traits_def(Pure())
    irdl_options = _OPTIONS
    assembly_format = _fmt(("x",), ("out",))

    def verify_(self) -> None:
        c = _Check(self)
        x = c.tensor("x", self.x, 3)
        out = c.tensor("result", self.out, 2)
        c.dim("result", out, 0, x[0], "x's token count")
        c.dim("result", out, 1, _mul(x[1], x[2]), "heads * head_dim")
        c.same_element("x and result", self.x, self.out)


@irdl_op_definition
class SiluAndMulOp(IRDLOperation):
    """``silu(x[:, :I]) * x[:, I:]``; x ``[T, 2 I]`` (gate, then up) -> ``[T, I]``."""

    name = "tessera.silu_and_mul"
    x = operand_def(TensorType)
    out = result_def(TensorType)
    traits = traits_def(Pure())
    irdl_options = _OPTIONS
    assembly_format = _fmt(("x",), ("out",))

    def verify_(self) -> None:
        c = _Check(self)
        x = c.tensor("x", self.x, 2)
        out = c.tensor("result", self.out, 2)
        if x[1] is not None and x[1] % 2:
            c.fail(f"x's last dim must be even (gate | up halves), got {x[1]}")
        c.dim("result", out, 0, x[0], "x's token count")
        c.dim("result", out, 1, None if x[1] is None else x[1] // 2, "half of x's last dim")
        c.same_element("x and result", self.x, self.out)


@irdl_op_definition
class ResidualAddOp(IRDLOperation):
    """``a + b`` (the residual stream); a, b and the result have one type."""

    name = "tessera.residual_add"
    a = operand_def(TensorType)
    b = operand_def(TensorType)
    out = result_def(TensorType)
    traits = traits_def(Pure())
    irdl_options = _OPTIONS
    assembly_format = _fmt(("a", "b"), ("out",))

    def verify_(self) -> None:
        c = _Check(self)
        c.tensor("a", self.a)
        if not (self.a.type == self.b.type == self.out.type):
            c.fail(f"a, b and the result must have one type, got {self.a.type}, {self.b.type} -> {self.out.type}")


# ----------------------------------------------------------------------------------------------------------------
# fused ops


@irdl_op_definition
class NormMatmulOp(IRDLOperation):
    """``rms_norm(x, norm_weight, eps) @ w.T``: the norm computed in the matmul's prologue.

    x ``[T, K]``, norm_weight ``[K]``, w ``[N, K]`` -> ``[T, N]``.
    """

    name = "tessera.norm_matmul"
    x = operand_def(TensorType)
    norm_weight = operand_def(TensorType)
    w = operand_def(TensorType)
    out = result_def(TensorType)
    eps = prop_def(FloatAttr)
    traits = traits_def(Pure())
    irdl_options = _OPTIONS
    assembly_format = _fmt(("x", "norm_weight", "w"), ("out",))

    def verify_(self) -> None:
        c = _Check(self)
        x, _ = _verify_matmul(c, self.x, self.w, self.out)
        n = c.tensor("norm weight", self.norm_weight, 1)
        c.dim("norm weight", n, 0, x[1], "x's last dim K")
        _check_eps(c, _float(self.eps))


@irdl_op_definition
class MatmulSiluMulOp(IRDLOperation):
    """``silu_and_mul(x @ w_gate_up.T)``: the gated activation in the matmul's epilogue.

    x ``[T, K]``, w_gate_up ``[2 I, K]`` (gate rows, then up rows), optional prologue ``norm`` ``[K]`` with ``eps``
    -> ``[T, I]``.
    """

    name = "tessera.matmul_silu_mul"
    x = operand_def(TensorType)
    w = operand_def(TensorType)
    norm_weight = opt_operand_def(TensorType)
    out = result_def(TensorType)
    eps = opt_prop_def(FloatAttr)
    traits = traits_def(Pure())
    irdl_options = _SEGMENTED
    assembly_format = _fmt(("x", "w"), ("out",), optional="norm_weight")

    def verify_(self) -> None:
        c = _Check(self)
        w = c.tensor("w", self.w, 2)
        if w[0] is not None and w[0] % 2:
            c.fail(f"w's rows must be even (gate | up halves), got {w[0]}")
        x, _ = _verify_matmul(c, self.x, self.w, self.out, None if w[0] is None else w[0] // 2)
        _check_prologue(c, self, x)


@irdl_op_definition
class MatmulResidualOp(IRDLOperation):
    """``x @ w.T + residual``: the residual add in the matmul's epilogue; residual ``[T, N]``."""

    name = "tessera.matmul_residual"
    x = operand_def(TensorType)
    w = operand_def(TensorType)
    residual = operand_def(TensorType)
    out = result_def(TensorType)
    traits = traits_def(Pure())
    irdl_options = _OPTIONS
    assembly_format = _fmt(("x", "w", "residual"), ("out",))

    def verify_(self) -> None:
        c = _Check(self)
        _verify_matmul(c, self.x, self.w, self.out)
        if self.residual.type != self.out.type:
            c.fail(f"residual must have the result's type {self.out.type}, got {self.residual.type}")


@irdl_op_definition
class MatmulRopeOp(IRDLOperation):
    """The QKV projection with RoPE in its epilogue: ``q, k, v = split_qkv(x @ w.T)``, then rope on q and k.

    x ``[T, K]``, w ``[(Hq + 2 Hkv) D, K]``, positions ``[T]`` int, optional prologue ``norm`` ``[K]`` with ``eps``
    -> q ``[T, Hq, D]``, k ``[T, Hkv, D]``, v ``[T, Hkv, D]``.
    """

    name = "tessera.matmul_rope"
    x = operand_def(TensorType)
    w = operand_def(TensorType)
    positions = operand_def(TensorType)
    norm_weight = opt_operand_def(TensorType)
    q = result_def(TensorType)
    k = result_def(TensorType)
    v = result_def(TensorType)
    num_q_heads = prop_def(IntegerAttr)
    num_kv_heads = prop_def(IntegerAttr)
    head_dim = prop_def(IntegerAttr)
    theta = prop_def(FloatAttr)
    rotary_dim = prop_def(IntegerAttr)
    eps = opt_prop_def(FloatAttr)
    traits = traits_def(Pure())
    irdl_options = _SEGMENTED
    assembly_format = _fmt(("x", "w", "positions"), ("q", "k", "v"), optional="norm_weight")

    def verify_(self) -> None:
        c = _Check(self)
        hq, hkv, d = _heads(c, self)
        x, w = _verify_matmul(c, self.x, self.w, None)  # type: ignore[arg-type]
        c.dim("w", w, 0, (hq + 2 * hkv) * d, f"(num_q_heads + 2 num_kv_heads) head_dim = ({hq} + 2*{hkv})*{d}")
        pos = c.tensor("positions", self.positions, 1, "int")
        c.dim("positions", pos, 0, x[0], "x's token count")
        _verify_qkv_results(c, self, x[0], hq, hkv, d)
        _check_rope_attrs(c, _float(self.theta), _int(self.rotary_dim), d)
        _check_prologue(c, self, x)


BASE_OPS = (EmbedOp, RmsNormOp, MatmulOp, QMatmulOp, SplitQkvOp, RopeOp, AttentionOp, MergeHeadsOp, SiluAndMulOp,
            ResidualAddOp)
FUSED_OPS = (NormMatmulOp, MatmulSiluMulOp, MatmulResidualOp, MatmulRopeOp)
Tessera = Dialect("tessera", [*BASE_OPS, *FUSED_OPS], [])


def context() -> Context:
    """An xDSL context with ``builtin``, ``func``, ``arith`` and ``tessera`` loaded: enough to parse what the
    capture and the passes print."""
    ctx = Context()
    for dialect in (builtin.Builtin, func.Func, arith.Arith, Tessera):
        ctx.load_dialect(dialect)
    return ctx


def parse_module(text: str) -> builtin.ModuleOp:
    """Parse ``text`` (a ``builtin.module``) with :func:`context` and verify it."""
    from xdsl.parser import Parser

    module = Parser(context(), text).parse_module()
    module.verify()
    return module


# ----------------------------------------------------------------------------------------------------------------
# building ops


def props(**values: Any) -> dict[str, Attribute]:
    """Python values as op properties: int -> i64, float -> f64, str -> string, True -> unit; None and False are
    left out (absent optional properties)."""
    out: dict[str, Attribute] = {}
    for key, value in values.items():
        if value is None or value is False:
            continue
        if value is True:
            out[key] = UnitAttr()
        elif isinstance(value, int):
            out[key] = IntegerAttr(value, i64)
        elif isinstance(value, float):
            out[key] = FloatAttr(value, f64)
        elif isinstance(value, str):
            out[key] = StringAttr(value)
        else:
            raise TypeError(f"props: {key} must be an int, float, str or bool, got {type(value).__name__}")
    return out


def make(cls: type[IRDLOperation], operands: Sequence[SSAValue | Sequence[SSAValue]], results: Sequence[Attribute],
         **values: Any) -> IRDLOperation:
    """``cls`` with ``operands`` (a sequence for an optional operand), result types and :func:`props` ``values``."""
    return cls.build(operands=list(operands), result_types=list(results), properties=props(**values))


def tensor(shape: Sequence[int | None], element: Attribute) -> TensorType:
    """``tensor<shape x element>``; ``None`` is a dynamic dimension."""
    return TensorType(element, [DYNAMIC_INDEX if d is None else d for d in shape])


# ----------------------------------------------------------------------------------------------------------------
# attention specs <-> attributes


def attention_attrs(spec: AttentionSpec) -> dict[str, Any]:
    """The :class:`AttentionOp` attributes of ``spec`` (for :func:`make`). Masks and scores outside the built-in
    kinds become "custom" (their functions are not representable as attributes)."""
    from tessera.attention import masks as M
    from tessera.attention import scores as S

    attrs: dict[str, Any] = {"num_q_heads": spec.num_q_heads, "num_kv_heads": spec.num_kv_heads,
                             "head_dim": spec.head_dim, "scale": float(spec.softmax_scale), "mask": "custom",
                             "score": "custom", "has_sinks": spec.sinks is not None}
    mask = spec.mask
    if isinstance(mask, M._And) and {type(mask.a), type(mask.b)} == {M._Causal, M._SlidingWindow}:
        mask = mask.a if isinstance(mask.a, M._SlidingWindow) else mask.b  # a sliding window is already causal
    if mask is None:
        attrs["mask"] = "none"
    elif isinstance(mask, M._Causal):
        attrs["mask"] = "causal"
    elif isinstance(mask, M._SlidingWindow):
        attrs.update(mask="sliding_window", window=mask.window)
    elif isinstance(mask, M._Chunked):
        attrs.update(mask="chunked", chunk_size=mask.chunk_size)
    elif isinstance(mask, M._PrefixLM):
        attrs.update(mask="prefix_lm", prefix_len=mask.prefix_len)
    elif isinstance(mask, M._Document):
        attrs["mask"] = "document"
    if spec.score is None:
        attrs["score"] = "none"
    elif isinstance(spec.score, S.Softcap):
        attrs.update(score="softcap", softcap=spec.score.cap)
    elif isinstance(spec.score, S.Alibi):
        attrs["score"] = "alibi"
    return attrs


def attention_spec(op: AttentionOp, num_tokens: int = 1, placeholders: bool = False) -> AttentionSpec:
    """The :class:`AttentionSpec` an attention op's attributes describe.

    Values that live at run time (sinks, document ids, ALiBi slopes) are not attributes: with ``placeholders`` they
    are filled with zeros (sinks, one document of ``num_tokens`` tokens) and the standard ALiBi slopes, which is
    enough to lower the kernel (its text depends on the structure only); without, such a spec raises.
    "custom" masks and scores always raise: their functions are not in the IR.
    """
    import torch

    from tessera.attention import AttentionSpec, alibi, causal, chunked, document, prefix_lm, sliding_window, softcap
    from tessera.attention.scores import alibi_slopes

    mask_kind, score_kind = op.mask.data, op.score.data
    hq = op.num_q_heads.value.data
    runtime = [what for what, used in (("sinks", op.has_sinks is not None), ("document ids", mask_kind == "document"),
                                       ("ALiBi slopes", score_kind == "alibi")) if used]
    if runtime and not placeholders:
        raise ValueError(f"tessera.attention: the op's {', '.join(runtime)} are runtime values, not attributes; pass "
                         "placeholders=True to fill them with placeholder values (enough to lower the kernel)")
    if "custom" in (mask_kind, score_kind):
        raise NotImplementedError("tessera.attention: a custom mask or score function is not held in the IR; "
                                  "build the AttentionSpec from the Python function instead")
    mask = {"none": lambda: None, "causal": causal,
            # as layer_spec builds it, so the lowered kernel is the one a model's layer runs
            "sliding_window": lambda: causal() & sliding_window(op.window.value.data),  # type: ignore[union-attr]
            "chunked": lambda: chunked(op.chunk_size.value.data),  # type: ignore[union-attr]
            "prefix_lm": lambda: prefix_lm(op.prefix_len.value.data),  # type: ignore[union-attr]
            "document": lambda: document(torch.zeros(1, num_tokens, dtype=torch.int32))}[mask_kind]()
    score = {"none": lambda: None, "softcap": lambda: softcap(float(op.softcap.value.data)),  # type: ignore[union-attr]
             "alibi": lambda: alibi(alibi_slopes(hq))}[score_kind]()
    return AttentionSpec(hq, op.num_kv_heads.value.data, op.head_dim.value.data, mask=mask, score=score,
                         sinks=torch.zeros(hq) if op.has_sinks is not None else None,
                         scale=float(op.scale.value.data))


def attention_schedule(op: AttentionOp) -> TileSchedule | None:
    """The :class:`~tessera.mlir.schedule.TileSchedule` a ``block-sparse-schedule`` pass attached to ``op``, or
    None; ValueError when the attributes do not describe a valid schedule."""
    from tessera.mlir.schedule import TileSchedule

    if op.schedule_shape is None or op.schedule_row_ptr is None or op.schedule_kv is None:
        return None
    q_len, kv_len, q_tile, kv_tile = op.schedule_shape.get_values()
    return TileSchedule(int(q_len), int(kv_len), int(q_tile), int(kv_tile), list(op.schedule_row_ptr.get_values()),
                        list(op.schedule_kv.get_values()))


def set_attention_schedule(op: AttentionOp, schedule: TileSchedule) -> None:
    """Attach ``schedule`` to ``op`` (the attributes :func:`attention_schedule` reads back)."""
    op.properties["schedule_shape"] = DenseArrayBase.from_list(
        i64, [schedule.q_len, schedule.kv_len, schedule.q_tile, schedule.kv_tile])
    op.properties["schedule_row_ptr"] = DenseArrayBase.from_list(i64, schedule.row_ptr.tolist())
    op.properties["schedule_kv"] = DenseArrayBase.from_list(i64, schedule.kv_starts.tolist())
