"""One normalized description of a decoder-only transformer, whatever checkpoint format it came from.

Family modules (``tessera/models/families/``) turn a Hugging Face ``config.json`` or GGUF metadata into a
:class:`ModelConfig`; the shared layers (``layers.py``) read only this. Field names say what they do, not what one
family called them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, eq=False)  # identity hash: per-layer specs are cached per config
class ModelConfig:
    """Architecture hyper-parameters and switches of the shared decoder.

    Attributes
    ----------
    family : the family module that built it ("llama", "gemma2", ...).
    layer_windows : per layer, the sliding-window size (``None`` = global causal attention).
    layer_rope : per layer, the key into ``rope_configs`` (Gemma 3 uses a different base on local layers).
    rope_configs : name -> an HF-style rope dict (``rope_theta``, ``rope_type``, scaling keys, ``head_dim``,
        ``partial_rotary_factor``, ``max_position_embeddings``) for :meth:`RotaryEmbedding.from_hf_config`.
    """

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int
    norm_eps: float
    norm: str = "rms"  # "rms", "rms_gemma" (x * (1 + w)), "layer" (LayerNorm with bias)
    activation: str = "silu"  # gated: "silu", "gelu_tanh", "gelu"; GPT-2's plain MLP: "gelu_tanh" with gated_mlp=False
    gated_mlp: bool = True
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    post_norms: bool = False  # Gemma 2/3: norms after attention and after the MLP, before the residual add
    tie_embeddings: bool = False
    embed_scale: bool = False  # Gemma: embeddings times sqrt(hidden) rounded to the model dtype
    learned_positions: bool = False  # GPT-2
    query_scale: float | None = None  # attention scale; None = 1/sqrt(head_dim)
    attn_softcap: float | None = None
    final_softcap: float | None = None
    layer_windows: tuple[int | None, ...] = ()
    layer_rope: tuple[str, ...] = ()
    rope_configs: dict[str, dict[str, Any]] = field(default_factory=dict)
    # mixture of experts
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    moe_routing: str = "softmax_topk"  # or "topk_softmax" (Mixtral)
    moe_renormalize: bool = True
    shared_expert_intermediate_size: int = 0
    dense_layers: tuple[int, ...] = ()  # MoE models: layers with a dense gated MLP of intermediate_size (Qwen2-MoE)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelConfig: num_heads {self.num_heads} is not a multiple of num_kv_heads "
                             f"{self.num_kv_heads}")
        if not self.layer_windows:
            object.__setattr__(self, "layer_windows", (None,) * self.num_layers)
        if not self.layer_rope:
            object.__setattr__(self, "layer_rope", ("default",) * self.num_layers)
        if len(self.layer_windows) != self.num_layers or len(self.layer_rope) != self.num_layers:
            raise ValueError(f"ModelConfig: layer_windows / layer_rope need {self.num_layers} entries, got "
                             f"{len(self.layer_windows)} / {len(self.layer_rope)}")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` runs the sparse MoE block (else the dense MLP)."""
        return self.is_moe and layer not in self.dense_layers

    @property
    def qkv_rows(self) -> int:
        """Output rows of the fused q/k/v projection."""
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
