"""A new backend is one folder plus one registry line: a toy backend written to a temporary folder, registered by
``"module:Class"``, runs the attention conformance cases and serves a kernel op from its own ``ops`` package."""

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
"""A toy accelerator: its own planning and row gathering; the per-sequence math is the oracle's (the conformance
cases then check the plumbing a new backend writes: the registry, its plan/run, the KV layout, the output rows)."""

import dataclasses

import torch

from tessera.backends.reference import sequence_attention


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
        return dataclasses.replace(spec, sinks=None), batch, layout  # run() excludes sinks: the caller folds them

    def run(self, state, q, k_rows, v_rows, out, lse):
        spec, batch, layout = state
        for s in range(batch.num_seqs):
            ql, q0 = batch.q_lens[s], batch.q_starts[s]
            if ql == 0:
                continue
            rows = layout.rows(s, batch.kv_lens[s])
            rows = rows if isinstance(rows, slice) else torch.from_numpy(rows)
            o, m = sequence_attention(q[q0:q0 + ql], k_rows[rows], v_rows[rows], spec, s)
            out[q0:q0 + ql] = o.to(out.dtype)
            lse[q0:q0 + ql] = m.float()
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


def test_replacing_a_backend_drops_its_cached_ops(toy, gen) -> None:
    """Kernel op tables and resolved answers are cached per backend name; registering another class under the name
    (or removing it) must not leave the old functions in use."""
    x = torch.randn(2, 5, generator=gen)
    K.silu(x, backend=toy)  # fills the caches for "toy"
    import toy_accel.backend

    renamed = type("Toy2", (toy_accel.backend.ToyBackend,), {"name": "toy2", "__module__": "toy_accel.backend"})()
    register("toy2", renamed)
    try:
        K.silu(x, backend="toy2")
        unregister("toy2")
        with pytest.raises(ValueError, match="unknown backend|no backend"):
            K.silu(x, backend="toy2")
    finally:
        unregister("toy2")
