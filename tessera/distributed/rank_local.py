"""Rank-local loading: a tensor-parallel rank reads the checkpoint itself and keeps only its shard.

Under torchrun every rank loads the checkpoint on its own. Loading the whole model and then cutting the shard
(:func:`tessera.distributed.sharding.shard_weights`) would make each rank's peak the whole model. Here a rank plans
its cut from the file's header alone (config, and the down projection's quantization group, which sets the MLP
split's granularity), then loads with a per-weight hook (:func:`tessera.models.load_model`'s ``transform``) that
cuts each canonical weight as soon as it is read: the whole weight is dropped at once, so a rank holds its shard
plus one weight being cut (and, with the loaders' per-layer release, the file pages of one layer).

The cut is ``shard_weights`` itself, applied to one weight at a time, so the shard is bit-identical to cutting the
fully loaded model: packed weights cut on whole quantization groups, GGUF's q/k un-permutation (done by the loader
before the hook), vocabulary rows of the token table and output head (a tied model has only the table), whole
experts, replicated KV heads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from tessera.distributed.sharding import RankShard, plan_shards, shard_weights
from tessera.distributed.slicing import AnyWeight
from tessera.models import hf
from tessera.models.config import ModelConfig
from tessera.models.load import checkpoint_path, load_model
from tessera.models.model import Model


@dataclass
class ShardedLoad:
    """One rank's share of a checkpoint, loaded rank-locally.

    Attributes
    ----------
    model : the whole model's config, tokenizer and chat template, with this rank's weights only (plain, unbound:
        what :func:`shard_weights` gives).
    rank : this rank.
    shards : every rank's :class:`RankShard`, planned from the file's header.
    forms : each whole weight's form (:func:`weight_form`), recorded as it passed the hook: what ranks compare to
        agree that they loaded the same model.
    """

    model: Model
    rank: int
    shards: list[RankShard]
    forms: dict[str, str]


def weight_form(w: AnyWeight) -> str:
    """A weight's kind, format or dtype, and shape (``"QuantizedWeight int4 (64, 128)"``): what ranks compare."""
    kind = getattr(w, "fmt", None) or getattr(w, "dtype", None)
    return f"{type(w).__name__} {kind} {tuple(getattr(w, 'shape', ()))}"


def checkpoint_plan(path: str | Path | None, world: int, keep_quantized: bool | None = None
                    ) -> tuple[ModelConfig, list[RankShard]]:
    """The config and every rank's shard of the checkpoint at ``path``, from its header: no weight is loaded.

    Equal to ``plan_shards(config, world, mlp_unit(load_model(path).weights, num_layers))``: a Hugging Face
    directory loads float weights only (group 1), and a GGUF file's down projections' groups are read from the
    tensor index and one row each (:func:`tessera.models.gguf.packed_group_size`).

    Raises
    ------
    FileNotFoundError, CheckpointError
        As :func:`tessera.models.load_model` for a missing or unreadable checkpoint (ValueError for a file that is
        not ``.gguf``).
    ValueError
        The model cannot be split across ``world`` ranks (:func:`plan_shards`' message).
    """
    path = checkpoint_path(path)
    if path.is_dir():
        _, _, config = hf.read_config(path)
        return config, plan_shards(config, world, 1)
    from tessera.models.gguf import config_from_gguf, open_reader, packed_group_size

    reader = open_reader(path)
    tensors = reader.tensor_index
    arch, family, config = config_from_gguf(reader.metadata, tensors, path)
    names = {spec.name for spec in family.weight_specs(config)}
    downs = (f"layers.{i}.down.weight" for i in range(config.num_layers))
    unit = max((packed_group_size(n, tensors, arch, keep_quantized) for n in downs if n in names), default=1)
    return config, plan_shards(config, world, unit)


def load_shard(path: str | Path | None, rank: int, world: int, dtype: str | torch.dtype = "float32",
               backend: str = "auto", *, keep_quantized: bool | None = None,
               device: str | torch.device | None = None) -> ShardedLoad:
    """Load rank ``rank``'s shard of the checkpoint at ``path``, never holding the whole model.

    Parameters
    ----------
    path : as :func:`tessera.models.load_model` (None: SmolLM2-135M-Instruct).
    rank, world : this rank and the number of ranks, ``0 <= rank < world``.
    dtype, backend, keep_quantized, device : as :func:`tessera.models.load_model`.

    Returns
    -------
    ShardedLoad
        Its ``model.weights`` equal ``shard_weights(config, load_model(path, ...).weights, shards[rank])`` key by
        key, bit for bit.

    Raises
    ------
    ValueError
        ``rank`` outside ``[0, world)``, or a model that cannot be split across ``world`` ranks.
    """
    if not 0 <= rank < world:
        raise ValueError(f"load_shard: rank {rank} is outside [0, world={world})")
    path = checkpoint_path(path)
    config, shards = checkpoint_plan(path, world, keep_quantized)
    shard = shards[rank]
    forms: dict[str, str] = {}

    def cut(name: str, weight: AnyWeight) -> AnyWeight:
        forms[name] = weight_form(weight)
        return _own_storage(shard_weights(config, {name: weight}, shard)[name], weight)

    model = load_model(path, dtype, backend, keep_quantized=keep_quantized, device=device, transform=cut)
    _check_same_config(config, model.config, path)
    return ShardedLoad(model, rank, shards, forms)


def _own_storage(kept: AnyWeight, whole: AnyWeight) -> AnyWeight:
    """``kept``, copied when it is a float tensor sharing ``whole``'s storage (a replicated norm or bias).

    Why: safetensors' tensors are views of the file's mapping, and a kept view would keep the whole mapping, with
    every page the cuts read, resident. A replicated weight is small (norms, biases, the router), so the copy is
    cheap. Packed GGUF weights need no copy: their cuts are copies, and the GGUF loader drops the mapping's pages
    after each layer."""
    if (isinstance(kept, torch.Tensor) and isinstance(whole, torch.Tensor)
            and kept.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()):
        return kept.clone()
    return kept


def _check_same_config(planned: ModelConfig, loaded: ModelConfig, path: Path) -> None:
    """The header read for the plan and the one the loader read must agree (the file changed in between if not)."""
    diffs = [f.name for f in dataclasses.fields(ModelConfig) if getattr(planned, f.name) != getattr(loaded, f.name)]
    if diffs:
        raise hf.CheckpointError(f"{path}: the checkpoint's config changed while it was loaded ({', '.join(diffs)} "
                                 "differ); load it again once it is no longer being written")

