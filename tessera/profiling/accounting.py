"""Per-op accounting: wrap the model's kernel call points, count calls, wall time, FLOPs and bytes.

:func:`account_ops` monkeypatches the functions a forward step calls (listed in :data:`TARGETS`) for the duration of
a ``with`` block and restores them in ``finally``. Each wrapper runs the original inside
``torch.profiler.record_function(name)``, so the ops show as named ranges in a Chrome/Perfetto trace, and adds the
call's ``time.perf_counter`` wall time and its FLOPs and bytes (from argument shapes and dtypes, counted with
:mod:`tessera.hw.roofline`) to that op's :class:`OpStats`.

Why these attribute paths: ``layers.py`` looks ``K.matmul`` etc. up on :mod:`tessera.kernels` at call time, so
patching the package attribute reaches it; ``runner.py`` imported ``sample`` by name, so it is patched there. A
backend adds its own kernels (a fused decoder layer) through ``profile_targets()``.
"""

from __future__ import annotations

import contextlib
import importlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from tessera.hw import roofline

CostFn = Callable[..., roofline.Cost]


@dataclass(slots=True)
class OpStats:
    """Totals of one op over a profiled run.

    Attributes
    ----------
    name : str
    calls : int
    seconds : float, wall time inside the op (``time.perf_counter``), summed over calls
    flops : float, FLOPs summed over calls (a multiply-add counts 2)
    bytes : float, bytes read + written, summed over calls
    """

    name: str
    calls: int = 0
    seconds: float = 0.0
    flops: float = 0.0
    bytes: float = 0.0
    #: the compute roof the op ran on when a backend says it is not the model dtype's (``"int8"``: integer dot
    #: products of an int8-activation quantized matmul); None: the model dtype's
    roof: str | None = None


@dataclass(slots=True)
class OpAccounting:
    """What :func:`account_ops` collected: ``stats`` maps op name -> :class:`OpStats`.

    With phases on, ``phase`` is ``"prefill"`` or ``"decode"`` from the first engine step on, and ops are keyed
    ``"matmul (prefill)"`` etc.: the two phases have different bottlenecks, and a sum over both hides both.
    """

    stats: dict[str, OpStats] = field(default_factory=dict)
    phase: str | None = None
    #: engine steps per phase (``"prefill"`` / ``"decode"``) and their wall seconds (with phases on)
    steps: dict[str, int] = field(default_factory=dict)
    step_seconds: dict[str, float] = field(default_factory=dict)
    _depth: int = 0

    def add(self, name: str, seconds: float, cost: roofline.Cost, roof: str | None = None) -> None:
        if self.phase is not None:
            name = f"{name} ({self.phase})"
        op = self.stats.get(name)
        if op is None:
            op = self.stats[name] = OpStats(name, roof=roof)
        op.calls += 1
        op.seconds += seconds
        op.flops += cost[0]
        op.bytes += cost[1]

    def sorted(self) -> list[OpStats]:
        """Ops by total time, largest first."""
        return sorted(self.stats.values(), key=lambda op: -op.seconds)

    @property
    def seconds(self) -> float:
        """Wall time inside all accounted ops."""
        return sum(op.seconds for op in self.stats.values())


# ------------------------------------------------------------------------------------------------ cost functions
def _nbytes(t: Any) -> int:
    """Bytes of a tensor, a NumPy array or a :class:`tessera.kernels.QuantizedWeight` (its packed bytes)."""
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    return int(t.nbytes)


def _matmul_cost(x: torch.Tensor, w: Any, *args: Any, **kwargs: Any) -> roofline.Cost:
    """Float or quantized ``x [M, K] @ w[N, K].T``; a quantized weight counts its packed bytes (scales included)."""
    m, k = x.shape
    n = w.shape[0]
    return roofline.matmul_cost(m, n, k, _nbytes(w) / max(n * k, 1), x.element_size())


def _lm_head_cost(hidden: torch.Tensor, table: torch.Tensor, *args: Any, **kwargs: Any) -> roofline.Cost:
    rows, (vocab, width) = hidden.numel() // hidden.shape[-1], table.shape
    # logits come out float32 whatever the model dtype
    per_weight = _nbytes(table) / max(vocab * width, 1)  # a packed table (QuantizedWeight) reads fewer bytes
    return roofline.matmul_cost(rows, vocab, width, per_weight, hidden.element_size(), out_bytes_per_elem=4)


def _embed_cost(ids: torch.Tensor, table: Any, *args: Any, **kwargs: Any) -> roofline.Cost:
    elems = ids.numel() * table.shape[1]
    # a packed table (QuantizedWeight) is read at its bytes per value
    size = table.element_size() if isinstance(table, torch.Tensor) else table.nbytes / (table.shape[0] * table.shape[1])
    return roofline.elementwise_cost(elems, elems, size, flops_per_elem=0.0)


def _rms_norm_cost(x: torch.Tensor, weight: torch.Tensor, *args: Any, residual: Any = None,
                   **kwargs: Any) -> roofline.Cost:
    return roofline.norm_cost(x.numel() // x.shape[-1], x.shape[-1], x.element_size(), residual=residual is not None)


def _layer_norm_cost(x: torch.Tensor, weight: torch.Tensor, bias: Any = None, *args: Any,
                     **kwargs: Any) -> roofline.Cost:
    return roofline.norm_cost(x.numel() // x.shape[-1], x.shape[-1], x.element_size(), bias=bias is not None)


def _rope_cost(q: torch.Tensor, k: torch.Tensor, *args: Any, **kwargs: Any) -> roofline.Cost:
    # in place: q and k are read and written; x * cos + rotate(x) * sin is 3 FLOPs per element
    elems = q.numel() + k.numel()
    return roofline.elementwise_cost(elems, elems, q.element_size(), flops_per_elem=3.0)


def _gated_cost(flops_per_elem: float) -> CostFn:
    def cost(gate_up: torch.Tensor, *args: Any, **kwargs: Any) -> roofline.Cost:
        # [..., 2I] in, [..., I] out; the count is per output element (activation + the multiply)
        return roofline.elementwise_cost(gate_up.numel(), gate_up.numel() // 2, gate_up.element_size(),
                                         flops_per_elem)
    return cost


def _gelu_cost(x: torch.Tensor, *args: Any, **kwargs: Any) -> roofline.Cost:
    return roofline.elementwise_cost(x.numel(), x.numel(), x.element_size(), flops_per_elem=8.0)


def _moe_cost(x: torch.Tensor, gate_up: Any, down: Any, router_logits: torch.Tensor, top_k: int, *args: Any,
              shared: Any = None, **kwargs: Any) -> roofline.Cost:
    """Experts touched read their weights once: at most ``min(E, T * top_k)`` of the E experts (an upper bound)."""
    tokens, hidden = x.shape
    experts = router_logits.shape[-1]
    inter = down[0].shape[-1]
    touched = min(experts, tokens * top_k) / experts
    weight_bytes = sum(_nbytes(w) for w in (*gate_up, *down)) if isinstance(gate_up, (list, tuple)) \
        else _nbytes(gate_up) + _nbytes(down)
    flops = 2.0 * tokens * top_k * 3 * inter * hidden
    nbytes = touched * weight_bytes + 2 * x.numel() * x.element_size()
    if shared is not None:
        s_inter = shared.down.shape[-1]
        flops += 2.0 * tokens * 3 * s_inter * hidden
        nbytes += _nbytes(shared.gate_up) + _nbytes(shared.down)
    return flops, float(nbytes)


def _sample_cost(logits: torch.Tensor, *args: Any, **kwargs: Any) -> roofline.Cost:
    # a softmax-like pass over each row (max, exp, sum, scan): a few FLOPs per logit, the logits read once
    return 5.0 * logits.numel(), float(_nbytes(logits))


def _argmax_cost(logits: torch.Tensor, *args: Any, **kwargs: Any) -> roofline.Cost:
    # one comparison per logit (a greedy step's token, picked inside the forward), the logits read once
    return float(logits.numel()), float(_nbytes(logits))


def _all_reduce_cost(comm: Any, t: torch.Tensor, *args: Any, **kwargs: Any) -> roofline.Cost:
    # the sum travels as float32 whatever the model dtype (Communicator.all_reduce); bytes = the reduced buffer
    return 0.0, float(t.numel() * 4)


def _all_gather_cost(comm: Any, t: torch.Tensor, sizes: list[int], *args: Any, **kwargs: Any) -> roofline.Cost:
    # every rank sends its rows padded to the widest piece (gloo gathers equal shapes); bytes = the gathered buffer
    rows = t.numel() // max(t.shape[-1], 1)
    return 0.0, float(rows * max(sizes) * comm.world * t.element_size())


def _argmax_across_cost(comm: Any, values: torch.Tensor, *args: Any, **kwargs: Any) -> roofline.Cost:
    # one float64 (value, id) pair per row and rank, all-gathered
    return 0.0, float(values.numel() * 16 * comm.world)


def _attention_cost(plan: Any, q: torch.Tensor, k_pages: torch.Tensor, *args: Any, **kwargs: Any) -> roofline.Cost:
    """Causal attention over the plan's batch (windows and custom masks not subtracted: an upper bound for them)."""
    spec, batch = plan.spec, plan.batch
    return roofline.attention_cost(list(batch.q_lens), list(batch.kv_lens), spec.num_q_heads, spec.num_kv_heads,
                                   spec.head_dim, q.element_size())


def _kv_write_cost(cache: Any, layer: int, k: torch.Tensor, v: torch.Tensor, *args: Any,
                   **kwargs: Any) -> roofline.Cost:
    # a copy: the new K and V are read, then written into their slots
    return 0.0, float(2 * (_nbytes(k) + _nbytes(v)))


#: (module path, attribute, op name, cost function); a "Class.method" attribute patches the class.
TARGETS: tuple[tuple[str, str, str, CostFn], ...] = (
    ("tessera.kernels", "matmul", "matmul", _matmul_cost),
    ("tessera.kernels", "qmatmul", "qmatmul", _matmul_cost),
    ("tessera.kernels", "rms_norm", "rms_norm", _rms_norm_cost),
    ("tessera.kernels", "layer_norm", "layer_norm", _layer_norm_cost),
    ("tessera.kernels", "qk_norm", "qk_norm", _rms_norm_cost),
    ("tessera.kernels", "apply_rope", "apply_rope", _rope_cost),
    ("tessera.kernels", "silu_and_mul", "silu_and_mul", _gated_cost(5.0)),
    ("tessera.kernels", "gelu_and_mul", "gelu_and_mul", _gated_cost(9.0)),
    ("tessera.kernels", "gelu", "gelu", _gelu_cost),
    ("tessera.kernels", "embed", "embed", _embed_cost),
    ("tessera.kernels", "lm_head", "lm_head", _lm_head_cost),
    ("tessera.kernels", "moe_mlp", "moe_mlp", _moe_cost),
    ("tessera.engine.runner", "sample", "sample", _sample_cost),
    ("tessera.kernels", "argmax", "argmax", _argmax_cost),
    ("tessera.attention.plan", "AttentionPlan.run", "attention", _attention_cost),
    ("tessera.kv.cache", "PagedKVCache.write", "kv_cache_write", _kv_write_cost),
    # the collectives of a tensor-parallel rank (only rank 0, the engine's process, is accounted)
    ("tessera.distributed.comm", "Communicator.all_reduce", "all_reduce", _all_reduce_cost),
    ("tessera.distributed.comm", "Communicator.all_gather_cols", "all_gather", _all_gather_cost),
    ("tessera.distributed.comm", "Communicator.argmax_across", "argmax_across", _argmax_across_cost),
)

#: accounted ops that are collectives, and the collective each one is in the cost model (:mod:`tessera.hw.links`):
#: their time is communication (and waiting for the other ranks), their "bytes" the collective's result buffer, not
#: memory traffic, so no roofline applies to them
COMM_OPS = {"all_reduce": "all_reduce", "all_gather": "all_gather", "argmax_across": "all_gather"}


def targets() -> tuple[tuple[str, str, str, CostFn], ...]:
    """:data:`TARGETS`, then each usable backend's own kernels (``Backend.profile_targets()``, optional), e.g. a
    fused decoder layer."""
    import tessera.attention  # noqa: F401  (backends import attention first)
    from tessera.backends import registered

    extra = [t for b in registered().values() if hasattr(b, "profile_targets") and not b.available()
             for t in b.profile_targets()]
    return (*TARGETS, *extra)


@contextlib.contextmanager
def account_ops(unfused: bool = False, phases: bool = False) -> Iterator[OpAccounting]:
    """Count every call of the :func:`targets` made inside the block; restore them all on exit, even on errors.

    Parameters
    ----------
    unfused : bool
        Also force the per-op decode path (:func:`force_unfused`), so each op of a decode step shows separately
        instead of one ``fused_decoder_layers`` call per run of layers.
    phases : bool
        Key ops by engine phase, ``"matmul (prefill)"`` / ``"matmul (decode)"``: each engine step
        (``tessera.engine.runner.forward_step``) sets the phase, ``"decode"`` when every sequence has one new token,
        else ``"prefill"`` (prompt chunks, mixed batches, draft verification). The step shows as a ``"prefill step"``
        / ``"decode step"`` range in the trace. Ops before the first step keep their plain names.

    Yields
    ------
    OpAccounting
        Filled in as the block runs. Calls made from inside another accounted op (a kernel calling a kernel) count
        toward the outer op only, so the op times never overlap.

    Examples
    --------
    >>> with account_ops() as acct:
    ...     llm.generate([prompt], params)
    >>> [(op.name, op.calls, op.seconds) for op in acct.sorted()[:5]]
    """
    acct = OpAccounting()
    roofs = _roof_hooks()
    with contextlib.ExitStack() as stack:
        for module, attr, name, cost in targets():
            owner, leaf = _resolve(module, attr)
            stack.enter_context(_patched(owner, leaf, _wrap(getattr(owner, leaf), name, cost, acct, roofs)))
        if unfused:
            stack.enter_context(force_unfused())
        if phases:
            from tessera.distributed import worker
            from tessera.engine import runner

            stack.enter_context(_patched(runner, "forward_step", _phase_marker(runner.forward_step, acct)))
            # a tensor-parallel engine runs rank 0's step through the worker module's forward_step instead
            stack.enter_context(_patched(worker, "forward_step", _phase_marker(worker.forward_step, acct)))
        yield acct


def force_unfused() -> contextlib.AbstractContextManager[None]:
    """Make ``forward_step`` take the per-op path on every step (its fused decode attempt returns None)."""
    from tessera.models import paged

    return _patched(paged, "fused_decode_op", _no_fused_decode_op)


def _no_fused_decode_op(model: Any) -> None:
    return None


def _resolve(module: str, attr: str) -> tuple[Any, str]:
    owner: Any = importlib.import_module(module)
    *path, leaf = attr.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, leaf


@contextlib.contextmanager
def _patched(owner: Any, attr: str, value: Any) -> Iterator[None]:
    original = getattr(owner, attr)
    setattr(owner, attr, value)
    try:
        yield
    finally:
        setattr(owner, attr, original)


def _phase_marker(forward_step: Callable[..., Any], acct: OpAccounting) -> Callable[..., Any]:
    def wrapper(model: Any, cache: Any, step: Any, *args: Any, **kwargs: Any) -> Any:
        phase = acct.phase = "decode" if all(q == 1 for q in step.q_lens) else "prefill"
        start = time.perf_counter()
        with torch.profiler.record_function(f"{phase} step"):
            out = forward_step(model, cache, step, *args, **kwargs)
        acct.steps[phase] = acct.steps.get(phase, 0) + 1
        acct.step_seconds[phase] = acct.step_seconds.get(phase, 0.0) + time.perf_counter() - start
        return out

    return wrapper


def _roof_hooks() -> list[Callable[[str, tuple], str | None]]:
    """Every usable backend's ``compute_roof(op, args)`` (backends whose kernels run on other roofs than the model
    dtype's, e.g. integer dot products, expose one)."""
    import tessera.attention  # noqa: F401  (backends import attention first)
    from tessera.backends import registered

    return [b.compute_roof for b in registered().values() if hasattr(b, "compute_roof") and not b.available()]


def _wrap(original: Callable[..., Any], name: str, cost: CostFn, acct: OpAccounting,
          roofs: list[Callable[[str, tuple], str | None]] = ()) -> Callable[..., Any]:
    """A plain function (so a patched method still binds ``self``) that times, counts and labels ``original``."""
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if acct._depth:
            return original(*args, **kwargs)
        acct._depth += 1
        try:
            with torch.profiler.record_function(name):
                start = time.perf_counter()
                out = original(*args, **kwargs)
                seconds = time.perf_counter() - start
        finally:
            acct._depth -= 1
        roof = next((r for r in (hook(name, args) for hook in roofs) if r is not None), None)
        acct.add(name, seconds, cost(*args, **kwargs), roof)
        return out

    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    wrapper.__name__ = getattr(original, "__name__", name)
    return wrapper
