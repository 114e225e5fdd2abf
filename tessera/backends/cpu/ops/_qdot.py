"""Host side of the int8-activation quantized GEMV (:mod:`._qdot_kernels` for int4 / int8 codes with separate
scales, :mod:`._qdot_ggml` for ggml's block formats kept whole): which weights it takes, which ISA token the chosen
``qgemv`` variant runs, and the call itself."""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
import weakref
from pathlib import Path

import numpy as np
import torch

from tessera._atomic import write_text_atomic
from tessera.backends.cpu import variants
from tessera.backends.cpu.ops import _qdot_ggml as ggml_kernels
from tessera.backends.cpu.ops import _qdot_kernels as kernels
from tessera.backends.cpu.ops import _qdot_kpanel as kpanel_kernels
from tessera.backends.cpu.ops import _qdot_panel as panel_kernels
from tessera.backends.cpu.ops import _qdot_q6panel as q6panel_kernels
from tessera.backends.cpu.ops import _qdot_q8panel as q8panel_kernels
from tessera.backends.cpu.ops._ggml_kernels import FMT_CODES as GGML_CODES
from tessera.backends.cpu.ops._int8_simd import AVX2, VNNI, VNNI512, IsaToken
from tessera.backends.cpu.ops._narrow import group_view
from tessera.kernels.quant import QuantizedWeight, StackedWeight

#: ``qgemv`` variant -> the ISA token its kernels compile for (None: the float-activation kernels)
_TOKENS: dict[str, IsaToken | None] = {"vnni512": VNNI512, "vnni": VNNI, "avx2": AVX2, "portable": None}


#: what one ``qgemv`` specialization is compiled for: the weight format and its scales' dtype (float32 from
#: :func:`~tessera.kernels.quant.quantize`, float16 as a GGUF file stores them; uint8 for ggml's block formats, whose
#: scales are bytes inside their blocks)
Kind = tuple[str, torch.dtype]
#: the kinds checked when the caller names no weight (the benchmarks and tuners, which quantize their own weights)
DEFAULT_KINDS: tuple[Kind, ...] = (("int4", torch.float32), ("int4_min", torch.float32), ("int8", torch.float32))

#: (variant name, kind) -> whether its kernels passed :func:`self_check` in this process
_CHECKED: dict[tuple[str, Kind], bool] = {}
_CHOSEN: dict[tuple, IsaToken | None] = {}


def kind_of(qw: QuantizedWeight) -> Kind:
    """The kernel specialization ``qw`` runs."""
    return (qw.fmt, torch.uint8 if qw.scales is None else qw.scales.dtype)


def _packed_parts(weights) -> list[QuantizedWeight]:
    """The :class:`QuantizedWeight` s among ``weights``, a :class:`StackedWeight` counted as its parts."""
    out: list[QuantizedWeight] = []
    for w in weights:
        out.extend(w.parts if isinstance(w, StackedWeight) else (w,))
    return out


def chosen_token(*weights: QuantizedWeight) -> IsaToken | None:
    """The ISA token of the ``qgemv`` variant chosen here for ``weights``, or None when the portable variant runs.

    A variant is used only after it passed :func:`self_check` once in the process, for each kind of weight it is
    given (:func:`kind_of`; :data:`DEFAULT_KINDS` when none is named): the VNNI variants are compiled only on CPUs that
    have the instruction, so a machine without it cannot test them, and a wrong result there would otherwise go
    unnoticed. The check runs the kernels with the argument types of the weights at hand, so it compiles nothing a
    model does not run (a first run on an empty kernel cache pays only for its own kinds). A variant that fails is
    replaced by the next one this CPU runs, for all the given weights together, with a warning.
    """
    taken = [w for w in _packed_parts(weights) if unsupported(w) is None]  # a weight the int8 kernels cannot take runs elsewhere
    kinds = tuple(sorted({kind_of(w) for w in taken}, key=str)) if taken else DEFAULT_KINDS
    key = (os.environ.get("TESSERA_CPU_VARIANTS", ""), os.environ.get("TESSERA_ISA", ""), variants.generation,
           variants.tuned_preference("qgemv"), kinds)  # what `tessera tune` chose: a memoized lookup
    if key in _CHOSEN:  # the hot path: a dict lookup (qmatmul asks on every call)
        return _CHOSEN[key]
    names = variants.available("qgemv")
    name = variants.choose("qgemv").name
    while _TOKENS[name] is not None and not all(_passes(name, kind) for kind in kinds):
        later = names[names.index(name) + 1:] if name in names else []
        name = later[0] if later else "portable"
    _CHOSEN[key] = _TOKENS[name]
    return _TOKENS[name]


def _passes(name: str, kind: Kind) -> bool:
    ok = _CHECKED.get((name, kind))
    if ok is None and _passed_before(name, kind):
        ok = _CHECKED[(name, kind)] = True
    if ok is None:
        error = self_check(_TOKENS[name], kind)
        ok = _CHECKED[(name, kind)] = error is None
        if ok:
            _record_pass(name, kind)
        else:
            warnings.warn(f"qgemv variant {name!r} failed its self-check ({error}); falling back to the next "
                          "variant this CPU runs. Please report this with the output of `tessera info`.",
                          RuntimeWarning, stacklevel=3)
    return ok


# A pass is remembered beside the compiled kernels: the check tests machine code, and the same code on the same CPU
# gives the same answer, so a warm process skips it (~0.4 s of a short `tessera generate`: it would load the
# standalone GEMV kernels from the cache just to check them, where a one-token decode runs only the fused layer).
# The file sits in the Numba cache directory, which is keyed by the kernel sources (tessera/_numba_cache.py); the key
# inside names the CPU, since one home directory can serve several machines. A failure is never remembered: it is
# re-checked, and warned about, in every process.
_VERDICTS = "qgemv-self-check.json"


def _verdict_key(name: str, kind: Kind) -> str:
    import llvmlite.binding as llvm  # what Numba keys its own cache by: the host CPU and its features

    return "|".join((llvm.get_host_cpu_name(), llvm.get_host_cpu_features().flatten(), name, kind[0], str(kind[1])))


def _verdicts_path() -> Path | None:
    import numba

    root = numba.config.CACHE_DIR
    return Path(root) / _VERDICTS if root else None


def _passed_before(name: str, kind: Kind) -> bool:
    path = _verdicts_path()
    if path is None:
        return False
    try:
        return json.loads(path.read_text()).get(_verdict_key(name, kind)) is True
    except (OSError, ValueError, AttributeError):  # absent, unreadable or damaged: check again
        return False


def _record_pass(name: str, kind: Kind) -> None:
    path = _verdicts_path()
    if path is None:
        return
    try:
        try:
            verdicts = json.loads(path.read_text())
            verdicts = verdicts if isinstance(verdicts, dict) else {}
        except (OSError, ValueError):
            verdicts = {}
        verdicts[_verdict_key(name, kind)] = True
        write_text_atomic(path, json.dumps(verdicts, indent=1, sort_keys=True))
    except OSError:  # a read-only cache: the check simply runs again next time
        pass


def self_check(isa: IsaToken, kind: Kind = ("int4", torch.float32)) -> str | None:
    """Run the int8 kernels of ``isa`` on small random weights of ``kind`` (group 32, and 128 where the format
    allows, serial and parallel, one and four x rows at a time) against the float64 product of the same quantized
    activation; None when all agree to fp32 rounding, else what differed. ~0.1 s after compilation."""
    from tessera.backends.reference.ops.quant import qmatmul_f64
    from tessera.kernels.quant import quantize

    fmt, scale_dtype = kind
    gen = torch.Generator().manual_seed(20261201)
    if fmt in GGML_CODES:
        return _self_check_ggml(isa, fmt, gen)
    # five x rows: a block of four and a single one; 11 blocks of 32: the 512-bit rows' unrolled pairs, one more
    # pair and an odd block
    shapes = ((32, 352), (128, 384)) if fmt == "int4" else ((32, 352),)
    for group, k in shapes:
        x = torch.randn(5, k, generator=gen)
        x_deq = quantized_activation(x)
        qw = _with_scale_dtype(quantize(torch.randn(21, k, generator=gen), fmt, group), scale_dtype)
        error = _mismatch(x, qw, qmatmul_f64(x_deq, qw), isa)
        if error is not None:
            return f"{fmt}/g{group} with {scale_dtype} scales, {error}"
    return None


def _mismatch(x: torch.Tensor, w: QuantizedWeight | StackedWeight, want: torch.Tensor, isa: IsaToken) -> str | None:
    """Where :func:`qmatmul` of ``isa``, serial or parallel, is not ``want`` to fp32 rounding (None: nowhere)."""
    for serial in (True, False):
        got = qmatmul(x, w, isa, serial).double()
        err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
        if not err <= 1e-5:  # also catches NaN
            return f"serial={serial}: relative error {err:.3g}"
    return None


def _self_check_ggml(isa: IsaToken, fmt: str, gen: torch.Generator) -> str | None:
    """:func:`self_check` for a ggml block format: random block bytes (every code and scale pattern), K of three
    blocks of 256 (11 blocks of 32 for Q5_0 / Q5_1: an odd count), and a weight of two row blocks (the second in
    another format, as a Q4_K_M file's q|k|v)."""
    from tessera.backends.reference.ops.quant import qmatmul_f64
    from tessera.tuning.random_weights import random_ggml_weight

    k = 352 if fmt in ("q5_0", "q5_1") else 768
    other = {"q5_0": "q5_1", "q5_1": "q5_0", "q4_k": "q6_k"}.get(fmt, "q4_k")
    x = torch.randn(5, k, generator=gen)
    x_deq = quantized_activation(x)
    single = random_ggml_weight(fmt, 21, k, gen)
    stacked = StackedWeight((single, random_ggml_weight(other, 19, k, gen)))
    for w in (single, stacked):
        parts = w.parts if isinstance(w, StackedWeight) else (w,)
        error = _mismatch(x, w, torch.cat([qmatmul_f64(x_deq, p) for p in parts], dim=1), isa)
        if error is not None:
            return f"{fmt} ({len(parts)} row blocks), {error}"
    return None


def _with_scale_dtype(qw: QuantizedWeight, dtype: torch.dtype) -> QuantizedWeight:
    """``qw`` with its scales (and mins) rounded to ``dtype``: the oracle reads the rounded values too."""
    if qw.scales.dtype == dtype:
        return qw
    mins = None if qw.mins is None else qw.mins.to(dtype)
    return dataclasses.replace(qw, scales=qw.scales.to(dtype), mins=mins)


def unsupported(qw: QuantizedWeight | StackedWeight) -> str | None:
    """Why the int8-activation kernels cannot take ``qw`` (None when they can)."""
    if isinstance(qw, StackedWeight):
        fmts = [p.fmt for p in qw.parts]
        if len(fmts) != 2 or not all(f in GGML_CODES for f in fmts):
            return (f"row blocks in formats {fmts} (the int8 dot products take two blocks of ggml formats "
                    f"{sorted(GGML_CODES)})")
        return unsupported(qw.parts[0]) or unsupported(qw.parts[1])
    if qw.fmt in GGML_CODES:
        return None  # whole blocks of 32 or 256 values: any K the format can hold
    if qw.fmt not in ("int4", "int4_min", "int8"):
        return f"format {qw.fmt} (the int8 dot products take int4, int4_min, int8 and {sorted(GGML_CODES)})"
    if qw.shape[1] % kernels.BLOCK:
        return f"K={qw.shape[1]} is not a multiple of the activation block {kernels.BLOCK}"
    if qw.group_size % kernels.BLOCK and qw.group_size != qw.shape[1]:
        return f"group size {qw.group_size} is not a multiple of {kernels.BLOCK}"
    return None


def takes_panels(qw: QuantizedWeight | StackedWeight, isa: IsaToken | None) -> bool:
    """Whether ``qw`` runs the row-panel kernels at every number of activation rows: group-32 int4 / int4_min (GGUF
    Q4_0 / Q4_1, :mod:`._qdot_panel`), group-32 int8 (Q8_0, :mod:`._qdot_q8panel`) and ggml's Q4_K and Q6_K
    (:mod:`._qdot_kpanel`, :mod:`._qdot_q6panel`), under the ``vnni512`` token."""
    if isa is not VNNI512 or not isinstance(qw, QuantizedWeight):
        return False
    return qw.fmt in PANEL_GEMVS and (qw.fmt in GGML_CODES or qw.group_size == kernels.BLOCK)


#: format -> (parallel, serial) GEMV of its row panels: each takes ``(isa, xq, xd, xs, *panel arrays, out)``, the
#: arrays being :func:`panel_arrays` without its trailing N
PANEL_GEMVS = {
    "int4": (panel_kernels.gemv_panel, panel_kernels.gemv_panel_serial),
    "int4_min": (panel_kernels.gemv_panel, panel_kernels.gemv_panel_serial),
    "int8": (q8panel_kernels.gemv_q8panel, q8panel_kernels.gemv_q8panel_serial),
    "q4_k": (kpanel_kernels.gemv_kpanel, kpanel_kernels.gemv_kpanel_serial),
    "q6_k": (q6panel_kernels.gemv_q6panel, q6panel_kernels.gemv_q6panel_serial),
}

#: activation rows from which a parallel call quantizes them over its threads too (a prefill chunk); below, the
#: thread pool's wake-up costs more than the work
PARALLEL_QUANTIZE_ROWS = 16

#: ids of (codes, scales, offsets), or of a K-quant weight's block bytes -> (weak references to them, their panel
#: layout): built on a weight's first use
_PANELS: dict[tuple[int, ...], tuple[tuple[weakref.ref, ...], tuple]] = {}


def panel_arrays(qw: QuantizedWeight) -> tuple:
    """``qw`` in its row-panel layout, repacked on its first use and kept while its arrays live: ``(codes, scales,
    offsets, N)`` for group-32 int4 (:func:`._qdot_panel.repack_int4_g32`; ``offsets`` without columns when every
    zero point is 8, as in GGUF Q4_0), ``(codes, sc, mn, d, dmin, N)`` for
    Q4_K (:func:`._qdot_kpanel.repack_q4k`), ``(codes, sc, d, N)`` for Q6_K (:func:`._qdot_q6panel.repack_q6k`; its
    int8 ``sc`` tells it from the group-32 tuple), ``(codes, scales, N)`` for group-32 int8
    (:func:`._qdot_q8panel.repack_int8_g32`; its uint8 codes tell it from the int8 rows' ``(q, scales, group)``).

    The repacked copy is held beside the weight's own arrays, which the other readers (de-quantization, the
    embedding rows, tensor-parallel sharding, export) still take, so a packed weight that takes the panels costs
    its bytes twice in memory on ``vnni512`` machines; the hot path reads only the panels. Repacking is one pass
    over the weight's bytes (not timed on its own)."""
    if qw.fmt in ("q4_k", "q6_k"):
        parts = (qw.data,)
    elif qw.fmt == "int8":
        parts = (qw.data, qw.scales)
    else:
        parts = (qw.data, qw.scales, qw.mins if qw.fmt == "int4_min" else qw.zeros)
    key = tuple(map(id, parts))  # weights made by dataclasses.replace may share some of these
    hit = _PANELS.get(key)
    if hit is not None and all(ref() is part for ref, part in zip(hit[0], parts)):
        return hit[1]
    if qw.fmt == "q4_k":
        arrays = (*kpanel_kernels.repack_q4k(qw.data.numpy()), qw.shape[0])
    elif qw.fmt == "q6_k":
        arrays = (*q6panel_kernels.repack_q6k(qw.data.numpy()), qw.shape[0])
    elif qw.fmt == "int8":
        arrays = (*q8panel_kernels.repack_int8_g32(qw.data.numpy(), group_view(qw.scales)), qw.shape[0])
    else:
        codes, scales, offsets = panel_kernels.repack_int4_g32(qw.data.numpy(), group_view(parts[1]),
                                                               group_view(parts[2]))
        if qw.fmt == "int4" and bool((qw.zeros == panel_kernels.Q4_0_ZERO).all()):  # Q4_0: no zero-point stream
            offsets = offsets[:, :0]
        arrays = (codes, scales, np.ascontiguousarray(offsets), qw.shape[0])
    drop = lambda _, key=key: _PANELS.pop(key, None)
    _PANELS[key] = (tuple(weakref.ref(part, drop) for part in parts), arrays)
    return arrays


def weight_arrays(qw: QuantizedWeight | StackedWeight, isa: IsaToken | None = None) -> tuple:
    """The kernels' weight arguments after the activation ones, as NumPy views: ``(q, scales, group)`` for int8,
    ``(packed, scales, offsets, has_min, group)`` for int4 / int4_min, and ``(w0, w1, fmt0, fmt1, split)`` for ggml's
    block formats (:func:`._qdot_ggml.ggml_rows`; one format: ``w1`` empty and ``split = N``). Given the ISA token
    the weights will run under, a weight that :func:`takes_panels` is in its panel layout (:func:`panel_arrays`:
    ``(codes, scales, offsets, N)``, ``(codes, sc, mn, d, dmin, N)`` for Q4_K, ``(codes, sc, d, N)`` for Q6_K,
    ``(codes, scales, N)`` for int8)."""
    if takes_panels(qw, isa):
        return panel_arrays(qw)
    if isinstance(qw, StackedWeight):
        a, b = qw.parts
        return (a.data.numpy(), b.data.numpy(), GGML_CODES[a.fmt], GGML_CODES[b.fmt], a.shape[0])
    if qw.fmt in GGML_CODES:
        data = qw.data.numpy()
        return (data, data[:0], GGML_CODES[qw.fmt], GGML_CODES[qw.fmt], qw.shape[0])
    if qw.fmt == "int8":
        return (qw.data.numpy(), group_view(qw.scales), qw.group_size)
    offsets = qw.mins if qw.fmt == "int4_min" else qw.zeros
    return (qw.data.numpy(), group_view(qw.scales), group_view(offsets), qw.fmt == "int4_min", qw.group_size)


def qmatmul(x: torch.Tensor, qw: QuantizedWeight | StackedWeight, isa: IsaToken, serial: bool) -> torch.Tensor:
    """float32 ``x_deq @ W.T`` for contiguous float32 ``x [M, K]``: x quantized to int8 per block of 32, then the
    integer kernels of ``isa`` on the calling thread (``serial``) or over all threads."""
    m = x.shape[0]
    out = torch.empty(m, qw.shape[0], dtype=torch.float32)
    parallel_rows = not serial and m >= PARALLEL_QUANTIZE_ROWS
    xq, xd, xs = (panel_kernels.quantize_activations_parallel if parallel_rows else
                  kernels.quantize_activations)(x.numpy())
    on = out.numpy()
    if takes_panels(qw, isa):
        parallel_gemv, serial_gemv = PANEL_GEMVS[qw.fmt]
        (serial_gemv if serial else parallel_gemv)(isa, xq, xd, xs, *panel_arrays(qw)[:-1], on)
    elif isinstance(qw, StackedWeight) or qw.fmt in GGML_CODES:
        (ggml_kernels.gemv_ggml_serial if serial else ggml_kernels.gemv_ggml)(isa, xq, xd, xs, *weight_arrays(qw), on)
    elif qw.fmt == "int8":
        q, scales, group = weight_arrays(qw)
        (kernels.gemv_int8_serial if serial else kernels.gemv_int8)(isa, xq, xd, q, scales, group, on)
    else:
        packed, scales, offsets, has_min, group = weight_arrays(qw)
        (kernels.gemv_int4_serial if serial else kernels.gemv_int4)(isa, xq, xd, xs, packed, scales, offsets,
                                                                    has_min, group, on)
    return out


def quantized_activation(x: torch.Tensor) -> torch.Tensor:
    """``x_deq``: float32 ``[M, K]`` as the int8-activation kernels see it (codes times block scales); the oracle
    input for testing them."""
    xq, xd, _ = kernels.quantize_activations(np.ascontiguousarray(x.detach().float().numpy()))
    return torch.from_numpy(xq).float() * torch.from_numpy(xd).repeat_interleave(kernels.BLOCK, dim=1)
