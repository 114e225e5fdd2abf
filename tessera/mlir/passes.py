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
``block-sparse-        annotates every ``tessera.attention`` with the kv tiles each q tile visits (``schedule_*``
schedule``             attributes), from the mask's analytic classification at a static query and kv length;
                       lowering visits only those tiles
=====================  ======================================================================================

Each fusion accepts both a plain and a norm-prologue producer, so the fusions commute: :data:`DEFAULT_PIPELINE` and
any reordering of its fusions give the same IR. Every pass verifies the module after rewriting.
``block-sparse-schedule`` runs last: it annotates the ops whose lengths are static (or given as options).

>>> module = pipeline(capture_layer(config, 0, 16))                     # doctest: +SKIP
>>> module = pipeline(module, "fuse-rope,attention-layout{kv=head}")    # doctest: +SKIP
>>> module = pipeline(module, "block-sparse-schedule{kv_tile=32}")       # doctest: +SKIP
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


@dataclass(frozen=True)
class BlockSparseSchedule(ModulePass):
    """Attach to every ``tessera.attention`` the kv tiles each q tile visits (its block-sparse schedule).

    The queries are the last ``q_len`` of ``kv_len`` positions (``q_len``/``kv_len`` 0: the op's static q and k
    token counts; an op whose count is dynamic and not given is left without a schedule, and its lowering classifies
    at the length it is lowered for). Queries are cut into tiles of ``q_tile`` positions and keys into
    tiles of ``kv_tile`` (0: the ``mlir_attention_kv_tile`` tunable); the mask's analytic classification
    (:func:`~tessera.mlir.schedule.tile_schedule`, the one the planner uses) drops the EMPTY pairs. Masks whose
    values are only known at run time (document ids) and custom masks keep every tile. The lowering
    (:mod:`tessera.mlir.lower_graph`) builds its work items from the annotation.
    """

    name = "block-sparse-schedule"
    q_len: int = 0
    kv_len: int = 0
    q_tile: int = 16
    kv_tile: int = 0

    def __post_init__(self) -> None:
        from tessera.mlir.attention_kernel import KV_TILE_CHOICES

        for what, value, lowest in (("q_len", self.q_len, 0), ("kv_len", self.kv_len, 0), ("q_tile", self.q_tile, 1)):
            if not isinstance(value, int) or value < lowest:
                raise ValueError(f"block-sparse-schedule: {what} must be an int >= {lowest}, got {value!r}")
        if self.kv_tile != 0 and self.kv_tile not in KV_TILE_CHOICES:
            raise ValueError(f"block-sparse-schedule: kv_tile must be 0 (the tuned value) or one of "
                             f"{list(KV_TILE_CHOICES)}, got {self.kv_tile!r}; e.g. block-sparse-schedule{{kv_tile=32}}")

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        for inner in op.walk():
            if isinstance(inner, td.AttentionOp):
                schedule = self.schedule_of(inner)
                if schedule is not None:
                    td.set_attention_schedule(inner, schedule)
        op.verify()

    def schedule_of(self, op: td.AttentionOp):
        """The :class:`~tessera.mlir.schedule.TileSchedule` of one attention op (None: a length is unknown)."""
        from tessera.backends.mlir import tunables  # noqa: F401  (registers mlir_attention_kv_tile)
        from tessera.mlir.attention_kernel import KV_TILE
        from tessera.mlir.schedule import dense_schedule, tile_schedule
        from tessera.tuning import tuned

        q_len = self._length("q_len", self.q_len, td.dims(op.q)[0])
        kv_len = self._length("kv_len", self.kv_len, td.dims(op.k)[0])
        if q_len is None or kv_len is None:
            return None
        kv_tile = self.kv_tile or tuned("mlir_attention_kv_tile", None, KV_TILE)
        if op.mask.data in ("custom", "document"):  # the function or the ids are not in the IR
            return dense_schedule(q_len, kv_len, self.q_tile, kv_tile)
        spec = td.attention_spec(op, placeholders=True)
        return tile_schedule(spec.mask, 0, q_len, kv_len, self.q_tile, kv_tile)

    def _length(self, what: str, given: int, static: int | None) -> int | None:
        if given and static is not None and given != static:
            raise ValueError(f"block-sparse-schedule: {what}={given} but the op's tensor has {static} tokens")
        return given or static


#: pass name -> class (the names ``pipeline`` and ``tessera mlir dump --passes`` accept)
PASSES: dict[str, type[ModulePass]] = {p.name: p for p in (FuseNormMatmul, FuseGatedMlp, FuseResidual, FuseRope,
                                                           AttentionLayout, BlockSparseSchedule)}
#: what ``"all"`` runs, in order
DEFAULT_PIPELINE = "fuse-norm-matmul,fuse-gated-mlp,fuse-residual,fuse-rope,attention-layout,block-sparse-schedule"

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


__all__ = ["PASSES", "DEFAULT_PIPELINE", "AttentionLayout", "BlockSparseSchedule", "FuseGatedMlp", "FuseNormMatmul",
           "FuseResidual", "FuseRope", "parse_passes", "pipeline"]
