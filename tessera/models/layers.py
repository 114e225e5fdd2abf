"""The shared decoder: every family runs this code, switched by its :class:`ModelConfig`.

Weights live in one flat dict under canonical names (see ``WEIGHT_NAMES`` in ``families/common.py``); projections
are fused on load (``qkv`` = q|k|v rows, ``gate_up`` = gate|up rows), so a layer is: norm -> one qkv GEMM -> q/k norm
-> RoPE in place -> attention with the layer's :class:`AttentionSpec` -> o GEMM -> (post norm) -> residual ->
norm -> one gate_up GEMM -> fused gated activation -> down GEMM -> (post norm) -> residual. Residual adds are fused
into the next RMSNorm (``rms_norm(..., residual=...)``), rounding the sum to the model dtype as Hugging Face does.
"""

from __future__ import annotations

import math
import weakref
from functools import lru_cache

import torch

from tessera import kernels as K
from tessera.attention import AttentionSpec, attention, causal, sliding_window, softcap
from tessera.kernels.quant import QuantizedWeight, StackedWeight
from tessera.models.config import ModelConfig
from tessera.models.parallel import ParallelExperts, ParallelLinear, ParallelTable

Weights = dict[str, "torch.Tensor | QuantizedWeight"]


def linear(x: torch.Tensor, w: torch.Tensor | QuantizedWeight | StackedWeight, bias: torch.Tensor | None = None,
           backend: str = "auto") -> torch.Tensor:
    """``x @ w.T (+ bias)`` for x ``[T, K]`` and w ``[N, K]`` (float, quantized, or row blocks in several packed
    formats), fp32 accumulation."""
    if isinstance(w, ParallelLinear):  # a tensor-parallel row shard: local product, all-reduce, bias once
        return w.linear(x, bias, backend)
    if isinstance(w, StackedWeight):
        out = torch.cat([K.qmatmul(x, p, backend=backend) for p in w.parts], dim=-1)
        return out if bias is None else out + bias
    out = K.qmatmul(x, w, backend=backend) if isinstance(w, QuantizedWeight) else K.matmul(x, w, backend=backend)
    return out if bias is None else out + bias


def norm(config: ModelConfig, x: torch.Tensor, w: Weights, name: str, residual: torch.Tensor | None = None,
         backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor | None]:
    """The family's norm of ``x`` (plus ``residual`` first, when given); returns ``(normed, new_residual)``."""
    if config.norm == "layer":
        if residual is not None:
            x = x + residual
        return K.layer_norm(x, w[f"{name}.weight"], w.get(f"{name}.bias"), config.norm_eps, backend=backend), x
    out = K.rms_norm(x, w[f"{name}.weight"], config.norm_eps, residual=residual, gemma=config.norm == "rms_gemma",
                     backend=backend)
    return out if residual is not None else (out, x)


@lru_cache(maxsize=64)
def layer_spec(config: ModelConfig, layer: int) -> AttentionSpec:
    """The attention variant of one layer: causal, maybe windowed, maybe soft-capped, maybe a query scale."""
    window = config.layer_windows[layer]
    mask = causal() if window is None else causal() & sliding_window(window)
    return AttentionSpec(config.num_heads, config.num_kv_heads, config.head_dim, mask=mask,
                         score=softcap(config.attn_softcap) if config.attn_softcap else None,
                         scale=config.query_scale)


def attention_block(config: ModelConfig, w: Weights, i: int, h: torch.Tensor, positions: torch.Tensor,
                    ropes: dict, attend, backend: str) -> torch.Tensor:
    """Self-attention of layer ``i`` for tokens ``h [T, hidden]`` at ``positions [T]``.

    ``attend(i, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, Hq, D]`` does the attention itself: over the
    dense batch (:func:`dense_attend`) or over a paged KV cache after storing k and v (``tessera.models.paged``).
    """
    p = f"layers.{i}"
    hq, hkv, d = config.num_heads, config.num_kv_heads, config.head_dim
    qkv = linear(h, w[f"{p}.qkv.weight"], w.get(f"{p}.qkv.bias"), backend)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.reshape(-1, hq, d), k.reshape(-1, hkv, d), v.reshape(-1, hkv, d)
    if config.qk_norm:
        gemma = config.norm == "rms_gemma"
        q = K.qk_norm(q, w[f"{p}.q_norm.weight"], config.norm_eps, gemma=gemma, backend=backend)
        k = K.qk_norm(k, w[f"{p}.k_norm.weight"], config.norm_eps, gemma=gemma, backend=backend)
    if ropes:
        q, k = q.contiguous(), k.contiguous()
        K.apply_rope(q, k, positions, ropes[config.layer_rope[i]], backend=backend)
    out = attend(i, q, k, v.contiguous())
    return linear(out.reshape(-1, hq * d), w[f"{p}.o.weight"], w.get(f"{p}.o.bias"), backend)


def dense_attend(config: ModelConfig, batch: int, seq: int, backend: str):
    """Attention over a dense batch of ``batch`` sequences of ``seq`` tokens each (no cache)."""
    hq, hkv, d = config.num_heads, config.num_kv_heads, config.head_dim

    def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = attention(q.view(batch, seq, hq, d), k.view(batch, seq, hkv, d), v.view(batch, seq, hkv, d),
                        layer_spec(config, i), backend=backend)
        return out.view(-1, hq, d)

    return attend


def mlp_block(config: ModelConfig, w: Weights, i: int, h: torch.Tensor, backend: str) -> torch.Tensor:
    """The feed-forward part of layer ``i``: gated MLP, GPT-2's plain MLP, or a sparse MoE block."""
    p = f"layers.{i}"
    if config.is_moe_layer(i):
        router = linear(h, w[f"{p}.router.weight"], None, backend)
        shared = None
        if config.shared_expert_intermediate_size:
            shared = K.SharedExpert(w[f"{p}.shared.gate_up.weight"], w[f"{p}.shared.down.weight"],
                                    w.get(f"{p}.shared.gate.weight"))
        experts = w[f"{p}.experts.gate_up"]
        args = (w[f"{p}.experts.down"], router, config.experts_per_token, config.moe_routing, config.moe_renormalize)
        if isinstance(experts, ParallelExperts):  # an expert-parallel shard: its own experts, then a sum across ranks
            return experts.moe_mlp(h, *args, shared=shared, backend=backend)
        return K.moe_mlp(h, experts, *args, shared=shared, backend=backend)
    up = linear(h, w[f"{p}.gate_up.weight"], w.get(f"{p}.gate_up.bias"), backend)
    if not config.gated_mlp:
        act = K.gelu(up, "tanh" if config.activation == "gelu_tanh" else "none", backend=backend)
    elif config.activation == "silu":
        act = K.silu_and_mul(up, backend=backend)
    else:
        act = K.gelu_and_mul(up, "tanh" if config.activation == "gelu_tanh" else "none", backend=backend)
    return linear(act, w[f"{p}.down.weight"], w.get(f"{p}.down.bias"), backend)


#: config -> (rows, name -> RotaryEmbedding): the base tables, built once per power-of-two length
_ROPE_BASE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def rope_tables(config: ModelConfig, seq_len: int) -> dict:
    """One RotaryEmbedding per distinct rope config, valid for positions below ``seq_len`` (dynamic scaling grows
    with it).

    The base tables are cached per config with a power-of-two row count (at least 256): a row's angles do not depend
    on the table's length, so a longer table gives the same rows, and a decode step no longer recomputes
    ``seq_len x rotary_dim`` cosines and sines. :meth:`RotaryEmbedding.for_length` still
    derives the length-dependent (dynamic, longrope) tables exactly for ``seq_len``.
    """
    if config.learned_positions:
        return {}
    seq_len = max(seq_len, 1)
    cached = _ROPE_BASE.get(config)
    if cached is None or cached[0] < seq_len:
        rows = max(256, 1 << (seq_len - 1).bit_length())
        cached = (rows, {name: K.RotaryEmbedding.from_hf_config(cfg, max_position=rows)
                         for name, cfg in config.rope_configs.items()})
        _ROPE_BASE[config] = cached
    return {name: rope.for_length(seq_len) for name, rope in cached[1].items()}


def forward_logits(config: ModelConfig, w: Weights, token_ids: torch.Tensor, backend: str = "auto",
                   hidden_states: list | None = None) -> torch.Tensor:
    """Float32 logits ``[B, S, vocab]`` for ``token_ids [B, S]`` (full sequences, causal, no KV cache).

    When ``hidden_states`` is a list, ``num_layers + 1`` tensors ``[B, S, hidden]`` (model dtype) are appended, as in
    Hugging Face's ``output_hidden_states``: the embeddings, the residual stream after each layer but the last, and
    the final-normed output of the last layer.
    """
    batch, seq = token_ids.shape
    positions = torch.arange(seq, dtype=torch.int64, device=token_ids.device).repeat(batch)
    collect = [] if hidden_states is not None else None
    h = decoder(config, w, token_ids.reshape(-1), positions, rope_tables(config, seq),
                dense_attend(config, batch, seq, backend), backend, collect)
    if hidden_states is not None:
        hidden_states.extend(t.view(batch, seq, -1) for t in collect)
    return output_logits(config, w, h, backend).view(batch, seq, -1)


def output_logits(config: ModelConfig, w: Weights, h: torch.Tensor, backend: str) -> torch.Tensor:
    """Float32 logits ``[T, vocab]`` of final-normed hidden states ``h [T, H]`` (the output table, or the tied
    token table; a vocabulary-parallel table gathers the whole vocabulary)."""
    head = w.get("lm_head", w["embed"])
    if isinstance(head, ParallelTable):
        return head.lm_head(h, config.final_softcap, backend)
    return K.lm_head(h, head, softcap=config.final_softcap, backend=backend)


def output_tokens(config: ModelConfig, w: Weights, h: torch.Tensor, backend: str) -> torch.Tensor:
    """Greedy tokens ``[T]`` int64 of final-normed hidden states ``h [T, H]``: the first maximal index of
    :func:`output_logits`' rows. A vocabulary-parallel table finds it without gathering the logits."""
    head = w.get("lm_head", w["embed"])
    if isinstance(head, ParallelTable):
        return head.greedy_tokens(h, config.final_softcap, backend)
    return K.argmax(K.lm_head(h, head, softcap=config.final_softcap, backend=backend), backend=backend)


def weights_dtype(w: Weights) -> torch.dtype:
    """The model's float dtype: the token table's, or the final norm's when the table is packed."""
    embed = w["embed"]
    return embed.dtype if isinstance(embed, torch.Tensor) else w["final_norm.weight"].dtype


def decoder(config: ModelConfig, w: Weights, ids: torch.Tensor, positions: torch.Tensor, ropes: dict, attend,
            backend: str, hidden_states: list | None = None) -> torch.Tensor:
    """All layers for tokens ``ids [T]`` at ``positions [T]``; returns the final-normed hidden states ``[T, H]``."""
    dtype = weights_dtype(w)
    scale = K.gemma_embed_scale(config.hidden_size, dtype) if config.embed_scale else None
    table = w["embed"]
    if isinstance(table, ParallelTable):  # vocabulary-parallel: each rank looks up its rows, then a sum
        x = table.embed(ids, scale, dtype, backend)
    else:
        x = K.embed(ids, table, scale=scale, dtype=dtype, backend=backend)
    if config.learned_positions:
        x = x + w["pos_embed"][positions]
    if hidden_states is not None:
        hidden_states.append(x)
    h, x = norm(config, x, w, "layers.0.attn_norm", backend=backend)
    for i in range(config.num_layers):
        a = attention_block(config, w, i, h, positions, ropes, attend, backend)
        if config.post_norms:
            a, _ = norm(config, a, w, f"layers.{i}.post_attn_norm", backend=backend)
        h, x = norm(config, a, w, f"layers.{i}.mlp_norm", residual=x, backend=backend)
        m = mlp_block(config, w, i, h, backend)
        if config.post_norms:
            m, _ = norm(config, m, w, f"layers.{i}.post_mlp_norm", backend=backend)
        following = f"layers.{i + 1}.attn_norm" if i + 1 < config.num_layers else "final_norm"
        h, x = norm(config, m, w, following, residual=x, backend=backend)
        if hidden_states is not None:
            # Hugging Face's convention: the residual stream after each layer, but the last entry after the final norm
            hidden_states.append(x if i + 1 < config.num_layers else h)
    return h


def default_query_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
