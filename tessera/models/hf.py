"""Load a Hugging Face model directory: ``config.json``, single or sharded safetensors (memory-mapped), tokenizer.

Weights are read with ``safetensors.safe_open`` (never pickle), converted to the requested dtype and assembled into
canonical names by the family's :class:`WeightSpec` list (q|k|v and gate|up fused on load). A ``transform`` hook
sees each canonical weight whole, once, as soon as it is assembled, and the loader keeps only what the hook returns:
a tensor-parallel rank cuts its shard there (:mod:`tessera.distributed.rank_local`), so no rank holds the whole model.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from tessera.models.config import ModelConfig
from tessera.models.families import by_model_type
from tessera.models.families.common import Family, WeightSpec


class CheckpointError(ValueError):
    """A checkpoint is missing a file or tensor, or holds a tensor of the wrong shape."""


#: a loader's per-weight hook: (canonical name, the whole weight as loaded) -> what the loader keeps under that name
WeightHook = Callable[[str, Any], Any]


def layer_key(name: str) -> str:
    """The group a canonical weight is loaded with: ``"layers.3"`` for ``"layers.3.qkv.weight"``, else the name
    itself (``embed``, ``final_norm.weight``, ``lm_head``). A loader with a hook lets go of the file's pages when
    the group changes."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else name


def read_config(directory: Path) -> tuple[dict, Family, ModelConfig]:
    path = directory / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{directory} has no config.json; a Hugging Face model directory needs one")
    hf = json.loads(path.read_text())
    if "model_type" not in hf:
        raise CheckpointError(f"{path} has no model_type; cannot tell the architecture")
    family = by_model_type(hf["model_type"])
    return hf, family, family.config_from_hf(hf)


def open_safetensors(path: Path) -> Any:
    """``safe_open(path)``; a damaged file raises :class:`CheckpointError` naming it (safetensors' own error, e.g.
    "Error while deserializing header: invalid header length", does not say which of a checkpoint's shards is bad)."""
    try:
        return safe_open(str(path), framework="pt")
    except SafetensorError as err:
        raise CheckpointError(f"{path} is not a readable safetensors file ({err}); it may be truncated or not a "
                              "safetensors file at all: download or export it again") from err


def tensor_files(directory: Path) -> dict[str, Path]:
    """Checkpoint tensor name -> the safetensors file holding it (single file or an index of shards)."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {name: directory / shard for name, shard in weight_map.items()}
        missing = sorted({str(p) for p in files.values() if not p.is_file()})
        if missing:
            raise CheckpointError(f"the shard index lists files that are missing: {missing}")
        return files
    single = directory / "model.safetensors"
    if single.is_file():
        with open_safetensors(single) as f:
            return {name: single for name in f.keys()}
    if list(directory.glob("*.bin")) or list(directory.glob("*.pt")):
        raise CheckpointError(f"{directory} holds only pickle checkpoints (.bin/.pt); Tessera reads safetensors only "
                              "(unpickling runs arbitrary code). Convert with `save_pretrained(safe_serialization=True)`")
    raise CheckpointError(f"{directory} has no model.safetensors or model.safetensors.index.json")


def load_weights(directory: Path, config: ModelConfig, family: Family, dtype: torch.dtype,
                 transform: WeightHook | None = None) -> dict[str, Any]:
    """Canonical weights from the directory's safetensors, in ``dtype``.

    Parameters
    ----------
    directory : a Hugging Face model directory (single or sharded safetensors).
    config, family : what :func:`read_config` gave.
    dtype : the weights' dtype.
    transform : called once per canonical weight, whole and shape-checked, in the family's order; its result is
        kept in place of the weight. With a hook the files are reopened whenever the next weight belongs to another
        layer, so the mapped pages read for earlier weights leave this process's resident set.

    Raises
    ------
    CheckpointError
        A file or tensor is missing or unreadable, or a weight's shape disagrees with ``config.json``.
    """
    files = tensor_files(directory)
    handles: dict[Path, object] = {}

    def get(name: str) -> torch.Tensor:
        if name not in files:
            raise CheckpointError(f"tensor {name!r} is missing from {directory} (needed by the {family.name} family)")
        path = files[name]
        if path not in handles:
            handles[path] = open_safetensors(path)
        try:
            return handles[path].get_tensor(name)
        except SafetensorError as err:
            raise CheckpointError(f"{path}: tensor {name!r} cannot be read ({err}); the file may be truncated: "
                                  "download or export it again") from err

    shapes = expected_shapes(config)
    weights: dict[str, Any] = {}
    group = None
    for spec in family.weight_specs(config):
        if spec.optional and not all(s in files for s in spec.sources):
            continue
        if transform is not None and layer_key(spec.name) != group:
            group = layer_key(spec.name)
            handles.clear()  # the mappings close once no tensor of theirs is left: their pages with them
        weight = _assemble(spec, [get(s) for s in spec.sources]).to(dtype).contiguous()
        check_shape(spec.name, weight, shapes)
        weights[spec.name] = weight if transform is None else transform(spec.name, weight)
        del weight  # with a hook, the whole weight goes here unless the hook kept it
    return weights


def _assemble(spec: WeightSpec, parts: list[torch.Tensor]) -> torch.Tensor:
    if spec.combine == "one":
        return parts[0]
    if spec.combine == "cat":
        return torch.cat(parts, dim=0)
    if spec.combine == "stack":
        return torch.stack(parts, dim=0)
    if spec.combine == "transpose":
        return parts[0].t()
    if spec.combine == "stack_pairs":  # MoE experts: [E, 2I, H] from (gate_0, up_0, gate_1, up_1, ...)
        return torch.stack([torch.cat(parts[j:j + 2], dim=0) for j in range(0, len(parts), 2)], dim=0)
    if spec.combine == "flatten":  # Qwen2-MoE's shared_expert_gate.weight [1, H] -> [H]
        return parts[0].reshape(-1)
    raise ValueError(f"unknown combine rule {spec.combine!r} for {spec.name}")


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of the canonical weights every family shares (checked after loading, naming the tensor)."""
    h, d = config.hidden_size, config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"embed": (config.vocab_size, h), "lm_head": (config.vocab_size, h)}
    for i in range(config.num_layers):
        shapes[f"layers.{i}.qkv.weight"] = (config.qkv_rows, h)
        shapes[f"layers.{i}.o.weight"] = (h, config.num_heads * d)
        if not config.is_moe and config.gated_mlp:
            shapes[f"layers.{i}.gate_up.weight"] = (2 * config.intermediate_size, h)
            shapes[f"layers.{i}.down.weight"] = (h, config.intermediate_size)
    return shapes


def check_shapes(config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    shapes = expected_shapes(config)
    for name in shapes:
        if name in weights:
            check_shape(name, weights[name], shapes)


def check_shape(name: str, weight: Any, shapes: dict[str, tuple[int, ...]]) -> None:
    """Raise :class:`CheckpointError` when ``weight``'s shape differs from ``shapes[name]`` (names not in ``shapes``
    are not checked)."""
    want = shapes.get(name)
    if want is not None and tuple(weight.shape) != want:
        raise CheckpointError(f"weight {name!r} has shape {tuple(weight.shape)}, but the config implies "
                              f"{want}; the checkpoint and its config.json disagree")


def load_tokenizer(directory: Path):
    """``tokenizers.Tokenizer`` from ``tokenizer.json`` when the directory has one, else None."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))
