"""Fixtures of the kernel-library tests."""

from __future__ import annotations

import pytest
import torch

from tests.attention.cases import seed_of


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    """A generator seeded from the test id: fresh random inputs per test, reproducible across runs and workers."""
    return torch.Generator().manual_seed(seed_of(request.node.nodeid))


def kernel_backends() -> list:
    """reference, cpu, and triton (under the interpreter on CPU tensors; skipped when it cannot run)."""
    from tessera.backends import registered

    reasons = registered()["triton"].available()
    return ["reference", "cpu",
            pytest.param("triton", marks=[pytest.mark.skip(reason="; ".join(reasons))] if reasons else [])]
