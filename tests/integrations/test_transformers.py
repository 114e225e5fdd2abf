"""``attn_implementation="tessera"`` in transformers: random-weight tiny models of four families (Llama; Qwen2; Gemma 2
with softcap and a sliding window; gpt-oss with sinks and a sliding window) give the logits of ``"eager"`` within the
float32 attention tolerance and the same greedy tokens, with and without padding."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM, Gemma2Config, GptOssConfig, LlamaConfig, Qwen2Config  # noqa: E402

from tessera.integrations import transformers as tessera_hf  # noqa: E402

from tests.attention.tolerances import TOLERANCES, rel_err  # noqa: E402

# Small enough for a two-core test run; windows of 5 are shorter than the prompts, so they bind in prefill and decode.
COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0)
CONFIGS = {
    "llama": lambda: LlamaConfig(**COMMON),
    "qwen2": lambda: Qwen2Config(**COMMON),
    "gemma2_softcap_window": lambda: Gemma2Config(**COMMON, head_dim=16, sliding_window=5,
                                                  attn_logit_softcapping=20.0, query_pre_attn_scalar=16),
    "gpt_oss_sinks_window": lambda: GptOssConfig(**COMMON, head_dim=16, sliding_window=5, num_local_experts=4,
                                                 num_experts_per_tok=2),
}
TOL = TOLERANCES[torch.float32]


@pytest.fixture(scope="module", autouse=True)
def registered() -> None:
    assert tessera_hf.register() == "tessera"


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[name](), attn_implementation="eager").eval()
    for module in model.modules():
        if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
            torch.nn.init.normal_(module.sinks, mean=0.5, std=1.0)  # random sinks matter; zeros barely would
    return model


class _Calls:
    """Counts Tessera attention calls, to prove the model really ran them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.n = 0
        inner = tessera_hf.attention

        def counted(*args, **kwargs):
            self.n += 1
            return inner(*args, **kwargs)

        monkeypatch.setattr(tessera_hf, "attention", counted)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_greedy_tokens_equal_eager(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(name)
    ids = torch.randint(1, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
        want_tokens = model.generate(ids, max_new_tokens=5, do_sample=False)
        model.set_attn_implementation("tessera")
        calls = _Calls(monkeypatch)
        got = model(ids).logits
        assert calls.n == model.config.num_hidden_layers
        got_tokens = model.generate(ids, max_new_tokens=5, do_sample=False)
    err = rel_err(got, want)
    assert err <= TOL, f"{name}: logits error {err:.3g} > {TOL:g}"
    assert torch.equal(got_tokens, want_tokens), f"{name}: greedy tokens differ"


@pytest.mark.parametrize("name", ["llama", "gemma2_softcap_window", "gpt_oss_sinks_window"])
def test_left_padding_matches_eager_on_real_tokens(name: str) -> None:
    model = _model(name)
    ids = torch.randint(1, 96, (2, 10), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    ids[0, :4], mask[0, :4] = 0, 0  # first prompt is 6 tokens, left-padded
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
        want_tokens = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        model.set_attn_implementation("tessera")
        got = model(ids, attention_mask=mask).logits
        got_tokens = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    real = mask.bool()  # padded rows are never read; transformers' eager averages them, Tessera writes 0
    err = rel_err(got[real], want[real])
    assert err <= TOL, f"{name}: logits error on real tokens {err:.3g} > {TOL:g}"
    assert torch.equal(got_tokens, want_tokens)


def test_settings_map_onto_the_spec() -> None:
    """The spec built per call: window + softcap + sinks + scale, and the built-in mask when the 4-D mask is just the
    causal window (so plans are shared and tiles skipped analytically)."""
    seen = {}

    def spy(q, k, v, spec, backend):
        seen["spec"] = spec
        return torch.zeros(q.shape)

    module = torch.nn.Module()
    module.is_causal = True
    q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 7, 8)
    sinks = torch.randn(4)
    pos_q, pos_k = torch.arange(4, 7).view(-1, 1), torch.arange(7).view(1, -1)
    window_mask = ((pos_k <= pos_q) & (pos_k > pos_q - 3)).view(1, 1, 3, 7)
    original = tessera_hf.attention
    tessera_hf.attention = spy
    try:
        out, weights = tessera_hf.tessera_attention_forward(module, q, k, k, window_mask, scaling=0.3,
                                                           sliding_window=3, softcap=30.0, s_aux=sinks)
    finally:
        tessera_hf.attention = original
    spec = seen["spec"]
    assert out.shape == (1, 3, 4, 8) and weights is None
    assert repr(spec.mask) == "sliding_window(3)" and repr(spec.score) == "softcap(30.0)"
    assert spec.sinks is sinks and spec.scale == 0.3 and (spec.num_q_heads, spec.num_kv_heads) == (4, 2)


def test_clear_errors_for_what_tessera_does_not_do() -> None:
    module = torch.nn.Module()
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match="no attention dropout"):
        tessera_hf.tessera_attention_forward(module, q, k, k, None, dropout=0.1)
    biased = torch.zeros(1, 1, 3, 3)
    biased[..., 0, 1] = -2.5  # an ALiBi-like bias, not a mask
    with pytest.raises(ValueError, match="carries a bias"):
        tessera_hf.tessera_attention_forward(module, q, k, k, biased)
    with pytest.raises(ValueError, match=r"\[B, 1 or Hq, Sq, >= Skv\]"):
        tessera_hf.tessera_attention_forward(module, q, k, k, torch.ones(1, 1, 2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="bidirectional sliding window"):
        module.is_causal = False
        tessera_hf.tessera_attention_forward(module, q, k, k, None, sliding_window=2)


def test_training_gradients_equal_eager_sinks_included() -> None:
    """A fine-tuning step: every parameter's gradient (the learned sinks too) equals eager's."""
    model = _model("gpt_oss_sinks_window")
    ids = torch.randint(1, 96, (2, 8), generator=torch.Generator().manual_seed(3))

    def grads(impl: str) -> dict[str, torch.Tensor]:
        model.set_attn_implementation(impl)
        model.zero_grad()
        model(ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want, got = grads("eager"), grads("tessera")
    assert set(got) == set(want) and any("sinks" in n for n in got)
    for name in want:
        err = rel_err(got[name], want[name])
        assert err <= TOL, f"d{name}: error {err:.3g} > {TOL:g}"


def test_maskless_calls_trace_into_one_graph() -> None:
    """Under torch.compile a call without a mask tensor becomes tessera::attention with a constant handle."""
    from torch._dynamo.testing import CompileCounter

    module = torch.nn.Module()
    module.is_causal = True
    gen = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(1, 4, 5, 16, generator=gen), torch.randn(1, 2, 7, 16, generator=gen), \
        torch.randn(1, 2, 7, 16, generator=gen)
    sinks = torch.randn(4, generator=gen)

    def layer(q, k, v):
        return tessera_hf.tessera_attention_forward(module, q, k, v, None, scaling=0.2, sliding_window=3,
                                                    softcap=15.0, s_aux=sinks)[0]

    cnt = CompileCounter()
    torch.testing.assert_close(torch.compile(layer, fullgraph=True, backend=cnt)(q, k, v), layer(q, k, v),
                               rtol=0, atol=0)
    assert cnt.frame_count == 1


def test_compiled_model_with_a_mask_runs_attention_eagerly_and_matches() -> None:
    """transformers (torch < 2.14) always materializes the mask under torch.compile; each attention call then runs
    outside the graph (a graph break per layer), with eager's numbers."""
    from torch._dynamo.testing import CompileCounter

    model = _model("llama")
    model.set_attn_implementation("tessera")
    ids = torch.randint(1, 96, (1, 7), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
        got = torch.compile(model, backend=CompileCounter())(ids, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)
