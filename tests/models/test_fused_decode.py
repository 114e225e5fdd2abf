"""The fused cpu decode layer equals the per-op path: same logits, same KV cache (to float32 rounding), for every
family it takes."""

from __future__ import annotations

import numba
import pytest
import torch
import transformers

import tessera.backends.cpu.ops.fused_decode as fused_decode
from tessera.backends.cpu import decode as cpu_decode
from tessera.backends.cpu import variants
from tessera.backends.cpu.ops.fused_decode import unsupported_reason
import tessera.models.paged as paged
from tessera.models import load_model
from tessera.models.paged import StepBatch, forward_step, new_cache
from tests.models.helpers import save_tiny, step_batch

PAGE = 4
_BASE = dict(vocab_size=211, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
             num_key_value_heads=2, max_position_embeddings=256)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(_BASE)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(_BASE)),  # q/k/v biases
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(_BASE, head_dim=16)),  # q/k norms
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(_BASE, head_dim=16, sliding_window=5,
                                                         query_pre_attn_scalar=24, attn_logit_softcapping=5.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        _BASE, head_dim=16, sliding_window=5, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0}})),
}
#: how far the fused logits and cache may be from the per-op ones. Both run the same helpers in the same order, but
#: the fused layer's row kernels are compiled as functions of their own, where LLVM may vectorize a fastmath reduction
#: in another order: measured 2026-12-02, identical everywhere but one K element of gemma3 float32 (1.6e-6 absolute,
#: 2.7e-6 relative: a GEMV rounding carried through the k norm and RoPE). bf16: one ulp of an intermediate.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=8e-3, atol=1e-3)}


def _model(name, tmp_path, dtype="float32"):
    config_cls, model_cls, kwargs = FAMILIES[name]
    save_tiny(getattr(transformers, model_cls), getattr(transformers, config_cls)(**kwargs), tmp_path)
    return load_model(tmp_path, dtype=dtype)


def _step(seqs: dict[int, list[int]], new: dict[int, int], tables: dict[int, list[int]]) -> StepBatch:
    return step_batch(seqs, new, tables, PAGE)


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts the steps the fused path took (it returns None when it declines)."""
    taken = []
    original_op = paged.fused_decode_op

    def op(model):
        fused = original_op(model)
        if fused is None:
            return None

        def spy(*args, **kwargs):
            h = fused(*args, **kwargs)
            taken.append(h is not None)
            return h
        return spy

    monkeypatch.setattr(paged, "fused_decode_op", op)
    return taken


@pytest.fixture(params=[1, 2], ids=["serial", "parallel"])
def workers(request, monkeypatch):
    """Run the fused layer on the calling thread, or as two workers sharing each layer in one parallel region (the
    tiny test models are far below the size where it would choose that itself)."""
    monkeypatch.setattr(fused_decode, "_workers", lambda work: request.param)
    return request.param


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_fused_decode_equals_per_op_path(name, dtype, tmp_path, fused_calls, workers):
    model = _model(name, tmp_path, dtype)
    gen = torch.Generator().manual_seed(5)
    seqs = {s: torch.randint(0, 211, (n,), generator=gen).tolist() for s, n in enumerate((11, 3, 7))}
    tables = {0: [9, 2, 12, 5, 0], 1: [3, 14, 7], 2: [1, 11, 6, 13]}  # shuffled pages, partial last pages
    caches = [new_cache(model, num_pages=16, page_size=PAGE) for _ in range(2)]
    prefill = _step(seqs, {s: len(t) for s, t in seqs.items()}, tables)
    for cache in caches:
        forward_step(model, cache, prefill, fused=False)
    new = {s: 1 for s in seqs}
    for _ in range(4):  # decode steps; the sliding windows (5) start dropping keys on the way
        step = _step({s: t + [(7 * s + len(t)) % 211] for s, t in seqs.items()}, new, tables)
        fused = forward_step(model, caches[0], step)
        per_op = forward_step(model, caches[1], step, fused=False)
        torch.testing.assert_close(fused, per_op, **TOL[model.dtype])
        for layer in range(model.config.num_layers):
            torch.testing.assert_close(caches[0].k_pages[layer], caches[1].k_pages[layer], **TOL[model.dtype])
            torch.testing.assert_close(caches[0].v_pages[layer], caches[1].v_pages[layer], **TOL[model.dtype])
        seqs = {s: t + [(7 * s + len(t)) % 211] for s, t in seqs.items()}
    assert fused_calls == [True] * 4  # fused=False steps never ask


#: the new tokens of each step of :func:`test_fused_verification_steps_equal_per_op_path`, per sequence: batch 1 with
#: 2, 5 and 8 new tokens (a speculative verification of 1, 4 and 7 drafted tokens), then batches of mixed counts
_VERIFY_STEPS = ({0: 2}, {0: 5}, {0: 8}, {0: 1, 1: 4, 2: 3}, {1: 3, 2: 5}, {0: 3, 1: 1, 2: 4})


def _extend(seqs: dict[int, list[int]], new: dict[int, int], salt: int) -> dict[int, list[int]]:
    """The sequences of ``new`` with ``new[s]`` more tokens each (made up from their lengths)."""
    return {s: seqs[s] + [(salt * s + len(seqs[s]) + j) % 211 for j in range(n)] for s, n in new.items()}


def _verify_steps(model, caches, seqs, tables, steps, salt: int) -> None:
    """Run ``steps`` (new tokens per sequence, each step's sequences in order) fused on ``caches[0]`` and per-op on
    ``caches[1]``, asking for every token row's logits: equal logits and equal caches after every step."""
    for new in steps:
        grown = _extend(seqs, new, salt)
        step = _step(grown, new, {s: tables[s] for s in new})
        fused = forward_step(model, caches[0], step, all_logits=True)
        per_op = forward_step(model, caches[1], step, all_logits=True, fused=False)
        assert fused.shape == per_op.shape == (sum(new.values()), model.config.vocab_size)
        torch.testing.assert_close(fused, per_op, **TOL[model.dtype])
        for layer in range(model.config.num_layers):
            torch.testing.assert_close(caches[0].k_pages[layer], caches[1].k_pages[layer], **TOL[model.dtype])
            torch.testing.assert_close(caches[0].v_pages[layer], caches[1].v_pages[layer], **TOL[model.dtype])
        seqs = {**seqs, **grown}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma2", "gemma3"])
def test_fused_verification_steps_equal_per_op_path(name, dtype, tmp_path, fused_calls, workers):
    """Steps with several new tokens per sequence (speculative verification: the last accepted token and up to 7
    drafted ones) run fused and equal the per-op path in every token row's logits and in the cache. The new tokens
    attend to each other causally (masked segments of the plan), and gemma2's window of 5 is narrower than a step of
    8, so its masks differ from query to query."""
    model = _model(name, tmp_path, dtype)
    gen = torch.Generator().manual_seed(11)
    seqs = {s: torch.randint(0, 211, (n,), generator=gen).tolist() for s, n in enumerate((11, 3, 7))}
    tables = {0: [9, 2, 12, 5, 0, 15, 8, 10], 1: [3, 14, 7], 2: [1, 11, 6, 13, 4]}  # shuffled, partial last pages
    caches = [new_cache(model, num_pages=16, page_size=PAGE) for _ in range(2)]
    for cache in caches:
        forward_step(model, cache, _step(seqs, {s: len(t) for s, t in seqs.items()}, tables), fused=False)
    _verify_steps(model, caches, seqs, tables, _VERIFY_STEPS, salt=7)
    assert fused_calls == [True] * len(_VERIFY_STEPS)


def test_replaced_weights_are_used_by_the_next_fused_step(tmp_path, fused_calls):
    """The kernel's weight views are cached per model, never stale: replacing a projection rebuilds them."""
    model = _model("llama", tmp_path)
    gen = torch.Generator().manual_seed(8)
    tokens = torch.randint(0, 211, (6,), generator=gen).tolist()
    table = {0: [3, 0, 5]}
    caches = [new_cache(model, num_pages=8, page_size=PAGE) for _ in range(2)]
    for cache in caches:
        forward_step(model, cache, _step({0: tokens}, {0: 6}, table), fused=False)
    forward_step(model, caches[0], _step({0: tokens + [5]}, {0: 1}, table))  # builds the weight views
    old = model.weights["layers.1.o.weight"]
    model.weights["layers.1.o.weight"] = torch.randn(old.shape, generator=gen, dtype=old.dtype)
    step = _step({0: tokens + [5, 9]}, {0: 1}, table)
    forward_step(model, caches[1], _step({0: tokens + [5]}, {0: 1}, table), fused=False)
    fused, per_op = forward_step(model, caches[0], step), forward_step(model, caches[1], step, fused=False)
    torch.testing.assert_close(fused, per_op, **TOL[model.dtype])
    assert fused_calls == [True, True]  # both steps fused: the second on views rebuilt from the new weight


def test_fused_decode_declines_what_it_cannot_run(tmp_path, fused_calls, monkeypatch):
    """More than SMALL_M (8) tokens in a step, a prefill-shaped sequence among them, or a sequence without new tokens
    goes per-op; a step of a few new tokens per sequence (a verification) is taken."""
    model = _model("llama", tmp_path)
    gen = torch.Generator().manual_seed(6)
    a, b = (torch.randint(0, 211, (n,), generator=gen).tolist() for n in (9, 3))
    cache = new_cache(model, num_pages=8, page_size=PAGE)
    tables = {0: [4, 1, 6, 2, 5], 1: [0, 7]}
    forward_step(model, cache, _step({0: a}, {0: 9}, tables))  # prefill of 9 tokens: declined
    forward_step(model, cache, _step({0: a + [5]}, {0: 1}, tables))  # decode: taken
    forward_step(model, cache, _step({0: a + [5, 6, 7]}, {0: 2}, tables))  # two queries (verification): taken
    forward_step(model, cache, _step({0: a + [5, 6, 7], 1: b}, {0: 0, 1: 3}, tables))  # a sequence idle: declined
    a, b = a + [5, 6, 7, 1, 2, 3, 4, 5], b + [8, 9, 10, 11]
    forward_step(model, cache, _step({0: a, 1: b}, {0: 5, 1: 4}, tables))  # 9 tokens, 8 or fewer each: declined
    assert fused_calls == [False, True, True, False, False]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_decode_splits_long_contexts_over_items(dtype, tmp_path, fused_calls, workers, monkeypatch):
    """A plan that spreads over the cores (each sequence cut into parts of a few keys, as a long context is) runs
    inside the fused layer: the workers claim the parts, then merge each sequence's parts by log-sum-exp. Batches of
    one and of three sequences of mixed lengths, a sliding window on every other layer (gemma3)."""
    model = _model("gemma3", tmp_path, dtype)
    monkeypatch.setattr(cpu_decode, "SERIAL_MAX_BYTES", 0)
    monkeypatch.setattr(cpu_decode, "SEGMENT_TILE", 4)  # segments of 4 keys, parts of at least MIN_PART_KEYS
    monkeypatch.setattr(cpu_decode, "MIN_PART_KEYS", 3)
    gen = torch.Generator().manual_seed(9)
    for lengths in ((13,), (13, 2, 9)):
        seqs = {s: torch.randint(0, 211, (n,), generator=gen).tolist() for s, n in enumerate(lengths)}
        tables = {0: [9, 2, 12, 5, 0, 15], 1: [3, 14, 7], 2: [1, 11, 6, 13]}
        tables = {s: tables[s] for s in seqs}
        caches = [new_cache(model, num_pages=16, page_size=PAGE) for _ in range(2)]
        for cache in caches:
            forward_step(model, cache, _step(seqs, {s: len(t) for s, t in seqs.items()}, tables), fused=False)
        for _ in range(3):
            step = _step({s: t + [(5 * s + len(t)) % 211] for s, t in seqs.items()}, {s: 1 for s in seqs}, tables)
            fused = forward_step(model, caches[0], step)
            per_op = forward_step(model, caches[1], step, fused=False)
            torch.testing.assert_close(fused, per_op, **TOL[model.dtype])
            seqs = {s: t + [(5 * s + len(t)) % 211] for s, t in seqs.items()}
    assert fused_calls == [True] * 6


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_verification_splits_long_contexts_over_items(dtype, tmp_path, fused_calls, workers, monkeypatch):
    """Several new tokens per sequence under a plan split into parts (as a long context is): each part writes every
    query row of its sequence (``h * q_len + i``), and the fused layer merges them for each token by log-sum-exp.
    Segments of 4 keys, so the new tokens' causal masks fall on several parts; gemma3's sliding layers drop keys."""
    model = _model("gemma3", tmp_path, dtype)
    monkeypatch.setattr(cpu_decode, "SERIAL_MAX_BYTES", 0)
    monkeypatch.setattr(cpu_decode, "SEGMENT_TILE", 4)
    monkeypatch.setattr(cpu_decode, "MIN_PART_KEYS", 3)
    gen = torch.Generator().manual_seed(12)
    runs = {(13,): ({0: 5}, {0: 8}, {0: 2}), (13, 2, 9): ({0: 1, 1: 4, 2: 3}, {0: 3, 1: 1, 2: 4}, {0: 2, 1: 3})}
    for lengths, steps in runs.items():
        seqs = {s: torch.randint(0, 211, (n,), generator=gen).tolist() for s, n in enumerate(lengths)}
        tables = {0: [9, 2, 12, 5, 0, 15, 4, 10], 1: [3, 14, 7], 2: [1, 11, 6, 13, 8]}
        tables = {s: tables[s] for s in seqs}
        caches = [new_cache(model, num_pages=16, page_size=PAGE) for _ in range(2)]
        for cache in caches:
            forward_step(model, cache, _step(seqs, {s: len(t) for s, t in seqs.items()}, tables), fused=False)
        _verify_steps(model, caches, seqs, tables, steps, salt=5)
    assert fused_calls == [True] * 6


# One case: each combination of codes dtype, model dtype and worker count compiles the whole fused layer again
# (minutes cold on two cores, more than the suite's budget allows). What the others add is shared code checked
# elsewhere: the slot quantizer (store_row's _quantize_rows) bit for bit for every format and dtype in
# tests/kv/test_cache_quantized.py, decode_item over e4m3 bits in tests/attention/test_paged_quantized.py, and the
# parallel layer kernel over float pages above.
@pytest.mark.parametrize(("name", "dtype", "fmt", "n_workers"), [("llama", "float32", "int8", 1)])
def test_fused_decode_over_a_quantized_cache_equals_per_op_path(name, dtype, fmt, n_workers, tmp_path, fused_calls,
                                                                 monkeypatch):
    """Over int8 / e4m3 pages the fused layer quantizes the new K/V into their slots and its attention items read the
    codes: the same codes and scales as the per-op path's slot writer, and the same logits. Decode steps of three
    sequences and a verification step, shuffled page tables with partial last pages."""
    monkeypatch.setattr(fused_decode, "_workers", lambda work: n_workers)
    model = _model(name, tmp_path, dtype)
    gen = torch.Generator().manual_seed(13)
    seqs = {s: torch.randint(0, 211, (n,), generator=gen).tolist() for s, n in enumerate((11, 3, 7))}
    tables = {0: [9, 2, 12, 5, 0], 1: [3, 14, 7], 2: [1, 11, 6, 13]}
    caches = [new_cache(model, num_pages=16, page_size=PAGE, kv_cache_dtype=fmt) for _ in range(2)]
    for cache in caches:
        forward_step(model, cache, _step(seqs, {s: len(t) for s, t in seqs.items()}, tables), fused=False)
    for new in ({0: 1, 1: 1, 2: 1}, {0: 1, 1: 1, 2: 1}, {0: 3, 1: 1, 2: 2}):
        grown = _extend(seqs, new, salt=3)
        step = _step(grown, new, tables)
        fused = forward_step(model, caches[0], step, all_logits=True)
        per_op = forward_step(model, caches[1], step, all_logits=True, fused=False)
        torch.testing.assert_close(fused, per_op, **TOL[model.dtype])
        for layer in range(model.config.num_layers):
            for a, b in ((caches[0].k_pages[layer], caches[1].k_pages[layer]),
                         (caches[0].v_pages[layer], caches[1].v_pages[layer])):
                # the K/V rows themselves agree to float rounding (TOL): a code may sit one step away at a tie
                steps = (a.code_bits().to(torch.int16) - b.code_bits().to(torch.int16)).abs()
                assert int(steps.max()) <= 1, f"layer {layer}: codes {int(steps.max())} steps apart"
                torch.testing.assert_close(a.scales.float(), b.scales.float(), rtol=1e-3, atol=0)
        seqs = grown
    assert fused_calls == [True] * 3


@pytest.mark.parametrize("name", ["gpt2", "mixtral"])
def test_unsupported_families_name_the_reason(name, tmp_path):
    kwargs = {"gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(vocab_size=211, n_embd=64, n_layer=1, n_head=4)),
              "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(_BASE, num_local_experts=4,
                                                                      num_experts_per_tok=2))}[name]
    save_tiny(getattr(transformers, kwargs[1]), getattr(transformers, kwargs[0])(**kwargs[2]), tmp_path)
    model = load_model(tmp_path)
    reason = unsupported_reason(model.config, model.weights)
    assert reason and ("norm" in reason or "experts" in reason)


def _three_packed_decode_steps(model) -> None:
    """Prefill two sequences per-op, then three decode steps fused and per-op on twin caches: equal logits (1e-4:
    x's group sums are summed in another order by the fused layer's row kernels)."""
    gen = torch.Generator().manual_seed(7)
    seqs = {s: torch.randint(0, 211, (n,), generator=gen).tolist() for s, n in enumerate((6, 9))}
    tables = {0: [5, 1, 3], 1: [2, 7, 0, 4]}
    caches = [new_cache(model, num_pages=8, page_size=PAGE) for _ in range(2)]
    for cache in caches:
        forward_step(model, cache, _step(seqs, {s: len(t) for s, t in seqs.items()}, tables), fused=False)
    for _ in range(3):
        step = _step({s: t + [(3 * s + len(t)) % 211] for s, t in seqs.items()}, {0: 1, 1: 1}, tables)
        fused = forward_step(model, caches[0], step)
        per_op = forward_step(model, caches[1], step, fused=False)
        torch.testing.assert_close(fused, per_op, rtol=1e-4, atol=1e-4)
        seqs = {s: t + [(3 * s + len(t)) % 211] for s, t in seqs.items()}


#: every format under every qgemv variant on the calling thread; the parallel region once, with the best variant
#: (its claims and phases do not depend on the weight format, and each parallel specialization compiles for ~50 s)
_PACKED_CASES = [(fmt, variant, 1) for fmt in ("int4", "int4_min", "int8") for variant in variants.available("qgemv")]
_PACKED_CASES.append(("int4_min", variants.available("qgemv")[0], 2))


@pytest.mark.parametrize("fmt, variant, n_workers", _PACKED_CASES,
                         ids=[f"{'serial' if n == 1 else 'parallel'}-{f}-{v}" for f, v, n in _PACKED_CASES])
def test_fused_decode_with_int4_projections(fmt, variant, n_workers, tmp_path, fused_calls, monkeypatch):
    """Packed projections (as a GGUF Q4_0 / Q4_1 / Q8_0 model keeps them) run through the fused kernel too, under
    every ``qgemv`` variant this CPU runs; int8 needs an int8-activation variant (the portable one declines it)."""
    from tessera.kernels import quantize

    monkeypatch.setenv("TESSERA_CPU_VARIANTS", f"qgemv={variant}")
    monkeypatch.setattr(fused_decode, "_workers", lambda work: n_workers)

    config = transformers.LlamaConfig(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    save_tiny(transformers.LlamaForCausalLM, config, tmp_path)
    model = load_model(tmp_path)
    for i in range(2):
        for name in ("qkv", "o", "gate_up", "down"):  # down has K = 96: an odd number of 32-groups (the tail path)
            key = f"layers.{i}.{name}.weight"
            model.weights[key] = quantize(model.weights[key], fmt, 32)
    _three_packed_decode_steps(model)
    assert fused_calls == [fmt != "int8" or variant != "portable"] * 3


def _ggml_weight(w: torch.Tensor, fmt: str):
    """``w`` in ggml block format ``fmt`` as a GGUF file holds it (K-quants by Tessera's writer, Q5_0 by gguf-py)."""
    import gguf
    import numpy as np

    from tessera.kernels.ggml_quantize import quantize_rows
    from tessera.kernels.quant import from_gguf

    values = w.detach().float().numpy().astype(np.float32)
    qtype = gguf.GGMLQuantizationType[fmt.upper()]
    blocks = quantize_rows(values, fmt) if fmt.endswith("_k") else gguf.quants.quantize(values, qtype)
    return from_gguf(blocks, qtype, tuple(w.shape))


#: (the mix, workers): llama.cpp's Q4_K_M layout (q|k in Q4_K with a Q6_K v: two row blocks; Q6_K down) on the
#: calling thread and in the parallel region; Q5_K / Q5_0 projections on the calling thread
_GGML_CASES = [("q4_k_m", 1), ("q4_k_m", 2), ("q5", 1)]


@pytest.mark.parametrize("mix, n_workers", _GGML_CASES, ids=[f"{m}-{'serial' if n == 1 else 'parallel'}"
                                                             for m, n in _GGML_CASES])
def test_fused_decode_with_ggml_block_projections(mix, n_workers, tmp_path, fused_calls, monkeypatch):
    """A GGUF K-quant model's projections, kept as the file's blocks, run through the fused kernel on the best
    int8-activation ``qgemv`` variant and equal the per-op path."""
    from tessera.backends.cpu.ops import _qdot
    from tessera.kernels.quant import StackedWeight

    best = variants.available("qgemv")[0]
    if _qdot._TOKENS[best] is None:
        pytest.skip("no int8-activation qgemv variant on this CPU")
    monkeypatch.setattr(fused_decode, "_workers", lambda work: n_workers)
    config = transformers.LlamaConfig(vocab_size=211, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    save_tiny(transformers.LlamaForCausalLM, config, tmp_path)
    model = load_model(tmp_path)
    for i in range(2):
        p = f"layers.{i}"
        qkv = model.weights[f"{p}.qkv.weight"]
        if mix == "q4_k_m":
            model.weights[f"{p}.qkv.weight"] = StackedWeight((_ggml_weight(qkv[:256 + 128], "q4_k"),
                                                              _ggml_weight(qkv[256 + 128:], "q6_k")))
            model.weights[f"{p}.down.weight"] = _ggml_weight(model.weights[f"{p}.down.weight"], "q6_k")
        else:
            model.weights[f"{p}.qkv.weight"] = _ggml_weight(qkv, "q5_k")
            model.weights[f"{p}.down.weight"] = _ggml_weight(model.weights[f"{p}.down.weight"], "q5_0")
        for name in ("o", "gate_up"):
            model.weights[f"{p}.{name}.weight"] = _ggml_weight(model.weights[f"{p}.{name}.weight"], "q4_k")
    assert unsupported_reason(model.config, model.weights) is None
    _three_packed_decode_steps(model)
    assert fused_calls == [True] * 3


def test_parallel_layer_finishes_on_a_pool_of_one(tmp_path, monkeypatch):
    """Workers claim their work, so a parallel region that a one-thread pool runs iteration by iteration still
    finishes (a barrier waiting for a fixed number of workers would hang here), with the same result."""
    model = _model("llama", tmp_path)
    tokens = torch.randint(0, 211, (6,), generator=torch.Generator().manual_seed(8)).tolist()
    table = {0: [3, 0, 5]}
    caches = [new_cache(model, num_pages=8, page_size=PAGE) for _ in range(2)]
    for cache in caches:
        forward_step(model, cache, _step({0: tokens}, {0: 6}, table), fused=False)
    step = _step({0: tokens + [9]}, {0: 1}, table)
    per_op = forward_step(model, caches[1], step, fused=False)
    monkeypatch.setattr(fused_decode, "_workers", lambda work: 3)
    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        fused = forward_step(model, caches[0], step)
    finally:
        numba.set_num_threads(threads)
    torch.testing.assert_close(fused, per_op, **TOL[model.dtype])
