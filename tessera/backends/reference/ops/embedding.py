"""Float64 oracle of the embedding ops; ``*_f64`` return float64, the registered ops the API's dtypes."""

from __future__ import annotations

import torch


def embed_f64(ids: torch.Tensor, table: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    out = table.detach().double()[ids.long()]
    return out if scale is None else out * scale


def lm_head_f64(hidden: torch.Tensor, table: torch.Tensor, softcap: float | None = None) -> torch.Tensor:
    logits = hidden.detach().double() @ table.detach().double().T
    return logits if softcap is None else softcap * torch.tanh(logits / softcap)


def embed(ids, table, scale):
    return embed_f64(ids, table, scale).to(table.dtype)


def lm_head(hidden, table, softcap):
    return lm_head_f64(hidden, table, softcap).to(torch.float32)


OPS = {"embed": embed, "lm_head": lm_head}
