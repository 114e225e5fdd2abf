"""Capture of Tessera's decoder (:mod:`tessera.models.layers`) as a ``func.func`` of ``tessera`` ops.

One layer, as ``decoder`` computes it for llama-style configs::

    h    = rms_norm(x, attn_norm)                 # [T, H]
    qkv  = matmul(h, qkv_w)                       # [T, (Hq + 2 Hkv) D]: one GEMM against q|k|v rows
    q, k, v = split_qkv(qkv)                      # [T, Hq, D], [T, Hkv, D], [T, Hkv, D]
    q, k = rope(q, positions), rope(k, positions)
    a    = merge_heads(attention(q, k, v))        # [T, Hq D], the layer's AttentionSpec as attributes
    x    = residual_add(matmul(a, o_w), x)
    h    = rms_norm(x, mlp_norm)
    x    = residual_add(matmul(silu_and_mul(matmul(h, gate_up_w)), down_w), x)

The QKV projection is one matmul followed by ``tessera.split_qkv`` (not three matmuls, not tensor slices): that is
how the weights are stored (``qkv`` = q|k|v rows) and it gives ``fuse-rope`` a single pattern, matmul ->
split_qkv -> rope on q and k, to turn into ``tessera.matmul_rope``. Weights are function arguments, named after
their canonical weight names (``l{i}_qkv`` for ``layers.{i}.qkv.weight``), with shapes from the config; the token
count ``T`` is fixed (an int) or dynamic (None).

Switches this capture cannot express raise ``NotImplementedError`` naming the ``ModelConfig`` field.
"""

from __future__ import annotations

from collections.abc import Sequence

from xdsl.builder import Builder, InsertPoint
from xdsl.dialects import func
from xdsl.dialects.builtin import BFloat16Type, Float16Type, ModuleOp, f32, i64
from xdsl.ir import Attribute, SSAValue

from tessera.mlir import dialect as td
from tessera.models.config import ModelConfig

#: element types by name
ELEMENTS: dict[str, Attribute] = {"f32": f32, "bf16": BFloat16Type(), "f16": Float16Type()}

#: (ModelConfig field, the value the capture handles): anything else is declined
_SWITCHES = (("norm", "rms"), ("activation", "silu"), ("gated_mlp", True), ("qkv_bias", False), ("o_bias", False),
             ("mlp_bias", False), ("qk_norm", False), ("post_norms", False), ("embed_scale", False),
             ("learned_positions", False), ("num_experts", 0))


def check_supported(config: ModelConfig, whole_model: bool = False) -> None:
    """Raise ``NotImplementedError`` naming the first config switch the dialect cannot express."""
    for field, supported in _SWITCHES:
        value = getattr(config, field)
        if value != supported:
            raise NotImplementedError(
                f"capture: ModelConfig.{field} = {value!r} is not expressible in the tessera dialect (it needs "
                f"{field} = {supported!r}); captured families are llama-style: rms norm, gated silu MLP, RoPE, GQA "
                f"attention with causal or sliding-window masks ({config.family!r} model)")
    if whole_model and config.final_softcap:
        raise NotImplementedError(f"capture: ModelConfig.final_softcap = {config.final_softcap!r} (a logits "
                                  "softcap) is not expressible in the tessera dialect; capture layers instead")


def rope_attrs(config: ModelConfig, layer: int) -> tuple[float, int]:
    """``(theta, rotary_dim)`` of layer ``layer``; only the "default" rope type (no scaling) is expressible."""
    cfg = config.rope_configs.get(config.layer_rope[layer])
    if cfg is None:
        raise ValueError(f"capture: layer {layer} uses rope config {config.layer_rope[layer]!r}, which "
                         f"ModelConfig.rope_configs lacks (has {sorted(config.rope_configs)})")
    params = dict(cfg.get("rope_parameters") or {})
    rope_type = params.get("rope_type", cfg.get("rope_type", "default"))
    if rope_type != "default":
        raise NotImplementedError(f"capture: rope_type {rope_type!r} (ModelConfig.rope_configs"
                                  f"[{config.layer_rope[layer]!r}]) is not expressible; tessera.rope has theta and "
                                  "rotary_dim only (rope_type 'default')")
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    partial = float(cfg.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0)))
    rotary = int(config.head_dim * partial) // 2 * 2
    return theta, rotary


def layer_weight_types(config: ModelConfig, layer: int, element: Attribute) -> list[tuple[str, Attribute]]:
    """``(argument name, tensor type)`` of layer ``layer``'s weights, in argument order."""
    h, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
    p = f"l{layer}_"
    return [(p + "attn_norm", td.tensor([h], element)), (p + "qkv", td.tensor([config.qkv_rows, h], element)),
            (p + "o", td.tensor([h, config.num_heads * d], element)), (p + "mlp_norm", td.tensor([h], element)),
            (p + "gate_up", td.tensor([2 * inter, h], element)), (p + "down", td.tensor([h, inter], element))]


class _Emitter:
    """Appends tessera ops to one block, naming results for readable IR."""

    def __init__(self, block_builder: Builder) -> None:
        self.b = block_builder

    def op(self, cls: type, operands: Sequence, results: Sequence[Attribute], hint: str | Sequence[str],
           **attrs: object) -> td.IRDLOperation:
        op = self.b.insert(td.make(cls, operands, results, **attrs))
        for value, name in zip(op.results, [hint] if isinstance(hint, str) else hint):
            value.name_hint = name
        return op


def _emit_layer(e: _Emitter, config: ModelConfig, i: int, x: SSAValue, positions: SSAValue,
                w: dict[str, SSAValue], tokens: int | None, el: Attribute) -> SSAValue:
    """One decoder layer on the residual stream ``x [T, H]``; returns the new residual stream."""
    from tessera.models.layers import layer_spec

    hq, hkv, d, hidden = config.num_heads, config.num_kv_heads, config.head_dim, config.hidden_size
    eps = float(config.norm_eps)
    p = f"l{i}_"
    t = td.tensor
    h = e.op(td.RmsNormOp, [x, w[p + "attn_norm"]], [x.type], "h", eps=eps).out
    qkv = e.op(td.MatmulOp, [h, w[p + "qkv"]], [t([tokens, config.qkv_rows], el)], "qkv").out
    split = e.op(td.SplitQkvOp, [qkv], [t([tokens, hq, d], el), t([tokens, hkv, d], el), t([tokens, hkv, d], el)],
                 ("q", "k", "v"), num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
    theta, rotary = rope_attrs(config, i)
    q = e.op(td.RopeOp, [split.q, positions], [split.q.type], "q_rot", theta=theta, rotary_dim=rotary).out
    k = e.op(td.RopeOp, [split.k, positions], [split.k.type], "k_rot", theta=theta, rotary_dim=rotary).out
    attn = e.op(td.AttentionOp, [q, k, split.v], [q.type], "attn", **td.attention_attrs(layer_spec(config, i))).out
    merged = e.op(td.MergeHeadsOp, [attn], [t([tokens, hq * d], el)], "attn_flat").out
    o = e.op(td.MatmulOp, [merged, w[p + "o"]], [x.type], "o").out
    x = e.op(td.ResidualAddOp, [o, x], [x.type], "x").out
    h = e.op(td.RmsNormOp, [x, w[p + "mlp_norm"]], [x.type], "h", eps=eps).out
    up = e.op(td.MatmulOp, [h, w[p + "gate_up"]], [t([tokens, 2 * config.intermediate_size], el)], "gate_up").out
    act = e.op(td.SiluAndMulOp, [up], [t([tokens, config.intermediate_size], el)], "act").out
    down = e.op(td.MatmulOp, [act, w[p + "down"]], [t([tokens, hidden], el)], "down").out
    return e.op(td.ResidualAddOp, [down, x], [x.type], "x").out


def _function(name: str, args: list[tuple[str, Attribute]]) -> tuple[func.FuncOp, _Emitter, dict[str, SSAValue]]:
    fn = func.FuncOp(name, ([t for _, t in args], []))
    values = {}
    for (arg_name, _), value in zip(args, fn.body.block.args):
        value.name_hint = arg_name
        values[arg_name] = value
    return fn, _Emitter(Builder(InsertPoint.at_end(fn.body.block))), values


def _finish(fn: func.FuncOp, e: _Emitter, result: SSAValue) -> ModuleOp:
    e.b.insert(func.ReturnOp(result))
    fn.function_type = func.FunctionType.from_lists(list(fn.function_type.inputs.data), [result.type])
    module = ModuleOp([fn])
    module.verify()
    return module


def _element(dtype: str) -> Attribute:
    if dtype not in ELEMENTS:
        raise ValueError(f"capture: dtype must be one of {list(ELEMENTS)}, got {dtype!r}")
    return ELEMENTS[dtype]


def capture_layer(config: ModelConfig, layer_index: int, num_tokens: int | None, dtype: str = "f32") -> ModuleOp:
    """Decoder layer ``layer_index`` as ``func.func @layer_<i>``.

    Parameters
    ----------
    config : ModelConfig
        A llama-style config (see :func:`check_supported`).
    layer_index : int
        ``0 <= layer_index < config.num_layers``.
    num_tokens : int or None
        ``T``: the tokens of the batch (all sequences' tokens concatenated, as the decoder takes them); None leaves
        it dynamic.
    dtype : str
        Element type of activations and weights: "f32", "bf16" or "f16".

    Returns
    -------
    ModuleOp
        One function ``(x [T, H], positions [T] i64, <the layer's 6 weights>) -> [T, H]``, verified.
    """
    check_supported(config)
    if not 0 <= layer_index < config.num_layers:
        raise ValueError(f"capture_layer: layer_index must be in [0, {config.num_layers}), got {layer_index}")
    el = _element(dtype)
    args = [("x", td.tensor([num_tokens, config.hidden_size], el)), ("positions", td.tensor([num_tokens], i64)),
            *layer_weight_types(config, layer_index, el)]
    fn, e, v = _function(f"layer_{layer_index}", args)
    out = _emit_layer(e, config, layer_index, v["x"], v["positions"], v, num_tokens, el)
    return _finish(fn, e, out)


def capture_model(config: ModelConfig, num_tokens: int | None, dtype: str = "f32") -> ModuleOp:
    """The whole forward as ``func.func @forward``: ``(ids [T] i64, positions [T] i64, embed [V, H], <6 weights
    per layer>, final_norm [H], [lm_head [V, H] when not tied]) -> logits [T, V]`` (in ``dtype``), verified.

    Each layer reads the residual stream the previous one returns; logits are ``matmul(rms_norm(x), head)``, with
    the token table as the head when ``tie_embeddings``.
    """
    check_supported(config, whole_model=True)
    el = _element(dtype)
    h, vocab = config.hidden_size, config.vocab_size
    args = [("ids", td.tensor([num_tokens], i64)), ("positions", td.tensor([num_tokens], i64)),
            ("embed", td.tensor([vocab, h], el))]
    for i in range(config.num_layers):
        args += layer_weight_types(config, i, el)
    args.append(("final_norm", td.tensor([h], el)))
    if not config.tie_embeddings:
        args.append(("lm_head", td.tensor([vocab, h], el)))
    fn, e, v = _function("forward", args)
    x = e.op(td.EmbedOp, [v["ids"], v["embed"]], [td.tensor([num_tokens, h], el)], "x").out
    for i in range(config.num_layers):
        x = _emit_layer(e, config, i, x, v["positions"], v, num_tokens, el)
    normed = e.op(td.RmsNormOp, [x, v["final_norm"]], [x.type], "h", eps=float(config.norm_eps)).out
    head = v["embed"] if config.tie_embeddings else v["lm_head"]
    logits = e.op(td.MatmulOp, [normed, head], [td.tensor([num_tokens, vocab], el)], "logits").out
    return _finish(fn, e, logits)
