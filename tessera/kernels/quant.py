"""Float and weight-only quantized matmul: the packed weight formats, quantize/dequantize, and the matmuls.

Weights follow ``torch.nn.Linear``: ``w [N, K]`` (N output features, K input features) and ``y = x @ w.T``.
Four packed formats, laid out byte by byte in ``docs/kernels/quant.md``:

``int8``      ``w = q * s``, q int8, one scale per row (per channel) or per group of 32/64/128 along K (GGUF Q8_0
              is int8 with group 32).
``int4``      ``w = (q - z) * s``, q in 0..15 packed two per byte, scale and integer zero point per group along K
              (GGUF Q4_0 is int4 with group 32 and z = 8).
``int4_min``  ``w = q * s + m``, q in 0..15 packed two per byte, scale and min per group (GGUF Q4_1, group 32).
``fp8_e4m3``  ``w = q * s``, q ``torch.float8_e4m3fn``, one scale per row.

Example::

    >>> qw = quantize(torch.randn(4096, 4096), "int4", group_size=128)
    >>> y = qmatmul(torch.randn(1, 4096), qw)              # [1, 4096] float32, no dequantized copy on cpu
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from tessera.dtypes import FLOAT_DTYPES
from tessera.kernels import registry
from tessera.kernels.ggml_blocks import BLOCKS, BY_TYPE_ID, row_bytes

#: the formats :func:`quantize` makes
QUANTIZABLE = ("int8", "int4", "int4_min", "fp8_e4m3")
#: every format a :class:`QuantizedWeight` holds: the above, and ggml's block formats kept as a GGUF file stores them
#: (:mod:`tessera.kernels.ggml_blocks`: Q5_0, Q5_1, Q4_K, Q5_K, Q6_K; no separate scales, ``data`` is the file's rows)
FORMATS = QUANTIZABLE + tuple(BLOCKS)
GROUP_SIZES = (32, 64, 128)
#: dtypes a QuantizedWeight's scales (and mins) may have
SCALE_DTYPES = (torch.float32, torch.float16)
# GGUF block formats we read: ggml type id -> (name, bytes per block of 32 weights)
_GGUF = {2: ("Q4_0", 18), 3: ("Q4_1", 20), 8: ("Q8_0", 34)}


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """A weight ``w [N, K]`` in one of :data:`FORMATS`. ``G = group_size`` (``K`` when per channel), ``ng = K // G``.

    Attributes
    ----------
    fmt : str
        One of :data:`FORMATS`.
    shape : tuple[int, int]
        ``(N, K)`` of the float weight.
    group_size : int
        Weights sharing one scale along K: 32, 64 or 128, or ``K`` for per-channel int8 and fp8; for a ggml block
        format, the values of one block (32 or 256).
    data : torch.Tensor
        int8 ``[N, K]`` (int8), uint8 ``[N, K // 2]`` (int4, int4_min; byte ``j`` of a group holds element ``j`` in
        its low nibble and element ``j + G/2`` in its high nibble), float8_e4m3fn ``[N, K]`` (fp8_e4m3), uint8
        ``[N, row_bytes]`` (a ggml block format: whole blocks as the file stores them).
    scales : torch.Tensor or None
        ``[N, ng]``, float32 (what :func:`quantize` makes) or float16 (what a GGUF file stores: :func:`from_gguf`
        keeps its blocks' scales as they are, so a packed weight takes the file's bytes, not more); None for a ggml
        block format, whose scales are inside its blocks.
    zeros : torch.Tensor or None
        uint8 ``[N, ng]`` zero points in 0..15 (int4 only).
    mins : torch.Tensor or None
        ``[N, ng]`` offsets in the scales' dtype (int4_min only).
    """

    fmt: str
    shape: tuple[int, int]
    group_size: int
    data: torch.Tensor
    scales: torch.Tensor | None
    zeros: torch.Tensor | None = None
    mins: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"unknown quantized format {self.fmt!r}; choose one of {list(FORMATS)}")
        n, k = self.shape
        g = self.group_size
        if g <= 0 or k % g:
            raise ValueError(f"{self.fmt}: K={k} is not a multiple of group_size={g}")
        if self.fmt in BLOCKS:
            block = BLOCKS[self.fmt][1]
            if g != block:
                raise ValueError(f"{self.fmt}: group_size must be its block of {block} values, got {g}")
            _check_part(self.fmt, "data", self.data, torch.uint8, (n, row_bytes(self.fmt, k)))
            if self.scales is not None or self.zeros is not None or self.mins is not None:
                raise ValueError(f"{self.fmt}: scales, zeros and mins live inside its blocks; pass None for each")
            return
        if self.scales is None:
            raise ValueError(f"{self.fmt}: scales are required")
        if self.fmt.startswith("int4") and g not in GROUP_SIZES:
            raise ValueError(f"{self.fmt}: group_size must be one of {GROUP_SIZES}, got {g}")
        packed = {"int8": (torch.int8, (n, k)), "int4": (torch.uint8, (n, k // 2)),
                  "int4_min": (torch.uint8, (n, k // 2)), "fp8_e4m3": (torch.float8_e4m3fn, (n, k))}[self.fmt]
        _check_part(self.fmt, "data", self.data, *packed)
        _check_part(self.fmt, "scales", self.scales, torch.float32 if self.fmt == "fp8_e4m3" else SCALE_DTYPES,
                    (n, k // g))
        if (self.zeros is not None) != (self.fmt == "int4"):
            raise ValueError(f"{self.fmt}: zeros must be given exactly for int4")
        if (self.mins is not None) != (self.fmt == "int4_min"):
            raise ValueError(f"{self.fmt}: mins must be given exactly for int4_min")
        if self.zeros is not None:
            _check_part(self.fmt, "zeros", self.zeros, torch.uint8, (n, k // g))
        if self.mins is not None:
            _check_part(self.fmt, "mins", self.mins, self.scales.dtype, (n, k // g))

    @property
    def device(self) -> torch.device:
        return self.data.device

    def to(self, device: str | torch.device) -> QuantizedWeight:
        """The same packed weight with every part on ``device`` (self when it is already there)."""
        device = torch.device(device)
        if self.data.device == device:
            return self
        move = (lambda t: None if t is None else t.to(device))  # noqa: E731
        return dataclasses.replace(self, data=move(self.data), scales=move(self.scales), zeros=move(self.zeros),
                                   mins=move(self.mins))

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The weight of rows ``index`` (int64 ``[R]``, on its device), still packed: what an embedding lookup in a
        packed table de-quantizes."""
        pick = (lambda t: None if t is None else t.index_select(0, index))  # noqa: E731
        return dataclasses.replace(self, shape=(int(index.numel()), self.shape[1]), data=pick(self.data),
                                   scales=pick(self.scales), zeros=pick(self.zeros), mins=pick(self.mins))

    @property
    def nbytes(self) -> int:
        """Bytes a matmul reads: packed data, scales, and zeros or mins."""
        parts = (self.data, self.scales, self.zeros, self.mins)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)


@dataclass(frozen=True, slots=True)
class StackedWeight:
    """One weight ``[N, K]`` held as row blocks in different packed formats, ``w = cat(parts, dim=0)``: a GGUF file's
    q|k|v whose v is Q6_K while q and k are Q4_K (llama.cpp's Q4_K_M mix) stays packed this way instead of being
    de-quantized. ``y = x @ w.T`` runs one :func:`qmatmul` per part (:func:`tessera.models.layers.linear`).

    Attributes
    ----------
    parts : tuple of QuantizedWeight
        ``[N_i, K]`` each, one K, on one device; ``N = sum(N_i)``.
    """

    parts: tuple[QuantizedWeight, ...]

    def __post_init__(self) -> None:
        if len(self.parts) < 2 or not all(isinstance(p, QuantizedWeight) for p in self.parts):
            raise ValueError("StackedWeight: parts must be two or more QuantizedWeight")
        if len({p.shape[1] for p in self.parts}) != 1 or len({p.device for p in self.parts}) != 1:
            raise ValueError(f"StackedWeight: parts must share K and a device, got shapes "
                             f"{[p.shape for p in self.parts]}")

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(p.shape[0] for p in self.parts), self.parts[0].shape[1])

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def to(self, device: str | torch.device) -> StackedWeight:
        return StackedWeight(tuple(p.to(device) for p in self.parts))


def _check_part(fmt: str, name: str, t: torch.Tensor, dtype: torch.dtype | tuple[torch.dtype, ...],
                shape: tuple[int, ...]) -> None:
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if not isinstance(t, torch.Tensor) or t.dtype not in dtypes or tuple(t.shape) != shape or not t.is_contiguous():
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        want = " or ".join(str(d) for d in dtypes)
        raise ValueError(f"{fmt}: {name} must be a contiguous {want} tensor of shape {shape}, got {got}")


def _check_float(name: str, t: torch.Tensor, ndim: int = 2) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}; cast it with .float()")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}; flatten leading dims with "
                         f".reshape(-1, K)")


def quantize(w: torch.Tensor, fmt: str, group_size: int | None = None, *, backend: str = "auto") -> QuantizedWeight:
    """Quantize a float weight (round to nearest).

    Parameters
    ----------
    w : torch.Tensor
        ``[N, K]`` float32, bfloat16 or float16.
    fmt : str
        ``"int8"`` (symmetric, ``s = max|w| / 127``), ``"int4"`` (symmetric with zero point 8, ``s = max|w| / 7``),
        ``"int4_min"`` (``s = (max - min) / 15``, ``m = min``) or ``"fp8_e4m3"`` (``s = max|w| / 448``).
    group_size : int, optional
        32, 64 or 128 along K; ``None`` means per channel for int8 and fp8_e4m3, 128 for the int4 formats. K must be
        a multiple of it.

    Returns
    -------
    QuantizedWeight
        Scales over a group are computed from that group; an all-zero group gets scale 0 and dequantizes to 0.
    """
    _check_float("w", w)
    if fmt in BLOCKS:
        raise ValueError(f"quantize makes {list(QUANTIZABLE)}, not {fmt!r} (ggml block formats come from GGUF "
                         "files: from_gguf)")
    if fmt not in QUANTIZABLE:
        raise ValueError(f"unknown quantized format {fmt!r}; choose one of {list(QUANTIZABLE)}")
    k = w.shape[1]
    if group_size is None:
        group_size = 128 if fmt.startswith("int4") else k
    elif fmt == "fp8_e4m3":
        raise ValueError("fp8_e4m3 is per channel only; pass group_size=None")
    elif group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES} (or None for per channel), got {group_size}")
    if k == 0 or k % group_size:
        raise ValueError(f"{fmt}: K={k} must be a positive multiple of group_size={group_size}; pad w's columns "
                         f"with zeros or pick another group size")
    if not torch.isfinite(w).all():
        raise ValueError("w has NaN or inf entries; they cannot be quantized")
    fn = registry.resolve("quantize", backend, w.device)
    return fn(w, fmt, group_size)


def dequantize(qw: QuantizedWeight | StackedWeight, *, backend: str = "auto") -> torch.Tensor:
    """The float weight a :class:`QuantizedWeight` (or :class:`StackedWeight`) stands for: float32 ``[N, K]``."""
    if isinstance(qw, StackedWeight):
        return torch.cat([dequantize(p, backend=backend) for p in qw.parts])
    if not isinstance(qw, QuantizedWeight):
        raise TypeError(f"qw must be a QuantizedWeight (from quantize or from_gguf), got {type(qw).__name__}")
    return registry.resolve("dequantize", backend, qw.device)(qw)


def matmul(x: torch.Tensor, w: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """``x @ w.T`` for float weights, accumulated in float32.

    Parameters
    ----------
    x : torch.Tensor
        ``[M, K]`` float32, bfloat16 or float16.
    w : torch.Tensor
        ``[N, K]``, same dtype as ``x``.

    Returns
    -------
    torch.Tensor
        ``[M, N]`` in x's dtype.
    """
    _check_float("x", x)
    _check_float("w", w)
    if w.dtype != x.dtype:
        raise TypeError(f"w.dtype {w.dtype} != x.dtype {x.dtype}; cast one of them")
    if w.shape[1] != x.shape[1]:
        raise ValueError(f"x is [M, K] = {tuple(x.shape)} but w is [N, K] = {tuple(w.shape)}: K differs")
    return registry.resolve("matmul", backend, x.device)(x, w)


def qmatmul(x: torch.Tensor, qw: QuantizedWeight, *, backend: str = "auto") -> torch.Tensor:
    """``x @ dequantize(qw).T`` accumulated in float32; the cpu backend never builds the dequantized matrix for M <= 8.

    Parameters
    ----------
    x : torch.Tensor
        ``[M, K]`` float32, bfloat16 or float16 (M may be 0).
    qw : QuantizedWeight
        Shape ``(N, K)``, on x's device.

    Returns
    -------
    torch.Tensor
        ``[M, N]`` in x's dtype.
    """
    _check_float("x", x)
    if not isinstance(qw, QuantizedWeight):
        raise TypeError(f"qw must be a QuantizedWeight (from quantize or from_gguf), got {type(qw).__name__}")
    if qw.shape[1] != x.shape[1]:
        raise ValueError(f"x is [M, K] = {tuple(x.shape)} but qw is [N, K] = {qw.shape}: K differs")
    if qw.device != x.device:
        raise ValueError(f"x is on {x.device} but qw on {qw.device}; move the QuantizedWeight's tensors")
    if torch.compiler.is_compiling():  # the kernels are opaque to Dynamo: trace the custom op instead
        from tessera.integrations import kernel_ops

        return kernel_ops.qmatmul(x, qw, backend=backend)
    return registry.resolve("qmatmul", backend, x.device)(x, qw)


def from_gguf(raw: bytes | np.ndarray | torch.Tensor, ggml_type: int | str, shape: tuple[int, int]) -> QuantizedWeight:
    """Wrap GGUF blocks as a :class:`QuantizedWeight` without changing any value: Q4_0, Q4_1 and Q8_0 split into
    codes and float16 scales (group 32); Q5_0, Q5_1, Q4_K, Q5_K and Q6_K kept whole (:mod:`.ggml_blocks`): a view of
    ``raw`` when it is a writable NumPy array or tensor of the right size, so a mapped file is not copied.

    Parameters
    ----------
    raw : bytes, numpy.ndarray or torch.Tensor
        The tensor's block data as stored in the file (any shape; read as its bytes).
    ggml_type : int or str
        A ``gguf.GGMLQuantizationType`` of those above, by id (``Q4_0`` is 2, ``Q4_K`` 12) or name (``"Q4_K"``).
    shape : tuple[int, int]
        ``(N, K)`` row-major, K contiguous (GGUF lists the dims the other way round: ``ne = [K, N]``).

    Example::

        >>> t = gguf.GGUFReader(path).tensors[0]
        >>> qw = from_gguf(t.data, t.tensor_type, tuple(reversed(t.shape.tolist())))
    """
    names = {name: tid for tid, (name, _) in _GGUF.items()} | {fmt.upper(): tid for tid, fmt in BY_TYPE_ID.items()}
    tid = names.get(ggml_type.upper(), -1) if isinstance(ggml_type, str) else int(ggml_type)
    if tid in BY_TYPE_ID:
        return _whole_blocks(raw, BY_TYPE_ID[tid], shape)
    if tid not in _GGUF:
        raise ValueError(f"ggml type {ggml_type!r} is not supported; supported: {sorted(names)}")
    name, block_bytes = _GGUF[tid]
    n, k = (int(d) for d in shape)
    if k <= 0 or k % 32:
        raise ValueError(f"{name}: K={k} must be a positive multiple of the block size 32")
    if isinstance(raw, torch.Tensor):
        raw = raw.detach().cpu().contiguous().numpy()
    buf = np.frombuffer(memoryview(np.ascontiguousarray(raw)).cast("B"), dtype=np.uint8)
    if buf.size != n * (k // 32) * block_bytes:
        raise ValueError(f"{name} {shape}: expected {n * (k // 32) * block_bytes} bytes "
                         f"({n * k // 32} blocks of {block_bytes}), got {buf.size}")
    blocks = buf.reshape(n, k // 32, block_bytes)
    # Scales and mins stay float16, as stored: widening them to float32 would add 2-4 bytes to every 18-34-byte
    # block that a memory-bound GEMV streams (Q4_0 21 -> 19 bytes a block with the zero points, Q4_1 24 -> 20).
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0]).contiguous()
    if name == "Q8_0":
        data = torch.from_numpy(blocks[..., 2:].copy().view(np.int8).reshape(n, k))
        return QuantizedWeight("int8", (n, k), 32, data, d)
    if name == "Q4_0":
        data = torch.from_numpy(blocks[..., 2:].reshape(n, k // 2).copy())
        return QuantizedWeight("int4", (n, k), 32, data, d, zeros=torch.full((n, k // 32), 8, dtype=torch.uint8))
    m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0]).contiguous()
    data = torch.from_numpy(blocks[..., 4:].reshape(n, k // 2).copy())
    return QuantizedWeight("int4_min", (n, k), 32, data, d, mins=m)


def _whole_blocks(raw: bytes | np.ndarray | torch.Tensor, fmt: str, shape: tuple[int, int]) -> QuantizedWeight:
    """A ggml block format's rows as they are: a view of ``raw`` where it can be one."""
    n, k = (int(d) for d in shape)
    values = BLOCKS[fmt][1]
    if k <= 0 or k % values:
        raise ValueError(f"{fmt.upper()}: K={k} must be a positive multiple of its block of {values} values")
    width = row_bytes(fmt, k)
    if isinstance(raw, torch.Tensor):
        data = raw.detach().cpu().contiguous().view(torch.uint8).reshape(-1)
    else:
        array = np.frombuffer(raw, dtype=np.uint8) if isinstance(raw, (bytes, bytearray, memoryview)) else \
            np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
        # torch needs a writable array to share memory; a read-only one (bytes, a read-only mapping) is copied
        data = torch.from_numpy(array if array.flags.writeable else array.copy())
    if data.numel() != n * width:
        raise ValueError(f"{fmt.upper()} {shape}: expected {n * width} bytes ({n * k // values} blocks of "
                         f"{BLOCKS[fmt][2]}), got {data.numel()}")
    return QuantizedWeight(fmt, (n, k), values, data.reshape(n, width), None)
