"""Lowering of one attention spec to a FlashAttention-style kernel in MLIR's upstream dialects, for IREE.

The kernel is one ``flow.dispatch.workgroups`` region: each workgroup takes one *work item* (``ITEM_FIELDS``) from the
host-built plan: ``rows`` query rows (``(token, head)`` pairs of one kv head's GQA group, so the group's heads
share every key and value read; :data:`ROWS` by default) and a list of kv tiles of ``kv_tile`` keys (a multiple of
:data:`~tessera.mlir.trace.LANES`; :data:`KV_TILE` by default). Only the tiles the plan keeps are visited (block
sparsity); scores never leave registers: per 16 keys of a tile, ``scf.for`` over the head dim builds the
``rows x 16`` scores with ``vector.fma``, the mask and score function run on those vectors, the online softmax
rescales the running ``(max, sum, acc)`` held in ``scf.for`` iter_args once per tile, and ``P @ V`` accumulates into
the ``rows x head_dim`` accumulator. ``rows`` and ``kv_tile`` are the ``mlir_attention_rows`` and
``mlir_attention_kv_tile`` tunables (:mod:`tessera.backends.mlir.tunables`); the plan and the kernel must agree on
them, so the planner records them and the backend lowers the kernel the plan names.

Layouts (the host packs them, see :mod:`tessera.backends.mlir.backend`):

- ``q``  ``[T, Hq, D]`` float32, token-major as the API holds it;
- ``kt`` ``[Hkv, rows / 16, D, 16]`` float32: keys *head-major, tile by tile, transposed*, so a tile's 16 keys for
  one ``d`` are one contiguous vector (the score loop needs no horizontal reductions) and a tile is one contiguous
  block (decode streams it in order). Every sequence starts at a multiple of 16 rows;
- ``v``  ``[rows, Hkv, D]`` float32, token-major: one key's value row is ``D / 16`` contiguous vectors.

``D`` is the head dim rounded up to a multiple of 16 (the host zero-pads). Everything else (tokens, heads, rows,
items, tiles, the GQA group size and the softmax scale) is a runtime value, so one compiled module serves every
length, batch and head count of a ``(mask structure, score structure, D)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tessera.attention.spec import AttentionSpec
from tessera.mlir.text import TextBuilder
from tessera.mlir.trace import FLOAT, INT, LANES, AuxValues, Scope, Sym, mask_value, score_value, vtype

#: default query rows per work item: 4 rows x (D / 16) accumulators stay in the 32 vector registers up to D = 128
ROWS = 4
#: default keys per kv tile (one vector); a bigger tile rescales the online softmax less often but visits more
#: masked keys at a mask's edge
KV_TILE = 16
#: the ``rows`` and ``kv_tile`` values a kernel can be lowered with (more rows would spill every accumulator)
ROW_CHOICES = (1, 2, 4, 8)
KV_TILE_CHOICES = (16, 32, 64)
#: fields of a work item (int32): which sequence, which rows, where its keys live, which tiles it visits
ITEM_FIELDS = ("seq", "row0", "num_rows", "q_row0", "q_pos0", "kv_row0", "kv_len", "kv_head", "tile_off",
               "tile_count")
F = {name: i for i, name in enumerate(ITEM_FIELDS)}
#: aux header slots every kernel reads before the spec's own values
AUX_GROUP, AUX_SCALE = 0, 0
_DT = "!iree_tensor_ext.dispatch.tensor"
_F32V = f"vector<{LANES}xf32>"


#: the key/value layouts a kernel can read (see the module docstring)
KEY_LAYOUTS = ("tiles", "tokens")
#: storage dtypes the "tokens" layout reads in place, by MLIR element type
KV_ELEMENTS = ("f32", "bf16", "f16")


@dataclass(frozen=True)
class AttentionKernel:
    """One lowered spec: the module text, the function to call, and the runtime values the spec holds."""

    text: str
    entry: str
    head_dim_padded: int
    aux_i: np.ndarray
    aux_f: np.ndarray
    key_layout: str
    kv_element: str
    rows: int = ROWS
    kv_tile: int = KV_TILE


def padded_head_dim(head_dim: int) -> int:
    """``head_dim`` rounded up to a whole number of vectors."""
    return -(-head_dim // LANES) * LANES


def lower_attention(spec: AttentionSpec, key_layout: str = "tiles", kv_element: str = "f32",
                    entry: str = "attention", rows: int = ROWS, kv_tile: int = KV_TILE) -> AttentionKernel:
    """The kernel of ``spec`` reading keys and values in ``key_layout`` (raises
    :class:`~tessera.mlir.trace.UntranslatableError` when its mask or score cannot be translated).

    ``kv_element`` is the element type of the "tokens" layout's keys and values (read in place and widened in
    registers); the "tiles" layout is always float32 (the host packs it). ``rows`` is the query rows per work item
    (:data:`ROW_CHOICES`) and ``kv_tile`` the keys per kv tile (:data:`KV_TILE_CHOICES`); the plan that feeds the
    kernel must be built with the same values.

    This is the llvm-cpu kernel. GPU targets compile the linalg form of the same spec
    (:func:`tessera.mlir.attention_linalg.lower_attention_linalg`); :mod:`tessera.backends.mlir.targets` picks per
    target.
    """
    if rows not in ROW_CHOICES:
        raise ValueError(f"rows must be one of {ROW_CHOICES} (query rows per work item), got {rows!r}")
    if kv_tile not in KV_TILE_CHOICES:
        raise ValueError(f"kv_tile must be one of {KV_TILE_CHOICES} (keys per kv tile), got {kv_tile!r}")
    if key_layout not in KEY_LAYOUTS:
        raise ValueError(f"key_layout must be one of {KEY_LAYOUTS}, got {key_layout!r}")
    if kv_element not in KV_ELEMENTS or (key_layout == "tiles" and kv_element != "f32"):
        raise ValueError(f"kv_element must be one of {KV_ELEMENTS} (f32 for the tiles layout), got {kv_element!r}")
    d = padded_head_dim(spec.head_dim)
    aux = AuxValues(ints=[spec.group_size], floats=[spec.softmax_scale])
    body = TextBuilder(indent=4)
    layout = _KeyReader(body, key_layout, kv_element, spec.head_dim, d)
    _emit_item(body, spec, aux, d, layout, rows, kv_tile)
    aux_i, aux_f = aux.buffers()
    return AttentionKernel(_module(entry, d, body.text(), layout, rows, kv_tile), entry, d, aux_i, aux_f, key_layout,
                           kv_element, rows, kv_tile)


def _module(entry: str, d: int, body: str, layout: _KeyReader, rows: int, kv_tile: int) -> str:
    q_t, kt_t, v_t = f"tensor<?x?x{d}xf32>", layout.k_type, layout.v_type
    items_t, lse_t = f"tensor<?x{len(ITEM_FIELDS)}xi32>", "tensor<?x?xf32>"
    vec_i, vec_f = "tensor<?xi32>", "tensor<?xf32>"
    ro = lambda t: f"{_DT}<readonly:{t}>"  # noqa: E731
    wo = lambda t: f"{_DT}<writeonly:{t}>"  # noqa: E731
    return f"""// Generated by tessera.mlir.attention_kernel: {rows} query rows per work item,
// kv tiles of {kv_tile} keys; runtime values live in %auxI / %auxF.
func.func @{entry}(%q: {q_t}, %kt: {kt_t}, %v: {v_t}, %items: {items_t}, %tiles: {vec_i}, %kvmap: {vec_i},
    %auxI: {vec_i}, %auxF: {vec_f}) -> ({q_t}, {lse_t}) {{
  %c0 = arith.constant 0 : index
  %c1 = arith.constant 1 : index
  %c2 = arith.constant 2 : index
  %T = tensor.dim %q, %c0 : {q_t}
  %Hq = tensor.dim %q, %c1 : {q_t}
  %Hkv = tensor.dim %kt, %c0 : {kt_t}
  %B = tensor.dim %kt, %c1 : {kt_t}
  %R = tensor.dim %v, %c0 : {v_t}
  %N = tensor.dim %items, %c0 : {items_t}
  %NT = tensor.dim %tiles, %c0 : {vec_i}
  %NM = tensor.dim %kvmap, %c0 : {vec_i}
  %NI = tensor.dim %auxI, %c0 : {vec_i}
  %NF = tensor.dim %auxF, %c0 : {vec_f}
  %out, %lse = flow.dispatch.workgroups[%N](%q, %kt, %v, %items, %tiles, %kvmap, %auxI, %auxF, %T, %Hq, %Hkv, %B,
      %R, %N, %NT, %NM, %NI, %NF) : ({q_t}{{%T, %Hq}}, {kt_t}{{{layout.k_dims}}}, {v_t}{{%R, %Hkv}}, {items_t}{{%N}},
      {vec_i}{{%NT}}, {vec_i}{{%NM}}, {vec_i}{{%NI}}, {vec_f}{{%NF}}, index, index, index, index, index, index, index,
      index, index, index)
      -> ({q_t}{{%T, %Hq}}, {lse_t}{{%T, %Hq}}) =
      (%qa: {ro(q_t)}, %kta: {ro(kt_t)}, %va: {ro(v_t)}, %ia: {ro(items_t)}, %ta: {ro(vec_i)}, %ma: {ro(vec_i)},
       %aia: {ro(vec_i)}, %afa: {ro(vec_f)}, %T_: index, %Hq_: index, %Hkv_: index, %B_: index, %R_: index,
       %N_: index, %NT_: index, %NM_: index, %NI_: index, %NF_: index, %oa: {wo(q_t)}, %la: {wo(lse_t)}) {{
    %qT = iree_tensor_ext.dispatch.tensor.load %qa, offsets=[0, 0, 0], sizes=[%T_, %Hq_, {d}], strides=[1, 1, 1]
        : {ro(q_t)}{{%T_, %Hq_}} -> {q_t}
    %ktT = iree_tensor_ext.dispatch.tensor.load %kta, offsets=[{layout.k_zeros}], sizes=[{layout.k_sizes}],
        strides=[{layout.k_ones}] : {ro(kt_t)}{{{layout.k_dims_}}} -> {kt_t}
    %vT = iree_tensor_ext.dispatch.tensor.load %va, offsets=[0, 0, 0], sizes=[%R_, %Hkv_, {layout.v_width}],
        strides=[1, 1, 1] : {ro(v_t)}{{%R_, %Hkv_}} -> {v_t}
    %kvmapT = iree_tensor_ext.dispatch.tensor.load %ma, offsets=[0], sizes=[%NM_], strides=[1]
        : {ro(vec_i)}{{%NM_}} -> {vec_i}
    %itemsT = iree_tensor_ext.dispatch.tensor.load %ia, offsets=[0, 0], sizes=[%N_, {len(ITEM_FIELDS)}], strides=[1, 1]
        : {ro(items_t)}{{%N_}} -> {items_t}
    %tilesT = iree_tensor_ext.dispatch.tensor.load %ta, offsets=[0], sizes=[%NT_], strides=[1]
        : {ro(vec_i)}{{%NT_}} -> {vec_i}
    %auxI = iree_tensor_ext.dispatch.tensor.load %aia, offsets=[0], sizes=[%NI_], strides=[1]
        : {ro(vec_i)}{{%NI_}} -> {vec_i}
    %auxF = iree_tensor_ext.dispatch.tensor.load %afa, offsets=[0], sizes=[%NF_], strides=[1]
        : {ro(vec_f)}{{%NF_}} -> {vec_f}
{body}
    flow.return
  }} count(%x: index) -> (index, index, index) {{
    %one = arith.constant 1 : index
    flow.return %x, %one, %one : index, index, index
  }}
  return %out, %lse : {q_t}, {lse_t}
}}
"""


def _emit_item(b: TextBuilder, spec: AttentionSpec, aux: AuxValues, d: int, keys: _KeyReader, n_rows: int,
               kv_tile: int) -> None:
    """The body of one workgroup: read its item, run the tile loop, write its rows."""
    chunks = d // LANES
    subs = kv_tile // LANES  # vectors of 16 keys per kv tile
    c = {n: b.value(f"arith.constant {n} : index", "c") for n in (0, 1)}
    item = b.value("flow.dispatch.workgroup.id[0] : index", "item")
    field = {}
    for name, pos in F.items():
        at = b.value(f"arith.constant {pos} : index", "c")
        raw = b.value(f"tensor.extract %itemsT[{item}, {at}] : tensor<?x{len(ITEM_FIELDS)}xi32>", name)
        field[name] = (raw, b.value(f"arith.index_cast {raw} : i32 to index", name))
    group_i = b.value(f"tensor.extract %auxI[{c[0]}] : tensor<?xi32>", "group")
    group = b.value(f"arith.index_cast {group_i} : i32 to index", "group")
    scale = b.value(f"tensor.extract %auxF[{c[0]}] : tensor<?xf32>", "scale")
    scope = Scope(b, aux)
    b.comment(f"the {n_rows} query rows of this item: row r is (token, head) = divmod(row0 + r, group)")
    rows = []
    last = b.value(f"arith.subi {field['num_rows'][1]}, {c[1]} : index")
    head0 = b.value(f"arith.muli {field['kv_head'][1]}, {group} : index")
    for r in range(n_rows):
        rc = b.value(f"arith.constant {r} : index", "c")
        clamped = b.value(f"arith.minsi {rc}, {last} : index")  # rows past num_rows repeat the last; never written
        rho = b.value(f"arith.addi {field['row0'][1]}, {clamped} : index")
        tok = b.value(f"arith.divui {rho}, {group} : index", "tok")
        head = b.value(f"arith.addi {head0}, " + b.value(f"arith.remui {rho}, {group} : index") + " : index", "head")
        q_row = b.value(f"arith.addi {field['q_row0'][1]}, {tok} : index", "qrow")
        q_pos = b.value(f"arith.addi {field['q_pos0'][1]}, {tok} : index", "qpos")
        rows.append({"r": rc, "head": head, "q_row": q_row, "q_pos": q_pos})
    neg_inf = b.value("arith.constant 0xFF800000 : f32", "ninf")
    zero_f = b.value("arith.constant 0.0 : f32", "zero")
    zero_v = b.value(f"arith.constant dense<0.0> : {_F32V}", "zv")
    ninf_v = b.value(f"arith.constant dense<0xFF800000> : {_F32V}", "ninfv")
    iota = b.value(f"arith.constant dense<[{', '.join(map(str, range(LANES)))}]> : {vtype(INT)}", "iota")
    scale_v = b.value(f"vector.broadcast {scale} : f32 to {_F32V}", "scalev")
    kv_len_v = b.value(f"vector.broadcast {field['kv_len'][0]} : i32 to {vtype(INT)}", "kvlenv")
    seq_v = Sym(b.value(f"vector.broadcast {field['seq'][0]} : i32 to {vtype(INT)}", "b"), INT, scope)
    d_end = b.value(f"arith.constant {d} : index", "c")
    keys.begin_item(field, c, rows)

    # Loop-carried state: the running max m, sum l and accumulator rows of every query row.
    carried = ([(f"%m{r}", neg_inf, "f32") for r in range(n_rows)]
               + [(f"%l{r}", zero_f, "f32") for r in range(n_rows)]
               + [(f"%a{r}_{j}", zero_v, _F32V) for r in range(n_rows) for j in range(chunks)])
    state = b.fresh("state")
    b.comment(f"online softmax over the kv tiles ({kv_tile} keys each) the plan keeps for this item")
    b.line(f"{state}:{len(carried)} = scf.for %t = {c[0]} to {field['tile_count'][1]} step {c[1]} iter_args("
           + ", ".join(f"{n} = {init}" for n, init, _ in carried) + ") -> (" + ", ".join(t for *_, t in carried)
           + ") {")
    with b.region():
        at = b.value(f"arith.addi {field['tile_off'][1]}, %t : index")
        tile_i = b.value(f"tensor.extract %tilesT[{at}] : tensor<?xi32>", "j")
        # One tile is `subs` vectors of 16 keys: sub-tile u starts at key j_u = j + 16 u.
        starts = []
        for u in range(subs):
            j_i = tile_i if u == 0 else b.value(f"arith.addi {tile_i}, "
                                                + b.value(f"arith.constant {u * LANES} : i32", "c") + " : i32", "j")
            starts.append((j_i, b.value(f"arith.index_cast {j_i} : i32 to index", "j")))
        acc = [keys.scores(j, rows, zero_v, d_end) for _, j in starts]  # [u][r]
        kv_pos, in_range = [], []
        for j_i, _ in starts:
            j_v = b.value(f"vector.broadcast {j_i} : i32 to {vtype(INT)}")
            pos = Sym(b.value(f"arith.addi {j_v}, {iota} : {vtype(INT)}", "kvpos"), INT, scope)
            kv_pos.append(pos)
            in_range.append(b.value(f"arith.cmpi slt, {pos.name}, {kv_len_v} : {vtype(INT)}", "inrange"))
        new_m, new_l, scaled_acc, probs = [], [], [], []
        traced = False
        for r, row in enumerate(rows):
            b.comment(f"row {r}: score function, mask, online softmax")
            if spec.score is not None or spec.mask is not None:
                h_v = Sym(b.value("vector.broadcast " + b.value(f"arith.index_cast {row['head']} : index to i32")
                                  + f" : i32 to {vtype(INT)}", "h"), INT, scope)
                q_pos_v = Sym(b.value("vector.broadcast " + b.value(f"arith.index_cast {row['q_pos']} : index to i32")
                                      + f" : i32 to {vtype(INT)}", "qposv"), INT, scope)
            masked = []
            for u in range(subs):
                s = Sym(b.value(f"arith.mulf {acc[u][r]}, {scale_v} : {_F32V}", "sc"), FLOAT, scope)
                keep = in_range[u]
                if spec.score is not None or spec.mask is not None:
                    if traced:
                        aux.replay()  # every trace reads the values the first one stored
                    traced = True
                    if spec.score is not None:
                        s = score_value(spec.score, s, seq_v, h_v, q_pos_v, kv_pos[u])
                    if spec.mask is not None:
                        allowed = mask_value(spec.mask, seq_v, h_v, q_pos_v, kv_pos[u])
                        keep = b.value(f"arith.andi {keep}, {allowed.name} : {vtype('bool')}", "keep")
                masked.append(b.value(f"arith.select {keep}, {s.name}, {ninf_v} : {vtype('bool')}, {_F32V}", "sm"))
            tile_max = b.value(f"vector.reduction <maximumf>, {masked[0]} : {_F32V} into f32", "tmax")
            for u in range(1, subs):
                tile_max = b.value(f"arith.maximumf {tile_max}, "
                                   + b.value(f"vector.reduction <maximumf>, {masked[u]} : {_F32V} into f32", "tmax")
                                   + " : f32", "tmax")
            m_new = b.value(f"arith.maximumf %m{r}, {tile_max} : f32", "mnew")
            # A row with nothing kept so far has m = -inf: subtract 0 instead, so exp gives 0, never NaN.
            dead = b.value(f"arith.cmpf oeq, {m_new}, {neg_inf} : f32")
            m_safe = b.value(f"arith.select {dead}, {zero_f}, {m_new} : f32", "msafe")
            alpha = b.value("math.exp " + b.value(f"arith.subf %m{r}, {m_safe} : f32") + " : f32", "alpha")
            m_safe_v = b.value(f"vector.broadcast {m_safe} : f32 to {_F32V}")
            p = [b.value("math.exp " + b.value(f"arith.subf {masked[u]}, {m_safe_v} : {_F32V}") + f" : {_F32V}", "p")
                 for u in range(subs)]
            tile_sum = b.value(f"vector.reduction <add>, {p[0]} : {_F32V} into f32", "tsum")
            for u in range(1, subs):
                tile_sum = b.value(f"arith.addf {tile_sum}, "
                                   + b.value(f"vector.reduction <add>, {p[u]} : {_F32V} into f32", "tsum")
                                   + " : f32", "tsum")
            l_new = b.value("arith.addf " + b.value(f"arith.mulf %l{r}, {alpha} : f32") + f", {tile_sum} : f32", "lnew")
            alpha_v = b.value(f"vector.broadcast {alpha} : f32 to {_F32V}", "alphav")
            new_m.append(m_new)
            new_l.append(l_new)
            probs.append(p)
            scaled_acc.append([b.value(f"arith.mulf %a{r}_{jj}, {alpha_v} : {_F32V}", "as") for jj in range(chunks)])
        flat = [a for row_acc in scaled_acc for a in row_acc]
        for u, (_, j) in enumerate(starts):
            b.comment(f"acc += P @ V over keys {u * LANES}..{u * LANES + LANES - 1} of the tile: each key's value row "
                      f"({chunks} vectors) times every row's probability")
            pv = b.fresh("pv")
            b.line(f"{pv}:{len(flat)} = scf.for %n = {c[0]} to " + b.value(f"arith.constant {LANES} : index", "c")
                   + f" step {c[1]} iter_args(" + ", ".join(f"%pa{i} = {a}" for i, a in enumerate(flat)) + ") -> ("
                   + ", ".join([_F32V] * len(flat)) + ") {")
            with b.region():
                v_row = keys.value_row(j, "%n")
                weights = [b.value("vector.broadcast " + b.value(f"vector.extract {probs[r][u]}[%n] : f32 from "
                                                                 f"{_F32V}") + f" : f32 to {_F32V}", "pw")
                           for r in range(n_rows)]
                updated = [f"%pa{i}" for i in range(len(flat))]
                for jj in range(chunks):
                    col = b.value(f"arith.constant {jj * LANES} : index", "c")
                    v_vec = keys.read_row("%vT", v_row, col, jj)
                    for r in range(n_rows):
                        i = r * chunks + jj
                        updated[i] = b.value(f"vector.fma {weights[r]}, {v_vec}, {updated[i]} : {_F32V}", "a")
                b.line(f"scf.yield {', '.join(updated)} : {', '.join([_F32V] * len(flat))}")
            b.line("}")
            flat = [f"{pv}#{i}" for i in range(len(flat))]
        b.line("scf.yield " + ", ".join(new_m + new_l + flat) + " : " + ", ".join(t for *_, t in carried))
    b.line("}")

    b.comment("write the item's rows: out = acc / l, lse = m + log(l); a row that kept no key is 0 and -inf")
    one_f = b.value("arith.constant 1.0 : f32", "one")
    for r, row in enumerate(rows):
        m, l_sum = f"{state}#{r}", f"{state}#{n_rows + r}"
        live = b.value(f"arith.cmpf ogt, {l_sum}, {zero_f} : f32", "live")
        inv = b.value(f"arith.divf {one_f}, " + b.value(f"arith.select {live}, {l_sum}, {one_f} : f32") + " : f32")
        inv_v = b.value(f"vector.broadcast {inv} : f32 to {_F32V}")
        lse = b.value(f"arith.select {live}, " + b.value(f"arith.addf {m}, " + b.value(f"math.log {l_sum} : f32")
                                                         + " : f32") + f", {neg_inf} : f32", "lse")
        written = b.value(f"arith.cmpi ult, {row['r']}, {field['num_rows'][1]} : index")
        b.line(f"scf.if {written} {{")
        with b.region():
            tile = b.value(f"tensor.empty() : tensor<1x1x{d}xf32>", "orow")
            for jj in range(chunks):
                val = b.value(f"arith.mulf {state}#{2 * n_rows + r * chunks + jj}, {inv_v} : {_F32V}", "o")
                col = b.value(f"arith.constant {jj * LANES} : index", "c")
                tile = b.value(f"vector.transfer_write {val}, {tile}[{c[0]}, {c[0]}, {col}] {{in_bounds = [true]}} "
                               f": {_F32V}, tensor<1x1x{d}xf32>", "orow")
            b.line(f"iree_tensor_ext.dispatch.tensor.store {tile}, %oa, offsets=[{row['q_row']}, {row['head']}, 0], "
                   f"sizes=[1, 1, {d}], strides=[1, 1, 1] : tensor<1x1x{d}xf32> -> "
                   f"{_DT}<writeonly:tensor<?x?x{d}xf32>>{{%T_, %Hq_}}")
            lse_t = b.value(f"tensor.from_elements {lse} : tensor<1x1xf32>")
            b.line(f"iree_tensor_ext.dispatch.tensor.store {lse_t}, %la, offsets=[{row['q_row']}, {row['head']}], "
                   f"sizes=[1, 1], strides=[1, 1] : tensor<1x1xf32> -> {_DT}<writeonly:tensor<?x?xf32>>{{%T_, %Hq_}}")
        b.line("}")


class _KeyReader:
    """How the kernel finds and reads keys and values: the part of the lowering that depends on their layout.

    ``tiles``: ``kt [Hkv, rows/16, D, 16]`` float32 packed by the host, and ``v [rows, Hkv, D]``; a sequence's keys
    start at packed row ``kv_row0`` (a multiple of 16). Scores are outer products: one key vector per ``d`` times a
    broadcast query element, no horizontal sums; best when many query rows share each tile (prefill).

    ``tokens``: ``k`` and ``v`` are the caller's token rows ``[rows, Hkv, D]`` in their storage type, read in place:
    key ``j`` of sequence ``s`` is row ``kvmap[2 + s * kvmap[1] + j // kvmap[0]] + j % kvmap[0]`` (the page table,
    with the page size in ``kvmap[0]``). Scores are dot products (a horizontal sum per key and row), so this layout
    suits few query rows per key (decode, verification), where not packing the cache is what matters.
    """

    def __init__(self, b: TextBuilder, layout: str, element: str, head_dim: int, d: int) -> None:
        self.b, self.layout, self.element, self.head_dim, self.d = b, layout, element, head_dim, d
        self.chunks = d // LANES
        if layout == "tiles":
            self.k_type, self.v_type = f"tensor<?x?x{d}x{LANES}xf32>", f"tensor<?x?x{d}xf32>"
            self.k_dims, self.k_dims_ = "%Hkv, %B", "%Hkv_, %B_"
            self.k_zeros, self.k_ones, self.k_sizes = "0, 0, 0, 0", "1, 1, 1, 1", f"%Hkv_, %B_, {d}, {LANES}"
            self.v_width = d
        else:
            self.k_type = self.v_type = f"tensor<?x?x{head_dim}x{element}>"
            self.k_dims, self.k_dims_ = "%R, %Hkv", "%R_, %Hkv_"
            self.k_zeros, self.k_ones, self.k_sizes = "0, 0, 0", "1, 1, 1", f"%R_, %Hkv_, {head_dim}"
            self.v_width = head_dim

    def begin_item(self, field: dict, c: dict, rows: list[dict]) -> None:
        """Item-invariant values, emitted before the tile loop."""
        b = self.b
        self.c, self.kv_head = c, field["kv_head"][1]
        self.key_rows: dict[str, str] = {}  # packed row of each sub-tile's first key, by its key index value
        if self.layout == "tiles":
            self.kv_row0 = field["kv_row0"][1]
            self.lanes = b.value(f"arith.constant {LANES} : index", "c")
            return
        self.last_key = b.value(f"arith.subi {field['kv_len'][1]}, {c[1]} : index", "lastkey")
        block = b.value(f"tensor.extract %kvmapT[{c[0]}] : tensor<?xi32>", "block")
        self.block = b.value(f"arith.index_cast {block} : i32 to index", "block")
        per_seq = b.value(f"tensor.extract %kvmapT[{c[1]}] : tensor<?xi32>", "maxblocks")
        per_seq = b.value(f"arith.index_cast {per_seq} : i32 to index", "maxblocks")
        self.table0 = b.value("arith.addi " + b.value(f"arith.muli {field['seq'][1]}, {per_seq} : index")
                              + ", " + b.value("arith.constant 2 : index", "c") + " : index", "table0")
        b.comment("the item's query rows, read once: rows x (D / 16) vectors")
        self.q = [[b.value(f"vector.transfer_read %qT[{row['q_row']}, {row['head']}, "
                           + b.value(f"arith.constant {jj * LANES} : index", "c")
                           + f"], {self._zero('f32')} {{in_bounds = [true]}} : tensor<?x?x{self.d}xf32>, {_F32V}", "qv")
                   for jj in range(self.chunks)] for row in rows]

    def _zero(self, element: str) -> str:
        return self.b.value(f"arith.constant 0.0 : {element}", "zero")

    def _key_row(self, key: str) -> str:
        """The token row of key index ``key`` (clamped to the sequence's last key: lanes past it are masked off)."""
        b = self.b
        key = b.value(f"arith.minsi {key}, {self.last_key} : index")
        page = b.value(f"arith.divui {key}, {self.block} : index")
        base = b.value("tensor.extract %kvmapT[" + b.value(f"arith.addi {self.table0}, {page} : index")
                       + "] : tensor<?xi32>")
        return b.value("arith.addi " + b.value(f"arith.index_cast {base} : i32 to index") + ", "
                       + b.value(f"arith.remui {key}, {self.block} : index") + " : index", "row")

    def scores(self, j: str, rows: list[dict], zero_v: str, d_end: str) -> list[str]:
        """The score vectors (16 keys each, unscaled) of every row for the 16 keys from key index ``j``."""
        b, c = self.b, self.c
        n = len(rows)
        acc = b.fresh("s")
        if self.layout == "tiles":
            key_row = self.key_rows[j] = b.value(f"arith.addi {self.kv_row0}, {j} : index", "krow")
            key_tile = b.value(f"arith.divui {key_row}, {self.lanes} : index", "ktile")
            b.comment(f"scores of the tile: {n} rows x {LANES} keys, outer products over the head dim")
            b.line(f"{acc}:{n} = scf.for %d = {c[0]} to {d_end} step {c[1]} iter_args("
                   + ", ".join(f"%s{r} = {zero_v}" for r in range(n)) + ") -> (" + ", ".join([_F32V] * n)
                   + ") {")
            with b.region():
                k_vec = b.value(f"vector.transfer_read %ktT[{self.kv_head}, {key_tile}, %d, {c[0]}], "
                                f"{self._zero('f32')} {{in_bounds = [true]}} : {self.k_type}, {_F32V}", "k")
                sums = []
                for r, row in enumerate(rows):
                    q_s = b.value(f"tensor.extract %qT[{row['q_row']}, {row['head']}, %d] : "
                                  f"tensor<?x?x{self.d}xf32>", "q")
                    q_v = b.value(f"vector.broadcast {q_s} : f32 to {_F32V}", "qv")
                    sums.append(b.value(f"vector.fma {q_v}, {k_vec}, %s{r} : {_F32V}", "s"))
                b.line(f"scf.yield {', '.join(sums)} : {', '.join([_F32V] * n)}")
            b.line("}")
            return [f"{acc}#{r}" for r in range(n)]
        b.comment(f"scores of the tile: {n} rows x {LANES} keys, one dot product per key and row")
        b.line(f"{acc}:{n} = scf.for %kn = {c[0]} to " + b.value(f"arith.constant {LANES} : index", "c")
               + f" step {c[1]} iter_args(" + ", ".join(f"%s{r} = {zero_v}" for r in range(n)) + ") -> ("
               + ", ".join([_F32V] * n) + ") {")
        with b.region():
            row = self._key_row(b.value(f"arith.addi {j}, %kn : index", "key"))
            k = [self.read_row("%ktT", row, b.value(f"arith.constant {jj * LANES} : index", "c"), jj)
                 for jj in range(self.chunks)]
            updated = []
            for r in range(n):
                dot = b.value(f"arith.mulf {self.q[r][0]}, {k[0]} : {_F32V}", "dot")
                for jj in range(1, self.chunks):
                    dot = b.value(f"vector.fma {self.q[r][jj]}, {k[jj]}, {dot} : {_F32V}", "dot")
                total = b.value(f"vector.reduction <add>, {dot} : {_F32V} into f32", "dot")
                updated.append(b.value(f"vector.insert {total}, %s{r} [%kn] : f32 into {_F32V}", "s"))
            b.line(f"scf.yield {', '.join(updated)} : {', '.join([_F32V] * n)}")
        b.line("}")
        return [f"{acc}#{r}" for r in range(n)]

    def value_row(self, j: str, n: str) -> str:
        """The row of ``v`` holding key ``j + n`` (inside the tile loop, after :meth:`scores`)."""
        if self.layout == "tiles":
            return self.b.value(f"arith.addi {self.key_rows[j]}, {n} : index")
        return self._key_row(self.b.value(f"arith.addi {j}, {n} : index", "key"))

    def read_row(self, tensor: str, row: str, col: str, chunk: int) -> str:
        """16 float32 elements ``tensor[row, kv_head, col : col + 16]`` (widened; zeros past the head dim)."""
        b = self.b
        element = "f32" if self.layout == "tiles" else self.element
        ragged = self.layout == "tokens" and (chunk + 1) * LANES > self.head_dim
        value = b.value(f"vector.transfer_read {tensor}[{row}, {self.kv_head}, {col}], {self._zero(element)} "
                        f"{{in_bounds = [{'false' if ragged else 'true'}]}} : "
                        f"{self.v_type if tensor == '%vT' else self.k_type}, vector<{LANES}x{element}>", "kv")
        if element != "f32":
            value = b.value(f"arith.extf {value} : vector<{LANES}x{element}> to {_F32V}", "kv")
        return value
