"""Masks and score functions as MLIR ``arith``/``math``/``vector`` ops over one block of keys.

The attention kernel evaluates a spec's mask and score on a vector of :data:`LANES` keys at a time: ``kv_pos`` is a
``vector<16xi32>``, and ``b``, ``h``, ``q_pos`` (one query row) are broadcast to the same shape. A :class:`Sym` is one
such vector SSA value; Python operators and the torch functions of :data:`TORCH_FUNCTIONS` on Syms emit ops instead of
computing, so a custom function written for tensors is *traced* into the kernel. The same tracing also emits scalars
(a :class:`Scope` with ``lanes=None``) for the ``linalg.generic`` bodies of the GPU-shaped lowering.

Built-in masks and scores have direct translations (:func:`mask_value`, :func:`score_value`). Every Python number a
mask or function holds (a window, a softcap, a captured table) becomes a *runtime* value read from the kernel's aux
buffers (:class:`AuxValues`), so the module text, and with it the compiled kernel, depends only on the spec's
structure. Anything without a translation raises :class:`UntranslatableError` with the reason, and the ``mlir``
backend declines the spec with it.
"""

from __future__ import annotations

import numbers
from typing import Callable

import numpy as np
import torch

from tessera.attention import masks as M
from tessera.attention import scores as S
from tessera.attention.symbolic import SymbolicOperators, pack_aux
from tessera.mlir.text import TextBuilder

#: keys per vector (one AVX-512 register of float32; two AVX2 registers)
LANES = 16
BOOL, INT, FLOAT = "bool", "int", "float"
_ELEMENT = {BOOL: "i1", INT: "i32", FLOAT: "f32"}
_INT32 = np.iinfo(np.int32)


class UntranslatableError(ValueError):
    """A mask or score function uses something that has no MLIR translation."""


class ReturnTypeError(TypeError):
    """A custom function returns the wrong kind of value (a mistake on every backend, not a translation limit)."""


def vtype(kind: str, lanes: int | None = LANES) -> str:
    """The type of a value of ``kind``: a vector of ``lanes`` elements, or the scalar element when ``lanes`` is
    None (inside a ``linalg.generic`` body, which sees one element at a time)."""
    return _ELEMENT[kind] if lanes is None else f"vector<{lanes}x{_ELEMENT[kind]}>"


class AuxValues:
    """The runtime values of one spec: an int32 and a float32 buffer the kernel reads.

    Scalars take a slot in a header; arrays (document ids, ALiBi slopes, captured tables) follow the headers, and their
    start offsets are themselves header slots. The kernel traces a function once per query row; :meth:`replay` makes
    every trace after the first reuse the first trace's slots, so a table is stored once.
    """

    def __init__(self, ints: list[int] | None = None, floats: list[float] | None = None) -> None:
        self._ints: list[int] = list(ints or [])
        self._floats: list[float] = list(floats or [])
        self._int_arrays: list[tuple[int, np.ndarray]] = []
        self._float_arrays: list[tuple[int, np.ndarray]] = []
        self._recorded: list[tuple[str, int]] = []
        self._cursor: int | None = None  # None: recording; else the position in _recorded being replayed

    def replay(self) -> None:
        """Make the following registrations return the slots recorded so far, in order."""
        self._cursor = 0

    def _slot(self, kind: str, make: Callable[[], int]) -> int:
        if self._cursor is None:
            slot = make()
            self._recorded.append((kind, slot))
            return slot
        recorded_kind, slot = self._recorded[self._cursor]
        if recorded_kind != kind:  # a function that traces differently on each call: not a pure function
            raise UntranslatableError("the function traced differently for two query rows; it must be deterministic")
        self._cursor += 1
        return slot

    def int_scalar(self, value: int) -> int:
        """The aux-int slot holding ``value``."""
        if not _INT32.min <= value <= _INT32.max:
            raise UntranslatableError(f"the runtime value {value} does not fit in int32 (mlir backend)")
        return self._slot("i", lambda: self._append_int(int(value)))

    def float_scalar(self, value: float) -> int:
        """The aux-float slot holding ``value``."""
        def make() -> int:
            self._floats.append(float(value))
            return len(self._floats) - 1
        return self._slot("f", make)

    def int_array(self, values: np.ndarray) -> int:
        """The aux-int slot holding the start offset of an int32 array."""
        values = np.asarray(values).astype(np.int64).reshape(-1)
        if values.size and (values.min() < _INT32.min or values.max() > _INT32.max):
            raise UntranslatableError("values captured by a mask must fit in int32 (mlir backend)")

        def make() -> int:
            slot = self._append_int(0)
            self._int_arrays.append((slot, values.astype(np.int32)))
            return slot
        return self._slot("ia", make)

    def float_array(self, values: np.ndarray) -> int:
        """The aux-int slot holding the start offset (into the float buffer) of a float32 array."""
        def make() -> int:
            slot = self._append_int(0)
            self._float_arrays.append((slot, np.asarray(values, dtype=np.float32).reshape(-1)))
            return slot
        return self._slot("fa", make)

    def _append_int(self, value: int) -> int:
        self._ints.append(value)
        return len(self._ints) - 1

    def buffers(self) -> tuple[np.ndarray, np.ndarray]:
        """``(aux_i int32, aux_f float32)``: headers with array offsets filled in, then the arrays."""
        return pack_aux(self._ints, self._floats, self._int_arrays, self._float_arrays)


class Scope:
    """Where traced ops go: the builder, the aux values, and the SSA names of the aux tensors in the kernel.

    ``lanes`` is the shape of every traced value: vectors of :data:`LANES` keys (the loop kernel), or None for
    scalars (a ``linalg.generic`` body, :mod:`tessera.mlir.attention_linalg`).
    """

    def __init__(self, builder: TextBuilder, aux: AuxValues, aux_i: str = "%auxI", aux_f: str = "%auxF",
                 lanes: int | None = LANES) -> None:
        self.b, self.aux, self.aux_i, self.aux_f, self.lanes = builder, aux, aux_i, aux_f, lanes

    def type(self, kind: str) -> str:
        """The MLIR type of a traced value of ``kind`` in this scope."""
        return vtype(kind, self.lanes)

    def index(self, value: int) -> str:
        return self.b.value(f"arith.constant {int(value)} : index", "c")

    def splat(self, kind: str, value: object) -> Sym:
        """A compile-time constant (only for values that are part of the structure: 0, 1, true)."""
        literal = {BOOL: lambda v: "true" if v else "false", INT: lambda v: str(int(v)),
                   FLOAT: lambda v: repr(float(v))}[kind](value)
        if self.lanes is None and kind == BOOL:  # `true` / `false` is already typed i1
            return Sym(self.b.value(f"arith.constant {literal}"), kind, self)
        if self.lanes is not None:
            literal = f"dense<{literal}>"
        return Sym(self.b.value(f"arith.constant {literal} : {self.type(kind)}"), kind, self)

    def broadcast(self, scalar: str, kind: str) -> Sym:
        if self.lanes is None:
            return Sym(scalar, kind, self)
        return Sym(self.b.value(f"vector.broadcast {scalar} : {_ELEMENT[kind]} to {self.type(kind)}"), kind, self)

    def runtime_int(self, value: int) -> Sym:
        slot = self.index(self.aux.int_scalar(value))
        scalar = self.b.value(f"tensor.extract {self.aux_i}[{slot}] : tensor<?xi32>")
        return self.broadcast(scalar, INT)

    def runtime_float(self, value: float) -> Sym:
        slot = self.index(self.aux.float_scalar(value))
        scalar = self.b.value(f"tensor.extract {self.aux_f}[{slot}] : tensor<?xf32>")
        return self.broadcast(scalar, FLOAT)

    def gather(self, table: str, start_slot: int, flat: Sym, kind: str) -> Sym:
        """``table[aux_i[start_slot] + flat]`` lane by lane (one ``tensor.extract`` for scalars)."""
        slot = self.index(start_slot)
        start = self.broadcast(self.b.value(f"tensor.extract {self.aux_i}[{slot}] : tensor<?xi32>"), INT)
        at = self.b.value(f"arith.addi {start.name}, {flat.name} : {self.type(INT)}")
        element = "f32" if kind == FLOAT else "i32"
        out_kind = FLOAT if kind == FLOAT else INT
        if self.lanes is None:
            where = self.b.value(f"arith.index_cast {at} : i32 to index")
            return Sym(self.b.value(f"tensor.extract {table}[{where}] : tensor<?x{element}>"), out_kind, self)
        zero = self.index(0)
        every = self.splat(BOOL, True)
        passthru = self.splat(out_kind, 0)
        result = self.type(out_kind)
        name = self.b.value(f"vector.gather {table}[{zero}][{at}], {every.name}, {passthru.name} : "
                            f"tensor<?x{element}>, {self.type(INT)}, {self.type(BOOL)}, {result} into {result}")
        return Sym(name, out_kind, self)


def _promote(*kinds: str) -> str:
    if FLOAT in kinds:
        return FLOAT
    if INT in kinds:
        return INT
    return BOOL


_INT_BINARY = {"+": "arith.addi", "-": "arith.subi", "*": "arith.muli", "&": "arith.andi", "|": "arith.ori",
               "^": "arith.xori"}
_FLOAT_BINARY = {"+": "arith.addf", "-": "arith.subf", "*": "arith.mulf", "/": "arith.divf"}
_INT_COMPARE = {"<": "slt", "<=": "sle", ">": "sgt", ">=": "sge", "==": "eq", "!=": "ne"}
_FLOAT_COMPARE = {"<": "olt", "<=": "ole", ">": "ogt", ">=": "oge", "==": "oeq", "!=": "une"}


class Sym(SymbolicOperators):
    """One traced vector value: its SSA name and kind (bool, int or float)."""

    __slots__ = ("name", "kind", "scope")

    def __init__(self, name: str, kind: str, scope: Scope) -> None:
        self.name, self.kind, self.scope = name, kind, scope

    # ---- emission helpers -----------------------------------------------------------------------------------
    def _emit(self, rhs: str, kind: str) -> Sym:
        return Sym(self.scope.b.value(rhs), kind, self.scope)

    def as_kind(self, kind: str) -> Sym:
        """This value converted to ``kind`` with torch's rules (float -> int truncates, nonzero -> True)."""
        if kind == self.kind:
            return self
        if kind == BOOL:
            zero = self.scope.splat(self.kind, 0)
            if self.kind == FLOAT:
                return self._emit(f"arith.cmpf une, {self.name}, {zero.name} : {self.scope.type(FLOAT)}", BOOL)
            return self._emit(f"arith.cmpi ne, {self.name}, {zero.name} : {self.scope.type(INT)}", BOOL)
        if kind == INT:
            if self.kind == BOOL:
                return self._emit(f"arith.extui {self.name} : {self.scope.type(BOOL)} to {self.scope.type(INT)}", INT)
            return self._emit(f"arith.fptosi {self.name} : {self.scope.type(FLOAT)} to {self.scope.type(INT)}", INT)
        if self.kind == BOOL:
            return self._emit(f"arith.uitofp {self.name} : {self.scope.type(BOOL)} to {self.scope.type(FLOAT)}", FLOAT)
        return self._emit(f"arith.sitofp {self.name} : {self.scope.type(INT)} to {self.scope.type(FLOAT)}", FLOAT)

    def _binary(self, other: object, op: str, reverse: bool = False) -> Sym:
        o = as_sym(other, self.scope)
        a, b = (o, self) if reverse else (self, o)
        kind = _promote(a.kind, b.kind)
        if op in ("&", "|", "^"):
            if kind == FLOAT:
                raise UntranslatableError(f"'{op}' needs bool or int operands, got {a.kind} and {b.kind}")
            a, b = a.as_kind(kind), b.as_kind(kind)
            return self._emit(f"{_INT_BINARY[op]} {a.name}, {b.name} : {self.scope.type(kind)}", kind)
        if op == "/":
            a, b = a.as_kind(FLOAT), b.as_kind(FLOAT)
            return self._emit(f"arith.divf {a.name}, {b.name} : {self.scope.type(FLOAT)}", FLOAT)
        if kind == BOOL:  # arithmetic on bools counts in ints, as torch does
            kind = INT
        a, b = a.as_kind(kind), b.as_kind(kind)
        if op == "//":
            if kind == FLOAT:
                quotient = a._emit(f"arith.divf {a.name}, {b.name} : {self.scope.type(FLOAT)}", FLOAT)
                return quotient._emit(f"math.floor {quotient.name} : {self.scope.type(FLOAT)}", FLOAT)
            return self._emit(f"arith.floordivsi {a.name}, {b.name} : {self.scope.type(INT)}", INT)
        if op == "%":
            if kind == FLOAT:
                return a - b * (a // b)
            rem = self._emit(f"arith.remsi {a.name}, {b.name} : {self.scope.type(INT)}", INT)
            zero = self.scope.splat(INT, 0)
            # Python's sign convention: a nonzero remainder takes the sign of the divisor.
            fix = (rem != zero) & ((rem < zero) ^ (b < zero))
            return where(fix, rem + b, rem)
        table = _FLOAT_BINARY if kind == FLOAT else _INT_BINARY
        return self._emit(f"{table[op]} {a.name}, {b.name} : {self.scope.type(kind)}", kind)

    def _compare(self, other: object, op: str) -> Sym:
        o = as_sym(other, self.scope)
        kind = _promote(self.kind, o.kind)
        if kind == BOOL:
            kind = INT
        a, b = self.as_kind(kind), o.as_kind(kind)
        if kind == FLOAT:
            return self._emit(f"arith.cmpf {_FLOAT_COMPARE[op]}, {a.name}, {b.name} : {self.scope.type(FLOAT)}", BOOL)
        return self._emit(f"arith.cmpi {_INT_COMPARE[op]}, {a.name}, {b.name} : {self.scope.type(INT)}", BOOL)


    def __neg__(self) -> Sym:
        if self.kind == FLOAT:
            return self._emit(f"arith.negf {self.name} : {self.scope.type(FLOAT)}", FLOAT)
        return self.scope.splat(INT, 0) - self.as_kind(INT)

    def __pos__(self) -> Sym:
        return self

    def __abs__(self) -> Sym:
        if self.kind == FLOAT:
            return self._emit(f"math.absf {self.name} : {self.scope.type(FLOAT)}", FLOAT)
        x = self.as_kind(INT)
        return x._emit(f"math.absi {x.name} : {self.scope.type(INT)}", INT)

    def __invert__(self) -> Sym:
        if self.kind == FLOAT:
            raise UntranslatableError("'~' needs a bool or int operand, got a float")
        ones = self.scope.splat(self.kind, True if self.kind == BOOL else -1)
        return self._emit(f"arith.xori {self.name}, {ones.name} : {self.scope.type(self.kind)}", self.kind)

    def __pow__(self, exponent: object) -> Sym:
        if isinstance(exponent, bool) or not isinstance(exponent, numbers.Integral) or not 0 <= int(exponent) <= 8:
            raise UntranslatableError(f"'**' is translated only for literal integer exponents 0..8, got {exponent!r}; "
                                      "use torch.exp / torch.log for other powers")
        if int(exponent) == 0:
            return self.scope.splat(FLOAT if self.kind == FLOAT else INT, 1)
        out = self.as_kind(INT) if self.kind == BOOL else self
        base = out
        for _ in range(int(exponent) - 1):
            out = out * base
        return out

    def __bool__(self) -> bool:
        raise UntranslatableError("the function branches on a position, head or score (Python if/and/or/not/min/max "
                                  "need a concrete value); write it with & | ~ and torch.where instead")

    def __index__(self) -> int:
        raise UntranslatableError("a symbolic position cannot be used as a Python int (e.g. in range() or a slice)")

    # ---- torch methods and functions ---------------------------------------------------------------------------
    def __getattr__(self, name: str):
        if name in _METHODS:
            return lambda *args, **kwargs: _METHODS[name](self, *args, **kwargs)
        raise UntranslatableError(f"tensor method .{name}() has no MLIR translation; {SUPPORTED}")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name == "__getitem__":
            return lookup(args[0], args[1])
        if name in TORCH_FUNCTIONS:
            # A captured tensor among the operands becomes a Sym first (0-d) or is refused (used whole); left as a
            # tensor, its own operator would dispatch back here forever.
            scope = _scope_of(*args)
            args = tuple(as_sym(a, scope) if isinstance(a, torch.Tensor) and not isinstance(a, Sym) else a
                         for a in args)
            return TORCH_FUNCTIONS[name](*args, **kwargs)
        raise UntranslatableError(f"torch.{name} has no MLIR translation; {SUPPORTED}")


def as_sym(value: object, scope: Scope) -> Sym:
    """A Sym for ``value``: a Sym itself, or a Python/NumPy number or 0-d tensor read from the aux buffers."""
    if isinstance(value, Sym):
        return value
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        value = value.item()
    if isinstance(value, (bool, np.bool_)):
        return scope.splat(BOOL, bool(value))
    if isinstance(value, numbers.Integral):
        return scope.runtime_int(int(value))
    if isinstance(value, numbers.Real):
        return scope.runtime_float(float(value))
    if isinstance(value, torch.Tensor):
        raise UntranslatableError(f"a captured tensor of shape {tuple(value.shape)} is used whole; index it with "
                                  "positions or heads (e.g. bias[h, kv_pos]) so each element is read where needed")
    raise UntranslatableError(f"a value of type {type(value).__name__} has no MLIR translation")


def _scope_of(*values: object) -> Scope:
    for v in values:
        if isinstance(v, Sym):
            return v.scope
    raise UntranslatableError("a torch function was called without a traced argument")


def lookup(table: object, index: object) -> Sym:
    """``table[i0, i1, ...]`` for a captured tensor indexed by Syms and ints: a clamped gather from the aux buffers."""
    if not isinstance(table, torch.Tensor):
        raise UntranslatableError("only captured torch tensors may be indexed by positions or heads")
    idx = index if isinstance(index, tuple) else (index,)
    if len(idx) != table.dim() or any(i is Ellipsis or isinstance(i, slice) or i is None for i in idx):
        raise UntranslatableError(f"index a captured tensor of shape {tuple(table.shape)} with exactly {table.dim()} "
                                  "scalar indices (positions, heads, b or ints); slices are not translated")
    scope = _scope_of(*idx)
    table = table.detach().cpu().contiguous()
    is_float = table.dtype.is_floating_point
    flat: Sym | None = None
    for i, size, stride in zip(idx, table.shape, table.stride()):
        if isinstance(i, Sym):
            # Lanes past a sequence's keys may index outside the table; their results are masked off.
            term = minimum(maximum(i.as_kind(INT), 0), size - 1)
        else:
            term = scope.runtime_int(int(i) % size)
        term = term if stride == 1 else term * stride
        flat = term if flat is None else flat + term
    assert flat is not None
    if is_float:
        start = scope.aux.float_array(table.float().reshape(-1).numpy())
        return scope.gather(scope.aux_f, start, flat, FLOAT)
    start = scope.aux.int_array(table.reshape(-1).numpy())
    out = scope.gather(scope.aux_i, start, flat, INT)
    return out.as_kind(BOOL) if table.dtype == torch.bool else out


def where(cond: object, a: object, b: object) -> Sym:
    scope = _scope_of(cond, a, b)
    c, x, y = as_sym(cond, scope).as_kind(BOOL), as_sym(a, scope), as_sym(b, scope)
    kind = _promote(x.kind, y.kind)
    x, y = x.as_kind(kind), y.as_kind(kind)
    return x._emit(f"arith.select {c.name}, {x.name}, {y.name} : {x.scope.type(BOOL)}, {x.scope.type(kind)}", kind)


def _minmax(fn: str) -> Callable[..., Sym]:
    def apply(a: object, b: object) -> Sym:
        scope = _scope_of(a, b)
        x, y = as_sym(a, scope), as_sym(b, scope)
        kind = _promote(x.kind, y.kind)
        kind = INT if kind == BOOL else kind
        x, y = x.as_kind(kind), y.as_kind(kind)
        op = {("min", INT): "arith.minsi", ("max", INT): "arith.maxsi", ("min", FLOAT): "arith.minimumf",
              ("max", FLOAT): "arith.maximumf"}[(fn, kind)]
        return x._emit(f"{op} {x.name}, {y.name} : {x.scope.type(kind)}", kind)
    return apply


minimum, maximum = _minmax("min"), _minmax("max")


def _unary(op: str) -> Callable[..., Sym]:
    def apply(x: object) -> Sym:
        if not isinstance(x, Sym):
            raise UntranslatableError(f"{op} was called on {type(x).__name__} without a traced argument")
        f = x.as_kind(FLOAT)
        return f._emit(f"{op} {f.name} : {f.scope.type(FLOAT)}", FLOAT)
    return apply


def _sigmoid(x: Sym) -> Sym:
    return 1.0 / (1.0 + _unary("math.exp")(-x.as_kind(FLOAT)))


def _clamp(x: Sym, min: object = None, max: object = None) -> Sym:  # noqa: A002  (torch's keyword names)
    out = x
    if min is not None:
        out = maximum(out, min)
    if max is not None:
        out = minimum(out, max)
    return out


def _div(a: object, b: object, rounding_mode: str | None = None) -> Sym:
    scope = _scope_of(a, b)
    x, y = as_sym(a, scope), as_sym(b, scope)
    if rounding_mode is None:
        return x / y
    if rounding_mode == "floor":
        return x // y
    if _promote(x.kind, y.kind) == FLOAT:  # trunc on floats: toward zero
        q = x / y
        return where(q < 0.0, -_unary("math.floor")(-q), _unary("math.floor")(q))
    xi, yi = x.as_kind(INT), y.as_kind(INT)
    return xi._emit(f"arith.divsi {xi.name}, {yi.name} : {xi.scope.type(INT)}", INT)


def _to(x: Sym, dtype: object = None, *args, **kwargs) -> Sym:
    dtype = kwargs.get("dtype", dtype)
    if isinstance(dtype, torch.dtype):
        if dtype.is_floating_point:
            return x.as_kind(FLOAT)
        return x.as_kind(BOOL if dtype == torch.bool else INT)
    return x  # .to(device) and friends change nothing here


TORCH_FUNCTIONS: dict[str, Callable[..., Sym]] = {
    "where": where,
    "abs": lambda x: abs(x),
    "exp": _unary("math.exp"),
    "exp2": _unary("math.exp2"),
    "log": _unary("math.log"),
    "log2": _unary("math.log2"),
    "sqrt": _unary("math.sqrt"),
    "rsqrt": _unary("math.rsqrt"),
    "sin": _unary("math.sin"),
    "cos": _unary("math.cos"),
    "tanh": _unary("math.tanh"),
    "sigmoid": _sigmoid,
    "floor": _unary("math.floor"),
    "ceil": _unary("math.ceil"),
    "minimum": minimum,
    "maximum": maximum,
    "clamp": _clamp,
    "clip": _clamp,
    "div": _div,
    "floor_divide": lambda a, b: _div(a, b, "floor"),
    "remainder": lambda a, b: as_sym(a, _scope_of(a, b)) % b,
    "logical_and": lambda a, b: as_sym(a, _scope_of(a, b)).as_kind(BOOL) & as_sym(b, _scope_of(a, b)).as_kind(BOOL),
    "logical_or": lambda a, b: as_sym(a, _scope_of(a, b)).as_kind(BOOL) | as_sym(b, _scope_of(a, b)).as_kind(BOOL),
    "logical_not": lambda a: ~a.as_kind(BOOL),
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
    "float": lambda x: x.as_kind(FLOAT), "double": lambda x: x.as_kind(FLOAT), "half": lambda x: x.as_kind(FLOAT),
    "bfloat16": lambda x: x.as_kind(FLOAT), "int": lambda x: x.as_kind(INT), "long": lambda x: x.as_kind(INT),
    "bool": lambda x: x.as_kind(BOOL), "to": _to,
}
SUPPORTED = ("custom functions may use + - * / // % ** (literal int exponent), comparisons, & | ~ ^, abs(), Python "
             "numbers, captured tensors indexed by positions/heads/b, and torch."
             + ", torch.".join(sorted(TORCH_FUNCTIONS)))


# ---- built-in masks and scores ---------------------------------------------------------------------------------------

def mask_value(mask: M.Mask, b: Sym, h: Sym, q_pos: Sym, kv_pos: Sym) -> Sym:
    """The bool vector of ``mask`` over one key block (built-ins translated directly, the rest traced)."""
    if isinstance(mask, M._Causal):
        return kv_pos <= q_pos
    if isinstance(mask, M._SlidingWindow):
        return (kv_pos <= q_pos) & (kv_pos > q_pos - mask.window)
    if isinstance(mask, M._Chunked):
        return (q_pos // mask.chunk_size) == (kv_pos // mask.chunk_size)
    if isinstance(mask, M._PrefixLM):
        return (kv_pos < mask.prefix_len) | (kv_pos <= q_pos)
    if isinstance(mask, M._Document):
        ids = mask.doc_ids
        if ids.dim() == 2:
            return lookup(ids, (b, q_pos)) == lookup(ids, (b, kv_pos))
        return lookup(ids, q_pos) == lookup(ids, kv_pos)
    if isinstance(mask, M._Or):  # before _And: _Or subclasses it
        return mask_value(mask.a, b, h, q_pos, kv_pos) | mask_value(mask.b, b, h, q_pos, kv_pos)
    if isinstance(mask, M._And):
        return mask_value(mask.a, b, h, q_pos, kv_pos) & mask_value(mask.b, b, h, q_pos, kv_pos)
    if isinstance(mask, M._Not):
        return ~mask_value(mask.inner, b, h, q_pos, kv_pos)
    fn = mask.fn if isinstance(mask, M.CustomMask) else mask.evaluate
    out = _call(fn, (b, h, q_pos, kv_pos))
    if isinstance(out, Sym) and out.kind == BOOL:
        return out
    got = out.kind if isinstance(out, Sym) else type(out).__name__
    raise ReturnTypeError(f"custom mask {_name(fn)!r} must return a bool tensor, got {got}; compare positions, "
                          "e.g. `return kv_pos <= q_pos`")


def score_value(score: S.ScoreMod, s: Sym, b: Sym, h: Sym, q_pos: Sym, kv_pos: Sym) -> Sym:
    """The float vector of ``score`` applied to the scaled scores ``s`` of one key block."""
    if isinstance(score, S.Softcap):
        cap = as_sym(score.cap, s.scope)
        return _unary("math.tanh")(s / cap) * cap
    if isinstance(score, S.Alibi):
        return s + lookup(score.slopes, h) * (kv_pos - q_pos).as_kind(FLOAT)
    fn = score.fn if isinstance(score, S.CustomScore) else score.apply
    out = _call(fn, (s, b, h, q_pos, kv_pos))
    if isinstance(out, Sym) and out.kind == FLOAT:
        return out
    got = out.kind if isinstance(out, Sym) else type(out).__name__
    raise ReturnTypeError(f"custom score function {_name(fn)!r} must return a float tensor, got {got}")


def _name(fn: Callable) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def _call(fn: Callable, args: tuple[Sym, ...]) -> object:
    try:
        return fn(*args)
    except (UntranslatableError, ReturnTypeError):
        raise
    except Exception as exc:  # the function did something symbols cannot stand in for
        raise UntranslatableError(f"tracing raised {type(exc).__name__}: {exc}; {SUPPORTED}") from exc
