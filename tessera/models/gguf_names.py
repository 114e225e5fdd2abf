"""Which GGUF tensors make each canonical weight, and how they combine.

The canonical names are the ones every family's :class:`~tessera.models.families.common.WeightSpec` list uses
(``layers.3.qkv.weight``, ``embed``, ...; see :mod:`tessera.models.families.common`); the GGUF names are llama.cpp's
(``blk.3.attn_q.weight``, ``token_embd.weight``). The table is one for all architectures; the two that store a
fused tensor under another name (Phi-3's ``attn_qkv`` and gate|up in ``ffn_up``) are chosen by what the file holds.

The reader (:mod:`tessera.models.gguf`) and the writer (:mod:`tessera.models.gguf_write`) both go through this
module, so a weight written is read back by the same rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tessera.models.config import ModelConfig
from tessera.models.hf import CheckpointError

if TYPE_CHECKING:
    from tessera.models.gguf_arch import GGUFArch

#: per-layer canonical suffix -> (GGUF suffixes in order, axis they are concatenated along)
LAYER_TENSORS: dict[str, tuple[tuple[str, ...], int]] = {
    "attn_norm.weight": (("attn_norm.weight",), 0),
    "attn_norm.bias": (("attn_norm.bias",), 0),
    "qkv.weight": (("attn_q.weight", "attn_k.weight", "attn_v.weight"), 0),
    "qkv.bias": (("attn_q.bias", "attn_k.bias", "attn_v.bias"), 0),
    "q_norm.weight": (("attn_q_norm.weight",), 0),
    "k_norm.weight": (("attn_k_norm.weight",), 0),
    "o.weight": (("attn_output.weight",), 0),
    "o.bias": (("attn_output.bias",), 0),
    "post_attn_norm.weight": (("post_attention_norm.weight",), 0),
    "mlp_norm.weight": (("ffn_norm.weight",), 0),
    "mlp_norm.bias": (("ffn_norm.bias",), 0),
    "gate_up.weight": (("ffn_gate.weight", "ffn_up.weight"), 0),
    "down.weight": (("ffn_down.weight",), 0),
    "post_mlp_norm.weight": (("post_ffw_norm.weight",), 0),
    "router.weight": (("ffn_gate_inp.weight",), 0),
    "experts.gate_up": (("ffn_gate_exps.weight", "ffn_up_exps.weight"), 1),  # [E, I, H] each -> [E, 2I, H]
    "experts.down": (("ffn_down_exps.weight",), 0),
    "shared.gate_up.weight": (("ffn_gate_shexp.weight", "ffn_up_shexp.weight"), 0),
    "shared.down.weight": (("ffn_down_shexp.weight",), 0),
    "shared.gate.weight": (("ffn_gate_inp_shexp.weight",), 0),
}
#: global canonical name -> GGUF name
GLOBAL_TENSORS = {"embed": "token_embd.weight", "final_norm.weight": "output_norm.weight", "lm_head": "output.weight",
                  "final_norm.bias": "output_norm.bias"}
#: fused forms some architectures store: canonical suffix -> the one GGUF suffix holding all parts
FUSED_TENSORS = {"qkv.weight": "attn_qkv.weight", "qkv.bias": "attn_qkv.bias", "gate_up.weight": "ffn_up.weight"}


@dataclass(frozen=True)
class GGUFSource:
    """The GGUF tensors of one canonical weight: concatenated along ``axis`` (one name: used as is)."""

    names: tuple[str, ...]
    axis: int = 0


def gguf_sources(name: str, arch: GGUFArch, tensors: dict[str, Any] | None = None) -> GGUFSource:
    """The GGUF tensors canonical weight ``name`` is read from (present in ``tensors`` or not), or, without
    ``tensors``, written to.

    The fused forms: gate|up by architecture (Phi-3's ``ffn_up`` exists either way); q|k|v by what the file holds
    (llama.cpp reads either form), and in the architecture's form when writing.
    """
    if name in GLOBAL_TENSORS:
        return GGUFSource((GLOBAL_TENSORS[name],))
    layer, suffix = _split(name)
    fused = FUSED_TENSORS.get(suffix)
    if fused is not None:
        by_file = tensors is not None and suffix != "gate_up.weight"
        if (f"blk.{layer}.{fused}" in tensors) if by_file else arch.fused_projections:
            return GGUFSource((f"blk.{layer}.{fused}",))
    parts, axis = LAYER_TENSORS[suffix]
    return GGUFSource(tuple(f"blk.{layer}.{p}" for p in parts), axis)


def _split(name: str) -> tuple[int, str]:
    head, _, rest = name.partition(".")
    layer, _, suffix = rest.partition(".")
    if head != "layers" or not layer.isdigit() or suffix not in LAYER_TENSORS:
        raise CheckpointError(f"no GGUF name is known for weight {name!r}; the GGUF loader maps "
                              f"{sorted(GLOBAL_TENSORS)} and per layer {sorted(LAYER_TENSORS)}")
    return int(layer), suffix


def assemble(source: GGUFSource, parts: list[torch.Tensor]) -> torch.Tensor:
    """The canonical weight from its GGUF tensors (already in our row order)."""
    if len(parts) == 1:
        out = parts[0]
        # Qwen2-MoE's shared-expert gate: llama.cpp stores [H] (newer converters) or [1, H]; the weight is [H]
        return out.reshape(-1) if source.names[0].endswith("ffn_gate_inp_shexp.weight") else out.contiguous()
    return torch.cat(parts, dim=source.axis)


def expected_shape(gguf_name: str, config: ModelConfig, arch: GGUFArch) -> tuple[int, ...] | None:
    """The shape the config implies for a GGUF tensor (None when not checked here)."""
    h, d, hq, hkv = config.hidden_size, config.head_dim, config.num_heads, config.num_kv_heads
    if gguf_name in ("token_embd.weight", "output.weight"):
        return (config.vocab_size, h)
    if not gguf_name.startswith("blk."):
        return None
    _, layer, suffix = gguf_name.split(".", 2)
    i = config.intermediate_size
    e, moe_i, shared_i = config.num_experts, config.moe_intermediate_size, config.shared_expert_intermediate_size
    shapes = {"attn_q.weight": (hq * d, h), "attn_k.weight": (hkv * d, h), "attn_v.weight": (hkv * d, h),
              "attn_qkv.weight": (config.qkv_rows, h), "attn_output.weight": (h, hq * d),
              "ffn_gate.weight": (i, h), "ffn_up.weight": (2 * i if arch.fused_projections else i, h),
              "ffn_down.weight": (h, i), "ffn_gate_inp.weight": (e, h), "ffn_gate_exps.weight": (e, moe_i, h),
              "ffn_up_exps.weight": (e, moe_i, h), "ffn_down_exps.weight": (e, h, moe_i),
              "ffn_gate_shexp.weight": (shared_i, h), "ffn_up_shexp.weight": (shared_i, h),
              "ffn_down_shexp.weight": (h, shared_i), "attn_norm.weight": (h,), "ffn_norm.weight": (h,),
              "post_attention_norm.weight": (h,), "post_ffw_norm.weight": (h,), "attn_q_norm.weight": (d,),
              "attn_k_norm.weight": (d,)}
    return shapes.get(suffix)
