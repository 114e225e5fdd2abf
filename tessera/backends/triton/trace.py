"""Turn a custom mask or score function into Triton source by running it on symbolic arguments.

The function is called once with :class:`Sym` stand-ins for ``score, b, h, q_pos, kv_pos``. Python operators and
the torch functions listed in :data:`TORCH_FUNCTIONS` (reached through ``__torch_function__``) build a Triton
expression instead of computing. Python numbers the function uses become runtime values (kernel arguments held in
the aux buffers), so a closure over another window size reuses the compiled kernel; torch tensors it captures and
indexes with positions or heads (``bias[h, kv_pos]``) are copied into the aux buffers and read with clamped indices.

Anything else (data-dependent Python ``if``/``and``/``or``, unsupported torch functions, tensors used whole) raises
:class:`UntranslatableError`, and the triton backend reports it as its reason to decline the spec.
"""

from __future__ import annotations

import numbers
from typing import Callable

import numpy as np
import torch

from tessera.attention.symbolic import SymbolicOperators
from tessera.backends.triton.emitter import Emitter


class UntranslatableError(ValueError):
    """A custom function uses something that has no Triton translation."""


class ReturnTypeError(TypeError):
    """A custom function returns the wrong kind of value (a mistake on every backend, not a translation limit)."""


BOOL, INT, FLOAT = "bool", "int", "float"


def _promote(*kinds: str) -> str:
    if FLOAT in kinds:
        return FLOAT
    if INT in kinds:
        return INT
    return BOOL


class Sym(SymbolicOperators):
    """A symbolic value inside a traced function: Triton source text and its kind (bool, int or float)."""

    __slots__ = ("code", "kind", "em")

    def __init__(self, code: str, kind: str, em: Emitter) -> None:
        self.code, self.kind, self.em = code, kind, em

    # ---- conversion of operands -------------------------------------------------------------------------------
    def _wrap(self, other: object) -> Sym:
        return as_sym(other, self.em)

    def _binary(self, other: object, op: str, reverse: bool = False) -> Sym:
        o = self._wrap(other)
        a, b = (o, self) if reverse else (self, o)
        kind = _promote(a.kind, b.kind)
        if op in ("&", "|", "^"):
            if FLOAT in (a.kind, b.kind):
                raise UntranslatableError(f"'{op}' needs bool or int operands, got {a.kind} and {b.kind}")
            return Sym(f"({a.code} {op} {b.code})", kind, self.em)
        if op == "/":
            return Sym(f"({_as_float(a)} / {_as_float(b)})", FLOAT, self.em)
        if op == "//":
            if kind == FLOAT:
                return Sym(f"tl.floor({_as_float(a)} / {_as_float(b)})", FLOAT, self.em)
            return Sym(f"floordiv({a.code}, {b.code})", INT, self.em)
        if op == "%":
            if kind == FLOAT:
                fa, fb = _as_float(a), _as_float(b)
                return Sym(f"({fa} - {fb} * tl.floor({fa} / {fb}))", FLOAT, self.em)
            return Sym(f"floormod({a.code}, {b.code})", INT, self.em)
        if kind == BOOL:  # arithmetic on bools counts in ints, as torch does
            kind = INT
        return Sym(f"({a.code} {op} {b.code})", kind, self.em)

    def _compare(self, other: object, op: str) -> Sym:
        o = self._wrap(other)
        return Sym(f"({self.code} {op} {o.code})", BOOL, self.em)


    def __neg__(self) -> Sym:
        return Sym(f"(-{self.code})", INT if self.kind == BOOL else self.kind, self.em)

    def __pos__(self) -> Sym:
        return self

    def __abs__(self) -> Sym:
        return Sym(f"tl.abs({self.code})", self.kind, self.em)

    def __invert__(self) -> Sym:
        if self.kind == BOOL:
            return Sym(f"({self.code} == 0)", BOOL, self.em)
        if self.kind == INT:
            return Sym(f"(~{self.code})", INT, self.em)
        raise UntranslatableError("'~' needs a bool or int operand, got a float")

    def __pow__(self, exponent: object) -> Sym:
        if isinstance(exponent, bool) or not isinstance(exponent, numbers.Integral) or not 0 <= int(exponent) <= 8:
            raise UntranslatableError(
                f"'**' is translated only for literal integer exponents 0..8, got {exponent!r}; "
                "use torch.exp / torch.log for other powers"
            )
        if int(exponent) == 0:
            return as_sym(1, self.em) if self.kind != FLOAT else as_sym(1.0, self.em)
        return Sym("(" + " * ".join([self.code] * int(exponent)) + ")", self.kind, self.em)

    def __bool__(self) -> bool:
        raise UntranslatableError(
            "the function branches on a position, head or score (Python if/and/or/not/min/max need a concrete "
            "value); write it with & | ~ and torch.where instead"
        )

    def __index__(self) -> int:
        raise UntranslatableError("a symbolic position cannot be used as a Python int (e.g. in range() or a slice)")

    # ---- torch methods and functions ----------------------------------------------------------------------------
    def __getattr__(self, name: str):
        if name in _METHODS:
            return lambda *args, **kwargs: _METHODS[name](self, *args, **kwargs)
        raise UntranslatableError(f"tensor method .{name}() has no Triton translation; {SUPPORTED}")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name == "__getitem__":
            return _index(args[0], args[1])
        if name in TORCH_FUNCTIONS:
            # A captured tensor among the operands becomes a Sym first (0-d) or is refused (used whole); left as a
            # tensor, its own operator would dispatch back here forever.
            em = next((a.em for a in args if isinstance(a, Sym)), None)
            if em is not None:
                args = tuple(as_sym(a, em) if isinstance(a, torch.Tensor) and not isinstance(a, Sym) else a
                             for a in args)
            return TORCH_FUNCTIONS[name](*args, **kwargs)
        raise UntranslatableError(f"torch.{name} has no Triton translation; {SUPPORTED}")


def _as_float(s: Sym) -> str:
    return s.code if s.kind == FLOAT else f"{s.code}.to(tl.float32)"


def as_sym(value: object, em: Emitter) -> Sym:
    """A Sym for ``value``: a Sym itself, or a Python/NumPy number or 0-d tensor hoisted into the aux buffers."""
    if isinstance(value, Sym):
        return value
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        value = value.item()
    if isinstance(value, (bool, np.bool_)):
        return Sym("True" if value else "False", BOOL, em)
    if isinstance(value, numbers.Integral):
        return Sym(em.int_scalar(int(value)), INT, em)
    if isinstance(value, numbers.Real):
        return Sym(em.float_scalar(float(value)), FLOAT, em)
    if isinstance(value, torch.Tensor):
        raise UntranslatableError(
            f"a captured tensor of shape {tuple(value.shape)} is used whole; index it with positions or heads "
            "(e.g. bias[h, kv_pos]) so each element is read where needed"
        )
    raise UntranslatableError(f"a value of type {type(value).__name__} has no Triton translation")


def _index(table: object, index: object) -> Sym:
    """``table[i0, i1, ...]`` for a captured tensor indexed by Syms and ints: a clamped gather from the aux buffers."""
    if not isinstance(table, torch.Tensor):
        raise UntranslatableError("only captured torch tensors may be indexed by positions or heads")
    idx = index if isinstance(index, tuple) else (index,)
    if len(idx) != table.dim() or any(i is Ellipsis or isinstance(i, slice) or i is None for i in idx):
        raise UntranslatableError(
            f"index a captured tensor of shape {tuple(table.shape)} with exactly {table.dim()} scalar indices "
            "(positions, heads, b or ints); slices and partial indexing are not translated"
        )
    em = next(i.em for i in idx if isinstance(i, Sym))
    table = table.detach().cpu().contiguous()
    is_float = table.dtype.is_floating_point
    base = em.float_array(table.float().reshape(-1).numpy()) if is_float else em.int_array(table.reshape(-1).numpy())
    terms = []
    for i, size, stride in zip(idx, table.shape, table.stride()):
        code = as_sym(i, em).code if isinstance(i, Sym) else str(int(i) % size)
        clamped = f"clamp_index({code}, {size})" if isinstance(i, Sym) else code
        terms.append(clamped if stride == 1 else f"{clamped} * {stride}")
    flat = " + ".join(terms)
    if is_float:
        return Sym(f"lookup_float(AUX_F, {base}, {flat})", FLOAT, em)
    kind = BOOL if table.dtype == torch.bool else INT
    code = f"lookup_int(AUX_I, {base}, {flat})"
    return Sym(f"({code} != 0)" if kind == BOOL else code, kind, em)


def _unary(fmt: str, kind: str | None = None, float_in: bool = True) -> Callable[..., Sym]:
    def apply(x: Sym) -> Sym:
        x = x if isinstance(x, Sym) else _lift(x)
        arg = _as_float(x) if float_in else x.code
        return Sym(fmt.format(arg), kind or (FLOAT if float_in else x.kind), x.em)
    return apply


def _lift(x: object) -> Sym:
    raise UntranslatableError(f"a torch function was called on {type(x).__name__} without a traced argument")


def _where(cond: object, a: object, b: object) -> Sym:
    em = next(v.em for v in (cond, a, b) if isinstance(v, Sym))
    c, x, y = as_sym(cond, em), as_sym(a, em), as_sym(b, em)
    kind = _promote(x.kind, y.kind)
    xc, yc = (_as_float(x), _as_float(y)) if kind == FLOAT else (x.code, y.code)
    return Sym(f"tl.where({c.code}, {xc}, {yc})", kind, em)


def _minmax(fn: str) -> Callable[..., Sym]:
    def apply(a: object, b: object) -> Sym:
        em = next(v.em for v in (a, b) if isinstance(v, Sym))
        x, y = as_sym(a, em), as_sym(b, em)
        kind = _promote(x.kind, y.kind)
        xc, yc = (_as_float(x), _as_float(y)) if kind == FLOAT else (x.code, y.code)
        return Sym(f"tl.{fn}({xc}, {yc})", kind, em)
    return apply


def _clamp(x: Sym, min: object = None, max: object = None) -> Sym:  # noqa: A002  (torch's keyword names)
    out = x
    if min is not None:
        out = _minmax("maximum")(out, min)
    if max is not None:
        out = _minmax("minimum")(out, max)
    return out


def _div(a: object, b: object, rounding_mode: str | None = None) -> Sym:
    x = a if isinstance(a, Sym) else as_sym(a, b.em)  # type: ignore[union-attr]
    if rounding_mode is None:
        return x / b
    if rounding_mode == "floor":
        return x // b
    y = as_sym(b, x.em)
    if _promote(x.kind, y.kind) == FLOAT:  # trunc on floats
        q = f"({_as_float(x)} / {_as_float(y)})"
        return Sym(f"tl.where({q} < 0, -tl.floor(-{q}), tl.floor({q}))", FLOAT, x.em)
    return Sym(f"({x.code} // {y.code})", INT, x.em)  # Triton's integer division truncates, like torch's "trunc"


def _cast(kind: str) -> Callable[..., Sym]:
    def apply(x: Sym, *args, **kwargs) -> Sym:
        if kind == FLOAT:
            return Sym(_as_float(x), FLOAT, x.em)
        if kind == BOOL:
            return Sym(f"({x.code} != 0)", BOOL, x.em)
        return Sym(f"{x.code}.to(tl.int32)" if x.kind != INT else x.code, INT, x.em)
    return apply


def _to(x: Sym, dtype: object = None, *args, **kwargs) -> Sym:
    dtype = kwargs.get("dtype", dtype)
    if isinstance(dtype, torch.dtype):
        if dtype.is_floating_point:
            return _cast(FLOAT)(x)
        return _cast(BOOL if dtype == torch.bool else INT)(x)
    return x  # .to(device) and friends change nothing here


_sigmoid = _unary("(1.0 / (1.0 + tl.exp(-{})))")

TORCH_FUNCTIONS: dict[str, Callable[..., Sym]] = {
    "where": _where,
    "abs": _unary("tl.abs({})", float_in=False),
    "exp": _unary("tl.exp({})"),
    "exp2": _unary("tl.math.exp2({})"),
    "log": _unary("tl.log({})"),
    "log2": _unary("tl.math.log2({})"),
    "sqrt": _unary("tl.sqrt({})"),
    "rsqrt": _unary("tl.math.rsqrt({})"),
    "sin": _unary("tl.sin({})"),
    "cos": _unary("tl.cos({})"),
    "tanh": _unary("tanh({})"),
    "sigmoid": _sigmoid,
    "floor": _unary("tl.floor({})"),
    "ceil": _unary("tl.ceil({})"),
    "minimum": _minmax("minimum"),
    "maximum": _minmax("maximum"),
    "clamp": _clamp,
    "clip": _clamp,
    "div": _div,
    "floor_divide": lambda a, b: _div(a, b, "floor"),
    "remainder": lambda a, b: as_sym(a, b.em) % b if not isinstance(a, Sym) else a % b,
    "logical_and": lambda a, b: _cast(BOOL)(a) & _cast(BOOL)(b),
    "logical_or": lambda a, b: _cast(BOOL)(a) | _cast(BOOL)(b),
    "logical_not": lambda a: ~_cast(BOOL)(a),
    "bitwise_and": lambda a, b: a & b,
    "bitwise_or": lambda a, b: a | b,
    "bitwise_not": lambda a: ~a,
    "eq": lambda a, b: a == b, "ne": lambda a, b: a != b,
    "lt": lambda a, b: a < b, "le": lambda a, b: a <= b,
    "gt": lambda a, b: a > b, "ge": lambda a, b: a >= b,
    "add": lambda a, b, alpha=1: a + b * alpha if alpha != 1 else a + b,
    "sub": lambda a, b, alpha=1: a - b * alpha if alpha != 1 else a - b,
    "mul": lambda a, b: a * b,
    "neg": lambda a: -a,
}
_METHODS: dict[str, Callable[..., Sym]] = {
    **{k: v for k, v in TORCH_FUNCTIONS.items() if k != "where"},
    "float": _cast(FLOAT), "double": _cast(FLOAT), "half": _cast(FLOAT), "bfloat16": _cast(FLOAT),
    "int": _cast(INT), "long": _cast(INT), "bool": _cast(BOOL), "to": _to,
}
SUPPORTED = (
    "custom functions may use + - * / // % ** (literal int exponent), comparisons, & | ~ ^, abs(), Python numbers, "
    "captured tensors indexed by positions/heads/b, and torch." + ", torch.".join(sorted(TORCH_FUNCTIONS))
)


def trace_mask(fn: Callable, em: Emitter) -> str:
    """Triton source of the bool expression ``fn(b, h, q_pos, kv_pos)``."""
    out = _call(fn, em, ("b", "h", "q_pos", "kv_pos"))
    if isinstance(out, Sym) and out.kind == BOOL:
        return out.code
    got = out.kind if isinstance(out, Sym) else type(out).__name__
    raise ReturnTypeError(f"custom mask {_name(fn)!r} must return a bool tensor, got {got}; compare positions, "
                          "e.g. `return kv_pos <= q_pos`")


def trace_score(fn: Callable, em: Emitter) -> str:
    """Triton source of the float expression ``fn(score, b, h, q_pos, kv_pos)``."""
    out = _call(fn, em, ("score", "b", "h", "q_pos", "kv_pos"))
    if isinstance(out, Sym) and out.kind == FLOAT:
        return out.code
    got = out.kind if isinstance(out, Sym) else type(out).__name__
    raise ReturnTypeError(f"custom score function {_name(fn)!r} must return a float tensor, got {got}")


def _name(fn: Callable) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def _call(fn: Callable, em: Emitter, names: tuple[str, ...]) -> object:
    kinds = {"score": FLOAT}
    args = [Sym(name, kinds.get(name, INT), em) for name in names]
    try:
        return fn(*args)
    except UntranslatableError:
        raise
    except Exception as exc:  # the function did something symbols cannot stand in for
        raise UntranslatableError(f"tracing raised {type(exc).__name__}: {exc}; {SUPPORTED}") from exc
