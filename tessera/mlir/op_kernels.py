"""The kernel library's ops as linalg modules for IREE: norms, gated activations, matmuls, RoPE, embeddings.

Unlike attention (:mod:`tessera.mlir.attention_kernel`, a hand-scheduled loop), these are written at the linalg level
on tensors with every dimension dynamic, and IREE's own pipeline fuses, tiles and vectorizes them: one module per op
(and variant) serves every shape. They compute in float32; the ``mlir`` backend's op wrappers widen other dtypes on
the host and round results back (``tessera/backends/mlir/ops``).
"""

from __future__ import annotations

import functools

_ID2 = "affine_map<(i, j) -> (i, j)>"
_ROW2 = "affine_map<(i, j) -> (i)>"
_COL2 = "affine_map<(i, j) -> (j)>"


@functools.cache
def rms_norm() -> str:
    """``rms_norm(x [N, H], w [H], eps, offset) -> y [N, H]``: ``x / sqrt(mean(x^2) + eps) * (w + offset)``
    (offset 1 for Gemma's ``1 + w``)."""
    return f"""func.func @rms_norm(%x: tensor<?x?xf32>, %w: tensor<?xf32>, %eps: f32, %offset: f32)
    -> tensor<?x?xf32> {{
  %c0 = arith.constant 0 : index
  %c1 = arith.constant 1 : index
  %zero = arith.constant 0.0 : f32
  %n = tensor.dim %x, %c0 : tensor<?x?xf32>
  %h = tensor.dim %x, %c1 : tensor<?x?xf32>
  %e = tensor.empty(%n) : tensor<?xf32>
  %init = linalg.fill ins(%zero : f32) outs(%e : tensor<?xf32>) -> tensor<?xf32>
  %ss = linalg.generic {{indexing_maps = [{_ID2}, {_ROW2}], iterator_types = ["parallel", "reduction"]}}
      ins(%x : tensor<?x?xf32>) outs(%init : tensor<?xf32>) {{
  ^bb0(%a: f32, %acc: f32):
    %sq = arith.mulf %a, %a : f32
    %sum = arith.addf %acc, %sq : f32
    linalg.yield %sum : f32
  }} -> tensor<?xf32>
  %hi = arith.index_cast %h : index to i64
  %hf = arith.sitofp %hi : i64 to f32
  %o = tensor.empty(%n, %h) : tensor<?x?xf32>
  %y = linalg.generic {{indexing_maps = [{_ID2}, {_ROW2}, {_COL2}, {_ID2}], iterator_types = ["parallel", "parallel"]}}
      ins(%x, %ss, %w : tensor<?x?xf32>, tensor<?xf32>, tensor<?xf32>) outs(%o : tensor<?x?xf32>) {{
  ^bb0(%a: f32, %s: f32, %wv: f32, %unused: f32):
    %mean = arith.divf %s, %hf : f32
    %var = arith.addf %mean, %eps : f32
    %inv = math.rsqrt %var : f32
    %scale = arith.addf %wv, %offset : f32
    %t = arith.mulf %a, %inv : f32
    %r = arith.mulf %t, %scale : f32
    linalg.yield %r : f32
  }} -> tensor<?x?xf32>
  return %y : tensor<?x?xf32>
}}
"""


@functools.cache
def gated_activation(kind: str) -> str:
    """``{kind}_and_mul(gate_up [N, 2I]) -> [N, I]``: ``act(gate) * up`` with gate the first half of each row."""
    if kind == "silu":
        body = """    %neg = arith.negf %g : f32
    %ex = math.exp %neg : f32
    %den = arith.addf %ex, %one : f32
    %act = arith.divf %g, %den : f32"""
    elif kind == "gelu_tanh":
        body = """    %g3 = arith.mulf %g, %g : f32
    %g3b = arith.mulf %g3, %g : f32
    %c044 = arith.constant 0.044715 : f32
    %inner0 = arith.mulf %g3b, %c044 : f32
    %inner1 = arith.addf %g, %inner0 : f32
    %k = arith.constant 0.7978845608028654 : f32
    %inner = arith.mulf %inner1, %k : f32
    %th = math.tanh %inner : f32
    %half = arith.constant 0.5 : f32
    %onep = arith.addf %th, %one : f32
    %hg = arith.mulf %g, %half : f32
    %act = arith.mulf %hg, %onep : f32"""
    elif kind == "gelu":
        body = """    %rs2 = arith.constant 0.7071067811865476 : f32
    %scaled = arith.mulf %g, %rs2 : f32
    %erf = math.erf %scaled : f32
    %half = arith.constant 0.5 : f32
    %onep = arith.addf %erf, %one : f32
    %hg = arith.mulf %g, %half : f32
    %act = arith.mulf %hg, %onep : f32"""
    else:
        raise ValueError(f"gated activation must be 'silu', 'gelu_tanh' or 'gelu', got {kind!r}")
    return f"""func.func @gated(%x: tensor<?x?xf32>) -> tensor<?x?xf32> {{
  %c0 = arith.constant 0 : index
  %c1 = arith.constant 1 : index
  %c2 = arith.constant 2 : index
  %n = tensor.dim %x, %c0 : tensor<?x?xf32>
  %w = tensor.dim %x, %c1 : tensor<?x?xf32>
  %i = arith.divui %w, %c2 : index
  %gate = tensor.extract_slice %x[0, 0] [%n, %i] [1, 1] : tensor<?x?xf32> to tensor<?x?xf32>
  %up = tensor.extract_slice %x[0, %i] [%n, %i] [1, 1] : tensor<?x?xf32> to tensor<?x?xf32>
  %o = tensor.empty(%n, %i) : tensor<?x?xf32>
  %y = linalg.generic {{indexing_maps = [{_ID2}, {_ID2}, {_ID2}], iterator_types = ["parallel", "parallel"]}}
      ins(%gate, %up : tensor<?x?xf32>, tensor<?x?xf32>) outs(%o : tensor<?x?xf32>) {{
  ^bb0(%g: f32, %u: f32, %unused: f32):
    %one = arith.constant 1.0 : f32
{body}
    %r = arith.mulf %act, %u : f32
    linalg.yield %r : f32
  }} -> tensor<?x?xf32>
  return %y : tensor<?x?xf32>
}}
"""


@functools.cache
def matmul(softcap: bool = False) -> str:
    """``x [M, K] @ w [N, K]^T -> [M, N]`` (torch.nn.Linear's weight layout), optionally ``c * tanh(y / c)``."""
    epilogue = ""
    result = "%y"
    if softcap:
        epilogue = f"""
  %o2 = tensor.empty(%m, %n) : tensor<?x?xf32>
  %capped = linalg.generic {{indexing_maps = [{_ID2}, {_ID2}], iterator_types = ["parallel", "parallel"]}}
      ins(%y : tensor<?x?xf32>) outs(%o2 : tensor<?x?xf32>) {{
  ^bb0(%a: f32, %unused: f32):
    %d = arith.divf %a, %cap : f32
    %t = math.tanh %d : f32
    %r = arith.mulf %t, %cap : f32
    linalg.yield %r : f32
  }} -> tensor<?x?xf32>"""
        result = "%capped"
    return f"""func.func @matmul(%x: tensor<?x?xf32>, %w: tensor<?x?xf32>, %cap: f32) -> tensor<?x?xf32> {{
  %c0 = arith.constant 0 : index
  %zero = arith.constant 0.0 : f32
  %m = tensor.dim %x, %c0 : tensor<?x?xf32>
  %n = tensor.dim %w, %c0 : tensor<?x?xf32>
  %e = tensor.empty(%m, %n) : tensor<?x?xf32>
  %init = linalg.fill ins(%zero : f32) outs(%e : tensor<?x?xf32>) -> tensor<?x?xf32>
  %y = linalg.matmul indexing_maps = [affine_map<(i, j, k) -> (i, k)>, affine_map<(i, j, k) -> (j, k)>,
                                      affine_map<(i, j, k) -> (i, j)>]
      ins(%x, %w : tensor<?x?xf32>, tensor<?x?xf32>) outs(%init : tensor<?x?xf32>) -> tensor<?x?xf32>{epilogue}
  return {result} : tensor<?x?xf32>
}}
"""


@functools.cache
def rope(interleaved: bool) -> str:
    """``rope(x [T, H, D], cos [T, R], sin [T, R]) -> [T, H, D]``: rotate the first ``2R`` dims of every head.

    Pairs are ``(d, d + R)`` (GPT-NeoX / Llama layout) or, interleaved, ``(2p, 2p + 1)`` (GPT-J layout); dims past
    ``2R`` pass through.
    """
    if interleaved:
        pick = """    %p = arith.divui %d, %c2 : index
    %odd = arith.remui %d, %c2 : index
    %is_second = arith.cmpi eq, %odd, %c1 : index
    %partner_up = arith.addi %d, %c1 : index
    %partner_down = arith.subi %d, %c1 : index"""
    else:
        pick = """    %is_second = arith.cmpi uge, %d, %r : index
    %p_low = arith.subi %d, %r : index
    %p = arith.select %is_second, %p_low, %d : index
    %partner_up = arith.addi %d, %r : index
    %partner_down = arith.subi %d, %r : index"""
    id3 = "affine_map<(t, h, d) -> (t, h, d)>"
    return f"""func.func @rope(%x: tensor<?x?x?xf32>, %cos: tensor<?x?xf32>, %sin: tensor<?x?xf32>)
    -> tensor<?x?x?xf32> {{
  %c0 = arith.constant 0 : index
  %c1 = arith.constant 1 : index
  %c2 = arith.constant 2 : index
  %nt = tensor.dim %x, %c0 : tensor<?x?x?xf32>
  %nh = tensor.dim %x, %c1 : tensor<?x?x?xf32>
  %nd = tensor.dim %x, %c2 : tensor<?x?x?xf32>
  %r = tensor.dim %cos, %c1 : tensor<?x?xf32>
  %rot = arith.muli %r, %c2 : index
  %o = tensor.empty(%nt, %nh, %nd) : tensor<?x?x?xf32>
  %y = linalg.generic {{indexing_maps = [{id3}, {id3}], iterator_types = ["parallel", "parallel", "parallel"]}}
      ins(%x : tensor<?x?x?xf32>) outs(%o : tensor<?x?x?xf32>) {{
  ^bb0(%a: f32, %unused: f32):
    %t = linalg.index 0 : index
    %h = linalg.index 1 : index
    %d = linalg.index 2 : index
    %rotated = arith.cmpi ult, %d, %rot : index
    %out = scf.if %rotated -> (f32) {{
{pick}
      %partner = arith.select %is_second, %partner_down, %partner_up : index
      %b = tensor.extract %x[%t, %h, %partner] : tensor<?x?x?xf32>
      %cv = tensor.extract %cos[%t, %p] : tensor<?x?xf32>
      %sv = tensor.extract %sin[%t, %p] : tensor<?x?xf32>
      %ac = arith.mulf %a, %cv : f32
      %bs = arith.mulf %b, %sv : f32
      %first = arith.subf %ac, %bs : f32
      %second = arith.addf %ac, %bs : f32
      %v = arith.select %is_second, %second, %first : f32
      scf.yield %v : f32
    }} else {{
      scf.yield %a : f32
    }}
    linalg.yield %out : f32
  }} -> tensor<?x?x?xf32>
  return %y : tensor<?x?x?xf32>
}}
"""


@functools.cache
def embed() -> str:
    """``embed(ids [T] i64, table [V, H], scale) -> [T, H]``: rows of the table, times ``scale``."""
    return f"""func.func @embed(%ids: tensor<?xi64>, %table: tensor<?x?xf32>, %scale: f32) -> tensor<?x?xf32> {{
  %c0 = arith.constant 0 : index
  %c1 = arith.constant 1 : index
  %nt = tensor.dim %ids, %c0 : tensor<?xi64>
  %nh = tensor.dim %table, %c1 : tensor<?x?xf32>
  %o = tensor.empty(%nt, %nh) : tensor<?x?xf32>
  %y = linalg.generic {{indexing_maps = [{_ROW2}, {_ID2}], iterator_types = ["parallel", "parallel"]}}
      ins(%ids : tensor<?xi64>) outs(%o : tensor<?x?xf32>) {{
  ^bb0(%id: i64, %unused: f32):
    %h = linalg.index 1 : index
    %row = arith.index_cast %id : i64 to index
    %v = tensor.extract %table[%row, %h] : tensor<?x?xf32>
    %r = arith.mulf %v, %scale : f32
    linalg.yield %r : f32
  }} -> tensor<?x?xf32>
  return %y : tensor<?x?xf32>
}}
"""
