"""What every code generator that traces masks and score functions shares, whatever it emits.

A backend that turns ``fn(b, h, q_pos, kv_pos)`` into kernel code calls the function on symbolic stand-ins; their
Python operators all route to two methods, ``_binary(other, op, reverse)`` and ``_compare(other, op)``
(:class:`SymbolicOperators`). Numbers the function holds become runtime values in two aux buffers, laid out by
:func:`pack_aux` (scalar headers, then arrays whose start offsets are header slots), so generated code depends only
on the spec's structure. The triton and mlir backends build on both.
"""

from __future__ import annotations

import numpy as np


class SymbolicOperators:
    """Python's arithmetic, bitwise and comparison operators as ``_binary`` / ``_compare`` calls (mixin)."""

    __slots__ = ()

    def _binary(self, other, op: str, reverse: bool = False):
        raise NotImplementedError

    def _compare(self, other, op: str):
        raise NotImplementedError

    def __add__(self, o): return self._binary(o, "+")
    def __radd__(self, o): return self._binary(o, "+", True)
    def __sub__(self, o): return self._binary(o, "-")
    def __rsub__(self, o): return self._binary(o, "-", True)
    def __mul__(self, o): return self._binary(o, "*")
    def __rmul__(self, o): return self._binary(o, "*", True)
    def __truediv__(self, o): return self._binary(o, "/")
    def __rtruediv__(self, o): return self._binary(o, "/", True)
    def __floordiv__(self, o): return self._binary(o, "//")
    def __rfloordiv__(self, o): return self._binary(o, "//", True)
    def __mod__(self, o): return self._binary(o, "%")
    def __rmod__(self, o): return self._binary(o, "%", True)
    def __and__(self, o): return self._binary(o, "&")
    def __rand__(self, o): return self._binary(o, "&", True)
    def __or__(self, o): return self._binary(o, "|")
    def __ror__(self, o): return self._binary(o, "|", True)
    def __xor__(self, o): return self._binary(o, "^")
    def __rxor__(self, o): return self._binary(o, "^", True)
    def __lt__(self, o): return self._compare(o, "<")
    def __le__(self, o): return self._compare(o, "<=")
    def __gt__(self, o): return self._compare(o, ">")
    def __ge__(self, o): return self._compare(o, ">=")
    def __eq__(self, o): return self._compare(o, "==")  # type: ignore[override]
    def __ne__(self, o): return self._compare(o, "!=")  # type: ignore[override]
    __hash__ = None  # type: ignore[assignment]


def pack_aux(ints: list[int], floats: list[float], int_arrays: list[tuple[int, np.ndarray]],
             float_arrays: list[tuple[int, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """``(aux_i int32, aux_f float32)``: the scalar headers, then the arrays.

    ``int_arrays`` / ``float_arrays`` hold ``(header slot, values)``; each slot (in the int header, for both kinds)
    receives the array's start offset in its buffer. Never empty: kernels take the buffers as pointers or tensors.
    """
    ints = list(ints)
    int_parts, pos = [], len(ints)
    for slot, arr in int_arrays:
        ints[slot] = pos
        int_parts.append(arr)
        pos += arr.size
    float_parts, fpos = [], len(floats)
    for slot, arr in float_arrays:
        ints[slot] = fpos
        float_parts.append(arr)
        fpos += arr.size
    aux_i = np.concatenate([np.asarray(ints, dtype=np.int32), *int_parts])
    aux_f = np.concatenate([np.asarray(floats, dtype=np.float32), *float_parts])
    return (aux_i if aux_i.size else np.zeros(1, np.int32)), (aux_f if aux_f.size else np.zeros(1, np.float32))
