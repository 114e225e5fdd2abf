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

Packed projections: given the model's weights (``capture_layer(..., weights=model.weights)``), a projection whose
weight is a ``QuantizedWeight`` in int8, int4 or int4_min (GGUF Q8_0 / Q4_0 / Q4_1 load as those) becomes
``tessera.qmatmul`` of its codes, scales and zero points or mins, each a function argument (``l0_qkv``,
``l0_qkv_scales``, ``l0_qkv_zeros``; :mod:`tessera.mlir.packed`). The fusion passes match ``tessera.matmul`` only,
so a packed projection keeps its norm, activation and residual as separate ops.

Switches this capture cannot express raise ``NotImplementedError`` naming the ``ModelConfig`` field.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from xdsl.builder import Builder, InsertPoint
from xdsl.dialects import func
from xdsl.dialects.builtin import BFloat16Type, Float16Type, ModuleOp, f32, i64
from xdsl.ir import Attribute, SSAValue

from tessera.mlir import dialect as td
from tessera.mlir import packed
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


#: the layer's projections, which may come packed (argument ``l{i}_qkv`` is weight ``layers.{i}.qkv.weight``)
PROJECTIONS = ("qkv", "o", "gate_up", "down")


def layer_weight_types(config: ModelConfig, layer: int, element: Attribute,
                       weights: Mapping[str, object] | None = None) -> list[tuple[str, Attribute]]:
    """``(argument name, tensor type)`` of layer ``layer``'s weights, in argument order.

    A projection whose weight in ``weights`` (canonical names, ``layers.{i}.qkv.weight``) is packed takes its
    ``tessera.qmatmul`` operands instead of one float argument (:mod:`tessera.mlir.packed`).
    """
    h, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
    p = f"l{layer}_"
    shapes = {"attn_norm": [h], "qkv": [config.qkv_rows, h], "o": [h, config.num_heads * d], "mlp_norm": [h],
              "gate_up": [2 * inter, h], "down": [h, inter]}
    out: list[tuple[str, Attribute]] = []
    for part, shape in shapes.items():
        weight = None if weights is None else weights.get(f"layers.{layer}.{part}.weight")
        if part in PROJECTIONS and weight is not None and packed.is_packed(weight):
            what = f"layers.{layer}.{part}.weight"
            out += [(p + part + suffix, t) for suffix, t in packed.operand_types(weight, what, tuple(shape))]
        else:
            out.append((p + part, td.tensor(shape, element)))
    return out


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


def packed_formats(weights: Mapping[str, object] | None, layer: int) -> dict[str, tuple[str, int]]:
    """``{argument name: (qmatmul format, group size)}`` of layer ``layer``'s packed projections in ``weights``."""
    out = {}
    for part in PROJECTIONS:
        weight = None if weights is None else weights.get(f"layers.{layer}.{part}.weight")
        if weight is not None and packed.is_packed(weight):
            out[f"l{layer}_{part}"] = (packed.qmatmul_format(weight, f"layers.{layer}.{part}.weight"),
                                       weight.group_size)  # type: ignore[attr-defined]
    return out


def _emit_layer(e: _Emitter, config: ModelConfig, i: int, x: SSAValue, positions: SSAValue,
                w: dict[str, SSAValue], tokens: int | None, el: Attribute,
                formats: Mapping[str, tuple[str, int]] | None = None) -> SSAValue:
    """One decoder layer on the residual stream ``x [T, H]``; returns the new residual stream. Projections named in
    ``formats`` (see :func:`packed_formats`) are ``tessera.qmatmul`` of their packed arguments."""
    from tessera.models.layers import layer_spec

    hq, hkv, d, hidden = config.num_heads, config.num_kv_heads, config.head_dim, config.hidden_size
    eps = float(config.norm_eps)
    p = f"l{i}_"
    t = td.tensor
    formats = formats or {}

    def project(a: SSAValue, part: str, width: int, hint: str) -> SSAValue:
        """``a @ w.T`` for projection ``part``: a qmatmul when its weight came packed (named in ``formats``)."""
        name = p + part
        if name not in formats:
            return e.op(td.MatmulOp, [a, w[name]], [t([tokens, width], el)], hint).out
        fmt, group = formats[name]
        offsets = [w[name + s] for s in ("_zeros", "_mins") if name + s in w]
        return e.op(td.QMatmulOp, [a, w[name], w[name + "_scales"], offsets], [t([tokens, width], el)], hint,
                    format=fmt, group_size=group).out

    h = e.op(td.RmsNormOp, [x, w[p + "attn_norm"]], [x.type], "h", eps=eps).out
    qkv = project(h, "qkv", config.qkv_rows, "qkv")
    split = e.op(td.SplitQkvOp, [qkv], [t([tokens, hq, d], el), t([tokens, hkv, d], el), t([tokens, hkv, d], el)],
                 ("q", "k", "v"), num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
    theta, rotary = rope_attrs(config, i)
    q = e.op(td.RopeOp, [split.q, positions], [split.q.type], "q_rot", theta=theta, rotary_dim=rotary).out
    k = e.op(td.RopeOp, [split.k, positions], [split.k.type], "k_rot", theta=theta, rotary_dim=rotary).out
    attn = e.op(td.AttentionOp, [q, k, split.v], [q.type], "attn", **td.attention_attrs(layer_spec(config, i))).out
    merged = e.op(td.MergeHeadsOp, [attn], [t([tokens, hq * d], el)], "attn_flat").out
    o = project(merged, "o", hidden, "o")
    x = e.op(td.ResidualAddOp, [o, x], [x.type], "x").out
    h = e.op(td.RmsNormOp, [x, w[p + "mlp_norm"]], [x.type], "h", eps=eps).out
    up = project(h, "gate_up", 2 * config.intermediate_size, "gate_up")
    act = e.op(td.SiluAndMulOp, [up], [t([tokens, config.intermediate_size], el)], "act").out
    down = project(act, "down", hidden, "down")
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


def capture_layer(config: ModelConfig, layer_index: int, num_tokens: int | None, dtype: str = "f32",
                  weights: Mapping[str, object] | None = None) -> ModuleOp:
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
    weights : Mapping[str, object], optional
        The model's weights by canonical name (``Model.weights``); only read to see which projections are packed
        (:class:`tessera.kernels.quant.QuantizedWeight` in int8, int4 or int4_min): those become ``tessera.qmatmul``
        with codes, scales and zeros or mins as arguments (:mod:`tessera.mlir.packed`). None: float weights.

    Returns
    -------
    ModuleOp
        One function ``(x [T, H], positions [T] i64, <the layer's weights>) -> [T, H]``, verified.

    Raises
    ------
    NotImplementedError
        A packed projection in a format ``tessera.qmatmul`` has no lowering for (ggml blocks, fp8, stacked rows).
    """
    check_supported(config)
    if not 0 <= layer_index < config.num_layers:
        raise ValueError(f"capture_layer: layer_index must be in [0, {config.num_layers}), got {layer_index}")
    el = _element(dtype)
    args = [("x", td.tensor([num_tokens, config.hidden_size], el)), ("positions", td.tensor([num_tokens], i64)),
            *layer_weight_types(config, layer_index, el, weights)]
    fn, e, v = _function(f"layer_{layer_index}", args)
    out = _emit_layer(e, config, layer_index, v["x"], v["positions"], v, num_tokens, el,
                      packed_formats(weights, layer_index))
    return _finish(fn, e, out)


def capture_model(config: ModelConfig, num_tokens: int | None, dtype: str = "f32",
                  weights: Mapping[str, object] | None = None) -> ModuleOp:
    """The whole forward as ``func.func @forward``: ``(ids [T] i64, positions [T] i64, embed [V, H], <6 weights
    per layer>, final_norm [H], [lm_head [V, H] when not tied]) -> logits [T, V]`` (in ``dtype``), verified.

    Each layer reads the residual stream the previous one returns; logits are ``matmul(rms_norm(x), head)``, with
    the token table as the head when ``tie_embeddings``. ``weights`` (the model's, by canonical name) makes packed
    projections ``tessera.qmatmul`` as in :func:`capture_layer`, and a packed ``lm_head`` (untied, or the packed
    output copy ``requantize_model(..., tables="output")`` adds to a tied model) a qmatmul of the logits; a packed
    token table is declined (``tessera.embed`` reads a float table).
    """
    check_supported(config, whole_model=True)
    el = _element(dtype)
    h, vocab = config.hidden_size, config.vocab_size
    embed_w = None if weights is None else weights.get("embed")
    if embed_w is not None and packed.is_packed(embed_w):
        raise NotImplementedError("capture_model: the token table 'embed' is packed; tessera.embed reads a float "
                                  "table: requantize with tables='output' (a packed lm_head, float lookups)")
    head_w = None if weights is None else weights.get("lm_head")
    packed_head = head_w is not None and packed.is_packed(head_w)
    args = [("ids", td.tensor([num_tokens], i64)), ("positions", td.tensor([num_tokens], i64)),
            ("embed", td.tensor([vocab, h], el))]
    for i in range(config.num_layers):
        args += layer_weight_types(config, i, el, weights)
    args.append(("final_norm", td.tensor([h], el)))
    if packed_head:
        args += [("lm_head" + suffix, t) for suffix, t in packed.operand_types(head_w, "lm_head", (vocab, h))]
    elif not config.tie_embeddings:
        args.append(("lm_head", td.tensor([vocab, h], el)))
    fn, e, v = _function("forward", args)
    x = e.op(td.EmbedOp, [v["ids"], v["embed"]], [td.tensor([num_tokens, h], el)], "x").out
    for i in range(config.num_layers):
        x = _emit_layer(e, config, i, x, v["positions"], v, num_tokens, el, packed_formats(weights, i))
    normed = e.op(td.RmsNormOp, [x, v["final_norm"]], [x.type], "h", eps=float(config.norm_eps)).out
    out_type = td.tensor([num_tokens, vocab], el)
    if packed_head:
        offsets = [v["lm_head" + s] for s in ("_zeros", "_mins") if "lm_head" + s in v]
        logits = e.op(td.QMatmulOp, [normed, v["lm_head"], v["lm_head_scales"], offsets], [out_type], "logits",
                      format=packed.qmatmul_format(head_w, "lm_head"),
                      group_size=head_w.group_size).out  # type: ignore[union-attr]
    else:
        head = v["embed"] if config.tie_embeddings else v["lm_head"]
        logits = e.op(td.MatmulOp, [normed, head], [out_type], "logits").out
    return _finish(fn, e, logits)
