"""The formats ``tessera quant-report`` compares, by name, and how each one's model is made from a model source.

Weight formats (``--formats``):

``fp32``      the reference: every weight in float32, a GGUF file's packed blocks de-quantized
              (``load_model(path, keep_quantized=False)``): the exact values of its codes.
``bf16``      every weight in bfloat16 (``load_model(path, dtype="bfloat16", keep_quantized=False)``).
``int8``      the reference's projections and token table(s) quantized by :func:`tessera.kernels.quant.quantize`,
``int4``      int8 / int4 / int4_min in groups of ``group_size`` (32 by default: the layouts of GGUF's Q8_0,
``int4_min``  Q4_0 and Q4_1, with float32 scales), fp8_e4m3 per output channel. A tied model holds one packed table
``fp8_e4m3``  for lookups and logits (:func:`tessera.models.requantize.requantize_model` with ``tables="all"``).
              int8's scales come from a least-squares search per group (:mod:`tessera.kernels.quant_search`), not
              ``max|w| / 127``: same bytes, smaller error.
``gguf``      a GGUF file as it loads by default: the projections and table its types allow kept packed as stored
              (Q4_0 / Q4_1 / Q8_0 / K-quants), what ``tessera generate`` runs.

KV formats (``--kv-formats``), each ``WEIGHTS:KV`` (``KV`` alone means ``fp32:KV``): the model of weight format
``WEIGHTS`` run through a paged KV cache holding ``KV``: ``int8``, ``fp8_e4m3``, or the model's own float dtype
(``fp32`` or ``bf16``, the unquantized pages a quantized cache is compared with).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI's parser reads the names above without loading torch
    from tessera.models.model import Model

#: the reference every other row is compared with
REFERENCE = "fp32"
#: every weight format, in the report's order
WEIGHT_FORMATS = ("fp32", "bf16", "int8", "int4", "int4_min", "fp8_e4m3", "gguf")
#: weight formats made by quantizing the reference, and whether they take the group size (fp8_e4m3: per channel)
REQUANTIZED = {"int8": True, "int4": True, "int4_min": True, "fp8_e4m3": False}
#: KV cache formats a row may name (the float ones must be the model's own dtype)
KV_FORMATS = ("fp32", "bf16", "int8", "fp8_e4m3")
QUANTIZED_KV = ("int8", "fp8_e4m3")
#: the KV rows run by default: the float32 reference over each quantized cache, and bf16 weights over bf16 pages
#: and over int8 pages (the comparison a quantized cache is chosen by: it replaces bf16 pages)
DEFAULT_KV_FORMATS = ("fp32:int8", "fp32:fp8_e4m3", "bf16:bf16", "bf16:int8")
GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 32
#: the short names of the float dtypes the report writes
DTYPE_NAMES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}


@dataclass(frozen=True)
class RowSpec:
    """One row of the report: a weight format, and the KV cache its windows run through.

    Attributes
    ----------
    weights : one of :data:`WEIGHT_FORMATS`
    kv : None (the windows run by ``Model.logits``, K/V in the model's dtype, no paged cache), or one of
        :data:`KV_FORMATS` (each window through a fresh paged cache holding that format)
    """

    weights: str
    kv: str | None = None

    @property
    def name(self) -> str:
        """``"int8"`` for a weight row, ``"bf16 + int8 KV"`` for a KV row."""
        return self.weights if self.kv is None else f"{self.weights} + {self.kv} KV"


def is_gguf(source: str | Path) -> bool:
    """Whether the model source is a GGUF file (the ``gguf`` format exists only for one)."""
    path = Path(source)
    return path.is_file() and path.suffix == ".gguf"


def parse_formats(formats: Iterable[str] | None, source_is_gguf: bool) -> list[str]:
    """The weight formats to report, the reference first, each once, in :data:`WEIGHT_FORMATS` order.

    Parameters
    ----------
    formats : names (a comma-separated string is split), or None for all (``gguf`` only for a GGUF source)
    source_is_gguf : whether the model source is a GGUF file

    Raises
    ------
    ValueError
        An unknown name, or ``gguf`` asked of a source that is not a GGUF file.
    """
    if formats is None:
        return [f for f in WEIGHT_FORMATS if f != "gguf" or source_is_gguf]
    names = _split(formats)
    unknown = [f for f in names if f not in WEIGHT_FORMATS]
    if unknown:
        raise ValueError(f"quant-report: unknown weight format(s) {unknown}; choose from {list(WEIGHT_FORMATS)}")
    if "gguf" in names and not source_is_gguf:
        raise ValueError("quant-report: the gguf format is the GGUF file's own packed types; the model source is not "
                         "a .gguf file")
    wanted = {REFERENCE, *names}  # the reference is always measured: every other row is compared with it
    return [f for f in WEIGHT_FORMATS if f in wanted]


def parse_kv_formats(specs: Iterable[str] | None, source_is_gguf: bool) -> list[RowSpec]:
    """The KV rows: each ``WEIGHTS:KV`` (or ``KV``, meaning ``fp32:KV``) validated, duplicates dropped.

    Parameters
    ----------
    specs : the rows (a comma-separated string is split); None for :data:`DEFAULT_KV_FORMATS`; ``["none"]`` or an
        empty list for no KV rows
    source_is_gguf : whether the model source is a GGUF file (for ``gguf:KV``)

    Raises
    ------
    ValueError
        An unknown weight or KV name, or a float KV format other than the model's dtype (``bf16:fp32``: the pages
        of a float cache hold the model's own dtype).
    """
    names = list(DEFAULT_KV_FORMATS) if specs is None else _split(specs)
    if names == ["none"]:
        return []
    rows: list[RowSpec] = []
    for spec in names:
        weights, _, kv = spec.rpartition(":")
        weights = weights or REFERENCE
        parse_formats([weights], source_is_gguf)  # the same errors as --formats
        if kv not in KV_FORMATS:
            raise ValueError(f"quant-report: KV format {spec!r}: the KV part must be one of {list(KV_FORMATS)} "
                             f"(written WEIGHTS:KV, e.g. bf16:int8)")
        own = "bf16" if weights == "bf16" else "fp32"  # every format but bf16 computes in float32
        if kv not in QUANTIZED_KV and kv != own:
            raise ValueError(f"quant-report: KV format {spec!r}: a {weights} model's unquantized pages hold {own}; "
                             f"use {weights}:{own}, {weights}:int8 or {weights}:fp8_e4m3")
        row = RowSpec(weights, kv)
        if row not in rows:
            rows.append(row)
    return rows


def check_group_size(group_size: int) -> int:
    """``group_size`` if it is one of :data:`GROUP_SIZES`."""
    if isinstance(group_size, bool) or group_size not in GROUP_SIZES:
        raise ValueError(f"quant-report: group_size must be one of {list(GROUP_SIZES)}, got {group_size!r}")
    return int(group_size)


def load_reference(source: str | Path, backend: str = "auto", device: str | None = None) -> Model:
    """The float32 reference of ``source``: a GGUF file's packed weights de-quantized to their exact values."""
    from tessera.models.load import load_model

    return load_model(source, dtype="float32", backend=backend, keep_quantized=False, device=device)


def build_model(fmt: str, reference: Model, source: str | Path, *, group_size: int = DEFAULT_GROUP_SIZE,
                backend: str = "auto", device: str | None = None) -> Model:
    """The model of weight format ``fmt`` (see the module docstring).

    Parameters
    ----------
    fmt : one of :data:`WEIGHT_FORMATS`
    reference : the float32 reference (:func:`load_reference`); ``fp32`` returns it, the quantized formats are
        made from it
    source : the model source (``bf16`` and ``gguf`` load it again)
    group_size : int8 / int4 / int4_min group along K
    backend, device : as for :func:`tessera.models.load.load_model`
    """
    from tessera.models.load import load_model
    from tessera.models.requantize import requantize_model

    if fmt == REFERENCE:
        return reference
    if fmt == "bf16":
        return load_model(source, dtype="bfloat16", backend=backend, keep_quantized=False, device=device)
    if fmt == "gguf":
        return load_model(source, dtype="float32", backend=backend, device=device)
    if fmt in REQUANTIZED:
        # int8 with searched scales: what an offline int8 quantizer should ship (tessera.kernels.quant_search)
        return requantize_model(reference, fmt, group_size if REQUANTIZED[fmt] else None, tables="all",
                                search_scales=fmt == "int8")
    raise ValueError(f"quant-report: unknown weight format {fmt!r}; choose from {list(WEIGHT_FORMATS)}")


def dtype_name(model: Model) -> str:
    """``"fp32"``, ``"bf16"`` or ``"fp16"``: the model's activations' dtype."""
    return DTYPE_NAMES[str(model.dtype)]


def _split(values: Iterable[str]) -> list[str]:
    """Names from a list whose items may themselves be comma-separated (``--formats int8,int4 fp8_e4m3``)."""
    if isinstance(values, str):
        values = [values]
    names: list[str] = []
    for value in values:
        for name in str(value).split(","):
            name = name.strip()
            if name and name not in names:
                names.append(name)
    return names
