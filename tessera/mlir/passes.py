"""Graph-level passes over ``tessera`` IR: fusions into the fused ops of :mod:`tessera.mlir.dialect`, and the key
layout of attention.

=====================  ======================================================================================
pass                   rewrite
=====================  ======================================================================================
``fuse-norm-matmul``   ``rms_norm`` whose result feeds only matmul-family ops as their ``x`` -> each becomes
                       ``norm_matmul`` (a ``matmul``) or gets the ``norm`` prologue operand (``matmul_silu_mul``,
                       ``matmul_rope``); the norm is erased
``fuse-gated-mlp``     ``matmul``/``norm_matmul`` (gate|up weight) used only by ``silu_and_mul`` -> ``matmul_silu_mul``
``fuse-residual``      ``matmul`` used only by ``residual_add`` -> ``matmul_residual``
``fuse-rope``          ``matmul``/``norm_matmul`` -> ``split_qkv`` whose q and k each feed one ``rope`` (same
                       positions and attributes) -> ``matmul_rope`` (v passes through)
``attention-layout``   sets ``kv_layout`` on every ``tessera.attention``: ``kv=token`` (keys read in place,
                       token-major ``[S, Hkv, D]``) or ``kv=head`` (packed head-major tiles)
=====================  ======================================================================================

Each fusion accepts both a plain and a norm-prologue producer, so the fusions commute: :data:`DEFAULT_PIPELINE` and
any reordering of its fusions give the same IR. Every pass verifies the module after rewriting.

>>> module = pipeline(capture_layer(config, 0, 16))                     # doctest: +SKIP
>>> module = pipeline(module, "fuse-rope,attention-layout{kv=head}")    # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp, StringAttr
from xdsl.ir import BlockArgument, Operation, SSAValue
from xdsl.passes import ModulePass, PassPipeline
from xdsl.pattern_rewriter import (
    PatternRewriter,
    PatternRewriteWalker,
    RewritePattern,
    op_type_rewrite_pattern,
)
from xdsl.rewriter import InsertPoint

from tessera.mlir import dialect as td

_SEGMENTS = "operandSegmentSizes"


def _projection(value: SSAValue, user: Operation) -> tuple[Operation, SSAValue | None, float | None] | None:
    """``(producer, norm weight, eps)`` when ``value`` is a ``matmul`` or ``norm_matmul`` result used only by
    ``user``; None otherwise (another use would need the unfused result too)."""
    op = value.owner
    if not isinstance(op, (td.MatmulOp, td.NormMatmulOp)) or value.get_user_of_unique_use() is not user:
        return None
    if isinstance(op, td.NormMatmulOp):
        return op, op.norm_weight, op.eps.value.data
    return op, None, None


def _props(op: Operation, **extra: object) -> dict:
    """``op``'s properties without the segment sizes (the builder recomputes them), plus ``extra`` (``td.props``)."""
    return {**{k: v for k, v in op.properties.items() if k != _SEGMENTS}, **td.props(**extra)}


def _dominates_before(value: SSAValue, op: Operation) -> bool:
    """Whether ``value`` is usable at ``op``'s position: an argument of its block or a result of an op before it."""
    if isinstance(value, BlockArgument):
        return value.block is op.parent_block()
    owner = value.owner
    return isinstance(owner, Operation) and owner.parent_block() is op.parent_block() and owner.is_before_in_block(op)


class _FuseGatedMlp(RewritePattern):
    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: td.SiluAndMulOp, rewriter: PatternRewriter) -> None:
        found = _projection(op.x, op)
        if found is None:
            return
        mm, norm, eps = found
        fused = td.MatmulSiluMulOp.build(operands=[mm.x, mm.w, [norm] if norm is not None else []],
                                        result_types=[op.out.type], properties=td.props(eps=eps))
        rewriter.replace(op, fused)
        rewriter.erase(mm)


class _FuseResidual(RewritePattern):
    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: td.ResidualAddOp, rewriter: PatternRewriter) -> None:
        for value, other in ((op.a, op.b), (op.b, op.a)):
            mm = value.owner
            if isinstance(mm, td.MatmulOp) and value.get_user_of_unique_use() is op and value is not other:
                rewriter.replace(op, td.MatmulResidualOp.build(operands=[mm.x, mm.w, other],
                                                               result_types=[op.out.type]))
                rewriter.erase(mm)
                return


class _FuseRope(RewritePattern):
    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: td.SplitQkvOp, rewriter: PatternRewriter) -> None:
        found = _projection(op.qkv, op)
        ropes = [value.get_user_of_unique_use() for value in (op.q, op.k)]
        if found is None or not all(isinstance(r, td.RopeOp) for r in ropes):
            return
        rq, rk = ropes
        same = (rq.positions is rk.positions and rq.theta == rk.theta and rq.rotary_dim == rk.rotary_dim
                and rq.x is op.q and rk.x is op.k)
        if not same or not _dominates_before(rq.positions, op):
            return
        mm, norm, eps = found
        fused = td.MatmulRopeOp.build(
            operands=[mm.x, mm.w, rq.positions, [norm] if norm is not None else []],
            result_types=[op.q.type, op.k.type, op.v.type],
            properties=_props(op, theta=rq.theta.value.data, rotary_dim=rq.rotary_dim.value.data, eps=eps))
        rewriter.insert(fused, InsertPoint.before(op))
        for value, name in zip(fused.results, ("q_rot", "k_rot", "v")):
            value.name_hint = name
        rewriter.replace(rq, [], [fused.q])
        rewriter.replace(rk, [], [fused.k])
        rewriter.replace(op, [], [fused.q, fused.k, fused.v])  # q and k have no uses left
        rewriter.erase(mm)


#: ops whose ``x`` operand can take an rms_norm prologue, and whether they already have one
def _takes_prologue(user: Operation) -> bool:
    if isinstance(user, td.MatmulOp):
        return True
    return isinstance(user, (td.MatmulSiluMulOp, td.MatmulRopeOp)) and user.norm_weight is None


class _FuseNormMatmul(RewritePattern):
    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: td.RmsNormOp, rewriter: PatternRewriter) -> None:
        uses = list(op.out.uses)
        if len(op.x.type.get_shape()) != 2 or not uses:
            return
        if not all(use.index == 0 and _takes_prologue(use.operation) for use in uses):
            return
        if len({use.operation for use in uses}) != len(uses):  # one op reading the norm twice: leave it
            return
        eps = op.eps.value.data
        for use in uses:
            user = use.operation
            types = [r.type for r in user.results]
            if isinstance(user, td.MatmulOp):
                new = td.NormMatmulOp.build(operands=[op.x, op.weight, user.w], result_types=types,
                                            properties=td.props(eps=eps))
            elif isinstance(user, td.MatmulSiluMulOp):
                new = td.MatmulSiluMulOp.build(operands=[op.x, user.w, [op.weight]], result_types=types,
                                               properties=_props(user, eps=eps))
            else:
                new = td.MatmulRopeOp.build(operands=[op.x, user.w, user.positions, [op.weight]],
                                            result_types=types, properties=_props(user, eps=eps))
            rewriter.replace(user, new)
        rewriter.erase(op)


def _walk(pattern: RewritePattern, module: ModuleOp) -> None:
    PatternRewriteWalker(pattern, apply_recursively=True).rewrite_module(module)
    module.verify()


@dataclass(frozen=True)
class FuseNormMatmul(ModulePass):
    """rms_norm -> matmul-family ops: the norm in each consumer's prologue (``norm_matmul`` or a ``norm`` operand)."""

    name = "fuse-norm-matmul"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        _walk(_FuseNormMatmul(), op)


@dataclass(frozen=True)
class FuseGatedMlp(ModulePass):
    """gate|up matmul -> silu_and_mul: ``matmul_silu_mul``."""

    name = "fuse-gated-mlp"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        _walk(_FuseGatedMlp(), op)


@dataclass(frozen=True)
class FuseResidual(ModulePass):
    """matmul -> residual_add: ``matmul_residual``."""

    name = "fuse-residual"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        _walk(_FuseResidual(), op)


@dataclass(frozen=True)
class FuseRope(ModulePass):
    """QKV matmul -> split_qkv -> rope on q and k: ``matmul_rope``."""

    name = "fuse-rope"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        _walk(_FuseRope(), op)


@dataclass(frozen=True)
class AttentionLayout(ModulePass):
    """Set ``kv_layout`` on every ``tessera.attention``.

    ``kv="token"``: the kernel reads keys and values in place, token-major ``[S, Hkv, D]`` (the ``tokens`` key
    layout of :func:`~tessera.mlir.attention_kernel.lower_attention`; decode). ``kv="head"``: the host packs them
    head-major in tiles of 16 keys (``tiles``; prefill). The operands keep their logical ``[S, Hkv, D]`` type: the
    attribute is the kernel's reading order, not a different tensor.
    """

    name = "attention-layout"
    kv: str = "token"

    def __post_init__(self) -> None:
        if self.kv not in td.KV_LAYOUTS:
            raise ValueError(f"attention-layout: kv must be one of {list(td.KV_LAYOUTS)}, got {self.kv!r}; "
                             "e.g. attention-layout{kv=head}")

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        for inner in op.walk():
            if isinstance(inner, td.AttentionOp):
                inner.properties["kv_layout"] = StringAttr(self.kv)
        op.verify()


#: pass name -> class (the names ``pipeline`` and ``tessera mlir dump --passes`` accept)
PASSES: dict[str, type[ModulePass]] = {p.name: p for p in (FuseNormMatmul, FuseGatedMlp, FuseResidual, FuseRope,
                                                           AttentionLayout)}
#: what ``"all"`` runs, in order
DEFAULT_PIPELINE = "fuse-norm-matmul,fuse-gated-mlp,fuse-residual,fuse-rope,attention-layout"

Callback = Callable[[ModulePass, ModuleOp], None]


def parse_passes(spec: str | Sequence[str] | None) -> tuple[ModulePass, ...]:
    """Passes from ``"all"``, ``"none"``/None/"" or an MLIR-style list (``"fuse-rope,attention-layout{kv=head}"``;
    a sequence of such entries is joined with commas)."""
    if spec is None:
        return ()
    text = spec if isinstance(spec, str) else ",".join(spec)
    text = text.strip()
    if text in ("", "none"):
        return ()
    if text == "all":
        text = DEFAULT_PIPELINE
    try:
        return PassPipeline.parse_spec({name: (lambda c=cls: c) for name, cls in PASSES.items()}, text).passes
    except ValueError as err:
        raise ValueError(f"passes {text!r}: {err}; known passes: {', '.join(PASSES)} (or 'all' / 'none')") from err


def pipeline(module: ModuleOp, passes: str | Sequence[str] | None = "all",
             callback: Callback | None = None) -> ModuleOp:
    """Run ``passes`` (see :func:`parse_passes`) on ``module`` in place, in order; ``callback(pass, module)`` after
    each. Returns ``module``."""
    ctx = td.context()
    for p in parse_passes(passes):
        p.apply(ctx, module)
        if callback is not None:
            callback(p, module)
    return module


__all__ = ["PASSES", "DEFAULT_PIPELINE", "AttentionLayout", "FuseGatedMlp", "FuseNormMatmul", "FuseResidual",
           "FuseRope", "parse_passes", "pipeline"]
