"""silu, gelu (erf / tanh), relu and the fused silu_and_mul / gelu_and_mul on every backend against the float64
oracle, against torch's eager composition, and their error messages."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tessera.backends.reference.ops import activations as ref
from tessera.kernels.activations import gelu, gelu_and_mul, relu, silu, silu_and_mul
from tests.kernels.conftest import kernel_backends
from tests.kernels.tolerances import assert_close_to_oracle

DTYPES = [pytest.param(d, id=str(d).removeprefix("torch.")) for d in (torch.float32, torch.bfloat16, torch.float16)]
SHAPES = [(1,), (0, 5), (3, 1001), (2, 3, 64)]
GATED_SHAPES = [(1, 2), (0, 8), (5, 2 * 1001), (2, 3, 2 * 300), (1, 2 * 2500)]  # I = 2500: several cpu chunks

ELEMENTWISE = {
    "silu": (lambda x, b: silu(x, backend=b), ref.silu_f64),
    "gelu": (lambda x, b: gelu(x, backend=b), lambda x: ref.gelu_f64(x, "none")),
    "gelu_tanh": (lambda x, b: gelu(x, "tanh", backend=b), lambda x: ref.gelu_f64(x, "tanh")),
    "relu": (lambda x, b: relu(x, backend=b), ref.relu_f64),
}
GATED = {
    "silu_and_mul": (lambda x, b: silu_and_mul(x, backend=b), ref.silu_and_mul_f64),
    "gelu_and_mul": (lambda x, b: gelu_and_mul(x, backend=b), lambda x: ref.gelu_and_mul_f64(x, "none")),
    "gelu_tanh_and_mul": (lambda x, b: gelu_and_mul(x, "tanh", backend=b),
                          lambda x: ref.gelu_and_mul_f64(x, "tanh")),
}


def _rand(gen: torch.Generator, shape, dtype: torch.dtype, scale: float = 3.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


@pytest.mark.parametrize("backend", kernel_backends())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("op", list(ELEMENTWISE))
def test_elementwise_matches_oracle(backend, dtype, shape, op, gen):
    ours, oracle = ELEMENTWISE[op]
    x = _rand(gen, shape, dtype)
    y = ours(x, backend)
    assert y.dtype == dtype and y.shape == x.shape
    assert_close_to_oracle(y, oracle(x), dtype, f"{op} {shape}")


@pytest.mark.parametrize("backend", kernel_backends())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", GATED_SHAPES, ids=str)
@pytest.mark.parametrize("op", list(GATED))
def test_gated_matches_oracle(backend, dtype, shape, op, gen):
    ours, oracle = GATED[op]
    gate_up = _rand(gen, shape, dtype)
    out = ours(gate_up, backend)
    assert out.dtype == dtype and out.shape == (*shape[:-1], shape[-1] // 2)
    assert_close_to_oracle(out, oracle(gate_up), dtype, f"{op} {shape}")


@pytest.mark.parametrize("backend", kernel_backends())
@pytest.mark.parametrize("op", list(GATED))
def test_gated_extreme_inputs_stay_finite(backend, op):
    """Large |gate| must not overflow the exp inside sigmoid or erf: silu(-1e4) = -0, silu(1e4) = 1e4."""
    ours, oracle = GATED[op]
    gate = torch.tensor([-1e4, -200.0, -88.0, -30.0, -1e-30, 0.0, 1e-30, 30.0, 88.0, 200.0, 1e4])
    gate_up = torch.cat([gate, torch.linspace(-2, 2, gate.numel())])[None]
    out = ours(gate_up, backend)
    assert torch.isfinite(out).all()
    assert_close_to_oracle(out, oracle(gate_up), torch.float32, f"{op} extremes")


@pytest.mark.parametrize("backend", kernel_backends())
def test_strided_gate_up(backend, gen):
    gate_up = _rand(gen, (16, 6), torch.float32).T  # [6, 16], not contiguous
    assert_close_to_oracle(silu_and_mul(gate_up, backend=backend), ref.silu_and_mul_f64(gate_up), torch.float32,
                           "strided")


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_torch_eager_composition(dtype, gen):
    """The vLLM / HF layout: ``gate, up = gate_up.chunk(2, -1)``; SwiGLU and Gemma's GeGLU (gelu_pytorch_tanh)."""
    gate_up = _rand(gen, (4, 2 * 384), dtype, 2.0)
    gate, up = gate_up.float().chunk(2, -1)
    assert_close_to_oracle(silu_and_mul(gate_up), (F.silu(gate) * up).double(), dtype, "silu_and_mul vs torch")
    expected = (F.gelu(gate, approximate="tanh") * up).double()
    assert_close_to_oracle(gelu_and_mul(gate_up, "tanh"), expected, dtype, "gelu_and_mul vs torch")


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"gate_up must be \[\.\.\., 2\*I\]"):
        silu_and_mul(torch.randn(2, 7))
    with pytest.raises(ValueError, match="approximate must be 'none'"):
        gelu(torch.randn(3), approximate="erf")
    with pytest.raises(ValueError, match="approximate must be 'none'"):
        gelu_and_mul(torch.randn(2, 4), approximate="fast")
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        silu(torch.arange(4))
    with pytest.raises(ValueError, match="does not implement|unknown backend"):
        relu(torch.randn(3), backend="npu")


@pytest.mark.parametrize("op", ["silu_and_mul", "gelu_and_mul"])
def test_cpu_gated_rows_do_not_depend_on_the_batch(op, gen):
    """A row's bits are the same from the serial kernel (few rows) and the parallel one (many): speculative
    verification and batched decode must reproduce a lone decode's greedy token."""
    x = torch.randn(40, 2 * 1536, generator=gen)
    fn = silu_and_mul if op == "silu_and_mul" else gelu_and_mul
    many = fn(x, backend="cpu")
    for r in (0, 17, 39):
        assert torch.equal(fn(x[r:r + 1], backend="cpu")[0], many[r])
