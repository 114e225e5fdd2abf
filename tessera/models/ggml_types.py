"""ggml's tensor types as GGUF files number them, with each type's block: values per block and bytes per block.

The same table as gguf-py's ``GGMLQuantizationType`` and ``GGML_QUANT_SIZES`` (a test keeps them equal), held here so
that opening a GGUF file does not import gguf-py: its package imports its writer, its lazy tensors and
``numpy.typing``, ~0.1 s of a start-up budget of a second or two. gguf-py stays the oracle the tests compare with and
the de-quantizer of the types :mod:`tessera.models.gguf_dequant` has no rule for.
"""

from __future__ import annotations

from enum import IntEnum


class GGMLType(IntEnum):
    """A tensor's type id in a GGUF file (ggml's ``ggml_type``)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39
    NVFP4 = 40
    Q1_0 = 41


_T = GGMLType
#: type -> (values per block, bytes per block)
BLOCK_SIZES: dict[GGMLType, tuple[int, int]] = {
    _T.F32: (1, 4), _T.F16: (1, 2), _T.Q4_0: (32, 18), _T.Q4_1: (32, 20), _T.Q5_0: (32, 22), _T.Q5_1: (32, 24),
    _T.Q8_0: (32, 34), _T.Q8_1: (32, 40), _T.Q2_K: (256, 84), _T.Q3_K: (256, 110), _T.Q4_K: (256, 144),
    _T.Q5_K: (256, 176), _T.Q6_K: (256, 210), _T.Q8_K: (256, 292), _T.IQ2_XXS: (256, 66), _T.IQ2_XS: (256, 74),
    _T.IQ3_XXS: (256, 98), _T.IQ1_S: (256, 50), _T.IQ4_NL: (32, 18), _T.IQ3_S: (256, 110), _T.IQ2_S: (256, 82),
    _T.IQ4_XS: (256, 136), _T.I8: (1, 1), _T.I16: (1, 2), _T.I32: (1, 4), _T.I64: (1, 8), _T.F64: (1, 8),
    _T.IQ1_M: (256, 56), _T.BF16: (1, 2), _T.TQ1_0: (256, 54), _T.TQ2_0: (256, 66), _T.MXFP4: (32, 17),
    _T.NVFP4: (64, 36), _T.Q1_0: (128, 18),
}
