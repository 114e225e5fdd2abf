"""A new backend is one folder plus one registry line: a toy backend written to a temporary folder, registered by
``"module:Class"``, passes the attention conformance cases and serves a kernel op from its own ``ops`` package."""

from __future__ import annotations

import textwrap

import pytest
import torch

from tessera import kernels as K
from tessera.attention import AttentionSpec, causal
from tessera.backends import register, registered, resolve_device, unregister
from tessera.kernels import registry as kernel_registry
from tests.attention.cases import VARIANTS, check_against_oracle, dense_layout, seed_of, varlen_layout

BACKEND_PY = '''
"""A toy accelerator: plain torch in float32, one sequence at a time, through the spec's public mask/score API."""

import torch


class ToyBackend:
    name = "toy"
    priority = -10  # never chosen under "auto"

    def available(self):
        return []

    def device_types(self):
        return ("cpu",)

    def why_not(self, request):
        return [] if request.device.type == "cpu" else [f"runs on cpu tensors, got {request.device.type}"]

    def plan(self, spec, batch, layout, options=None):
        return spec, batch, layout

    def run(self, state, q, k_rows, v_rows, out, lse):
        spec, batch, layout = state
        for s in range(batch.num_seqs):
            ql, kl, q0 = batch.q_lens[s], batch.kv_lens[s], batch.q_starts[s]
            if ql == 0:
                continue
            rows = layout.rows(s, kl)
            rows = rows if isinstance(rows, slice) else torch.from_numpy(rows)
            k = k_rows[rows].float().repeat_interleave(spec.group_size, dim=1).transpose(0, 1)
            v = v_rows[rows].float().repeat_interleave(spec.group_size, dim=1).transpose(0, 1)
            qs = q[q0:q0 + ql].float().transpose(0, 1)                      # [Hq, ql, D]
            scores = qs @ k.transpose(1, 2) * spec.softmax_scale            # [Hq, ql, kl]
            b = torch.tensor(s)
            h = torch.arange(spec.num_q_heads).view(-1, 1, 1)
            qp = torch.arange(kl - ql, kl).view(1, -1, 1)
            kp = torch.arange(kl).view(1, 1, -1)
            if spec.score is not None:
                scores = spec.score.apply(scores, b, h, qp, kp).float()
            if spec.mask is not None:
                keep = torch.broadcast_to(spec.mask.evaluate(b, h, qp, kp), scores.shape)
                scores = scores.masked_fill(~keep, float("-inf"))
            m = torch.logsumexp(scores, dim=-1)                              # [Hq, ql]
            finite = torch.isfinite(m)
            p = torch.where(finite.unsqueeze(-1), torch.exp(scores - torch.where(finite, m, 0.0).unsqueeze(-1)), 0.0)
            out[q0:q0 + ql] = (p @ v).transpose(0, 1).to(out.dtype)
            lse[q0:q0 + ql] = m.transpose(0, 1)
'''

OPS_PY = '''
import torch


def silu(x):
    return (x.float() * torch.sigmoid(x.float())).to(x.dtype)


OPS = {"silu": silu}
'''


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    return torch.Generator().manual_seed(seed_of(request.node.nodeid))


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    root = tmp_path_factory.mktemp("plugin")
    package = root / "toy_accel"
    (package / "ops").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "backend.py").write_text(textwrap.dedent(BACKEND_PY))
    (package / "ops" / "__init__.py").write_text("")
    (package / "ops" / "activations.py").write_text(textwrap.dedent(OPS_PY))
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(root))
    register("toy", "toy_accel.backend:ToyBackend")
    yield "toy"
    unregister("toy")
    mp.undo()


LAYOUTS = [dense_layout(batch=2, sq=70, skv=100, hq=4, hkv=1, d=80),
           varlen_layout((1, 33, 70, 0, 0, 7, 5), (300, 33, 600, 0, 9, 7, 520), hq=4, hkv=2, d=64)]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_toy_backend_passes_the_conformance_cases(toy, variant, gen) -> None:
    for layout in LAYOUTS:
        check_against_oracle(toy, layout, variant.spec(layout, gen), torch.float32, gen)


def test_toy_backend_is_found_and_serves_its_ops(toy, gen) -> None:
    assert toy in registered() and resolve_device(toy) == torch.device("cpu")
    assert kernel_registry.implementations("silu").count(toy) == 1
    x = torch.randn(3, 17, generator=gen)
    torch.testing.assert_close(K.silu(x, backend=toy), x * torch.sigmoid(x))
    with pytest.raises(ValueError, match="backend 'toy' does not implement 'rms_norm'"):
        K.rms_norm(x, torch.ones(17), 1e-6, backend=toy)
    spec = AttentionSpec(4, 2, 16, mask=causal())
    q, k = torch.randn(5, 4, 16, generator=gen), torch.randn(5, 2, 16, generator=gen)
    from tessera.attention import varlen_attention

    ours = varlen_attention(q, k, k, [5], [5], spec, backend=toy)
    torch.testing.assert_close(ours, varlen_attention(q, k, k, [5], [5], spec, backend="reference"))


def test_registration_errors() -> None:
    with pytest.raises(ValueError, match="already exists; pass replace=True"):
        register("cpu", "x.y:Z")
    with pytest.raises(ValueError, match="is not 'module:Class'"):
        register("mine", "no_colon")
    with pytest.raises(ValueError, match="other than 'auto'"):
        register("auto", "x.y:Z")
    register("broken", "no_such_module_xyz.backend:Nope")
    try:
        with pytest.raises(ImportError, match="backend 'broken': cannot load 'no_such_module_xyz.backend:Nope'"):
            resolve_device("broken")
    finally:
        unregister("broken")
