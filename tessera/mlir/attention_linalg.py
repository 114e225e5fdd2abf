"""Lowering of one attention spec to linalg on tensors: the GPU-shaped form of :mod:`tessera.mlir.attention_kernel`.

The loop kernel hands IREE one hand-scheduled dispatch (a sequential tile loop per work item), which only IREE's CPU
pipeline accepts. Here the same spec is written as the data-parallel ops attention is made of, and IREE's own
pipelines fuse, tile and distribute them to threads and workgroups for any target (cuda, rocm, vulkan-spirv and
llvm-cpu alike):

1. ``s = q . k`` per (sequence, query, head, key): a ``linalg.generic`` contraction over the head dim, reading the kv
   head of each query head's GQA group directly (no repeated keys);
2. ``s * scale``, the score function and the mask: an elementwise ``linalg.generic`` whose body is the traced spec
   (:mod:`tessera.mlir.trace` with scalar values; positions come from ``linalg.index``); masked scores are ``-inf``;
3. the softmax statistics: ``m = max_j s`` (a sink's logit joins it), ``l = sum_j exp(s - m)`` (plus the sink's);
4. ``acc = exp(s - m) @ v``, a contraction over the keys, then ``out = acc / l`` and ``lse = m + log(l)``. A row
   that keeps no key (and has no sink) is 0 with lse ``-inf``, as in the loop kernel.

Two forms (``kv_tile``): all keys at once (the default; IREE makes it 7 dispatches, and the scores
``[B, Tq, Hkv, G, S]`` live in device memory between them), or an online softmax over tiles of ``kv_tile`` keys:
an ``scf.for`` outside any dispatch carries ``(m, l, acc)`` as tensors, each iteration runs steps 1-4 on one tile and
rescales the carried state, so only ``[B, Tq, Hkv, G, kv_tile]`` scores exist at a time, for 7 dispatches per tile.
Neither is a FlashAttention schedule (scores do not stay in registers); they are the form every IREE GPU pipeline
accepts today.

Layouts (one dense batch of equal-length sequences; the host views the API's token-major tensors):

- ``q`` ``[B, Tq, Hkv, G, D]`` float32: query head ``h * G + g`` of token ``i``; ``G`` is the GQA group size;
- ``k``, ``v`` ``[B, S, Hkv, D]`` float32;
- results ``out [B, Tq, Hkv, G, D]`` and ``lse [B, Tq, Hkv, G]`` (natural log, sinks included).

Query ``i`` sits at position ``S - Tq + i`` (queries are the last tokens of their sequence, as everywhere in
tessera), key ``j`` at ``j``, and a mask's batch index ``b`` is the sequence's index in the batch. ``D`` is static;
``B``, ``Tq``, ``S``, ``Hkv`` and ``G`` are runtime dims, and every value a spec holds (scale, window, softcap,
tables, sinks) is read from the aux buffers, so one compiled module serves every shape of a ``(structure, D)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tessera.attention.spec import AttentionSpec
from tessera.mlir.text import TextBuilder
from tessera.mlir.trace import FLOAT, INT, AuxValues, Scope, Sym, mask_value, score_value

_ROW = "tensor<?x?x?x?xf32>"  # [B, Tq, Hkv, G]: one value per query row
_SCORES = "tensor<?x?x?x?x?xf32>"  # [B, Tq, Hkv, G, S]
# Iteration spaces: (b, i, h, g, j) over scores, with d appended for q.k and swapped in for p @ v.
_S5 = "affine_map<(b, i, h, g, j) -> (b, i, h, g, j)>"
_R5 = "affine_map<(b, i, h, g, j) -> (b, i, h, g)>"
_QK = ("affine_map<(b, i, h, g, j, d) -> (b, i, h, g, d)>", "affine_map<(b, i, h, g, j, d) -> (b, j, h, d)>",
       "affine_map<(b, i, h, g, j, d) -> (b, i, h, g, j)>")
_PV = ("affine_map<(b, i, h, g, d, j) -> (b, i, h, g, j)>", "affine_map<(b, i, h, g, d, j) -> (b, j, h, d)>",
       "affine_map<(b, i, h, g, d, j) -> (b, i, h, g, d)>")
_O5 = "affine_map<(b, i, h, g, d) -> (b, i, h, g, d)>"
_OR5 = "affine_map<(b, i, h, g, d) -> (b, i, h, g)>"
_R4 = "affine_map<(b, i, h, g) -> (b, i, h, g)>"
_PAR5 = '["parallel", "parallel", "parallel", "parallel", "parallel"]'
_RED5 = '["parallel", "parallel", "parallel", "parallel", "reduction"]'
_RED6 = '["parallel", "parallel", "parallel", "parallel", "parallel", "reduction"]'
_PAR4 = '["parallel", "parallel", "parallel", "parallel"]'


@dataclass(frozen=True)
class LinalgAttentionKernel:
    """One lowered spec: the module text, the function to call, and the runtime values the spec holds.

    Call ``entry(q, k, v, aux_i, aux_f) -> (out, lse)`` with the layouts of the module docstring.
    """

    text: str
    entry: str
    head_dim: int
    aux_i: np.ndarray
    aux_f: np.ndarray
    kv_tile: int | None = None


def lower_attention_linalg(spec: AttentionSpec, entry: str = "attention", kv_tile: int | None = None
                           ) -> LinalgAttentionKernel:
    """The linalg-on-tensors kernel of ``spec`` (raises :class:`~tessera.mlir.trace.UntranslatableError` when its
    mask or score cannot be translated; the same translations as the loop kernel).

    ``kv_tile`` None scores every key at once (one pass, scores ``[B, Tq, Hkv, G, S]`` in memory); an int walks the
    keys in tiles of that many with an online softmax (``scf.for`` with tensor iter_args around the same linalg ops),
    so only ``[B, Tq, Hkv, G, kv_tile]`` scores exist at a time, at the price of a host-side loop of dispatches.
    """
    if kv_tile is not None and (isinstance(kv_tile, bool) or not isinstance(kv_tile, int) or kv_tile < 1):
        raise ValueError(f"kv_tile must be None or an int >= 1, got {kv_tile!r}")
    e = _Emitter(spec)
    if kv_tile is None:
        out, lse = e.whole()
    else:
        out, lse = e.tiled(kv_tile)
    e.b.line(f"return {out}, {lse} : {e.q_t}, {_ROW}")
    aux_i, aux_f = e.aux.buffers()
    form = "one pass over all keys" if kv_tile is None else f"online softmax over kv tiles of {kv_tile}"
    text = (f"// Generated by tessera.mlir.attention_linalg: linalg on tensors ({form}), for IREE's GPU and CPU "
            f"pipelines.\nfunc.func @{entry}(%q: {e.q_t}, %k: {e.kv_t}, %v: {e.kv_t}, %auxI: tensor<?xi32>, "
            f"%auxF: tensor<?xf32>)\n    -> ({e.q_t}, {_ROW}) {{\n{e.b.text()}\n}}\n")
    return LinalgAttentionKernel(text, entry, spec.head_dim, aux_i, aux_f, kv_tile)


class _Emitter:
    """The function body: dims and constants first, then the ops of one of the two forms."""

    def __init__(self, spec: AttentionSpec) -> None:
        self.spec = spec
        # The header mirrors the loop kernel's (group, scale); the group is read from q's shape here.
        self.aux = AuxValues(ints=[spec.group_size], floats=[spec.softmax_scale])
        self.b = b = TextBuilder(indent=2)
        d = spec.head_dim
        self.q_t, self.kv_t = f"tensor<?x?x?x?x{d}xf32>", f"tensor<?x?x?x{d}xf32>"
        self.dims = dims = {}
        for name, (tensor, ty, axis) in {"B": ("%q", self.q_t, 0), "T": ("%q", self.q_t, 1),
                                         "H": ("%q", self.q_t, 2), "G": ("%q", self.q_t, 3),
                                         "S": ("%k", self.kv_t, 1)}.items():
            dims[name] = b.value(f"tensor.dim {tensor}, " + b.value(f"arith.constant {axis} : index", "c")
                                 + f" : {ty}", name)
        self.row_dims = ", ".join(dims[n] for n in "BTHG")
        self.c0 = b.value("arith.constant 0 : index", "c")
        self.scale = b.value(f"tensor.extract %auxF[{self.c0}] : tensor<?xf32>", "scale")
        self.zero = b.value("arith.constant 0.0 : f32", "zero")
        self.one = b.value("arith.constant 1.0 : f32", "one")
        self.ninf = b.value("arith.constant 0xFF800000 : f32", "ninf")
        # The query's position is S - Tq + i: queries are the sequence's last tokens.
        self.q_offset = b.value("arith.index_cast " + b.value(f"arith.subi {dims['S']}, {dims['T']} : index")
                                + " : index to i32", "qoff")
        self.group = b.value(f"arith.index_cast {dims['G']} : index to i32", "group")

    # ---- pieces shared by both forms ------------------------------------------------------------------------------
    def row(self) -> str:
        return self.b.value(f"tensor.empty({self.row_dims}) : {_ROW}")

    def fill_row(self, value: str) -> str:
        return self.b.value(f"linalg.fill ins({value} : f32) outs({self.row()} : {_ROW}) -> {_ROW}")

    def rowwise(self, operands: list[str], body) -> str:
        """An elementwise op over rows: ``body(*element names)`` returns the yielded value."""
        names = [f"%x{n}" for n in range(len(operands))]
        maps = ", ".join([_R4] * (len(operands) + 1))
        return _generic(self.b, maps, _PAR4, ", ".join(operands) + " : " + ", ".join([_ROW] * len(operands)),
                        f"{self.row()} : {_ROW}", _ROW, ", ".join(f"{n}: f32" for n in names) + ", %unused: f32",
                        lambda: body(*names))

    def scores(self, keys: str, n_keys: str, kv_start: str | None) -> str:
        """Scaled, score-modified and masked ``[B, Tq, Hkv, G, n]`` scores of ``keys`` (keys from ``kv_start``)."""
        b = self.b
        dims = f"{self.row_dims}, {n_keys}"
        b.comment("scores s = q . k over the head dim, for each query head's kv head")
        s0 = b.value(f"linalg.fill ins({self.zero} : f32) outs(" + b.value(f"tensor.empty({dims}) : {_SCORES}")
                     + f" : {_SCORES}) -> {_SCORES}")
        raw = _generic(b, f"{_QK[0]}, {_QK[1]}, {_QK[2]}", _RED6, f"%q, {keys} : {self.q_t}, {self.kv_t}",
                       f"{s0} : {_SCORES}", _SCORES, "%qe: f32, %ke: f32, %acc: f32",
                       lambda: b.value("arith.addf %acc, " + b.value("arith.mulf %qe, %ke : f32") + " : f32"))
        b.comment("scale, score function and mask, one element at a time; masked scores are -inf")
        return _generic(b, f"{_S5}, {_S5}", _PAR5, f"{raw} : {_SCORES}",
                        b.value(f"tensor.empty({dims}) : {_SCORES}") + f" : {_SCORES}", _SCORES,
                        "%se: f32, %unused: f32", lambda: self._masked(kv_start))

    def _masked(self, kv_start: str | None) -> str:
        b, spec = self.b, self.spec
        scope = Scope(b, self.aux, lanes=None)
        idx = [b.value("arith.index_cast " + b.value(f"linalg.index {n} : index") + " : index to i32", v)
               for n, v in enumerate(("b", "i", "h", "g", "j"))]
        s = Sym(b.value(f"arith.mulf %se, {self.scale} : f32", "s"), FLOAT, scope)
        if spec.score is None and spec.mask is None:
            return s.name
        seq = Sym(idx[0], INT, scope)
        head = Sym(b.value("arith.addi " + b.value(f"arith.muli {idx[2]}, {self.group} : i32") + f", {idx[3]} : i32",
                           "head"), INT, scope)
        q_pos = Sym(b.value(f"arith.addi {self.q_offset}, {idx[1]} : i32", "qpos"), INT, scope)
        kv = idx[4] if kv_start is None else b.value(f"arith.addi {kv_start}, {idx[4]} : i32", "kvpos")
        kv_pos = Sym(kv, INT, scope)
        if spec.score is not None:
            s = score_value(spec.score, s, seq, head, q_pos, kv_pos)
        if spec.mask is None:
            return s.name
        keep = mask_value(spec.mask, seq, head, q_pos, kv_pos)
        return b.value(f"arith.select {keep.name}, {s.name}, {self.ninf} : f32", "sm")

    def sinks(self) -> str | None:
        """Each query row's sink logit ``[B, Tq, Hkv, G]`` (None without sinks)."""
        if self.spec.sinks is None:
            return None
        b = self.b
        b.comment("each head's sink logit: it starts the running max and joins the denominator")
        slot = self.aux.float_array(self.spec.sinks.detach().cpu().float().numpy())

        def body() -> str:
            head = b.value("arith.addi " + b.value("arith.muli " + b.value("linalg.index 2 : index")
                                                   + f", {self.dims['G']} : index") + ", "
                           + b.value("linalg.index 3 : index") + " : index")
            start = b.value("tensor.extract %auxI[" + b.value(f"arith.constant {slot} : index", "c")
                            + "] : tensor<?xi32>")
            at = b.value("arith.addi " + b.value(f"arith.index_cast {start} : i32 to index") + f", {head} : index")
            return b.value(f"tensor.extract %auxF[{at}] : tensor<?xf32>", "sink")

        return _generic(b, _R4, _PAR4, None, f"{self.row()} : {_ROW}", _ROW, "%unused: f32", body)

    def reduce_rows(self, scores: str, init: str, body, extra: str | None = None) -> str:
        """A reduction over the keys into ``init``; ``body(score, acc[, extra row value])``."""
        maps, ins = f"{_S5}, {_R5}", f"{scores} : {_SCORES}"
        args = "%se: f32, %acc: f32"
        if extra is not None:
            maps, ins = f"{_S5}, {_R5}, {_R5}", f"{scores}, {extra} : {_SCORES}, {_ROW}"
            args = "%se: f32, %me: f32, %acc: f32"
        return _generic(self.b, maps, _RED5, ins, f"{init} : {_ROW}", _ROW, args,
                        lambda: body("%se", "%acc") if extra is None else body("%se", "%acc", "%me"))

    def safe_max(self, m: str) -> str:
        """``m``, or 0 where it is -inf (a row with nothing kept: exp(-inf - 0) = 0, never NaN)."""
        b = self.b
        return self.rowwise([m], lambda x: b.value("arith.select " + b.value(f"arith.cmpf oeq, {x}, {self.ninf} : f32")
                                                   + f", {self.zero}, {x} : f32"))

    def exp_scores(self, scores: str, m_safe: str, n_keys: str) -> str:
        b = self.b
        dims = f"{self.row_dims}, {n_keys}"
        return _generic(b, f"{_S5}, {_R5}, {_S5}", _PAR5, f"{scores}, {m_safe} : {_SCORES}, {_ROW}",
                        b.value(f"tensor.empty({dims}) : {_SCORES}") + f" : {_SCORES}", _SCORES,
                        "%se: f32, %me: f32, %unused: f32",
                        lambda: b.value("math.exp " + b.value("arith.subf %se, %me : f32") + " : f32"))

    def pv(self, p: str, values: str, acc: str) -> str:
        """``acc + p @ values`` over the keys."""
        b = self.b
        return _generic(b, f"{_PV[0]}, {_PV[1]}, {_PV[2]}", _RED6, f"{p}, {values} : {_SCORES}, {self.kv_t}",
                        f"{acc} : {self.q_t}", self.q_t, "%pe: f32, %ve: f32, %acc: f32",
                        lambda: b.value("arith.addf %acc, " + b.value("arith.mulf %pe, %ve : f32") + " : f32"))

    def zero_acc(self) -> str:
        b = self.b
        empty = b.value(f"tensor.empty({self.row_dims}) : {self.q_t}")
        return b.value(f"linalg.fill ins({self.zero} : f32) outs({empty} : {self.q_t}) -> {self.q_t}")

    def finish(self, acc: str, m: str, l_sum: str) -> tuple[str, str]:
        """``out = acc / l`` and ``lse = m + log(l)``; a row that kept nothing is 0 and -inf."""
        b = self.b
        b.comment("out = acc / l; lse = m + log(l), -inf for a row that kept nothing")
        out = _generic(b, f"{_O5}, {_OR5}, {_O5}", _PAR5, f"{acc}, {l_sum} : {self.q_t}, {_ROW}",
                       b.value(f"tensor.empty({self.row_dims}) : {self.q_t}") + f" : {self.q_t}", self.q_t,
                       "%oe: f32, %le: f32, %unused: f32",
                       lambda: b.value("arith.mulf %oe, " + _inverse(b, "%le", self.zero, self.one) + " : f32"))
        lse = self.rowwise([m, l_sum], lambda me, le: b.value(
            "arith.select " + b.value(f"arith.cmpf ogt, {le}, {self.zero} : f32") + ", "
            + b.value(f"arith.addf {me}, " + b.value(f"math.log {le} : f32") + " : f32") + f", {self.ninf} : f32"))
        return out, lse

    # ---- the two forms --------------------------------------------------------------------------------------------
    def whole(self) -> tuple[str, str]:
        """Every key at once: scores, max, sum, p @ v."""
        b, n = self.b, self.dims["S"]
        scores = self.scores("%k", n, None)
        sink = self.sinks()
        b.comment("softmax statistics: row max m (from the sink, if any) and row sum l of exp(s - m)")
        m = self.reduce_rows(scores, sink or self.fill_row(self.ninf),
                             lambda s, acc: b.value(f"arith.maximumf {acc}, {s} : f32"))
        m_safe = self.safe_max(m)
        l_sum = self.reduce_rows(scores, self.fill_row(self.zero), lambda s, acc, me: b.value(
            f"arith.addf {acc}, " + b.value("math.exp " + b.value(f"arith.subf {s}, {me} : f32") + " : f32")
            + " : f32"), extra=m_safe)
        if sink is not None:
            l_sum = self.rowwise([l_sum, sink, m_safe], lambda le, ke, me: b.value(
                f"arith.addf {le}, " + b.value("math.exp " + b.value(f"arith.subf {ke}, {me} : f32") + " : f32")
                + " : f32"))
        b.comment("acc = exp(s - m) @ v over the keys")
        acc = self.pv(self.exp_scores(scores, m_safe, n), "%v", self.zero_acc())
        return self.finish(acc, m, l_sum)

    def tiled(self, kv_tile: int) -> tuple[str, str]:
        """Keys in tiles of ``kv_tile``: an online softmax carried in ``scf.for`` iter_args ``(m, l, acc)``."""
        b, d = self.b, self.spec.head_dim
        sink = self.sinks()
        # With a sink, m starts at the sink's logit and l at exp(sink - m) = 1; without, at -inf and 0.
        m0 = sink or self.fill_row(self.ninf)
        l0 = self.fill_row(self.one if sink else self.zero)
        acc0 = self.zero_acc()
        step = b.value(f"arith.constant {kv_tile} : index", "c")
        state = b.fresh("state")
        b.comment(f"online softmax over kv tiles of {kv_tile} keys (the last one may be shorter)")
        b.line(f"{state}:3 = scf.for %j0 = {self.c0} to {self.dims['S']} step {step} iter_args(%m_run = {m0}, "
               f"%l_run = {l0}, %acc_run = {acc0}) -> ({_ROW}, {_ROW}, {self.q_t}) {{")
        with b.region():
            n = b.value(f"arith.minsi {step}, " + b.value(f"arith.subi {self.dims['S']}, %j0 : index") + " : index",
                        "n")
            sl = (f"[0, %j0, 0, 0] [{self.dims['B']}, {n}, {self.dims['H']}, {d}] [1, 1, 1, 1] : {self.kv_t} to "
                  f"{self.kv_t}")
            keys = b.value(f"tensor.extract_slice %k{sl}", "kt")
            values = b.value(f"tensor.extract_slice %v{sl}", "vt")
            start = b.value("arith.index_cast %j0 : index to i32", "j0")
            scores = self.scores(keys, n, start)
            tile_max = self.reduce_rows(scores, self.fill_row(self.ninf),
                                        lambda s, acc: b.value(f"arith.maximumf {acc}, {s} : f32"))
            m_new = self.rowwise(["%m_run", tile_max], lambda a, c: b.value(f"arith.maximumf {a}, {c} : f32"))
            m_safe = self.safe_max(m_new)
            alpha = self.rowwise(["%m_run", m_safe], lambda a, c: b.value(
                "math.exp " + b.value(f"arith.subf {a}, {c} : f32") + " : f32"))
            p = self.exp_scores(scores, m_safe, n)
            tile_sum = self.reduce_rows(p, self.fill_row(self.zero),
                                        lambda s, acc: b.value(f"arith.addf {acc}, {s} : f32"))
            l_new = self.rowwise(["%l_run", alpha, tile_sum], lambda le, al, ts: b.value(
                "arith.addf " + b.value(f"arith.mulf {le}, {al} : f32") + f", {ts} : f32"))
            b.comment("acc = acc * alpha + p @ v")
            rescaled = _generic(b, f"{_O5}, {_OR5}, {_O5}", _PAR5, f"%acc_run, {alpha} : {self.q_t}, {_ROW}",
                                b.value(f"tensor.empty({self.row_dims}) : {self.q_t}") + f" : {self.q_t}", self.q_t,
                                "%oe: f32, %ae: f32, %unused: f32", lambda: b.value("arith.mulf %oe, %ae : f32"))
            acc_new = self.pv(p, values, rescaled)
            b.line(f"scf.yield {m_new}, {l_new}, {acc_new} : {_ROW}, {_ROW}, {self.q_t}")
        b.line("}")
        return self.finish(f"{state}#2", f"{state}#0", f"{state}#1")


def _inverse(b: TextBuilder, value: str, zero: str, one: str) -> str:
    """``1 / value``, or 0 when ``value`` is 0 (a row that kept nothing: its sum of weights is 0, and so is acc)."""
    live = b.value(f"arith.cmpf ogt, {value}, {zero} : f32")
    inv = b.value(f"arith.divf {one}, " + b.value(f"arith.select {live}, {value}, {one} : f32") + " : f32")
    return b.value(f"arith.select {live}, {inv}, {zero} : f32")


def _generic(b: TextBuilder, maps: str, iterators: str, ins: str | None, outs: str, result: str, args: str,
             body) -> str:
    """Emit one ``linalg.generic``; ``body()`` emits the region's ops and returns the value it yields."""
    name = b.fresh("g")
    ins_text = f" ins({ins})" if ins else ""
    b.line(f"{name} = linalg.generic {{indexing_maps = [{maps}], iterator_types = {iterators}}}{ins_text} "
           f"outs({outs}) {{")
    b.line(f"^bb0({args}):")
    with b.region():
        yielded = body()
        b.line(f"linalg.yield {yielded} : f32")
    b.line(f"}} -> {result}")
    return name
