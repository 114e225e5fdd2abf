"""The shapes a tuning run measures on: a model's projections and attention, read from its config alone."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tessera.kernels.quant import FORMATS
from tessera.tuning import registry, search


@dataclass(frozen=True)
class Workload:
    """Shapes the measurements run on.

    Attributes
    ----------
    name : shown in tables and recorded in the cache entries.
    projections : ``(N, K)`` of each weight matrix of one layer (``y = x @ w.T``).
    num_q_heads, num_kv_heads, head_dim : the attention shape of the decode measurement.
    formats : the packed formats the model's projections use (``None``: all of :data:`FORMATS`).
    """

    name: str
    projections: tuple[tuple[int, int], ...]
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    formats: tuple[str, ...] | None = None


SMOLLM2 = Workload("SmolLM2-135M", ((3072, 576), (576, 1536), (960, 576)), 9, 3, 64)
SMOLLM2_AND_1B = Workload("SmolLM2-135M + 1B-class", SMOLLM2.projections + ((2048, 2048), (11264, 2048)), 9, 3, 64)


def workload() -> Workload:
    """The workload of the search in progress: the model's (``--model``), else SmolLM2 (``--quick``) or SmolLM2 plus
    the 1B-class shapes."""
    opts = search.options()
    if isinstance(opts.workload, Workload):
        return opts.workload
    return SMOLLM2 if opts.quick else SMOLLM2_AND_1B


def workload_from_model(path: str | Path) -> Workload:
    """The projection and attention shapes of a GGUF file or Hugging Face directory, from its config only (no
    weights are read; the GGUF file is memory-mapped for its header and tensor table)."""
    path = Path(path)
    formats = None
    if path.is_file():
        from tessera.models.gguf import config_from_gguf, open_reader, read_metadata

        reader = open_reader(path)
        tensors = {t.name: t for t in reader.tensors}
        config = config_from_gguf(read_metadata(reader), tensors, path)[2]
        packed = {"Q4_0": "int4", "Q4_1": "int4_min", "Q8_0": "int8"}
        found = {packed[t.tensor_type.name] for name, t in tensors.items()
                 if name.startswith("blk.") and name.endswith(".weight") and t.tensor_type.name in packed}
        formats = tuple(f for f in FORMATS if f in found) or None
    elif path.is_dir():
        from tessera.models.hf import read_config

        config = read_config(path)[2]
    else:
        raise FileNotFoundError(f"--model {path}: no such file or directory; pass a .gguf file or a Hugging Face "
                                "model directory")
    h = config.hidden_size
    inner = config.moe_intermediate_size if config.is_moe else config.intermediate_size
    mlp = ((2 * inner, h), (h, inner)) if config.gated_mlp else ((inner, h), (h, inner))
    projections = ((config.qkv_rows, h), (h, config.num_heads * config.head_dim), *mlp)
    return Workload(path.name, tuple(dict.fromkeys(projections)), config.num_heads, config.num_kv_heads,
                    config.head_dim, formats)


def format_classes(w: Workload | None) -> dict[str, Sequence[str]]:
    """The shape classes a model restricts the run to, for :func:`tessera.tuning.search.plan`: every tunable keyed
    by packed format is timed on the model's formats only."""
    if w is None or not w.formats:
        return {}
    return {name: w.formats for name, t in registry.tunables().items()
            if t.shape_classes != (None,) and set(t.shape_classes) <= set(FORMATS)}
