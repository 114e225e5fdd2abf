"""Runtime values of generated mask/score code: two aux buffers the kernel reads, so values never recompile.

Generated code refers to a value by its *slot* in a fixed header (``tl.load(AUX_I + 3)``); arrays (document ids,
ALiBi slopes, captured tables) follow the headers and their start offsets are themselves header slots. The source
text therefore depends only on the structure of the spec, while lengths, windows, ids and slopes live in the buffers.
"""

from __future__ import annotations

import numpy as np

from tessera.attention.symbolic import pack_aux

_INT32 = np.iinfo(np.int32)


class Emitter:
    """Collects the runtime values of one spec while its Triton source is generated."""

    def __init__(self) -> None:
        self._ints: list[int] = []  # header of AUX_I: scalars and array start offsets
        self._floats: list[float] = []  # header of AUX_F: scalars
        self._int_arrays: list[tuple[int, np.ndarray]] = []  # (header slot of its start, values)
        self._float_arrays: list[tuple[int, np.ndarray]] = []

    def int_scalar(self, value: int) -> str:
        """Source reading an int32 runtime value."""
        return f"tl.load(AUX_I + {self._int_slot(value)})"

    def float_scalar(self, value: float) -> str:
        """Source reading a float32 runtime value."""
        self._floats.append(float(value))
        return f"tl.load(AUX_F + {len(self._floats) - 1})"

    def int_array(self, values: np.ndarray) -> str:
        """Source of the start offset (in AUX_I) of an int32 array."""
        values = np.asarray(values).astype(np.int64).reshape(-1)
        if values.size and (values.min() < _INT32.min or values.max() > _INT32.max):
            raise ValueError("values captured by a mask must fit in int32 for the triton backend")
        slot = self._int_slot(0)
        self._int_arrays.append((slot, values.astype(np.int32)))
        return f"tl.load(AUX_I + {slot})"

    def float_array(self, values: np.ndarray) -> str:
        """Source of the start offset (in AUX_F) of a float32 array."""
        slot = self._int_slot(0)
        self._float_arrays.append((slot, np.asarray(values, dtype=np.float32).reshape(-1)))
        return f"tl.load(AUX_I + {slot})"

    def _int_slot(self, value: int) -> int:
        if not _INT32.min <= value <= _INT32.max:
            raise ValueError(f"the runtime value {value} does not fit in int32 (triton backend)")
        self._ints.append(int(value))
        return len(self._ints) - 1

    def buffers(self) -> tuple[np.ndarray, np.ndarray]:
        """``(aux_i int32, aux_f float32)``: headers with array offsets filled in, then the arrays."""
        return pack_aux(self._ints, self._floats, self._int_arrays, self._float_arrays)
