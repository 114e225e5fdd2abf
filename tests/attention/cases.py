"""Shared test material: backend parameters, seeded random inputs, oracle runs, and the catalogue of variants.

A *variant* builds an :class:`AttentionSpec` for a :class:`Layout` (heads, head_dim and the batch's lengths, which
document masks need) from a seeded generator, so every test draws fresh random inputs, masks and sinks.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

from tessera.attention import (
    AttentionSpec,
    alibi,
    alibi_slopes,
    attention,
    causal,
    chunked,
    custom,
    custom_mask,
    custom_score,
    document,
    prefix_lm,
    sliding_window,
    softcap,
    varlen_attention,
)
from tessera.backends import RaggedBatch, registered
from tessera.backends.reference import varlen_attention_f64

from tests.attention.tolerances import assert_matches_oracle

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_PARAMS = [pytest.param(d, id=str(d).removeprefix("torch.")) for d in DTYPES]


def backend_params(include_reference: bool = True) -> list:
    """One pytest param per registered backend; those unusable on this machine are skipped with their reasons."""
    params = []
    for name, backend in sorted(registered().items()):
        if name == "reference" and not include_reference:
            continue
        reasons = backend.available()
        marks = [pytest.mark.skip(reason=f"{name} unavailable: " + "; ".join(reasons))] if reasons else []
        params.append(pytest.param(name, id=name, marks=marks))
    return params


def seed_of(text: str) -> int:
    """A stable per-test seed (same on every xdist worker and every run)."""
    return zlib.crc32(text.encode())


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Standard normal values drawn in float32, stored in ``dtype``."""
    return torch.randn(*shape, generator=gen).to(dtype)


@dataclass(frozen=True)
class Layout:
    """Shapes of one test batch. Dense batches have equal lengths; ``batch`` is the number of sequences."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    dense: bool

    @property
    def batch(self) -> int:
        return len(self.q_lens)

    @property
    def max_kv(self) -> int:
        return max(self.kv_lens, default=0)

    def __str__(self) -> str:
        kind = "dense" if self.dense else "varlen"
        return (f"{kind} Hq={self.num_q_heads} Hkv={self.num_kv_heads} D={self.head_dim} "
                f"q_lens={list(self.q_lens)} kv_lens={list(self.kv_lens)}")


def dense_layout(batch: int, sq: int, skv: int, hq: int, hkv: int, d: int) -> Layout:
    return Layout(hq, hkv, d, (sq,) * batch, (skv,) * batch, dense=True)


def varlen_layout(q_lens, kv_lens, hq: int, hkv: int, d: int) -> Layout:
    return Layout(hq, hkv, d, tuple(q_lens), tuple(kv_lens), dense=False)


def make_inputs(layout: Layout, dtype: torch.dtype, gen: torch.Generator):
    """Random q, k, v in the layout's shape: ``[B, S, H, D]`` when dense, ``[tokens, H, D]`` when varlen."""
    hq, hkv, d = layout.num_q_heads, layout.num_kv_heads, layout.head_dim
    if layout.dense:
        q_rows, kv_rows = (layout.batch, layout.q_lens[0]), (layout.batch, layout.kv_lens[0])
    else:
        q_rows, kv_rows = (sum(layout.q_lens),), (sum(layout.kv_lens),)
    return (randn(gen, *q_rows, hq, d, dtype=dtype), randn(gen, *kv_rows, hkv, d, dtype=dtype),
            randn(gen, *kv_rows, hkv, d, dtype=dtype))


def oracle(q, k, v, layout: Layout, spec: AttentionSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 oracle on the same inputs upcast to float64, shaped like the API's results."""
    batch = RaggedBatch(layout.q_lens, layout.kv_lens)
    if layout.dense:
        flat = lambda t: t.reshape(-1, *t.shape[2:]).double()  # noqa: E731
        out, lse = varlen_attention_f64(flat(q), flat(k), flat(v), batch, spec)
        b, sq = q.shape[0], q.shape[1]
        return out.reshape(b, sq, *out.shape[1:]), lse.reshape(b, sq, lse.shape[-1])
    return varlen_attention_f64(q.double(), k.double(), v.double(), batch, spec)


def run_api(q, k, v, layout: Layout, spec: AttentionSpec, backend: str):
    """``(out, lse)`` from the public API in the layout's form."""
    if layout.dense:
        return attention(q, k, v, spec, backend=backend, return_lse=True)
    return varlen_attention(q, k, v, list(layout.q_lens), list(layout.kv_lens), spec, backend=backend, return_lse=True)


def check_against_oracle(backend: str, layout: Layout, spec: AttentionSpec, dtype: torch.dtype,
                         gen: torch.Generator, context: str = "") -> None:
    """Draw inputs, run ``backend`` through the API and assert it matches the float64 oracle."""
    q, k, v = make_inputs(layout, dtype, gen)
    out, lse = run_api(q, k, v, layout, spec, backend)
    ref_out, ref_lse = oracle(q, k, v, layout, spec)
    assert_matches_oracle(out, lse, ref_out, ref_lse, dtype, f"{backend} {spec!r} {layout} {context}".strip())


# ---- the catalogue of variants -------------------------------------------------------------------------------

def random_doc_ids(gen: torch.Generator, rows: int | None, length: int, interleaved: bool = False) -> torch.Tensor:
    """Document ids over ``length`` positions: runs of ~8 tokens, or ids drawn independently when interleaved."""
    shape = (length,) if rows is None else (rows, length)
    if interleaved:
        return torch.randint(0, 3, shape, generator=gen)
    starts = torch.rand(shape, generator=gen) < 0.12
    return torch.cumsum(starts.long(), dim=-1)


def _doc_len(layout: Layout) -> int:
    # Dense batches need exactly Skv ids; ragged ones accept more than the longest kv.
    return layout.max_kv if layout.dense else layout.max_kv + 5


def _sinks(layout: Layout, gen: torch.Generator) -> torch.Tensor:
    # Around the size of a typical lse, so sinks change the result noticeably.
    return torch.randn(layout.num_q_heads, generator=gen) * 1.5 + 2.0


def head_dependent(b, h, q_pos, kv_pos):
    """Even heads causal, odd heads a causal window of 8."""
    return (kv_pos <= q_pos) & ((h % 2 == 0) | (kv_pos > q_pos - 8))


def dilated(b, h, q_pos, kv_pos):
    """Every third position back from the query (a dilated causal pattern)."""
    return (kv_pos <= q_pos) & ((q_pos - kv_pos) % 3 == 0)


def batch_dependent(b, h, q_pos, kv_pos):
    """Sequence ``b`` drops kv positions congruent to ``b`` mod 4."""
    return (kv_pos % 4) != (b % 4)


def nothing(b, h, q_pos, kv_pos):
    """Masks everything out."""
    return kv_pos < 0


def first_four(b, h, q_pos, kv_pos):
    return kv_pos < 4


def distance_bias(score, b, h, q_pos, kv_pos):
    """A relative-position bias that differs per head and per sequence."""
    return score - (0.03 * (h + 1) + 0.01 * b) * (q_pos - kv_pos).abs()


def head_temperature(score, b, h, q_pos, kv_pos):
    return score * (0.5 + 0.25 * h)


SpecKwargs = Callable[[Layout, torch.Generator], dict]


@dataclass(frozen=True)
class Variant:
    name: str
    build: SpecKwargs

    def spec(self, layout: Layout, gen: torch.Generator) -> AttentionSpec:
        return AttentionSpec(layout.num_q_heads, layout.num_kv_heads, layout.head_dim, **self.build(layout, gen))


def _v(name: str, build: SpecKwargs) -> Variant:
    return Variant(name, build)


VARIANTS: list[Variant] = [
    _v("full", lambda L, g: {}),
    _v("causal", lambda L, g: {"mask": causal()}),
    _v("window1", lambda L, g: {"mask": sliding_window(1)}),
    _v("window16", lambda L, g: {"mask": sliding_window(16)}),
    _v("window_huge", lambda L, g: {"mask": sliding_window(100_000)}),
    _v("chunked16", lambda L, g: {"mask": chunked(16)}),
    _v("chunked16_causal", lambda L, g: {"mask": chunked(16) & causal()}),
    _v("prefix_lm24", lambda L, g: {"mask": prefix_lm(24)}),
    _v("prefix_lm0", lambda L, g: {"mask": prefix_lm(0)}),
    _v("document1d", lambda L, g: {"mask": document(random_doc_ids(g, None, _doc_len(L)))}),
    _v("document1d_causal", lambda L, g: {"mask": document(random_doc_ids(g, None, _doc_len(L))) & causal()}),
    _v("document2d_causal", lambda L, g: {"mask": document(random_doc_ids(g, L.batch, _doc_len(L))) & causal()}),
    _v("document_interleaved", lambda L, g: {"mask": document(random_doc_ids(g, L.batch, _doc_len(L), True))}),
    _v("custom_head_dependent", lambda L, g: {"mask": custom_mask(head_dependent)}),
    _v("custom_dilated", lambda L, g: {"mask": custom(dilated)}),
    _v("custom_batch_dependent", lambda L, g: {"mask": custom_mask(batch_dependent) & causal()}),
    _v("not_causal", lambda L, g: {"mask": ~causal()}),
    _v("window_and_nothing", lambda L, g: {"mask": sliding_window(8) & custom_mask(nothing)}),
    _v("causal_and_far", lambda L, g: {"mask": causal() & ~sliding_window(8)}),
    _v("streaming", lambda L, g: {"mask": causal() & (sliding_window(8) | custom_mask(first_four))}),
    _v("window_and_chunk", lambda L, g: {"mask": sliding_window(20) & chunked(32)}),
    _v("softcap", lambda L, g: {"score": softcap(5.0), "scale": 1.0}),
    _v("softcap_causal", lambda L, g: {"mask": causal(), "score": softcap(20.0)}),
    _v("alibi_causal", lambda L, g: {"mask": causal(), "score": alibi(alibi_slopes(L.num_q_heads))}),
    _v("alibi_full", lambda L, g: {"score": alibi(alibi_slopes(L.num_q_heads))}),
    _v("custom_score_bias", lambda L, g: {"mask": causal(), "score": custom(distance_bias)}),
    _v("custom_score_temperature", lambda L, g: {"score": custom_score(head_temperature)}),
    _v("sinks", lambda L, g: {"sinks": _sinks(L, g)}),
    _v("sinks_causal", lambda L, g: {"mask": causal(), "sinks": _sinks(L, g)}),
    _v("sinks_window4", lambda L, g: {"mask": sliding_window(4), "sinks": _sinks(L, g)}),
    _v("sinks_not_causal", lambda L, g: {"mask": ~causal(), "sinks": _sinks(L, g)}),
    _v("sinks_nothing", lambda L, g: {"mask": custom_mask(nothing), "sinks": _sinks(L, g)}),
    _v("gpt_oss_like", lambda L, g: {"mask": sliding_window(16), "score": softcap(30.0), "sinks": _sinks(L, g)}),
    _v("peaky_scale", lambda L, g: {"mask": causal(), "scale": 1.0}),
    _v("flat_scale", lambda L, g: {"scale": 1e-3}),
]
VARIANT_PARAMS = [pytest.param(v, id=v.name) for v in VARIANTS]
